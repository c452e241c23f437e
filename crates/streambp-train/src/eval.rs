//! Held-out evaluation shared by the recipes: exact-match accuracy of greedy answers on
//! prompt/completion rows, and SFT's eval loss, before, during (`--eval-every`) and after training.

use streambp_models::Model;
use streambp_objectives::TokenTargets;

use crate::batch::collate;
use crate::config::TrainConfig;
use crate::data::Example;
use crate::dataset::DataSource;
use crate::generate::greedy;
use crate::logprobs::sequence_logps;
use crate::recipe::Setup;
use crate::tokenizer::TextTokenizer;
use crate::{Result, TrainError};

/// Exact-match accuracy of greedy answers on prompt/completion rows.
pub fn accuracy(model: &Model, tok: &TextTokenizer, rows: &[(String, String)]) -> Result<f64> {
    let mut correct = 0;
    for (prompt, answer) in rows {
        let ids = tok.encode(prompt)?;
        let max_new = tok.encode(answer)?.len() + 2;
        let out =
            streambp_core::on_workers(model.device(), || greedy(model, &ids, tok.eos_id, max_new))?;
        if tok.decode(&out)?.trim() == answer.trim() {
            correct += 1;
        }
    }
    Ok(correct as f64 / rows.len().max(1) as f64)
}

/// Prompt/completion rows of held-out data; none when its first row is in another format (messages,
/// text…), which has no answer to compare.
pub fn eval_rows(source: &DataSource) -> Result<Option<Vec<(String, String)>>> {
    let mut rows = source.rows().peekable();
    if let Some(Ok((_, first))) = rows.peek() {
        if !["prompt", "completion"]
            .iter()
            .all(|k| first.contains_key(*k))
        {
            tracing::warn!(
                data = source.name(),
                "the held-out rows have no \"prompt\" and \"completion\": no accuracy measured"
            );
            return Ok(None);
        }
    }
    rows.map(|row| {
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
    .collect::<Result<Vec<_>>>()
    .map(Some)
}

/// The mean cross entropy of `examples`' target tokens under the model being trained (TRL's SFT
/// `eval_loss`), in micro-batches of `--batch-size`, streamed like the backward.
pub fn eval_loss(setup: &Setup, cfg: &TrainConfig, examples: &[Example]) -> Result<f64> {
    let mut score = cfg.scorer(&setup.model);
    let (mut nll, mut tokens) = (0.0, 0usize);
    for group in examples.chunks(cfg.batch_size) {
        let rows: Vec<&Example> = group.iter().collect();
        let c = collate(&rows, setup.tokenizer.pad_id);
        let t = c.tensors(&setup.device)?;
        let vocab = setup.model.config.vocab_size;
        let targets = TokenTargets::from_labels(&c.labels, vocab, &setup.device)?;
        let logps = sequence_logps(&mut score, &t.input_ids, Some(&t.attention_mask), &targets)?;
        nll -= logps.iter().sum::<f64>();
        tokens += rows.iter().map(|e| e.targets()).sum::<usize>();
    }
    Ok(nll / tokens.max(1) as f64)
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
