//! The rows of a batch of preference pairs and what the pairwise objectives (DPO, ORPO, CPO) read
//! from them: each completion's summed or length-averaged log-prob and the chosen rows' mean token
//! NLL.
//!
//! Rows are laid out `[chosen_0 .. chosen_{P−1}, rejected_0 .. rejected_{P−1}]`, right-padded to one
//! length. The completion's tokens are the labels' (HF-style, `-100` on the prompt and padding). The
//! NLL may cover more than the completions: ORPO, as TRL computes it, trains on every real token of
//! the chosen rows, prompt included, so its targets are read at those positions too.

use candle_core::{DType, Device, Tensor};

use crate::{ObjectiveError, Result, TokenTargets, IGNORE_INDEX};

/// The target tokens of a pair batch, with the completion's and the NLL's masks.
#[derive(Debug, Clone)]
pub struct PairRows {
    /// Every token read (the completions', and the NLL's where it covers more).
    pub targets: TokenTargets,
    /// `[2P, T]` f64: 1 at completion targets.
    completion: Tensor,
    /// `[P, T]` f64: 1 at the chosen rows' tokens the NLL averages over.
    nll: Tensor,
    /// Completion targets per row.
    completion_counts: Vec<usize>,
    /// The number of pairs `P`.
    pub pairs: usize,
}

impl PairRows {
    /// From the `2P` rows' completion `labels`; `nll_labels` (same shape, agreeing with `labels`
    /// wherever those are set) when the chosen rows' NLL covers more tokens than their completions.
    pub fn new(
        labels: &[Vec<i64>],
        nll_labels: Option<&[Vec<i64>]>,
        vocab_size: usize,
        device: &Device,
    ) -> Result<Self> {
        if labels.is_empty() || !labels.len().is_multiple_of(2) {
            return Err(ObjectiveError::Batch(format!(
                "{} label rows: expected 2P rows (P chosen, then P rejected)",
                labels.len()
            )));
        }
        let pairs = labels.len() / 2;
        let completion = TokenTargets::from_labels(labels, vocab_size, device)?;
        if let Some(row) = completion.rows_without_target().first() {
            return Err(ObjectiveError::Batch(format!(
                "{} row {} has no target token",
                if *row < pairs { "chosen" } else { "rejected" },
                row % pairs
            )));
        }
        let completion_counts = completion.counts.clone();
        let (targets, nll) = match nll_labels {
            None => {
                let nll = completion.mask.narrow(0, 0, pairs)?;
                (completion.clone(), nll)
            }
            Some(wider) => {
                check_agreement(labels, wider)?;
                let targets = TokenTargets::from_labels(wider, vocab_size, device)?;
                let nll = targets.mask.narrow(0, 0, pairs)?;
                (targets, nll)
            }
        };
        Ok(Self {
            targets,
            completion: completion.mask,
            nll,
            completion_counts,
            pairs,
        })
    }

    /// Each row's completion log-prob (`[2P]`): summed over its completion tokens, or their mean.
    pub fn logps(&self, logp: &Tensor, averaged: bool) -> Result<Tensor> {
        let summed = (logp * self.completion.to_dtype(logp.dtype())?)?.sum(1)?;
        Ok(match averaged {
            true => (summed / self.completion_tokens(logp.dtype())?)?,
            false => summed,
        })
    }

    /// Completion tokens per row (`[2P]`, in `dtype`).
    pub fn completion_tokens(&self, dtype: DType) -> Result<Tensor> {
        let counts: Vec<f64> = self.completion_counts.iter().map(|&n| n as f64).collect();
        let device = self.completion.device();
        Ok(Tensor::from_vec(counts, self.completion_counts.len(), device)?.to_dtype(dtype)?)
    }

    /// The tokens the chosen rows' NLL averages over.
    pub fn nll_tokens(&self) -> Result<f64> {
        Ok(self
            .nll
            .sum_all()?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?)
    }

    /// The chosen rows' summed NLL over `tokens` (their own NLL tokens when `None`: a mean over the
    /// batch's tokens, as TRL's cross entropy is).
    pub fn chosen_nll(&self, logp: &Tensor, tokens: Option<f64>) -> Result<Tensor> {
        let tokens = match tokens {
            Some(t) => t,
            None => self.nll_tokens()?,
        };
        let chosen = logp.narrow(0, 0, self.pairs)?;
        let sum = (chosen * self.nll.to_dtype(logp.dtype())?)?.sum_all()?;
        Ok((sum.neg()? / tokens)?)
    }

    /// The chosen (`[P]`) and rejected (`[P]`) halves of a per-row value.
    pub fn split(&self, per_row: &Tensor) -> Result<(Tensor, Tensor)> {
        let p = self.pairs;
        Ok((per_row.narrow(0, 0, p)?, per_row.narrow(0, p, p)?))
    }
}

/// `nll_labels` covers `labels`: the same shape, and the same token wherever `labels` has one.
fn check_agreement(labels: &[Vec<i64>], wider: &[Vec<i64>]) -> Result<()> {
    if wider.len() != labels.len() {
        return Err(ObjectiveError::Batch(format!(
            "{} NLL label rows for {} label rows",
            wider.len(),
            labels.len()
        )));
    }
    for (row, (narrow, wide)) in labels.iter().zip(wider).enumerate() {
        if narrow.len() != wide.len() {
            return Err(ObjectiveError::Batch(format!(
                "NLL labels row {row} has {} entries, its labels {}",
                wide.len(),
                narrow.len()
            )));
        }
        let differs = narrow
            .iter()
            .zip(wide)
            .position(|(&n, &w)| n != IGNORE_INDEX && n != w);
        if let Some(pos) = differs {
            return Err(ObjectiveError::Batch(format!(
                "row {row}, position {pos}: label {} but NLL label {}",
                narrow[pos], wide[pos]
            )));
        }
    }
    Ok(())
}

/// TRL's logged means over pairs of per-row values (`[2P]`, chosen then rejected): `{prefix}/chosen`,
/// `{prefix}/rejected`, and for rewards also margins and accuracies.
pub(crate) fn pair_metrics(
    per_row: &Tensor,
    pairs: usize,
    prefix: &str,
    with_margins: bool,
) -> Result<Vec<(String, f64)>> {
    let values = per_row.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    let (chosen, rejected) = values.split_at(pairs);
    let p = pairs as f64;
    let mean = |v: &[f64]| v.iter().sum::<f64>() / p;
    let mut metrics = vec![
        (format!("{prefix}/chosen"), mean(chosen)),
        (format!("{prefix}/rejected"), mean(rejected)),
    ];
    if with_margins {
        let margins: Vec<f64> = chosen.iter().zip(rejected).map(|(c, r)| c - r).collect();
        let accuracy = margins.iter().filter(|m| **m > 0.0).count() as f64 / p;
        metrics.push((format!("{prefix}/margins"), mean(&margins)));
        metrics.push((format!("{prefix}/accuracies"), accuracy));
    }
    Ok(metrics)
}
