//! The MoE router and experts against transformers 5.23's MoE blocks
//! (`tools/make_moe_fixture.py`: Mixtral, OLMoE, DeepSeek-V2's routed part on 6 tokens):
//! the same experts chosen, the output, and the gradients of the input, the router and both
//! expert weights, within 1e-5.

use ferrotron_nn::moe::{
    ExpertGroups, ExpertWeights, GroupScore, RouterConfig, ScoreFunction, experts_backward,
    experts_forward,
};
use ferrotron_tensor::gemm::WeightRef;
use ferrotron_tensor::gemm::{Op, sgemm};
use safetensors::SafeTensors;

mod common;
use common::assert_close;

const T: usize = 6;
const H: usize = 16;
const F: usize = 8;

fn fixture() -> Vec<u8> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../fixtures/moe/moe.safetensors"
    );
    std::fs::read(path).unwrap()
}

fn f32s(st: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap();
    t.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

fn router(family: &str) -> RouterConfig {
    let base = |num_experts, pre_softmax| RouterConfig {
        num_experts,
        topk: 2,
        score_function: ScoreFunction::Softmax,
        pre_softmax,
        groups: None,
        scaling_factor: None,
    };
    match family {
        "mixtral" => base(4, false),
        "olmoe" => base(4, true),
        _ => RouterConfig {
            groups: Some(ExpertGroups {
                num_groups: 4,
                group_topk: 2,
                score: GroupScore::Max,
            }),
            scaling_factor: Some(16.0),
            ..base(8, true)
        },
    }
}

#[test]
fn router_and_experts_match_transformers() {
    let bytes = fixture();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for family in ["mixtral", "olmoe", "deepseek_v2"] {
        let get = |n: &str| f32s(&st, &format!("{family}.{n}"));
        let cfg = router(family);
        let e = cfg.num_experts;
        let (x, c, gate) = (get("x"), get("c"), get("gate"));
        let (fc1, fc2) = (get("gate_up_proj"), get("down_proj"));
        // Router logits [T, E] = x · gateᵀ.
        let mut logits = vec![0f32; T * e];
        sgemm(T, e, H, &x, Op::N, &gate, Op::T, &mut logits, false);
        let routing = cfg.route(&logits, None).unwrap();
        let hf_experts: Vec<u32> = st
            .tensor(&format!("{family}.experts"))
            .unwrap()
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
            .collect();
        assert_eq!(routing.experts, hf_experts, "{family}: experts chosen");
        let w = ExpertWeights {
            fc1: WeightRef::F32(&fc1),
            fc2: WeightRef::F32(&fc2),
            hidden: H,
            ffn: F,
        };
        let (y, acts) = experts_forward(&x, &routing, &w);
        assert_close(&format!("{family}.y"), &y, &get("y"));
        // Backward of Σ y·c: through the experts, then the router, then the gate's linear.
        let g = experts_backward(&routing, &w, &acts, &c);
        let dlogits = cfg.backward(&routing, &g.dprobs);
        let mut dgate = vec![0f32; e * H];
        sgemm(e, H, T, &dlogits, Op::T, &x, Op::N, &mut dgate, false);
        let mut dx = g.dx.clone();
        sgemm(T, H, e, &dlogits, Op::N, &gate, Op::N, &mut dx, true);
        assert_close(&format!("{family}.grad.x"), &dx, &get("grad.x"));
        assert_close(&format!("{family}.grad.gate"), &dgate, &get("grad.gate"));
        assert_close(
            &format!("{family}.grad.gate_up_proj"),
            &g.dfc1,
            &get("grad.gate_up_proj"),
        );
        assert_close(
            &format!("{family}.grad.down_proj"),
            &g.dfc2,
            &get("grad.down_proj"),
        );
    }
}
