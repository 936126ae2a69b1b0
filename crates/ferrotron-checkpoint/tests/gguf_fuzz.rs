//! Random byte mutations and truncations of a valid tiny GGUF: opening, reading every tensor,
//! building the config/tokenizer and converting must return (Ok or an error), never panic, and a
//! failed conversion must leave no output directory.

mod common;

use std::sync::OnceLock;

use common::{TinyOpts, tiny_llama, write};
use ferrotron_checkpoint::gguf::{
    GgufFile, LlamaGgufConfig, hf_tokenizer_from_gguf, plan_llama_tensors,
};
use ferrotron_checkpoint::{GgufToHfOptions, gguf_to_hf};
use proptest::prelude::*;
use proptest::sample::Index;

/// The base file and the length of its header + metadata + tensor table.
fn base() -> &'static (Vec<u8>, usize) {
    static BASE: OnceLock<(Vec<u8>, usize)> = OnceLock::new();
    BASE.get_or_init(|| {
        let (b, _) = tiny_llama(&TinyOpts {
            layers: 1,
            ..TinyOpts::default()
        });
        let bytes = b.build();
        let dir = tempfile::tempdir().unwrap();
        let f = GgufFile::open(write(dir.path(), "base.gguf", &bytes)).unwrap();
        let header = f.data_offset() as usize;
        (bytes, header)
    })
}

#[derive(Debug, Clone)]
enum Mutation {
    /// Set one byte in the header/metadata/tensor table.
    HeaderByte(Index, u8),
    /// Set one byte anywhere.
    AnyByte(Index, u8),
    /// Write a little-endian u64 (a count, length, dim or offset) in the header region.
    HeaderU64(Index, u64),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let word = prop_oneof![
        Just(0u64),
        Just(1),
        Just(u64::MAX),
        Just(1 << 32),
        Just(1 << 62),
        any::<u32>().prop_map(u64::from),
        any::<u64>()
    ];
    prop_oneof![
        4 => (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::HeaderByte(i, b)),
        1 => (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::AnyByte(i, b)),
        2 => (any::<Index>(), word).prop_map(|(i, w)| Mutation::HeaderU64(i, w)),
    ]
}

fn apply(bytes: &mut Vec<u8>, header: usize, muts: &[Mutation], truncate: Option<Index>) {
    for m in muts {
        match m {
            Mutation::HeaderByte(i, b) => {
                let at = i.index(header);
                bytes[at] = *b;
            }
            Mutation::AnyByte(i, b) => {
                let at = i.index(bytes.len());
                bytes[at] = *b;
            }
            Mutation::HeaderU64(i, w) => {
                let at = i.index(header - 8);
                bytes[at..at + 8].copy_from_slice(&w.to_le_bytes());
            }
        }
    }
    if let Some(t) = truncate {
        bytes.truncate(t.index(bytes.len()));
    }
}

/// Runs every reading path on `bytes`; panics only if a failed conversion left output behind.
fn exercise(bytes: &[u8]) {
    if let Ok(p) = std::env::var("FERROTRON_FUZZ_SAVE") {
        std::fs::write(p, bytes).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let input = write(dir.path(), "in.gguf", bytes);
    if let Ok(f) = GgufFile::open(&input) {
        for t in f.tensors() {
            let _ = f.tensor_f32(&t.name);
        }
        if let Ok(cfg) = LlamaGgufConfig::from_gguf(&f) {
            let _ = plan_llama_tensors(&f, &cfg);
        }
        let _ = hf_tokenizer_from_gguf(&f, Some(16));
    }
    let out = dir.path().join("hf");
    if gguf_to_hf(&input, &out, &GgufToHfOptions::default()).is_err() {
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, ["in.gguf"], "a failed conversion left files behind");
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        // FERROTRON_FUZZ_CASES=100000 for a long run.
        cases: std::env::var("FERROTRON_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(256),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn mutated_gguf_never_panics(
        muts in prop::collection::vec(mutation(), 1..6),
        truncate in prop::option::weighted(0.2, any::<Index>()),
    ) {
        let (base, header) = base();
        let mut bytes = base.clone();
        apply(&mut bytes, *header, &muts, truncate);
        exercise(&bytes);
    }
}

#[test]
fn every_truncation_of_the_header_is_an_error() {
    let (base, header) = base();
    for len in (0..*header).step_by(7) {
        let dir = tempfile::tempdir().unwrap();
        let p = write(dir.path(), "t.gguf", &base[..len]);
        assert!(
            GgufFile::open(&p).is_err(),
            "truncation to {len} bytes opened"
        );
    }
}

#[test]
fn unmutated_base_converts() {
    let (base, _) = base();
    let dir = tempfile::tempdir().unwrap();
    let input = write(dir.path(), "in.gguf", base);
    gguf_to_hf(&input, &dir.path().join("hf"), &GgufToHfOptions::default()).unwrap();
}
