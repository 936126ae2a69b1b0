//! Chat-template tests: SmolLM2's ChatML template against strings transformers produces, the HF
//! environment (trim/lstrip blocks, raise_exception, tojson, strftime_now, pycompat methods,
//! Python printing), tokenizer_config.json loading, and the transformers fixture when present.

use std::path::Path;

use ferrotron_data::chat::{ChatError, ChatMessage, ChatTemplate, json_to_value};
use minijinja::Value;

/// SmolLM2-Instruct's template as it reads after JSON decoding (`\n` are real newlines).
const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
const DEFAULT_SYSTEM: &str = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n";

fn msg(role: &str, content: &str) -> ChatMessage {
    ChatMessage::new(role, content)
}

fn render(template: &str, messages: &[ChatMessage]) -> Result<String, ChatError> {
    ChatTemplate::new(template, None, None)?.render(messages, false)
}

#[test]
fn smollm2_single_user() {
    let t = ChatTemplate::new(
        SMOLLM2,
        Some("<|im_start|>".into()),
        Some("<|im_end|>".into()),
    )
    .unwrap();
    let user = [msg("user", "What is the capital of France?")];
    let turn = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n";
    assert_eq!(
        t.render(&user, false).unwrap(),
        format!("{DEFAULT_SYSTEM}{turn}")
    );
    assert_eq!(
        t.render(&user, true).unwrap(),
        format!("{DEFAULT_SYSTEM}{turn}<|im_start|>assistant\n")
    );
}

#[test]
fn smollm2_system_and_user() {
    let t = ChatTemplate::new(SMOLLM2, None, None).unwrap();
    let messages = [msg("system", "You are a pirate."), msg("user", "Hi")];
    let want = "<|im_start|>system\nYou are a pirate.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n";
    assert_eq!(t.render(&messages, false).unwrap(), want);
    assert_eq!(
        t.render(&messages, true).unwrap(),
        format!("{want}<|im_start|>assistant\n")
    );
}

#[test]
fn smollm2_multi_turn() {
    let t = ChatTemplate::new(SMOLLM2, None, None).unwrap();
    let messages = [
        msg("user", "Hi"),
        msg("assistant", "Hello! How can I help?"),
        msg("user", "  Tell me a joke.\n\nA short one. "),
    ];
    let want = format!(
        "{DEFAULT_SYSTEM}<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello! How can I help?<|im_end|>\n\
         <|im_start|>user\n  Tell me a joke.\n\nA short one. <|im_end|>\n"
    );
    assert_eq!(t.render(&messages, false).unwrap(), want);
    assert_eq!(
        t.render(&messages, true).unwrap(),
        format!("{want}<|im_start|>assistant\n")
    );
    // Jinja escapes in string literals (`'\n'` as two characters) decode to the same text.
    let escaped = SMOLLM2.replace('\n', "\\n");
    assert_eq!(
        ChatTemplate::new(&escaped, None, None)
            .unwrap()
            .render(&messages, false)
            .unwrap(),
        want
    );
    // No messages: only the generation prompt.
    assert_eq!(t.render(&[], true).unwrap(), "<|im_start|>assistant\n");
    assert_eq!(t.render(&[], false).unwrap(), "");
}

#[test]
fn trim_and_lstrip_blocks_and_trailing_newline() {
    let template = "{% for m in messages %}\n    {% if m.role == 'user' %}\nU: {{ m.content }}\n    {% else %}\nA: {{ m.content }}\n    {% endif %}\n{% endfor %}\n";
    let out = render(template, &[msg("user", "hi"), msg("assistant", "yo")]).unwrap();
    assert_eq!(out, "U: hi\nA: yo\n");
    assert_eq!(render("{{ 'a' }}\n", &[]).unwrap(), "a");
    let first_only = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}";
    assert_eq!(
        render(first_only, &[msg("user", "a"), msg("user", "b")]).unwrap(),
        "a"
    );
}

#[test]
fn raise_exception_becomes_an_error() {
    let template = "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}ok";
    assert_eq!(render(template, &[msg("user", "x")]).unwrap(), "ok");
    match render(template, &[msg("assistant", "x")]) {
        Err(ChatError::Raised(m)) => assert_eq!(
            m,
            "Conversation roles must alternate user/assistant/user/assistant/..."
        ),
        other => panic!("expected Raised, got {other:?}"),
    }
}

#[test]
fn syntax_and_render_errors_carry_lines() {
    match ChatTemplate::new(
        "{% for m in messages %}\n{{ m.content }\n{% endfor %}",
        None,
        None,
    ) {
        Err(ChatError::Syntax {
            line: Some(2),
            message,
        }) => assert!(!message.is_empty()),
        other => panic!("expected syntax error on line 2, got {other:?}"),
    }
    let err = render(
        "line one\n{{ messages[0].missing.deeper }}",
        &[msg("user", "x")],
    )
    .unwrap_err();
    assert!(
        matches!(err, ChatError::Render { line: Some(2), .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("line 2"), "{err}");
}

#[test]
fn special_tokens_and_kwargs() {
    let template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}{{ extra }}";
    let t = ChatTemplate::new(template, Some("<s>".into()), Some("</s>".into())).unwrap();
    assert_eq!(t.render(&[msg("user", "hi")], false).unwrap(), "<s>hi</s>");
    let kwargs = [
        ("bos_token", Value::from("[B]")),
        ("extra", Value::from("!")),
    ];
    assert_eq!(
        t.render_with_kwargs(&[msg("user", "hi")], false, &kwargs)
            .unwrap(),
        "[B]hi</s>!"
    );
    assert_eq!(render(template, &[msg("user", "hi")]).unwrap(), "hi");
    let reserved = t.render_with_kwargs(&[], false, &[("tools", Value::from(1))]);
    assert!(matches!(reserved, Err(ChatError::ReservedKwarg(k)) if k == "tools"));
    let tools =
        json_to_value(&serde_json::json!([{"type": "function", "function": {"name": "f"}}]));
    // HF always passes tools=None/documents=None; extra JSON goes in through json_to_value.
    let template =
        "{{ tools is none }} {{ documents is none }} {{ custom_tools[0].function.name }}";
    let t = ChatTemplate::new(template, None, None).unwrap();
    let rendered = t
        .render_with_kwargs(&[], false, &[("custom_tools", tools)])
        .unwrap();
    assert_eq!(rendered, "True True f");
}

#[test]
fn python_methods_and_printing() {
    let template = "{{ messages[0].content.strip() }}|{{ messages[0].content.startswith('  He') }}|{{ 'a,b'.split(',') }}|{% for k, v in {'x': 1, 'y': 2}.items() %}{{ k }}={{ v }};{% endfor %}|{{ tools }}";
    assert_eq!(
        render(template, &[msg("user", "  Hello  ")]).unwrap(),
        "Hello|True|['a', 'b']|x=1;y=2;|None"
    );
    let printed = "{{ none }} {{ true }} {{ false }} {{ 1.0 }} {{ 1e-5 }} {{ 3 }} {{ [1, 'a', none, \"it's\"] }} {{ {'k': false, 'j': 2.5} }}";
    assert_eq!(
        render(printed, &[]).unwrap(),
        "None True False 1.0 1e-05 3 [1, 'a', None, \"it's\"] {'k': False, 'j': 2.5}"
    );
}

#[test]
fn tojson_is_python_json_dumps() {
    let t = |template: &str, messages: &[ChatMessage]| render(template, messages).unwrap();
    let value = "{'b': 1, 'a': [1, 2.5, none, true, 'é\"<\\n']}";
    assert_eq!(
        t(&format!("{{{{ {value} | tojson }}}}"), &[]),
        r#"{"b": 1, "a": [1, 2.5, null, true, "é\"<\n"]}"#
    );
    assert_eq!(
        t(
            "{{ {'b': 1, 'a': [1, {}], 'c': []} | tojson(indent=2) }}",
            &[]
        ),
        "{\n  \"b\": 1,\n  \"a\": [\n    1,\n    {}\n  ],\n  \"c\": []\n}"
    );
    assert_eq!(
        t(
            "{{ {'b': 1, 'a': 2} | tojson(separators=(',', ':'), sort_keys=true) }}",
            &[]
        ),
        r#"{"a":2,"b":1}"#
    );
    assert_eq!(
        t("{{ [1, [2]] | tojson(indent='\t') }}", &[]),
        "[\n\t1,\n\t[\n\t\t2\n\t]\n]"
    );
    let unicode = [msg("user", "é😀\u{7f}")];
    assert_eq!(
        t("{{ messages[0].content | tojson }}", &unicode),
        "\"é😀\u{7f}\""
    );
    assert_eq!(
        t(
            "{{ messages[0].content | tojson(ensure_ascii=true) }}",
            &unicode
        ),
        r#""\u00e9\ud83d\ude00\u007f""#
    );
    assert_eq!(
        t("{{ messages[0] | tojson }}", &[msg("user", "hi")]),
        r#"{"role": "user", "content": "hi"}"#
    );
    assert_eq!(
        t(
            "{{ [1e16, 1e15, 0.0001, 0.00001, -0.0, 123.456, 1.5e300, {1: 'x'}] | tojson }}",
            &[]
        ),
        r#"[1e+16, 1000000000000000.0, 0.0001, 1e-05, -0.0, 123.456, 1.5e+300, {"1": "x"}]"#
    );
    let twice = render("{{ 1 | tojson(false, ensure_ascii=true) }}", &[]).unwrap_err();
    assert!(twice.to_string().contains("multiple values"), "{twice}");
}

#[test]
fn strftime_now_formats_local_time() {
    let out = render(
        "{{ strftime_now('%Y-%m-%d') }}|{{ strftime_now('%d %b %Y') }}",
        &[],
    )
    .unwrap();
    let (iso, human) = out.split_once('|').unwrap();
    let year: i32 = iso[..4].parse().unwrap();
    assert!(
        year >= 2024 && iso.len() == 10 && iso.as_bytes()[4] == b'-',
        "{out}"
    );
    assert!(human.ends_with(&iso[..4]) && human.len() == 11, "{out}");
}

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn loads_tokenizer_config_forms() {
    let dir = tempfile::tempdir().unwrap();
    let config = serde_json::json!({
        "chat_template": SMOLLM2,
        "bos_token": {"__type": "AddedToken", "content": "<|im_start|>", "lstrip": false},
        "eos_token": "<|im_end|>",
    });
    let path = write(dir.path(), "tokenizer_config.json", &config.to_string());
    let t = ChatTemplate::from_tokenizer_config(&path).unwrap();
    assert_eq!(
        (t.bos_token(), t.eos_token()),
        (Some("<|im_start|>"), Some("<|im_end|>"))
    );
    assert!(
        t.render(&[msg("user", "x")], true)
            .unwrap()
            .starts_with(DEFAULT_SYSTEM)
    );

    let list = serde_json::json!({"chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ eos_token }}default"}
    ], "eos_token": null});
    let path = write(dir.path(), "tokenizer_config.json", &list.to_string());
    assert_eq!(
        ChatTemplate::from_tokenizer_config(&path)
            .unwrap()
            .render(&[], false)
            .unwrap(),
        "default"
    );

    // chat_template.jinja beside the config clobbers the config's template, as in transformers.
    write(dir.path(), "chat_template.jinja", "from jinja file\n");
    assert_eq!(
        ChatTemplate::from_tokenizer_config(&path)
            .unwrap()
            .render(&[], false)
            .unwrap(),
        "from jinja file"
    );
}

#[test]
fn tokenizer_config_errors_name_file_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (r#"{"eos_token": "</s>"}"#, "chat_template", "missing"),
        (
            r#"{"chat_template": [{"name": "tool_use", "template": "x"}]}"#,
            "chat_template",
            "default",
        ),
        (
            r#"{"chat_template": [{"name": "default"}]}"#,
            "chat_template",
            "lacks a string",
        ),
        (
            r#"{"chat_template": 3}"#,
            "chat_template",
            "string or a list",
        ),
        (
            r#"{"chat_template": "x", "bos_token": 5}"#,
            "bos_token",
            "content",
        ),
    ];
    for (json, want_field, want_text) in cases {
        let path = write(dir.path(), "tokenizer_config.json", json);
        match ChatTemplate::from_tokenizer_config(&path) {
            Err(e @ ChatError::Config { field, .. }) => {
                let text = e.to_string();
                assert_eq!(field, want_field, "{json}");
                assert!(
                    text.contains(want_text) && text.contains("tokenizer_config.json"),
                    "{text}"
                );
            }
            other => panic!("{json}: expected Config error, got {other:?}"),
        }
    }
    let path = write(dir.path(), "bad.json", "{not json");
    assert!(matches!(
        ChatTemplate::from_tokenizer_config(&path),
        Err(ChatError::Json { .. })
    ));
    let missing = dir.path().join("absent.json");
    let err = ChatTemplate::from_tokenizer_config(&missing).unwrap_err();
    assert!(
        matches!(err, ChatError::Io { .. }) && err.to_string().contains("absent.json"),
        "{err}"
    );
}

/// Renders every case of fixtures/smollm2/reference.json (generated with transformers'
/// `apply_chat_template`) and compares byte for byte.
#[test]
fn matches_transformers_reference_fixture() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/smollm2/reference.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let reference: serde_json::Value = serde_json::from_str(&text).unwrap();
    let token = |key: &str| {
        reference
            .get(key)
            .and_then(|v| v.as_str())
            .map(String::from)
    };
    let source = reference["chat_template"]
        .as_str()
        .expect("reference.json: chat_template string");
    let template = ChatTemplate::new(source, token("bos_token"), token("eos_token")).unwrap();
    let cases = reference["chat_renders"]
        .as_array()
        .expect("reference.json: chat_renders list");
    assert!(!cases.is_empty());
    for (i, case) in cases.iter().enumerate() {
        let messages: Vec<ChatMessage> = serde_json::from_value(case["messages"].clone()).unwrap();
        let add_generation_prompt = case["add_generation_prompt"].as_bool().unwrap();
        let rendered = template.render(&messages, add_generation_prompt).unwrap();
        assert_eq!(
            rendered,
            case["text"].as_str().unwrap(),
            "case {i}: {messages:?}"
        );
    }
}
