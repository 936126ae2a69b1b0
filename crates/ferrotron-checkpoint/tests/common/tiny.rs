//! A tiny synthetic LLaMA GGUF whose expected HF tensors are known exactly.

use std::collections::BTreeMap;

use ferrotron_checkpoint::gguf::{GgmlType, GgufArray, GgufValue, bytes_to_unicode};
use half::{bf16, f16};

use super::GgufBuilder;

/// A small deterministic generator (xorshift64*).
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// Encodes one row (length a multiple of the block size) of random values stored as `ty`;
/// returns (bytes, the exact f32 values those bytes decode to), computed independently of the
/// crate's dequantizer from ggml's block definitions.
pub fn random_row(ty: GgmlType, n: usize, rng: &mut Rng) -> (Vec<u8>, Vec<f32>) {
    let mut bytes = Vec::new();
    let mut vals = Vec::new();
    let h = |x: f32| f16::from_f32(x);
    match ty {
        GgmlType::F32 => (0..n).for_each(|_| {
            let v = rng.unit();
            bytes.extend(v.to_le_bytes());
            vals.push(v);
        }),
        GgmlType::F16 => (0..n).for_each(|_| {
            let v = h(rng.unit());
            bytes.extend(v.to_le_bytes());
            vals.push(v.to_f32());
        }),
        GgmlType::BF16 => (0..n).for_each(|_| {
            let v = bf16::from_f32(rng.unit());
            bytes.extend(v.to_le_bytes());
            vals.push(v.to_f32());
        }),
        GgmlType::Q8_0 => (0..n / 32).for_each(|_| {
            let d = h(rng.unit() * 0.01);
            bytes.extend(d.to_le_bytes());
            for _ in 0..32 {
                let q = rng.below(256) as u8 as i8;
                bytes.push(q as u8);
                vals.push(q as f32 * d.to_f32());
            }
        }),
        GgmlType::Q4_0 | GgmlType::Q4_1 => (0..n / 32).for_each(|_| {
            let d = h(rng.unit() * 0.1);
            let m = h(rng.unit() * 0.5);
            bytes.extend(d.to_le_bytes());
            if ty == GgmlType::Q4_1 {
                bytes.extend(m.to_le_bytes());
            }
            let qs: Vec<u8> = (0..32).map(|_| rng.below(16) as u8).collect();
            bytes.extend((0..16).map(|j| qs[j] | (qs[j + 16] << 4)));
            for &q in &qs {
                vals.push(if ty == GgmlType::Q4_1 {
                    q as f32 * d.to_f32() + m.to_f32()
                } else {
                    (q as f32 - 8.0) * d.to_f32()
                });
            }
        }),
        other => panic!("no test encoder for {other}"),
    }
    (bytes, vals)
}

/// llama.cpp's `permute` in `convert_hf_to_gguf.py`, spelled from its numpy definition:
/// `w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)`.
/// Returns, for each output (GGUF) row in order, the input (HF) row it comes from.
pub fn llama_cpp_permutation(rows: usize, n_head: usize) -> Vec<usize> {
    let half = rows / n_head / 2;
    // Input viewed as [n_head][2][half]; after swapaxes(1, 2) the output walks [n_head][half][2].
    let mut order = Vec::with_capacity(rows);
    for h in 0..n_head {
        for i in 0..half {
            for j in 0..2 {
                order.push((h * 2 + j) * half + i);
            }
        }
    }
    order
}

/// Shape and storage choices for [`tiny_llama`].
#[derive(Clone)]
pub struct TinyOpts {
    pub layers: u64,
    pub tied: bool,
    pub hidden: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub ffn: u64,
    /// Storage type per GGUF tensor suffix (e.g. "attn_q.weight"); default F32.
    pub types: BTreeMap<&'static str, GgmlType>,
}

impl Default for TinyOpts {
    fn default() -> Self {
        let types = [
            ("token_embd.weight", GgmlType::Q8_0),
            ("attn_q.weight", GgmlType::Q4_1),
            ("attn_k.weight", GgmlType::Q4_0),
            ("attn_v.weight", GgmlType::F16),
            ("attn_output.weight", GgmlType::BF16),
            ("ffn_gate.weight", GgmlType::Q4_1),
            ("ffn_up.weight", GgmlType::Q8_0),
            ("ffn_down.weight", GgmlType::F32),
            ("output.weight", GgmlType::Q8_0),
        ]
        .into_iter()
        .collect();
        TinyOpts {
            layers: 2,
            tied: true,
            hidden: 32,
            heads: 4,
            kv_heads: 2,
            ffn: 64,
            types,
        }
    }
}

/// The byte-level vocab of the tiny model: specials, the 256 byte characters, then merges.
pub fn tiny_vocab() -> (Vec<String>, Vec<i32>, Vec<String>) {
    let mut tokens: Vec<String> = vec![
        "<|endoftext|>".into(),
        "<|im_start|>".into(),
        "<|im_end|>".into(),
    ];
    let mut types = vec![3, 3, 3];
    let alphabet = bytes_to_unicode();
    tokens.extend(alphabet.iter().map(|c| c.to_string()));
    types.extend(std::iter::repeat_n(1, 256));
    let merges: Vec<String> = [
        "h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "Ġ t", "Ġt he",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for m in &merges {
        tokens.push(m.replace(' ', ""));
        types.push(1);
    }
    (tokens, types, merges)
}

/// HF tensor name -> (HF shape, exact values).
pub type Expected = BTreeMap<String, (Vec<u64>, Vec<f32>)>;

/// A tiny LLaMA GGUF and the HF tensors (name -> (shape, values)) it must convert to.
pub fn tiny_llama(o: &TinyOpts) -> (GgufBuilder, Expected) {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let (tokens, token_types, merges) = tiny_vocab();
    let vocab = tokens.len() as u64;
    let hd = o.hidden / o.heads;
    let mut b = GgufBuilder::default();
    let s = |x: &str| GgufValue::String(x.into());
    b.kv("general.architecture", s("llama"))
        .kv("general.name", s("tiny"))
        .kv("llama.block_count", GgufValue::U32(o.layers as u32))
        .kv("llama.context_length", GgufValue::U32(128))
        .kv("llama.embedding_length", GgufValue::U32(o.hidden as u32))
        .kv("llama.feed_forward_length", GgufValue::U32(o.ffn as u32))
        .kv("llama.attention.head_count", GgufValue::U32(o.heads as u32))
        .kv(
            "llama.attention.head_count_kv",
            GgufValue::U32(o.kv_heads as u32),
        )
        .kv("llama.rope.freq_base", GgufValue::F32(100000.0))
        .kv(
            "llama.attention.layer_norm_rms_epsilon",
            GgufValue::F32(1e-5),
        )
        .kv("llama.rope.dimension_count", GgufValue::U32(hd as u32))
        .kv("llama.vocab_size", GgufValue::U32(vocab as u32))
        .kv("tokenizer.ggml.model", s("gpt2"))
        .kv("tokenizer.ggml.pre", s("smollm"))
        .kv(
            "tokenizer.ggml.tokens",
            GgufValue::Array(GgufArray::String(tokens)),
        )
        .kv(
            "tokenizer.ggml.token_type",
            GgufValue::Array(GgufArray::I32(token_types)),
        )
        .kv(
            "tokenizer.ggml.merges",
            GgufValue::Array(GgufArray::String(merges)),
        )
        .kv("tokenizer.ggml.bos_token_id", GgufValue::U32(1))
        .kv("tokenizer.ggml.eos_token_id", GgufValue::U32(2))
        .kv("tokenizer.ggml.unknown_token_id", GgufValue::U32(0))
        .kv("tokenizer.ggml.padding_token_id", GgufValue::U32(2))
        .kv("tokenizer.ggml.add_bos_token", GgufValue::Bool(false))
        .kv(
            "tokenizer.chat_template",
            s("{% for m in messages %}{{m['content']}}{% endfor %}"),
        );

    let mut expected = BTreeMap::new();
    let ty = |suffix: &str| o.types.get(suffix).copied().unwrap_or(GgmlType::F32);
    // (gguf name, hf name, hf rows, hf cols, permute heads)
    let mut specs: Vec<(String, String, u64, u64, Option<u64>, GgmlType)> = vec![(
        "token_embd.weight".into(),
        "model.embed_tokens.weight".into(),
        vocab,
        o.hidden,
        None,
        ty("token_embd.weight"),
    )];
    for i in 0..o.layers {
        let l = |g: &str, h: &str, r, c, p| {
            (
                format!("blk.{i}.{g}"),
                format!("model.layers.{i}.{h}"),
                r,
                c,
                p,
                ty(g),
            )
        };
        let (q, kv) = (o.heads * hd, o.kv_heads * hd);
        specs.extend([
            l(
                "attn_norm.weight",
                "input_layernorm.weight",
                1,
                o.hidden,
                None,
            ),
            l(
                "attn_q.weight",
                "self_attn.q_proj.weight",
                q,
                o.hidden,
                Some(o.heads),
            ),
            l(
                "attn_k.weight",
                "self_attn.k_proj.weight",
                kv,
                o.hidden,
                Some(o.kv_heads),
            ),
            l(
                "attn_v.weight",
                "self_attn.v_proj.weight",
                kv,
                o.hidden,
                None,
            ),
            l(
                "attn_output.weight",
                "self_attn.o_proj.weight",
                o.hidden,
                q,
                None,
            ),
            l(
                "ffn_norm.weight",
                "post_attention_layernorm.weight",
                1,
                o.hidden,
                None,
            ),
            l(
                "ffn_gate.weight",
                "mlp.gate_proj.weight",
                o.ffn,
                o.hidden,
                None,
            ),
            l("ffn_up.weight", "mlp.up_proj.weight", o.ffn, o.hidden, None),
            l(
                "ffn_down.weight",
                "mlp.down_proj.weight",
                o.hidden,
                o.ffn,
                None,
            ),
        ]);
    }
    specs.push((
        "output_norm.weight".into(),
        "model.norm.weight".into(),
        1,
        o.hidden,
        None,
        GgmlType::F32,
    ));
    if !o.tied {
        specs.push((
            "output.weight".into(),
            "lm_head.weight".into(),
            vocab,
            o.hidden,
            None,
            ty("output.weight"),
        ));
    }
    for (gname, hname, rows, cols, perm, t) in specs {
        let t = if hname.ends_with("norm.weight") {
            GgmlType::F32
        } else {
            t
        };
        let mut row_bytes = Vec::new();
        let mut vals = Vec::new();
        for _ in 0..rows {
            let (bb, vv) = random_row(t, cols as usize, &mut rng);
            row_bytes.push(bb);
            vals.extend(vv);
        }
        // The GGUF stores q/k rows in llama.cpp's permuted order.
        let order: Vec<usize> = match perm {
            Some(h) => llama_cpp_permutation(rows as usize, h as usize),
            None => (0..rows as usize).collect(),
        };
        let data: Vec<u8> = order.iter().flat_map(|&r| row_bytes[r].clone()).collect();
        let dims: Vec<u64> = if rows == 1 {
            vec![cols]
        } else {
            vec![cols, rows]
        };
        b.tensor(&gname, &dims, t, data);
        let shape = if rows == 1 {
            vec![cols]
        } else {
            vec![rows, cols]
        };
        expected.insert(hname, (shape, vals));
    }
    (b, expected)
}
