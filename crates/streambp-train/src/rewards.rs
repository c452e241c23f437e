//! GRPO reward functions: a trait for library users' own, and two built-ins selected on the command line
//! as `exact:COLUMN` (1 when the completion equals the row's COLUMN, trimmed) and `format:REGEX` (1 when the
//! whole completion matches). Several rewards are summed, as TRL sums its reward functions.

use serde_json::{Map, Value};

use crate::{Result, TrainError};

/// Scores one completion of a data row (the row carries the prompt and any extra columns).
pub trait Reward {
    /// The metric its mean per completion is logged under (e.g. `reward/exact_answer`).
    fn name(&self) -> &str;
    /// The reward of `completion` (decoded text) for the data row it answers.
    fn score(&self, completion: &str, row: &Map<String, Value>) -> f64;
    /// The data column the reward reads, which every row must have (checked when the data loads).
    fn column(&self) -> Option<&str> {
        None
    }
}

/// 1 when the completion equals the row's `column` (both trimmed), else 0.
pub struct ExactAnswer {
    name: String,
    column: String,
}

impl Reward for ExactAnswer {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, completion: &str, row: &Map<String, Value>) -> f64 {
        let expected = match row.get(&self.column) {
            Some(Value::String(s)) => s.trim().to_string(),
            Some(Value::Number(n)) => n.to_string(),
            _ => return 0.0,
        };
        (completion.trim() == expected) as u8 as f64
    }

    fn column(&self) -> Option<&str> {
        Some(&self.column)
    }
}

/// 1 when the whole completion matches the pattern, else 0.
pub struct FormatRegex {
    name: String,
    regex: regex::Regex,
}

impl Reward for FormatRegex {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, completion: &str, _row: &Map<String, Value>) -> f64 {
        self.regex.is_match(completion) as u8 as f64
    }
}

/// Parses `exact:COLUMN` or `format:REGEX`.
pub fn parse_reward(spec: &str) -> Result<Box<dyn Reward>> {
    match spec.split_once(':') {
        Some(("exact", column)) if !column.is_empty() => Ok(Box::new(ExactAnswer {
            name: format!("reward/exact_{column}"),
            column: column.to_string(),
        })),
        Some(("format", pattern)) => {
            let anchored = format!("^(?:{pattern})$");
            let regex = regex::Regex::new(&anchored).map_err(|e| {
                TrainError::flag(
                    "--reward",
                    spec,
                    format!("not a valid regular expression: {e}"),
                )
            })?;
            Ok(Box::new(FormatRegex {
                name: "reward/format".into(),
                regex,
            }))
        }
        _ => Err(TrainError::flag(
            "--reward",
            spec,
            "unknown reward (use exact:COLUMN or format:REGEX)",
        )),
    }
}

/// TRL's group-relative advantages: `(r − mean) / (std + 1e-4)` within the group (std over the group,
/// unbiased as torch's default).
pub fn group_advantages(rewards: &[f64]) -> Vec<f64> {
    let n = rewards.len() as f64;
    let mean = rewards.iter().sum::<f64>() / n;
    let var = if rewards.len() > 1 {
        rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    rewards
        .iter()
        .map(|r| (r - mean) / (var.sqrt() + 1e-4))
        .collect()
}
