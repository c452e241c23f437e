//! Helpers shared by this crate's tests.

#![allow(unused_imports, dead_code)]

pub mod trl_variants;

pub use streambp_testkit::*;

use streambp_train::data::{load_sft, Example, Overflow};
use streambp_train::dataset::DataSource;
use streambp_train::tokenizer::TextTokenizer;

/// The SFT examples of `source` with the tests' limits: 64 tokens, truncated, plain text in `text`.
pub fn sft_examples(
    source: &DataSource,
    tok: &TextTokenizer,
) -> streambp_train::Result<Vec<Example>> {
    load_sft(source, tok, 64, Overflow::Truncate, "text")
}

/// [`sft_examples`] of the data file `path`.
pub fn sft_file(
    path: &std::path::Path,
    tok: &TextTokenizer,
) -> streambp_train::Result<Vec<Example>> {
    sft_examples(&DataSource::file(path).unwrap(), tok)
}

/// A chat message.
pub fn msg(role: &str, content: &str) -> serde_json::Value {
    serde_json::json!({"role": role, "content": content})
}

/// The arithmetic task's tokenizer with `template` as its chat template (written with characters the
/// tokenizer knows).
pub fn arithmetic_tokenizer_with_template(dir: &std::path::Path, template: &str) -> TextTokenizer {
    let builtin = streambp_train::setup::materialize_builtin(dir).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(builtin.join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    config["chat_template"] = template.into();
    std::fs::write(builtin.join("tokenizer_config.json"), config.to_string()).unwrap();
    TextTokenizer::from_dir(&builtin).unwrap()
}

/// `family`'s batch file `file` after `edit`, loaded for `config` on the CPU (its reference
/// log-probs given in the file; a distillation batch's teacher the fixtures' `teacher`, in f64 as
/// the tests' models).
pub fn edited_batch(
    family: &str,
    file: &str,
    edit: &dyn Fn(&mut serde_json::Value),
    config: &streambp_models::ModelConfig,
) -> streambp_train::batch_file::PreparedBatch {
    use candle_core::Tensor;
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture_dir(family).join(file)).unwrap())
            .unwrap();
    edit(&mut json);
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join(file);
    std::fs::write(&path, json.to_string()).unwrap();
    let mut no_reference =
        |_: &Tensor, _: Option<&Tensor>, _: &Tensor, _: f64| -> streambp_train::Result<Tensor> {
            panic!("the fixture batches carry their reference log-probs")
        };
    let device = candle_core::Device::Cpu;
    // A distillation batch's teacher: the fixtures' wider one (scripts/make_distill_fixtures.py).
    let teacher = (json["objective"] == "distill").then(|| {
        streambp_models::load_model(&fixture_dir("teacher"), candle_core::DType::F64, &device)
            .unwrap()
    });
    let chunks = streambp_core::Chunks {
        chunk: 3,
        logits_chunk: 4,
    };
    let mut make_teacher = teacher
        .as_ref()
        .map(|t| streambp_train::teacher::teacher_of(t, chunks));
    let with_teacher = make_teacher
        .as_mut()
        .map(|t| t as &mut streambp_train::batch_file::Teacher);
    streambp_train::batch_file::load_batch_with_teacher(
        &path,
        config,
        &device,
        &mut no_reference,
        with_teacher,
    )
    .unwrap()
}
