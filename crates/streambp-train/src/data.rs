//! TRL-style JSONL data for SFT: `prompt` + `completion` (loss on the completion only) or `text` (loss
//! on every token). A malformed line is an error naming its line number; sequences over the length
//! limit are truncated or skipped, and the log says how many.

use std::path::Path;

use crate::tokenizer::TextTokenizer;
use crate::{Result, TrainError};

/// One tokenized training example: ids and HF-aligned labels (-100 where there is no loss).
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub input_ids: Vec<u32>,
    pub labels: Vec<i64>,
}

/// What to do with examples longer than the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overflow {
    Truncate,
    Skip,
}

impl std::str::FromStr for Overflow {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "truncate" => Ok(Self::Truncate),
            "skip" => Ok(Self::Skip),
            other => Err(format!("expected truncate or skip, got {other:?}")),
        }
    }
}

/// The prompt/completion text pairs of a JSONL file (`text` rows have an empty prompt).
pub fn read_jsonl(path: &Path) -> Result<Vec<serde_json::Map<String, serde_json::Value>>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| TrainError::Usage(format!("cannot read {}: {e}", path.display())))?;
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value = serde_json::from_str(line).map_err(|e| {
            TrainError::Usage(format!(
                "{} line {}: not valid JSON: {e}",
                path.display(),
                i + 1
            ))
        })?;
        match value {
            serde_json::Value::Object(o) => rows.push(o),
            _ => {
                return Err(TrainError::Usage(format!(
                    "{} line {}: expected a JSON object",
                    path.display(),
                    i + 1
                )))
            }
        }
    }
    if rows.is_empty() {
        return Err(TrainError::Usage(format!(
            "{} holds no examples",
            path.display()
        )));
    }
    Ok(rows)
}

fn string_field(
    row: &serde_json::Map<String, serde_json::Value>,
    key: &str,
    path: &Path,
    line: usize,
) -> Result<Option<String>> {
    match row.get(key) {
        None => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(serde_json::Value::Array(_)) => Err(TrainError::Usage(format!(
            "{} line {line}: {key:?} holds messages; conversational data needs a chat template, \
             which this build does not render yet (use prompt/completion strings)",
            path.display()
        ))),
        Some(_) => Err(TrainError::Usage(format!(
            "{} line {line}: {key:?} must be a string",
            path.display()
        ))),
    }
}

/// Tokenized SFT examples from a JSONL file in TRL's `prompt`/`completion` or `text` format. The EOS
/// token ends every example and is trained on.
pub fn load_sft(
    path: &Path,
    tokenizer: &TextTokenizer,
    max_length: usize,
    overflow: Overflow,
) -> Result<Vec<Example>> {
    let rows = read_jsonl(path)?;
    let mut out = Vec::with_capacity(rows.len());
    let (mut truncated, mut skipped) = (0usize, 0usize);
    for (i, row) in rows.iter().enumerate() {
        let line = i + 1;
        if row.contains_key("messages") {
            string_field(row, "messages", path, line)?;
        }
        let (prompt, completion) = match (
            string_field(row, "prompt", path, line)?,
            string_field(row, "completion", path, line)?,
            string_field(row, "text", path, line)?,
        ) {
            (Some(p), Some(c), _) => (p, c),
            (None, None, Some(t)) => (String::new(), t),
            _ => {
                return Err(TrainError::Usage(format!(
                    "{} line {line}: expected \"prompt\" and \"completion\", or \"text\"",
                    path.display()
                )))
            }
        };
        let prompt_ids = tokenizer.encode(&prompt)?;
        let mut completion_ids = tokenizer.encode(&completion)?;
        completion_ids.push(tokenizer.eos_id);
        let mut input_ids = prompt_ids.clone();
        input_ids.extend(&completion_ids);
        let mut labels: Vec<i64> = vec![-100; prompt_ids.len()];
        labels.extend(completion_ids.iter().map(|&t| t as i64));
        if input_ids.len() > max_length {
            match overflow {
                Overflow::Skip => {
                    skipped += 1;
                    continue;
                }
                Overflow::Truncate => {
                    truncated += 1;
                    input_ids.truncate(max_length);
                    labels.truncate(max_length);
                }
            }
        }
        if labels.iter().skip(1).all(|&l| l == -100) {
            skipped += 1;
            continue;
        }
        out.push(Example { input_ids, labels });
    }
    if truncated > 0 {
        tracing::warn!(
            truncated,
            max_length,
            "examples truncated to the maximum length"
        );
    }
    if skipped > 0 {
        tracing::warn!(
            skipped,
            max_length,
            "examples skipped (over the maximum length, or nothing left to train on)"
        );
    }
    if out.is_empty() {
        return Err(TrainError::Usage(format!(
            "{}: no example left to train on (max length {max_length})",
            path.display()
        )));
    }
    Ok(out)
}

/// A right-padded micro-batch.
pub struct Collated {
    pub input_ids: Vec<Vec<i64>>,
    pub labels: Vec<Vec<i64>>,
    pub attention_mask: Vec<Vec<i64>>,
}

/// Pads `examples` on the right to their longest length.
pub fn collate(examples: &[&Example], pad_id: u32) -> Collated {
    let t = examples
        .iter()
        .map(|e| e.input_ids.len())
        .max()
        .unwrap_or(0);
    let mut ids = Vec::with_capacity(examples.len());
    let mut labels = Vec::with_capacity(examples.len());
    let mut mask = Vec::with_capacity(examples.len());
    for e in examples {
        let n = e.input_ids.len();
        let mut row: Vec<i64> = e.input_ids.iter().map(|&v| v as i64).collect();
        row.resize(t, pad_id as i64);
        ids.push(row);
        let mut l = e.labels.clone();
        l.resize(t, -100);
        labels.push(l);
        let mut m = vec![1i64; n];
        m.resize(t, 0);
        mask.push(m);
    }
    Collated {
        input_ids: ids,
        labels,
        attention_mask: mask,
    }
}
