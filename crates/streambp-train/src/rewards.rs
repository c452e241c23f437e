//! GRPO reward functions: a trait for library users' own, and two built-ins selected on the command line
//! as `exact:COLUMN` (1 when the completion equals the row's COLUMN, trimmed) and `format:REGEX` (1 when the
//! whole completion matches). Several rewards are summed, as TRL sums its reward functions.
//!
//! An answer column may hold what pandas and `datasets` write: strings, integers, floats with an
//! integral value (`152.0`, an integer column that had a missing value: read as `152`), or a list of
//! these (any one is accepted). Anything else (`null`, `true`, an object, an empty list) is refused
//! when the data loads, naming the row: a reward that could only ever score 0 would train on nothing.

use serde_json::{Map, Value};

use crate::{Result, TrainError};

/// Scores one completion of a data row (the row carries the prompt and any extra columns).
pub trait Reward {
    /// The metric its mean per completion is logged under (e.g. `reward/exact_answer`).
    fn name(&self) -> &str;
    /// The reward of `completion` (decoded text) for the data row it answers.
    fn score(&self, completion: &str, row: &Map<String, Value>) -> f64;
    /// Why `row` cannot be scored (a column the reward reads missing or of the wrong kind), checked
    /// for every row when the data loads; `Ok` by default.
    fn check_row(&self, _row: &Map<String, Value>) -> std::result::Result<(), String> {
        Ok(())
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
        let answers = row.get(&self.column).map(answers).unwrap_or(Ok(Vec::new()));
        let completion = completion.trim();
        answers.is_ok_and(|a| a.iter().any(|a| a == completion)) as u8 as f64
    }

    fn check_row(&self, row: &Map<String, Value>) -> std::result::Result<(), String> {
        let column = &self.column;
        match row.get(column) {
            None => Err(format!(
                "no {column:?} column, which the reward exact:{column} reads"
            )),
            Some(value) => answers(value).map(|_| ()).map_err(|what| {
                format!(
                    "the {column:?} column (read by the reward exact:{column}) holds {what}; \
                     it needs a string, a number or a list of those"
                )
            }),
        }
    }
}

/// The accepted answers a column value stands for (trimmed text), or what the value is instead.
fn answers(value: &Value) -> std::result::Result<Vec<String>, String> {
    match value {
        Value::Array(items) if items.is_empty() => Err("an empty list".into()),
        Value::Array(items) => items
            .iter()
            .map(|item| match item {
                Value::Array(_) => Err("a list of lists".into()),
                scalar => scalar_answer(scalar),
            })
            .collect(),
        scalar => scalar_answer(scalar).map(|a| vec![a]),
    }
}

/// One answer as text: a string trimmed, a number as it is written (`152.0` as `152`).
fn scalar_answer(value: &Value) -> std::result::Result<String, String> {
    match value {
        Value::String(s) => Ok(s.trim().to_string()),
        Value::Number(n) => Ok(number_text(n)),
        Value::Null => Err("null".into()),
        Value::Bool(b) => Err(format!("the boolean {b}")),
        Value::Object(_) => Err("an object".into()),
        Value::Array(_) => Err("a list".into()),
    }
}

/// A number as its answer text: integers as written, floats with an integral value as integers
/// (pandas stores an integer column with a missing value as floats), others in their shortest form.
fn number_text(n: &serde_json::Number) -> String {
    match n.as_f64() {
        Some(f) if !n.is_i64() && !n.is_u64() && f.fract() == 0.0 && f.abs() < 1e15 => {
            format!("{}", f as i64)
        }
        _ => n.to_string(),
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
        Some(("format", "")) => Err(TrainError::flag(
            "--reward",
            spec,
            "format: needs a pattern (an empty one rewards only empty completions)",
        )),
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

/// What TRL's `scale_rewards` divides a group's centred rewards by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleRewards {
    /// The group's own standard deviation (TRL's default).
    Group,
    /// That of every reward of the step's whole batch (all groups, all ranks).
    Batch,
    /// Nothing: the advantages are the centred rewards.
    None,
}

impl std::str::FromStr for ScaleRewards {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "group" => Ok(Self::Group),
            "batch" => Ok(Self::Batch),
            "none" => Ok(Self::None),
            _ => Err(format!("{s:?}: expected group, batch or none")),
        }
    }
}

impl ScaleRewards {
    /// TRL's name of it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Group => "group",
            Self::Batch => "batch",
            Self::None => "none",
        }
    }
}

/// TRL's group-relative advantages: `(r − mean) / (std + 1e-4)` within the group.
pub fn group_advantages(rewards: &[f64]) -> Vec<f64> {
    scaled_advantages(rewards, Some(group_std(rewards)))
}

/// A group's rewards less their mean, divided by `std + 1e-4` when given (TRL's `scale_rewards`).
pub fn scaled_advantages(rewards: &[f64], std: Option<f64>) -> Vec<f64> {
    let n = rewards.len() as f64;
    let mean = rewards.iter().sum::<f64>() / n;
    let scale = std.map_or(1.0, |s| s + 1e-4);
    rewards.iter().map(|r| (r - mean) / scale).collect()
}

/// The unbiased standard deviation of `n` rewards from their sum and sum of squares (so that ranks
/// can add theirs up); 0 for fewer than two.
pub fn std_from_sums(sum: f64, sum_squares: f64, n: f64) -> f64 {
    if n < 2.0 {
        return 0.0;
    }
    let mean = sum / n;
    ((sum_squares - n * mean * mean).max(0.0) / (n - 1.0)).sqrt()
}

/// Whether a group's rewards are all the same (TRL's `frac_reward_zero_std` counts such groups):
/// its advantages are then 0, and it teaches the policy nothing.
pub fn group_without_signal(rewards: &[f64]) -> bool {
    // torch.isclose(std, 0) with its default absolute tolerance, as TRL tests it.
    group_std(rewards) <= 1e-8
}

/// The standard deviation of a group's rewards, unbiased as torch's default.
fn group_std(rewards: &[f64]) -> f64 {
    if rewards.len() < 2 {
        return 0.0;
    }
    let n = rewards.len() as f64;
    let mean = rewards.iter().sum::<f64>() / n;
    let var = rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n - 1.0);
    var.sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn row(answer: Value) -> Map<String, Value> {
        match json!({"prompt": "1+1=", "answer": answer}) {
            Value::Object(o) => o,
            _ => unreachable!(),
        }
    }

    /// Numbers as pandas writes them, lists of accepted answers and padded strings all score; values
    /// that cannot be an answer are refused by the row check rather than scored 0.
    #[test]
    fn exact_reads_every_kind_of_answer_column() {
        let reward = parse_reward("exact:answer").unwrap();
        for (value, completion, want) in [
            (json!("152"), " 152\n", 1.0),
            (json!(" 152 "), "152", 1.0),
            (json!(152), "152", 1.0),
            (json!(152.0), "152", 1.0),
            (json!(-3.0), "-3", 1.0),
            (json!(1.5), "1.5", 1.0),
            (json!(["151", 152]), "152", 1.0),
            (json!(["151", "153"]), "152", 0.0),
            (json!(152.0), "153", 0.0),
        ] {
            let row = row(value.clone());
            assert_eq!(reward.check_row(&row), Ok(()), "{value}");
            assert_eq!(
                reward.score(completion, &row),
                want,
                "{value} vs {completion:?}"
            );
        }
        for (value, says) in [
            (Value::Null, "null"),
            (json!(true), "boolean"),
            (json!({"a": 1}), "object"),
            (json!([]), "empty list"),
            (json!([["152"]]), "list of lists"),
            (json!(["152", null]), "null"),
        ] {
            let err = reward.check_row(&row(value.clone())).unwrap_err();
            assert!(
                err.contains(says) && err.contains("exact:answer"),
                "{value}: {err}"
            );
        }
        let mut missing = row(json!("1"));
        missing.remove("answer");
        assert!(reward
            .check_row(&missing)
            .unwrap_err()
            .contains("no \"answer\" column"));
    }
}
