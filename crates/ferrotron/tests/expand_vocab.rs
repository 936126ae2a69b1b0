//! `ferrotron convert expand-vocab` (issue 19) on SmolLM2-135M, in both modes: tokens added
//! as HF's `add_tokens` adds them, and tokens merged into the BPE model. Each new embedding
//! row is the mean of its old pieces' rows, logits over the old vocabulary are unchanged on
//! old-token text, and continued pretraining runs on data preprocessed with the new
//! tokenizer. (`tools/check_vocab_expansion.py` checks the output against transformers.)
//!
//! Needs `FERROTRON_SMOLLM2_GGUF` (like tests/smollm2.rs); without it the tests are reported
//! as ignored (`common::weights`).

use std::path::{Path, PathBuf};

use ferrotron_data::Tokenizer;
use ferrotron_model::GptModel;
use ferrotron_model::families::load_hf_model;

mod common;
use common::weights::{self, GGUF, trials};
use common::{ferrotron, model_dir, text, train, train_losses};

fn main() {
    let smollm2 = trials![needs [GGUF]:
        added_tokens_continue_pretraining,
        merged_tokens_continue_pretraining,
    ];
    weights::run(smollm2);
}

const OLD_VOCAB: u32 = 49152;

/// Runs `convert expand-vocab` on SmolLM2 with `tokens` (one per line) and `extra` flags into
/// `dir/expanded`; returns the directory and stdout.
fn expand(dir: &Path, tokens: &str, extra: &[&str]) -> (PathBuf, String) {
    let file = dir.join("tokens.txt");
    std::fs::write(&file, tokens).unwrap();
    let expanded = dir.join("expanded");
    let mut args = vec![
        "convert",
        "expand-vocab",
        "--hf",
        model_dir().to_str().unwrap(),
        "--add-tokens",
        file.to_str().unwrap(),
        "--output",
        expanded.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let o = ferrotron(&args);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    (expanded, out)
}

/// Asserts `id`'s embedding row in `new` is the mean (in f64, stored f32) of the old rows of
/// `pieces`.
fn assert_piece_mean(old: &GptModel, new: &GptModel, id: u32, pieces: &[u32]) {
    let (emb_old, emb_new) = (old.parameter_f32(0).unwrap(), new.parameter_f32(0).unwrap());
    let h = old.config().hidden_size;
    for j in 0..h {
        let mean = pieces
            .iter()
            .map(|&p| emb_old[p as usize * h + j] as f64)
            .sum::<f64>()
            / pieces.len() as f64;
        assert_eq!(
            emb_new[id as usize * h + j],
            mean as f32,
            "id {id} column {j}"
        );
    }
    assert_eq!(emb_new[..emb_old.len()], emb_old[..], "old rows kept");
}

/// Asserts the logits over the old vocabulary of old-token text are unchanged; returns the
/// expanded model's vocabulary size (the logits' length).
fn assert_old_logits_unchanged(old: &GptModel, new: &GptModel, old_tok: &Tokenizer) -> usize {
    use ferrotron_model::{KvCache, LogitsMode};
    let ids = old_tok
        .encode(
            "In the beginning God created the heaven and the earth.",
            true,
        )
        .unwrap();
    let last = |m: &GptModel| {
        let mut cache = KvCache::new(m.config(), 1, ids.len()).unwrap();
        m.forward(&ids, &mut cache, LogitsMode::Last).unwrap()
    };
    let (a, b) = (last(old), last(new));
    let diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(diff <= 1e-5, "old-vocabulary logits moved by {diff}");
    b.len()
}

/// Preprocesses a corpus that uses `new_ids`' texts with the expanded tokenizer (the ids
/// must appear in the data) and continues pretraining on it for three iterations.
fn continue_pretraining(dir: &Path, expanded: &Path, new_ids: &[u32]) {
    let corpus = dir.join("corpus.txt");
    let lines: Vec<String> = (0..200)
        .map(|i| format!("{i}: Ferrotron，今天天气很好，天气预报说明天下雨。"))
        .collect();
    std::fs::write(&corpus, lines.join("\n")).unwrap();
    let prefix = dir.join("weather");
    let o = ferrotron(&[
        "preprocess-data",
        "--input",
        corpus.to_str().unwrap(),
        "--tokenizer",
        expanded.to_str().unwrap(),
        "--output-prefix",
        prefix.to_str().unwrap(),
        "--append-eod",
    ]);
    assert!(o.status.success(), "preprocess: {}", text(&o).1);
    let data = dir.join("weather_text_document");
    let bin = std::fs::read(data.with_extension("bin")).unwrap();
    // uint16 ids: Megatron's choice for vocabularies under 65500.
    let ids: Vec<u32> = bin
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
        .collect();
    for id in new_ids {
        assert!(ids.contains(id), "new id {id} is in the data");
    }
    let out = train(
        dir,
        &format!(
            "[model]\nload = {:?}\nseq_length = 32\n\
             [data]\ndata_path = {:?}\nsplit = \"100,0,0\"\n\
             [training]\nmicro_batch_size = 1\nglobal_batch_size = 2\ntrain_iters = 3\n\
             log_interval = 1\n\
             [optimizer]\nlr = 1e-4\n\
             [logging]\noutput_dir = {:?}\ntensorboard = false\n",
            expanded.to_str().unwrap(),
            data.to_str().unwrap(),
            dir.join("out").to_str().unwrap()
        ),
    );
    let losses = train_losses(&out);
    assert_eq!(losses.len(), 3, "{out}");
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
}

/// Added mode (HF's `add_tokens`): the new tokens encode to single new ids numbered after the
/// tokenizer's last, each row the mean of its old pieces'; the vocabulary is padded.
fn added_tokens_continue_pretraining() {
    let tmp = tempfile::tempdir().unwrap();
    let (expanded, out) = expand(
        tmp.path(),
        "天气\nFerrotron\n",
        &["--pad-to-multiple-of", "64"],
    );
    assert!(
        out.contains("2 tokens added (ids 49152..=49153), vocab_size 49152 -> 49216"),
        "{out}"
    );
    let old_tok = Tokenizer::from_dir(model_dir()).unwrap();
    let new_tok = Tokenizer::from_dir(&expanded).unwrap();
    assert_eq!(new_tok.encode("天气", false).unwrap(), [49152]);
    assert_eq!(new_tok.encode("Ferrotron", false).unwrap(), [49153]);
    let (old, _) = load_hf_model(model_dir(), ferrotron_tensor::DType::F32).unwrap();
    let (new, _) = load_hf_model(&expanded, ferrotron_tensor::DType::F32).unwrap();
    assert_piece_mean(&old, &new, 49152, &old_tok.encode("天气", false).unwrap());
    assert_eq!(assert_old_logits_unchanged(&old, &new, &old_tok), 49216);
    continue_pretraining(tmp.path(), &expanded, &[49152, 49153]);
}

/// Merged mode: each token (and each intermediate string its merges need, whole characters
/// first) joins the BPE vocabulary with a row the mean of its old pieces'; a token is found
/// inside running text, text without the new strings encodes as before, and a token the
/// pre-tokenizer splits is an error naming it that writes nothing.
fn merged_tokens_continue_pretraining() {
    let tmp = tempfile::tempdir().unwrap();
    let tokens = ["天气", "天气预报", "Ferrotron", " Ferrotron"];
    let (expanded, out) = expand(tmp.path(), &tokens.join("\n"), &["--mode", "merged"]);
    let old_tok = Tokenizer::from_dir(model_dir()).unwrap();
    let new_tok = Tokenizer::from_dir(&expanded).unwrap();
    // 天, 气 (its three bytes need one partial intermediate), 天气, 预, 报, 预报, 天气预报,
    // rotron, Ferrotron, ' Ferrotron'
    let added = 11;
    assert!(
        out.contains(&format!(
            "{added} tokens added (ids 49152..={}), vocab_size 49152 -> {}",
            OLD_VOCAB + added - 1,
            OLD_VOCAB + added
        )),
        "{out}"
    );
    let mut roots = Vec::new();
    for t in tokens {
        let ids = new_tok.encode(t, false).unwrap();
        assert!(ids.len() == 1 && ids[0] >= OLD_VOCAB, "{t:?} -> {ids:?}");
        roots.push(ids[0]);
    }
    let running = "今天天气很好, Ferrotron!天气预报说Ferrotron。";
    let ids = new_tok.encode(running, false).unwrap();
    assert!(roots.iter().all(|r| ids.contains(r)), "{ids:?}");
    assert_eq!(new_tok.decode(&ids, false).unwrap(), running);
    let plain = "And God said, Let there be light: and there was light.";
    assert_eq!(
        new_tok.encode(plain, false).unwrap(),
        old_tok.encode(plain, false).unwrap()
    );
    let (old, _) = load_hf_model(model_dir(), ferrotron_tensor::DType::F32).unwrap();
    let (new, _) = load_hf_model(&expanded, ferrotron_tensor::DType::F32).unwrap();
    let mut partial = 0;
    for id in OLD_VOCAB..OLD_VOCAB + added {
        let piece = new_tok.decode(&[id], false).unwrap();
        if piece.contains('\u{FFFD}') {
            partial += 1;
        } else {
            assert_piece_mean(&old, &new, id, &old_tok.encode(&piece, false).unwrap());
        }
    }
    assert_eq!(
        partial, 1,
        "only 气 needs an intermediate inside a character"
    );
    assert_old_logits_unchanged(&old, &new, &old_tok);
    continue_pretraining(tmp.path(), &expanded, &[roots[0], roots[1], roots[3]]);

    std::fs::write(tmp.path().join("bad.txt"), "天气\nhello world\n").unwrap();
    let bad_out = tmp.path().join("bad");
    let o = ferrotron(&[
        "convert",
        "expand-vocab",
        "--hf",
        model_dir().to_str().unwrap(),
        "--add-tokens",
        tmp.path().join("bad.txt").to_str().unwrap(),
        "--output",
        bad_out.to_str().unwrap(),
        "--mode",
        "merged",
    ]);
    let err = text(&o).1;
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("`hello world` is split by the pre-tokenizer into 2 words")
            && err.contains("--mode added"),
        "{err}"
    );
    assert!(!bad_out.exists(), "nothing written");
}
