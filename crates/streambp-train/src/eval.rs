//! Held-out evaluation shared by the recipes: exact-match accuracy of greedy answers on
//! prompt/completion rows, before and after training.

use streambp_models::Model;

use crate::dataset::DataSource;
use crate::generate::greedy;
use crate::recipe::Setup;
use crate::tokenizer::TextTokenizer;
use crate::{Result, TrainError};

/// Exact-match accuracy of greedy answers on prompt/completion rows.
pub fn accuracy(model: &Model, tok: &TextTokenizer, rows: &[(String, String)]) -> Result<f64> {
    let mut correct = 0;
    for (prompt, answer) in rows {
        let ids = tok.encode(prompt)?;
        let max_new = tok.encode(answer)?.len() + 2;
        let out = greedy(model, &ids, tok.eos_id, max_new)?;
        if tok.decode(&out)?.trim() == answer.trim() {
            correct += 1;
        }
    }
    Ok(correct as f64 / rows.len().max(1) as f64)
}

/// Prompt/completion rows of held-out data.
pub fn eval_rows(source: &DataSource) -> Result<Vec<(String, String)>> {
    source
        .rows()
        .map(|row| {
            let (at, r) = row?;
            let field = |k: &str| r.get(k).and_then(|v| v.as_str()).map(String::from);
            match (field("prompt"), field("completion")) {
                (Some(p), _) if p.is_empty() => Err(TrainError::data(
                    at,
                    "the prompt is empty (no token to answer after)",
                )),
                (Some(p), Some(c)) => Ok((p, c)),
                _ => Err(TrainError::data(
                    at,
                    "eval data needs \"prompt\" and \"completion\" strings",
                )),
            }
        })
        .collect()
}

/// Exact-match accuracy on `rows`, as a named metric (empty without rows).
pub fn eval_accuracy(
    setup: &Setup,
    rows: &Option<Vec<(String, String)>>,
) -> Result<Vec<(String, f64)>> {
    Ok(match rows {
        Some(rows) => vec![(
            "accuracy".into(),
            accuracy(&setup.model, &setup.tokenizer, rows)?,
        )],
        None => Vec::new(),
    })
}
