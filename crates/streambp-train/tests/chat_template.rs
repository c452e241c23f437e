//! Chat templates: rendered like transformers' apply_chat_template (Python string methods,
//! raise_exception, add_generation_prompt), split into prompt and reply, and used for messages data.

mod common;

use common::{arithmetic_tokenizer_with_template, msg, sft_file};
use streambp_train::chat::ChatTemplate;
use streambp_train::tokenizer::TextTokenizer;

const CHATML: &str = "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('the first message must not be the assistant') }}{% endif %}\
{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'].strip() + '<|im_end|>\\n' }}{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

#[test]
fn chatml_renders_and_splits_like_transformers() {
    let t = ChatTemplate::new(CHATML.into(), String::new(), "<|im_end|>".into()).unwrap();
    let prompt = vec![msg("system", "Be brief."), msg("user", " 2+2? ")];
    let rendered = t
        .render(&serde_json::Value::from(prompt.clone()), true)
        .unwrap();
    assert_eq!(
        rendered,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
    let (p, c) = t.split(&prompt, &[msg("assistant", "4")]).unwrap();
    assert_eq!(p, rendered);
    assert_eq!(c, "4<|im_end|>\n");
    let err = t
        .render(&serde_json::Value::from(vec![msg("assistant", "x")]), false)
        .unwrap_err();
    assert!(
        err.to_string().contains("must not be the assistant"),
        "{err}"
    );
}

/// The trained text of each example: the decoded runs of labelled tokens.
fn trained_runs(tok: &TextTokenizer, labels: &[i64]) -> Vec<String> {
    labels
        .split(|&l| l == -100)
        .filter(|run| !run.is_empty())
        .map(|run| {
            tok.decode(&run.iter().map(|&l| l as u32).collect::<Vec<_>>())
                .unwrap()
        })
        .collect()
}

#[test]
fn messages_train_every_assistant_turn() {
    let dir = tempfile::tempdir().unwrap();
    let template = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'].strip() }}={% else %}{{ m['content'] }}{% endif %}{% endfor %}";
    let tok = arithmetic_tokenizer_with_template(dir.path(), template);
    let data = dir.path().join("chat.jsonl");
    let rows = [
        serde_json::json!({"messages": [msg("user", " 12+3 "), msg("assistant", "15")]}),
        serde_json::json!({"prompt": [msg("user", "1+1")], "completion": [msg("assistant", "2")]}),
        serde_json::json!({"messages": [msg("user", "1+1"), msg("assistant", "2"), msg("user", "3+4"), msg("assistant", "7"), msg("user", "9+9")]}),
    ];
    std::fs::write(
        &data,
        rows.iter()
            .map(|r| r.to_string() + "\n")
            .collect::<String>(),
    )
    .unwrap();
    let examples = sft_file(&data, &tok).unwrap();
    assert_eq!(tok.decode(&examples[0].input_ids).unwrap(), "12+3=15");
    assert_eq!(examples[0].labels[..5], [-100; 5]);
    let trained: Vec<u32> = examples[0].labels[5..].iter().map(|&l| l as u32).collect();
    assert_eq!(
        tok.decode(&trained).unwrap(),
        "15",
        "no EOS added: the template ends turns"
    );
    assert_eq!(tok.decode(&examples[1].input_ids).unwrap(), "1+1=2");
    assert_eq!(
        tok.decode(&examples[2].input_ids).unwrap(),
        "1+1=23+4=79+9="
    );
    assert_eq!(trained_runs(&tok, &examples[2].labels), ["2", "7"]);

    // A conversation that does not end with the assistant, and a tokenizer without a template.
    std::fs::write(
        &data,
        serde_json::json!({"messages": [msg("user", "1+1")]}).to_string(),
    )
    .unwrap();
    let err = sft_file(&data, &tok).unwrap_err().to_string();
    assert!(
        err.contains("line 1") && err.contains("no assistant message"),
        "{err}"
    );
    let plain = TextTokenizer::from_dir(
        &streambp_train::setup::materialize_builtin(&dir.path().join("plain")).unwrap(),
    )
    .unwrap();
    std::fs::write(&data, rows[0].to_string()).unwrap();
    let err = sft_file(&data, &plain).unwrap_err().to_string();
    assert!(
        err.contains("line 1") && err.contains("no chat_template"),
        "{err}"
    );
}

/// Whitespace like transformers' environment (trim_blocks, lstrip_blocks): block tags on their own
/// lines leave no blank lines behind. Expected text from transformers' render_jinja_template.
#[test]
fn block_whitespace_is_trimmed_like_transformers() {
    let template = "{%- for m in messages %}\n  {% if m['role'] == 'user' %}\nU: {{ m['content'] }}\n  {% else %}\nA: {{ m['content'] }}\n  {% endif %}\n{% endfor %}";
    let t = ChatTemplate::new(template.into(), String::new(), String::new()).unwrap();
    let out = t
        .render(
            &serde_json::Value::from(vec![msg("user", "hi"), msg("assistant", "yo")]),
            false,
        )
        .unwrap();
    assert_eq!(out, "U: hi\nA: yo\n");
}

/// A template that renders the last assistant turn differently (as Qwen3 adds an empty thinking block
/// to it): earlier turns cannot be cut from the whole conversation, so only the final one trains.
#[test]
fn templates_that_rewrite_earlier_turns_train_the_final_turn() {
    let dir = tempfile::tempdir().unwrap();
    let template = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}={% elif loop.last %}+{{ m['content'] }}{% else %}{{ m['content'] }}{% endif %}{% endfor %}";
    let tok = arithmetic_tokenizer_with_template(dir.path(), template);
    let data = dir.path().join("chat.jsonl");
    let row = serde_json::json!({"messages": [msg("user", "1+1"), msg("assistant", "2"), msg("user", "3+4"), msg("assistant", "7")]});
    std::fs::write(&data, row.to_string()).unwrap();
    let examples = sft_file(&data, &tok).unwrap();
    assert_eq!(tok.decode(&examples[0].input_ids).unwrap(), "1+1=23+4=+7");
    assert_eq!(trained_runs(&tok, &examples[0].labels), ["+7"]);
}
