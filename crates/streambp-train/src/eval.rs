//! Held-out evaluation shared by the recipes: exact-match accuracy of greedy answers on
//! prompt/completion rows, and SFT's eval loss, before, during (`--eval-every`) and after training.

use streambp_models::init::NormalRng;
use streambp_models::Model;

use crate::batch::collate;
use crate::config::TrainConfig;
use crate::data::Example;
use crate::dataset::DataSource;
use crate::logprobs::collated_logps;
use crate::sampling::{items_within, sample_groups, SamplingConfig};
use crate::setup::Setup;
use crate::tokenizer::{Keep, TextTokenizer};
use crate::{Result, TrainError};

/// A held-out prompt, tokenized, with the answer its greedy continuation must match.
pub struct Question {
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// The answer, compared with the decoded continuation (whitespace at the ends ignored).
    pub answer: String,
    /// New tokens decoded at most: the answer's tokens and two more (its EOS, and one to see
    /// whether it would go on), within `--max-length`.
    pub max_new: usize,
}

/// Questions decoded together at most: their rows' tokens (prompt and answer, padded to the longest),
/// which bounds the KV cache a batch holds (a few rows of long prompts, many of short ones).
const EVAL_BATCH_TOKENS: usize = 4096;

/// Exact-match accuracy of greedy answers to `questions`, decoded in batches through the KV cache
/// (one forward per new token for a batch; a row's answer is cut at its own `max_new`, which is what
/// decoding it alone gives, greedy decoding being deterministic).
pub fn accuracy(model: &Model, tok: &TextTokenizer, questions: &[Question]) -> Result<f64> {
    let mut correct = 0;
    let mut rest = questions;
    while !rest.is_empty() {
        let widths = rest.iter().map(|q| q.prompt.len() + q.max_new);
        let (batch, after) = rest.split_at(items_within(widths, 1, EVAL_BATCH_TOKENS));
        rest = after;
        let prompts: Vec<&[u32]> = batch.iter().map(|q| q.prompt.as_slice()).collect();
        let cfg = SamplingConfig {
            temperature: 0.0,
            top_p: 1.0,
            max_new_tokens: batch.iter().map(|q| q.max_new).max().unwrap_or(0),
        };
        // Greedy decoding draws nothing: the generators are never read.
        let mut unused = vec![NormalRng::new(0); batch.len()];
        let answers = streambp_core::on_workers(model.device(), || {
            sample_groups(model, &prompts, 1, tok.eos_id, &cfg, &mut unused)
        })?;
        for (q, mut rows) in batch.iter().zip(answers) {
            let mut out = rows.pop().unwrap_or_default();
            out.truncate(q.max_new);
            if tok.decode(&out)?.trim() == q.answer.trim() {
                correct += 1;
            }
        }
    }
    Ok(correct as f64 / questions.len().max(1) as f64)
}

/// The questions of held-out prompt/completion rows (KTO's rows labelled undesirable left out: their
/// completion is no answer to match); none when the first row is in another format (messages,
/// text…), which has no answer to compare. A row whose prompt and answer (and its EOS)
/// take more than `max_length` tokens is left out, as the model never trains on such a row whole
/// and greedy decoding of it would cost memory and time in proportion to its size; a warning
/// counts them, and an error says when no row is left.
pub fn eval_rows(
    source: &DataSource,
    tok: &TextTokenizer,
    max_length: usize,
) -> Result<Option<Vec<Question>>> {
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
    let (mut questions, mut too_long, mut undesirable) = (Vec::new(), 0usize, 0usize);
    for row in rows {
        let (at, r) = row?;
        let field = |k: &str| r.get(k).and_then(|v| v.as_str());
        let (prompt, answer) = match (field("prompt"), field("completion")) {
            (Some(""), _) => {
                return Err(TrainError::data(
                    at,
                    "the prompt is empty (no token to answer after)",
                ))
            }
            (Some(p), Some(c)) => (p, c),
            _ => {
                return Err(TrainError::data(
                    at,
                    "eval data needs \"prompt\" and \"completion\" strings",
                ))
            }
        };
        // KTO's rows label their completion: an undesirable one is no answer to match.
        match r.get("label") {
            None | Some(serde_json::Value::Bool(true)) => {}
            Some(serde_json::Value::Bool(false)) => {
                undesirable += 1;
                continue;
            }
            Some(other) => {
                return Err(TrainError::data(
                    at,
                    format!("\"label\" is {other}: a held-out row's label is true or false"),
                ))
            }
        }
        let prompt = tok.encode_at_most(prompt, max_length, Keep::Start)?;
        let answer_tokens = tok.encode_at_most(answer, max_length, Keep::Start)?.len();
        if prompt.len() + answer_tokens + 1 > max_length {
            too_long += 1;
            continue;
        }
        questions.push(Question {
            max_new: (answer_tokens + 2).min(max_length - prompt.len()),
            prompt,
            answer: answer.to_string(),
        });
    }
    if undesirable > 0 && questions.is_empty() && too_long == 0 {
        return Err(TrainError::data(
            source.name(),
            format!(
                "every held-out row ({undesirable}) is labelled undesirable (\"label\": false): no \
                 answer to measure the accuracy against"
            ),
        ));
    }
    if undesirable > 0 {
        tracing::warn!(
            data = source.name(),
            left_out = undesirable,
            kept = questions.len(),
            "held-out rows labelled undesirable are left out of the accuracy (their completions are \
             answers not to give)"
        );
    }
    if too_long > 0 && questions.is_empty() {
        return Err(TrainError::data(
            source.name(),
            format!(
                "every held-out row ({too_long}) has more than --max-length {max_length} tokens \
                 with its answer: no accuracy to measure (raise --max-length)"
            ),
        ));
    }
    if too_long > 0 {
        tracing::warn!(
            data = source.name(),
            left_out = too_long,
            kept = questions.len(),
            max_length,
            "held-out rows longer than --max-length with their answers are left out of the accuracy"
        );
    }
    Ok(Some(questions))
}

/// The mean cross entropy of `examples`' target tokens under the model being trained (TRL's SFT
/// `eval_loss`), in micro-batches of `--batch-size`, streamed like the backward.
pub fn eval_loss(setup: &Setup, cfg: &TrainConfig, examples: &[Example]) -> Result<f64> {
    let mut score = cfg.local_scorer(&setup.model);
    let (mut nll, mut tokens) = (0.0, 0usize);
    for group in examples.chunks(cfg.batch_size) {
        let rows: Vec<&Example> = group.iter().collect();
        let c = collate(&rows, setup.tokenizer.pad_id);
        let t = c.tensors(&setup.device)?;
        let logps = collated_logps(&mut score, &c, &t, setup.model.config.vocab_size)?;
        nll -= logps.iter().sum::<f64>();
        tokens += rows.iter().map(|e| e.targets()).sum::<usize>();
    }
    Ok(nll / tokens.max(1) as f64)
}

/// Exact-match accuracy on `questions`, as a named metric (empty without them).
pub fn eval_accuracy(
    setup: &Setup,
    questions: &Option<Vec<Question>>,
) -> Result<Vec<(String, f64)>> {
    Ok(match questions {
        Some(questions) => vec![(
            "accuracy".into(),
            accuracy(&setup.model, &setup.tokenizer, questions)?,
        )],
        None => Vec::new(),
    })
}
