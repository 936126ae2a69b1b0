//! Benchmark of the training attention kernels ([`core_attention_forward_train`] and
//! [`core_attention_backward`]), causal, on the current rayon pool: the median time of each
//! pass and its rate in GFLOP/s against the machine's measured f32 FMA peak on the same
//! threads.
//!
//! FLOPs follow FlashAttention-2's count (Dao 2023): the forward's two products (`q·kᵀ`,
//! `P·v`) are `4·d` per visible (query, key) pair; the backward's five (`S` recomputed, `dP`,
//! `dV`, `dQ`, `dK`) are `10·d`. Causal: `sq·(sq + 1)/2` visible pairs per sequence and head.
//!
//! `cargo bench -p ferrotron-nn --bench attention_train [-- S B A G D]` (defaults: SmolLM2's
//! attention at 512 tokens: s 512, b 1, 9 heads, 3 groups, head dim 64). Prints one JSON line.

use ferrotron_nn::attention::{
    AttentionDims, AttentionMask, AttentionPrecision, core_attention_backward,
    core_attention_forward_train,
};

mod common;
use common::{time, values};

fn main() {
    ferrotron_tensor::allocator::retain_freed_memory();
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let arg = |i: usize, default: usize| args.get(i).copied().unwrap_or(default);
    let (s, b, a, g, d) = (arg(0, 512), arg(1, 1), arg(2, 9), arg(3, 3), arg(4, 64));
    let dims = AttentionDims {
        sq: s,
        skv: s,
        batch: b,
        heads: a,
        groups: g,
        head_dim: d,
        q_offset: 0,
        kv_offset: 0,
    };
    let (nq, nkv) = (s * b * a * d, s * b * g * d);
    let (q, k, v, dout) = (
        values(nq, 1, 2.0),
        values(nkv, 2, 2.0),
        values(nkv, 3, 2.0),
        values(nq, 4, 0.1),
    );
    let (mut out, mut lse) = (vec![0f32; nq], vec![0f32; s * b * a]);
    let (mut dq, mut dk, mut dv) = (vec![0f32; nq], vec![0f32; nkv], vec![0f32; nkv]);
    let mask = AttentionMask::default();
    let precision = AttentionPrecision::F32;
    let runs = 15;
    let forward_ms = time(runs, || {
        core_attention_forward_train(&q, &k, &v, &mut out, &mut lse, dims, mask, precision)
    });
    let backward_ms = time(runs, || {
        core_attention_backward(
            &q, &k, &v, &out, &dout, &lse, &mut dq, &mut dk, &mut dv, dims, mask, precision,
        )
    });
    let pairs = (s * (s + 1) / 2 * b * a) as f64;
    let gflops = |flops_per_pair: f64, ms: f64| pairs * flops_per_pair * d as f64 / ms / 1e6;
    let (fwd, bwd) = (gflops(4.0, forward_ms), gflops(10.0, backward_ms));
    let peak = ferrotron_tensor::peak::f32_fma().map_or(f64::NAN, |p| p.gflops);
    println!(
        "{{\"bench\":\"attention_train\",\"s\":{s},\"b\":{b},\"heads\":{a},\"groups\":{g},\
         \"head_dim\":{d},\"threads\":{},\"forward_ms\":{forward_ms:.3},\
         \"backward_ms\":{backward_ms:.3},\"forward_gflops\":{fwd:.1},\
         \"backward_gflops\":{bwd:.1},\"peak_f32_gflops\":{peak:.1},\
         \"forward_of_peak\":{:.3},\"backward_of_peak\":{:.3}}}",
        rayon::current_num_threads(),
        fwd / peak,
        bwd / peak
    );
}
