//! Log-probabilities under a frozen model, the one way every caller gets them: DPO's reference
//! (summed per sequence), GRPO's reference and old policy (per token), and the `grad` command's batch
//! files when they carry no reference log-probs.

use std::sync::Arc;

use candle_core::{DType, Tensor};
use streambp_core::{forward_logprobs, forward_logprobs_sequence_parallel, Batch, Chunks};
use streambp_dist::Communicator;
use streambp_models::Model;
use streambp_objectives::TokenTargets;

use crate::batch::{to_u32_tensor, BatchTensors, Collated};
use crate::Result;

/// Target log-probs `[batch, T]` (logits coordinates: position `t` scores `targets[t]`) of some frozen
/// model for `(input_ids, attention_mask, targets, temperature)`, taken from `logits / temperature`
/// (1 but for GRPO, which scores at its sampling temperature).
pub type Scorer<'a> = dyn FnMut(&Tensor, Option<&Tensor>, &Tensor, f64) -> Result<Tensor> + 'a;

/// A [`Scorer`] that runs `model` streamed like the backward, with the chunks `chunks` picks for each
/// batch; each rank of a sequence `group` runs its span of the positions.
pub fn scorer<'a>(
    model: &'a Model,
    mut chunks: impl FnMut(&Tensor) -> Result<Chunks> + 'a,
    group: Option<Arc<dyn Communicator>>,
) -> impl FnMut(&Tensor, Option<&Tensor>, &Tensor, f64) -> Result<Tensor> + 'a {
    move |ids, mask, targets, temperature| {
        let chunks = chunks(ids)?;
        let batch = Batch::new(ids, mask);
        let settings = (chunks, temperature);
        Ok(match &group {
            Some(group) => {
                forward_logprobs_sequence_parallel(model, batch, targets, settings, group.as_ref())?
            }
            None => forward_logprobs(model, batch, targets, settings)?,
        })
    }
}

/// The summed log-prob of each row's target tokens (DPO's sequence log-probs).
pub fn sequence_logps(
    score: &mut Scorer,
    ids: &Tensor,
    mask: Option<&Tensor>,
    targets: &TokenTargets,
) -> Result<Vec<f64>> {
    let logp = score(ids, mask, &targets.ids, 1.0)?;
    Ok((logp.to_dtype(DType::F64)? * &targets.mask)?
        .sum(1)?
        .to_vec1::<f64>()?)
}

/// [`sequence_logps`] of collated rows `c` (their labels' tokens; `t` the same rows as tensors).
pub fn collated_logps(
    score: &mut Scorer,
    c: &Collated,
    t: &BatchTensors,
    vocab_size: usize,
) -> Result<Vec<f64>> {
    let targets = TokenTargets::from_labels(&c.labels, vocab_size, t.input_ids.device())?;
    sequence_logps(score, &t.input_ids, Some(&t.attention_mask), &targets)
}

/// `log p(input_ids[t] | input_ids[..t])` for every token of `rows` at `temperature` (GRPO's
/// per-token log-probs), aligned with the inputs: 0 at position 0, which nothing predicts.
pub fn token_logps(
    score: &mut Scorer,
    (ids, mask): (&Tensor, Option<&Tensor>),
    rows: &[Vec<i64>],
    temperature: f64,
) -> Result<Vec<Vec<f64>>> {
    let targets = to_u32_tensor(&next_token_targets(rows), ids.device())?;
    align_to_inputs(&score(ids, mask, &targets, temperature)?)
}

/// Targets that score every token of `rows` from the logits before it (logits position `t` scores
/// `rows[t + 1]`; the last position scores nothing and gets id 0).
fn next_token_targets(rows: &[Vec<i64>]) -> Vec<Vec<i64>> {
    rows.iter()
        .map(|r| {
            r.iter()
                .skip(1)
                .copied()
                .chain(std::iter::once(0))
                .collect()
        })
        .collect()
}

/// Log-probs of [`next_token_targets`] (`[B, T]`, logits coordinates) moved onto the tokens they score:
/// position `t` holds `log p(input_ids[t])`, 0 at position 0.
fn align_to_inputs(logp: &Tensor) -> Result<Vec<Vec<f64>>> {
    Ok(logp
        .to_dtype(DType::F64)?
        .to_vec2::<f64>()?
        .iter()
        .map(|r| {
            std::iter::once(0.0)
                .chain(r[..r.len() - 1].iter().copied())
                .collect()
        })
        .collect())
}
