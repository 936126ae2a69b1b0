//! SFT rendering and loss masks on hand-checked examples, with the tiny character-level ChatML
//! tokenizer in `fixtures/sft/tiny-chatml` (one token per character, specials `<|endoftext|>` 0,
//! `<|im_start|>` 1, `<|im_end|>` 2, and a single BPE merge `h i -> hi` so that a token can
//! straddle an answer boundary).

use std::path::{Path, PathBuf};

use ferrotron_data::Tokenizer;
use ferrotron_data::chat::{ChatMessage, ChatTemplate};
use ferrotron_data::sft::{
    ALPACA_PROMPT_INPUT, ALPACA_PROMPT_NO_INPUT, Conversation, EncodedSample, SftEncoder,
    SpecialTokens,
};

fn tiny_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/sft/tiny-chatml")
}

fn tiny() -> SftEncoder {
    SftEncoder::from_model_dir(&tiny_dir()).unwrap()
}

fn alpaca(instruction: &str, input: &str, output: &str) -> Conversation {
    Conversation::Alpaca {
        instruction: instruction.into(),
        input: input.into(),
        output: output.into(),
    }
}

fn chat(turns: &[(&str, &str)]) -> Conversation {
    Conversation::Chat(
        turns
            .iter()
            .map(|(r, c)| ChatMessage::new(*r, *c))
            .collect(),
    )
}

/// Splits a sample into maximal runs of equal `trained` flags, decoded: `(trained, text)`.
fn runs(enc: &SftEncoder, s: &EncodedSample) -> Vec<(bool, String)> {
    let mut out: Vec<(bool, Vec<u32>)> = Vec::new();
    for (&t, &m) in s.tokens.iter().zip(&s.trained) {
        match out.last_mut() {
            Some((flag, ids)) if *flag == m => ids.push(t),
            _ => out.push((m, vec![t])),
        }
    }
    out.into_iter()
        .map(|(m, ids)| (m, enc.tokenizer().decode(&ids, false).unwrap()))
        .collect()
}

const SYSTEM: &str = "<|im_start|>system\nYou are a test model.<|im_end|>\n";

#[test]
fn alpaca_through_chat_template_trains_answer_and_end_token_only() {
    let enc = tiny();
    let s = enc.encode(&alpaca("Say hi", "", "hi there")).unwrap();
    let prompt = format!("{SYSTEM}<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n");
    assert_eq!(
        runs(&enc, &s),
        vec![
            (false, prompt),
            (true, "hi there<|im_end|>".to_string()),
            (false, "\n".to_string()),
        ]
    );
    // Hand-checked ids of the answer: "hi" merged (id 100), then characters, then <|im_end|>.
    let t = enc.tokenizer();
    let id = |c: &str| t.token_to_id(c).unwrap();
    let answer: Vec<u32> = s
        .tokens
        .iter()
        .zip(&s.trained)
        .filter(|p| *p.1)
        .map(|p| *p.0)
        .collect();
    let want = ["hi", " ", "t", "h", "e", "r", "e", "<|im_end|>"].map(id);
    assert_eq!(answer, want);
    assert_eq!(id("hi"), 100);
    assert_eq!(
        enc.default_pad_id(),
        0,
        "pad_token <|endoftext|> wins over eos"
    );
}

#[test]
fn alpaca_input_joins_the_user_turn_with_a_blank_line() {
    let enc = tiny();
    let s = enc
        .encode(&alpaca("Translate.", "Bonjour", "Hello"))
        .unwrap();
    let r = runs(&enc, &s);
    assert!(
        r[0].1
            .ends_with("user\nTranslate.\n\nBonjour<|im_end|>\n<|im_start|>assistant\n")
    );
    assert_eq!(r[1], (true, "Hello<|im_end|>".into()));
}

#[test]
fn multi_turn_chat_trains_every_assistant_turn() {
    let enc = tiny();
    let c = chat(&[
        ("system", "Be brief."),
        ("user", "Q1"),
        ("assistant", "A1"),
        ("user", "Q2"),
        ("assistant", "  A2 spaced\n"),
    ]);
    let s = enc.encode(&c).unwrap();
    let r = runs(&enc, &s);
    let p1 = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n";
    let p2 = "\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(
        r,
        vec![
            (false, p1.into()),
            (true, "A1<|im_end|>".into()),
            (false, p2.into()),
            (true, "  A2 spaced\n<|im_end|>".into()),
            (false, "\n".into()),
        ]
    );
    // The pieces reproduce the rendered text token for token.
    let full = enc.chat_template().unwrap().render(
        &[
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Q1"),
            ChatMessage::new("assistant", "A1"),
            ChatMessage::new("user", "Q2"),
            ChatMessage::new("assistant", "  A2 spaced\n"),
        ],
        false,
    );
    assert_eq!(
        s.tokens,
        enc.tokenizer().encode(&full.unwrap(), false).unwrap()
    );
}

#[test]
fn chat_ending_with_user_turn_masks_it() {
    let enc = tiny();
    let s = enc
        .encode(&chat(&[("user", "a"), ("assistant", "b"), ("user", "c")]))
        .unwrap();
    let r = runs(&enc, &s);
    assert_eq!(r[1], (true, "b<|im_end|>".into()));
    assert_eq!(r[2], (false, "\n<|im_start|>user\nc<|im_end|>\n".into()));
}

#[test]
fn plain_alpaca_prompt_exact_strings() {
    let enc = tiny().without_chat_template().unwrap();
    let s = enc.encode(&alpaca("Add.", "1, 2", "3\nDone.")).unwrap();
    let prompt = "Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request.\n\n### Instruction:\nAdd.\n\n### Input:\n1, 2\n\n### Response:\n";
    assert_eq!(
        ALPACA_PROMPT_INPUT
            .replace("{instruction}", "Add.")
            .replace("{input}", "1, 2"),
        prompt
    );
    assert_eq!(
        runs(&enc, &s),
        vec![(false, prompt.into()), (true, "3\nDone.<|im_end|>".into())]
    );
    let s = enc.encode(&alpaca("Greet.", "", "Hello")).unwrap();
    let prompt = "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n### Instruction:\nGreet.\n\n### Response:\n";
    assert_eq!(
        ALPACA_PROMPT_NO_INPUT.replace("{instruction}", "Greet."),
        prompt
    );
    assert_eq!(runs(&enc, &s)[0], (false, prompt.into()));
    assert!(
        enc.encode(&chat(&[("user", "a"), ("assistant", "b")]))
            .is_err()
    );
}

#[test]
fn plain_alpaca_gets_the_post_processor_bos_but_chat_templates_do_not() {
    let dir = tempfile::tempdir().unwrap();
    let mut tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tiny_dir().join("tokenizer.json")).unwrap())
            .unwrap();
    tok["post_processor"] = serde_json::json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}}
    });
    std::fs::write(dir.path().join("tokenizer.json"), tok.to_string()).unwrap();
    std::fs::copy(
        tiny_dir().join("tokenizer_config.json"),
        dir.path().join("tokenizer_config.json"),
    )
    .unwrap();
    let enc = SftEncoder::from_model_dir(dir.path()).unwrap();
    let with_template = enc.encode(&alpaca("a", "", "b")).unwrap();
    assert_eq!(with_template.tokens[0], 1, "<|im_start|>, no BOS added");
    let plain = enc.without_chat_template().unwrap();
    let s = plain.encode(&alpaca("a", "", "b")).unwrap();
    assert_eq!((s.tokens[0], s.trained[0]), (0, false));
    assert_eq!(s.tokens[1], plain.tokenizer().token_to_id("B").unwrap());
}

fn tiny_with_template(template: &str) -> SftEncoder {
    let tokenizer = Tokenizer::from_dir(&tiny_dir()).unwrap();
    let special = SpecialTokens {
        eos_token: Some("<|im_end|>".into()),
        ..Default::default()
    };
    let t = ChatTemplate::new(template, None, None).unwrap();
    SftEncoder::new(tokenizer, Some(t), special, Path::new("test-template")).unwrap()
}

#[test]
fn token_straddling_the_answer_boundary_is_rejected() {
    // The generation prompt ends in "h" and the answer starts with "i": tokenized whole, "hi"
    // merges into one token that is half prompt, half answer.
    let enc = tiny_with_template(
        "{% for m in messages %}{% if m.role == 'user' %}Q: {{ m.content }}\n{% else %}A: h{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}A: h{% endif %}",
    );
    let err = enc
        .encode(&chat(&[("user", "x"), ("assistant", "i there")]))
        .unwrap_err();
    assert!(err.contains("spans an answer boundary"), "{err}");
    assert!(err.contains("at token 8"), "{err}");
    // Same template, no straddling token: fine.
    let ok = enc
        .encode(&chat(&[("user", "x"), ("assistant", "o there")]))
        .unwrap();
    assert_eq!(runs(&enc, &ok)[1], (true, "o there<|im_end|>".into()));
}

#[test]
fn tokenizers_that_prefix_every_piece_fall_back_to_prefix_tokenization() {
    // Like SentencePiece's prepended "▁": a Prepend("_") normalizer marks the start of every
    // tokenized text, so pieces tokenized alone differ from the whole; boundaries are then found
    // by tokenizing the text before each of them.
    let dir = tempfile::tempdir().unwrap();
    let mut tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tiny_dir().join("tokenizer.json")).unwrap())
            .unwrap();
    tok["normalizer"] = serde_json::json!({"type": "Prepend", "prepend": "_"});
    std::fs::write(dir.path().join("tokenizer.json"), tok.to_string()).unwrap();
    let config = tiny_dir().join("tokenizer_config.json");
    std::fs::copy(config, dir.path().join("tokenizer_config.json")).unwrap();
    let enc = SftEncoder::from_model_dir(dir.path()).unwrap();
    let underscore = enc.tokenizer().token_to_id("_").unwrap();
    assert_eq!(enc.tokenizer().encode("ok", false).unwrap()[0], underscore);
    let messages = [
        ("user", "Q"),
        ("assistant", "hi there"),
        ("user", "R"),
        ("assistant", "ok"),
    ];
    let s = enc.encode(&chat(&messages)).unwrap();
    let full = enc
        .chat_template()
        .unwrap()
        .render(&messages.map(|(r, c)| ChatMessage::new(r, c)), false)
        .unwrap();
    assert_eq!(s.tokens, enc.tokenizer().encode(&full, false).unwrap());
    let trained: Vec<String> = runs(&enc, &s)
        .into_iter()
        .filter(|r| r.0)
        .map(|r| r.1)
        .collect();
    assert_eq!(trained, ["hi there<|im_end|>", "ok<|im_end|>"]);
}

#[test]
fn template_that_rewrites_earlier_turns_is_rejected() {
    let enc = tiny_with_template(
        "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}[old]\n{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}",
    );
    let two = chat(&[
        ("user", "a"),
        ("assistant", "b"),
        ("user", "c"),
        ("assistant", "d"),
    ]);
    let err = enc.encode(&two).unwrap_err();
    assert!(
        err.contains("messages[1]") && err.contains("differently"),
        "{err}"
    );
}

#[test]
fn generation_prompt_not_a_prefix_is_rejected() {
    let enc = tiny_with_template(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}<|im_end|>{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}",
    );
    let err = enc
        .encode(&chat(&[("user", "a"), ("assistant", "b")]))
        .unwrap_err();
    assert!(err.contains("not a prefix"), "{err}");
}

#[test]
fn template_without_end_token_trains_the_whole_turn() {
    let tokenizer = Tokenizer::from_dir(&tiny_dir()).unwrap();
    let t = ChatTemplate::new(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}",
        None,
        None,
    )
    .unwrap();
    let enc =
        SftEncoder::new(tokenizer, Some(t), SpecialTokens::default(), Path::new("t")).unwrap();
    let s = enc
        .encode(&chat(&[("user", "a"), ("assistant", "b")]))
        .unwrap();
    assert_eq!(
        runs(&enc, &s),
        vec![(false, "user: a\nassistant: ".into()), (true, "b\n".into())]
    );
    assert_eq!(enc.default_pad_id(), 0, "no pad/eos: pad id 0");
}

#[test]
fn missing_eos_without_template_is_a_clear_error() {
    let tokenizer = Tokenizer::from_dir(&tiny_dir()).unwrap();
    let err = SftEncoder::new(tokenizer, None, SpecialTokens::default(), Path::new("m")).err();
    let msg = err.unwrap().to_string();
    assert!(msg.starts_with("m: ") && msg.contains("EOS"), "{msg}");
    let tokenizer = Tokenizer::from_dir(&tiny_dir()).unwrap();
    let special = SpecialTokens {
        eos_token: Some("</s>".into()),
        ..Default::default()
    };
    let msg = SftEncoder::new(tokenizer, None, special, Path::new("m"))
        .err()
        .unwrap()
        .to_string();
    assert!(
        msg.contains("eos_token \"</s>\" is not in the vocabulary"),
        "{msg}"
    );
}
