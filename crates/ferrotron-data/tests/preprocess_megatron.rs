//! Our preprocessing against Megatron's on the real SmolLM2 tokenizer: the committed corpus
//! fixtures/megatron_idx/preprocess_input.jsonl (keys text and title; Unicode, sentence lists,
//! an empty text, special-token strings) was preprocessed with --append-eod by Megatron's steps
//! and megatron.core's HuggingFaceTokenizer (tools/make_megatron_idx_fixture.py). Ours must
//! write the same bytes, with Megatron's EOD choice (the tokenizer's eos_token).
//!
//! The tokenizer comes from `$FERROTRON_SMOLLM2_HF` (an HF directory), else from the GGUF at
//! `$FERROTRON_SMOLLM2_GGUF` (converted here); without either the test is reported as ignored
//! (`common::weights`).

use ferrotron_checkpoint::GgufFile;
use ferrotron_checkpoint::gguf::hf_tokenizer_from_gguf;
use ferrotron_data::Tokenizer;
use ferrotron_data::indexed::data_paths;
use ferrotron_data::preprocess::{EodToken, PreprocessConfig, preprocess_data, resolve_eod};
use std::path::{Path, PathBuf};

mod common;
use common::weights::{self, GGUF, HF, trials};

fn main() {
    weights::run(trials![needs [HF, GGUF]: preprocessing_matches_megatron_on_smollm2]);
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The SmolLM2 HF tokenizer directory: `$FERROTRON_SMOLLM2_HF`, or the tokenizer of
/// `$FERROTRON_SMOLLM2_GGUF` written into `tmp`.
fn smollm2_dir(tmp: &Path) -> PathBuf {
    if weights::var(HF).is_some() {
        return weights::path(HF);
    }
    let f = GgufFile::open(weights::path(GGUF)).expect("FERROTRON_SMOLLM2_GGUF");
    let files = hf_tokenizer_from_gguf(&f, None).expect("tokenizer from GGUF");
    std::fs::write(tmp.join("tokenizer.json"), files.tokenizer_json.to_string()).unwrap();
    std::fs::write(
        tmp.join("tokenizer_config.json"),
        files.tokenizer_config.to_string(),
    )
    .unwrap();
    tmp.to_path_buf()
}

fn preprocessing_matches_megatron_on_smollm2() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = smollm2_dir(tmp.path());
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    let fixtures = root().join("fixtures/megatron_idx");
    let ops: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures.join("ops.json")).unwrap()).unwrap();
    let eod = resolve_eod(&EodToken::TokenizerEos, &tokenizer, &dir).unwrap();
    assert_eq!(eod, 2, "SmolLM2-Instruct's eos_token is <|im_end|>");
    assert_eq!(ops["preprocess"]["eod"], eod);

    let mut cfg = PreprocessConfig::new(
        vec![fixtures.join("preprocess_input.jsonl")],
        tmp.path().join("ours"),
    );
    cfg.json_keys = vec!["text".into(), "title".into()];
    cfg.append_eod = Some(eod);
    cfg.workers = 2;
    let report = preprocess_data(&cfg, &tokenizer, &mut |_| {}).unwrap();
    assert_eq!(report.skipped, 0);
    for out in &report.outputs {
        let ours = data_paths(&out.prefix);
        let theirs = data_paths(&fixtures.join(format!("preprocess_{}_document", out.key)));
        for (a, b) in [(&ours.0, &theirs.0), (&ours.1, &theirs.1)] {
            assert_eq!(
                std::fs::read(a).unwrap(),
                std::fs::read(b).unwrap(),
                "{} differs from Megatron's {}",
                a.display(),
                b.display()
            );
        }
    }
}
