//! SFT datasets with the real SmolLM2-135M-Instruct tokenizer and ChatML template on the committed
//! samples: `fixtures/sft/alpaca_sample.json(l)` (hand-made) and `fixtures/sft/chitchat_sample.jsonl`
//! (the first 50 chats of PyPI `chitchat-dataset==0.9.0`, via `tools/make_chitchat_jsonl.py`).
//!
//! Needs an HF model directory (tokenizer.json + tokenizer_config.json) at `$FERROTRON_SMOLLM2_HF`,
//! e.g. `ferrotron convert gguf-to-hf --input <SmolLM2 gguf> --output /tmp/smollm2-hf`; reported
//! as ignored when the variable is unset (`common::weights`), failed when it names no such
//! directory.

use std::path::{Path, PathBuf};

use ferrotron_data::chat::{ChatMessage, ChatTemplate};
use ferrotron_data::sft::{
    Conversation, EncodedSample, IdxmapSftDataset, RawSftDataset, SftEncoder, SftOptions,
    SpecialTokens, idxmap_prefix, source, write_idxmap,
};
use ferrotron_data::{Tokenizer, sft::SftReport};

mod common;
use common::weights::{self, HF, trials};

fn main() {
    weights::run(trials![needs [HF]:
        alpaca_masks_decode_to_prompt_and_answer,
        chitchat_every_assistant_turn_is_trained,
        chitchat_raw_and_preprocessed_agree_packed_and_padded,
        bpe_merge_across_the_answer_boundary_is_reported,
    ]);
}

/// `$FERROTRON_SMOLLM2_HF`, checked to hold a tokenizer.
fn model_dir() -> PathBuf {
    let dir = weights::path(HF);
    assert!(
        dir.join("tokenizer.json").is_file(),
        "{HF}={} has no tokenizer.json",
        dir.display()
    );
    dir
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/sft")
        .join(name)
}

fn records(path: &Path) -> Vec<Conversation> {
    let mut out = Vec::new();
    let mut report = SftReport::default();
    source::read_file(path, source::SftFormat::Auto, true, &mut report, &mut |r| {
        out.push(r.conversation);
        Ok(())
    })
    .unwrap();
    out
}

/// Decoded maximal runs of masked / trained tokens.
fn runs(enc: &SftEncoder, s: &EncodedSample) -> Vec<(bool, String)> {
    let mut out: Vec<(bool, Vec<u32>)> = Vec::new();
    for (&t, &m) in s.tokens.iter().zip(&s.trained) {
        match out.last_mut() {
            Some((flag, ids)) if *flag == m => ids.push(t),
            _ => out.push((m, vec![t])),
        }
    }
    let dec = |ids: &[u32]| enc.tokenizer().decode(ids, false).unwrap();
    out.iter().map(|(m, ids)| (*m, dec(ids))).collect()
}

fn alpaca_masks_decode_to_prompt_and_answer() {
    let dir = model_dir();
    let enc = SftEncoder::from_model_dir(&dir).unwrap();
    assert_eq!(enc.eos(), Some(("<|im_end|>", 2)));
    assert_eq!(enc.default_pad_id(), 2, "pad_token is <|im_end|>");
    let template = enc.chat_template().unwrap();
    let mut n = 0;
    for file in ["alpaca_sample.json", "alpaca_sample.jsonl"] {
        for c in records(&fixture(file)) {
            let Conversation::Alpaca {
                instruction,
                input,
                output,
            } = &c
            else {
                panic!()
            };
            let user = if input.is_empty() {
                instruction.clone()
            } else {
                format!("{instruction}\n\n{input}")
            };
            let prompt = template
                .render(&[ChatMessage::new("user", user)], true)
                .unwrap();
            let s = enc.encode(&c).unwrap();
            let want = vec![
                (false, prompt),
                (true, format!("{output}<|im_end|>")),
                (false, "\n".into()),
            ];
            assert_eq!(runs(&enc, &s), want, "{file}: {instruction}");
            n += 1;
        }
    }
    assert_eq!(n, 12);
}

fn chitchat_every_assistant_turn_is_trained() {
    let dir = model_dir();
    let enc = SftEncoder::from_model_dir(&dir).unwrap();
    let template = enc.chat_template().unwrap();
    let chats = records(&fixture("chitchat_sample.jsonl"));
    assert_eq!(chats.len(), 50);
    for c in &chats {
        let Conversation::Chat(messages) = c else {
            panic!()
        };
        let s = enc.encode(c).unwrap();
        let full = template.render(messages, false).unwrap();
        assert_eq!(enc.tokenizer().decode(&s.tokens, false).unwrap(), full);
        assert_eq!(s.tokens, enc.tokenizer().encode(&full, false).unwrap());
        let trained: Vec<String> = runs(&enc, &s)
            .into_iter()
            .filter(|r| r.0)
            .map(|r| r.1)
            .collect();
        let answers: Vec<String> = messages
            .iter()
            .filter(|m| m.role == "assistant")
            .map(|m| format!("{}<|im_end|>", m.content))
            .collect();
        assert_eq!(trained, answers);
    }
}

fn chitchat_raw_and_preprocessed_agree_packed_and_padded() {
    let dir = model_dir();
    let enc = SftEncoder::from_model_dir(&dir).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let files = [
        fixture("chitchat_sample.jsonl"),
        fixture("alpaca_sample.json"),
    ];
    let files: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    for pack in [false, true] {
        let mut opts = SftOptions::new(512);
        opts.pack = pack;
        let raw = RawSftDataset::load(&files, &enc, &opts).unwrap();
        let r = raw.report();
        assert_eq!((r.records, r.bad_records, r.dropped_no_answer), (56, 0, 0));
        assert!(r.truncated > 0, "some chitchat chats exceed 512 tokens");
        let out = tmp.path().join(format!("chitchat_{pack}"));
        assert_eq!(&write_idxmap(&files, &enc, &opts, &out).unwrap(), r);
        let mmap = IdxmapSftDataset::open(&idxmap_prefix(&out)).unwrap();
        assert_eq!(raw.len(), mmap.len());
        for i in 0..raw.len() {
            let x = raw.get(i).unwrap();
            assert_eq!(x, mmap.get(i).unwrap());
            assert!(
                x.tokens[x.cu_seqlens()[raw.group(i).unwrap().len()]..]
                    .iter()
                    .all(|&t| t == 2)
            );
        }
        if pack {
            assert!(raw.len() < 56);
        } else {
            assert_eq!(raw.len(), 56);
        }
    }
}

fn bpe_merge_across_the_answer_boundary_is_reported() {
    let dir = model_dir();
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    // "A: Hel" + "lo world": whole, "Hello" is one token; as pieces it cannot be.
    let t = ChatTemplate::new(
        "{% for m in messages %}{% if m.role == 'user' %}Q: {{ m.content }}\n{% else %}A: Hel{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}A: Hel{% endif %}",
        None,
        None,
    )
    .unwrap();
    let special = SpecialTokens::from_tokenizer_config(&dir.join("tokenizer_config.json")).unwrap();
    let enc = SftEncoder::new(tokenizer, Some(t), special, &dir).unwrap();
    let chat = Conversation::Chat(vec![
        ChatMessage::new("user", "Greet"),
        ChatMessage::new("assistant", "lo world"),
    ]);
    let err = enc.encode(&chat).unwrap_err();
    assert!(err.contains("spans an answer boundary"), "{err}");
}
