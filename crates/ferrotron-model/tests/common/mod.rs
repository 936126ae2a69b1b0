//! What several model tests share: the committed tiny fixtures, pseudo-random token streams
//! and LoRA adapters made non-trivial.

#![allow(dead_code)] // each test file uses its own part

use ferrotron_model::GptModel;
use ferrotron_model::families::load_hf_model;
use ferrotron_tensor::DType;
use std::borrow::Cow;
use std::path::PathBuf;

/// The committed fixture `fixtures/<name>` in f32.
pub fn fixture(name: &str) -> GptModel {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name);
    load_hf_model(&dir, DType::F32).unwrap().0
}

/// A pseudo-random stream of `n` token ids below `vocab` from `seed`.
pub fn tokens(vocab: usize, seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// Sets every adapter's `linear_out` of `model` to values uniform in ±0.1 from `seed` (a
/// fresh adapter's is zero, which leaves the outputs unchanged and `linear_in` without
/// gradient).
pub fn randomize_adapter_outputs(model: &mut GptModel, seed: u64) {
    let outs: Vec<usize> = (0..model.parameters().len())
        .filter(|&i| {
            model.layout().decls()[i]
                .name
                .ends_with("linear_out.weight")
        })
        .collect();
    let sizes: Vec<usize> = model.parameters().iter().map(|p| p.numel()).collect();
    let mut x = seed;
    model
        .load_parameters_with(&outs, |i| {
            Cow::Owned(
                (0..sizes[i])
                    .map(|_| {
                        x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                        ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
                    })
                    .collect(),
            )
        })
        .unwrap();
}
