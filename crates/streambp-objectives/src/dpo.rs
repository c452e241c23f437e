//! DPO as TRL computes it: a sequence's policy log-prob is the sum over its target tokens, and by
//! default `loss = mean over pairs of −log σ(β((π_c − ρ_c) − (π_r − ρ_r)))` (TRL's `sigmoid`),
//! optionally plus `w ×` the mean token NLL of the chosen completions (`loss_type=["sigmoid", "sft"]`,
//! `loss_weights=[1, w]`: RPO), which keeps the chosen answers likely while the margin grows. Any of
//! TRL's other loss types, and weighted lists of them, through [`Dpo::with_loss`] ([`crate::dpo_loss`]).
//!
//! Rows are laid out `[chosen_0 .. chosen_{P−1}, rejected_0 .. rejected_{P−1}]`, right-padded to one
//! length. The loss is not a sum over positions, so the engine gives it all of `logp` at once (after a
//! forward-only pass over the LM head) and streams `dLoss/dlogp` back.

use std::ops::Range;

use candle_core::{Device, Tensor};

use crate::dpo_loss::{per_pair, DpoLoss, DpoLossType, Pairs};
use crate::{Objective, ObjectiveError, Result, TokenTargets};

/// The DPO (optionally RPO) objective of one batch of preference pairs.
#[derive(Debug, Clone)]
pub struct Dpo {
    targets: TokenTargets,
    pairs: usize,
    /// `[2P]`: ρ_c then ρ_r.
    reference: Tensor,
    beta: f64,
    /// The loss types and their weights (`sft`: the chosen completions' mean token NLL).
    loss: DpoLoss,
    /// What the chosen rows' summed NLL is divided by (None: their target tokens).
    nll_tokens: Option<f64>,
}

impl Dpo {
    /// `labels` are HF-style (`-100` ignored, aligned with input_ids) for the `2P` rows, chosen first.
    /// `ref_chosen` / `ref_rejected`: the reference model's summed log-probs of each pair's sequences.
    pub fn new(
        labels: &[Vec<i64>],
        ref_chosen: &[f64],
        ref_rejected: &[f64],
        beta: f64,
        vocab_size: usize,
        device: &Device,
    ) -> Result<Self> {
        let pairs = ref_chosen.len();
        if labels.len() != 2 * pairs || ref_rejected.len() != pairs {
            return Err(ObjectiveError::Batch(format!(
                "{} label rows, {} chosen and {} rejected reference log-probs: expected 2P rows for P pairs",
                labels.len(),
                ref_chosen.len(),
                ref_rejected.len()
            )));
        }
        if !beta.is_finite() || beta <= 0.0 {
            return Err(ObjectiveError::Batch(format!(
                "beta must be positive, got {beta}"
            )));
        }
        if let Some(v) = ref_chosen
            .iter()
            .chain(ref_rejected)
            .find(|v| !v.is_finite())
        {
            return Err(ObjectiveError::Batch(format!(
                "reference log-prob {v} is not finite"
            )));
        }
        let targets = TokenTargets::from_labels(labels, vocab_size, device)?;
        if let Some(row) = targets.rows_without_target().first() {
            return Err(ObjectiveError::Batch(format!(
                "{} row {} has no target token",
                if *row < pairs { "chosen" } else { "rejected" },
                row % pairs
            )));
        }
        let reference: Vec<f64> = ref_chosen.iter().chain(ref_rejected).copied().collect();
        Ok(Self {
            targets,
            pairs,
            reference: Tensor::from_vec(reference, 2 * pairs, device)?,
            beta,
            loss: DpoLoss::default(),
            nll_tokens: None,
        })
    }

    /// Adds `weight ×` the chosen completions' mean token NLL to the loss.
    pub fn with_sft_weight(mut self, weight: f64) -> Result<Self> {
        if !weight.is_finite() || weight < 0.0 {
            return Err(ObjectiveError::Batch(format!(
                "the SFT weight must be a non-negative number, got {weight}"
            )));
        }
        self.loss = self.loss.with_sft(weight);
        Ok(self)
    }

    /// The loss as `loss` says (TRL's `loss_type`, `loss_weights`, `label_smoothing`,
    /// `discopop_tau`) instead of `sigmoid` (and an earlier [`Dpo::with_sft_weight`]).
    pub fn with_loss(mut self, loss: DpoLoss) -> Result<Self> {
        loss.validate()?;
        self.loss = loss;
        Ok(self)
    }

    /// Divides the chosen rows' summed NLL by `tokens` instead of their own target tokens. A
    /// data-parallel step splits one micro-batch over ranks: each rank passes the micro-batch's chosen
    /// tokens over the number of ranks, so the ranks' terms average to the whole micro-batch's mean.
    pub fn with_nll_tokens(mut self, tokens: f64) -> Result<Self> {
        if !tokens.is_finite() || tokens <= 0.0 {
            return Err(ObjectiveError::Batch(format!(
                "the NLL's token count must be positive, got {tokens}"
            )));
        }
        self.nll_tokens = Some(tokens);
        Ok(self)
    }

    /// The chosen rows' target tokens (what the NLL's mean is over on one process).
    pub fn chosen_tokens(&self) -> Result<f64> {
        let mask = self.targets.mask.narrow(0, 0, self.pairs)?;
        Ok(mask
            .sum_all()?
            .to_dtype(candle_core::DType::F64)?
            .to_scalar::<f64>()?)
    }

    /// Mean token NLL of the chosen rows.
    fn chosen_nll(&self, logp: &Tensor) -> Result<Tensor> {
        let mask = self.targets.mask.narrow(0, 0, self.pairs)?;
        let tokens = match self.nll_tokens {
            Some(t) => t,
            None => self.chosen_tokens()?,
        };
        let sum = (logp.narrow(0, 0, self.pairs)? * mask.to_dtype(logp.dtype())?)?.sum_all()?;
        Ok((sum.neg()? / tokens)?)
    }

    /// Summed target log-probs per row (`[2P]`).
    fn sequence_logps(&self, logp: &Tensor) -> Result<Tensor> {
        let mask = self.targets.mask.to_dtype(logp.dtype())?;
        Ok((logp * mask)?.sum(1)?)
    }

    /// Target tokens per row (`[2P]`, in `dtype`): what IPO's and `sigmoid_norm`'s log-ratios are
    /// averaged over (TRL's completion tokens).
    fn row_tokens(&self, dtype: candle_core::DType) -> Result<Tensor> {
        Ok(self.targets.mask.to_dtype(dtype)?.sum(1)?)
    }

    /// `β (π − ρ)` per row: chosen rewards then rejected rewards.
    fn rewards(&self, logp: &Tensor) -> Result<Tensor> {
        let rho = self.reference.to_dtype(logp.dtype())?;
        Ok(((self.sequence_logps(logp)? - rho)? * self.beta)?)
    }
}

impl Objective for Dpo {
    fn name(&self) -> &str {
        "dpo"
    }

    fn targets(&self) -> &Tensor {
        &self.targets.ids
    }

    fn separable(&self) -> bool {
        false
    }

    fn loss(&self, logp: &Tensor, cols: Range<usize>) -> Result<Tensor> {
        if cols.start != 0 || cols.len() != self.targets.ids.dim(1)? {
            return Err(ObjectiveError::Batch(
                "DPO needs the log-probs of all positions at once".into(),
            ));
        }
        let p = self.pairs;
        let seq = self.sequence_logps(logp)?;
        let rho = self.reference.to_dtype(logp.dtype())?;
        let tokens = self.row_tokens(logp.dtype())?;
        let pairs = Pairs {
            chosen: seq.narrow(0, 0, p)?,
            rejected: seq.narrow(0, p, p)?,
            ref_chosen: rho.narrow(0, 0, p)?,
            ref_rejected: rho.narrow(0, p, p)?,
            chosen_tokens: tokens.narrow(0, 0, p)?,
            rejected_tokens: tokens.narrow(0, p, p)?,
            beta: self.beta,
        };
        // As TRL: each type's mean over the pairs, times its weight, summed.
        let mut total: Option<Tensor> = None;
        for &(kind, weight) in &self.loss.terms {
            let term = match kind {
                DpoLossType::Sft => self.chosen_nll(logp)?,
                other => per_pair(other, &pairs, &self.loss)?.mean_all()?,
            };
            let term = (term * weight)?;
            total = Some(match total {
                Some(t) => (t + term)?,
                None => term,
            });
        }
        total.ok_or_else(|| ObjectiveError::Batch("loss_type names no loss".into()))
    }

    fn metrics(&self, logp: &Tensor) -> Result<Vec<(String, f64)>> {
        let rewards = self
            .rewards(logp)?
            .to_dtype(candle_core::DType::F64)?
            .to_vec1::<f64>()?;
        let (chosen, rejected) = rewards.split_at(self.pairs);
        let p = self.pairs as f64;
        let mean = |v: &[f64]| v.iter().sum::<f64>() / p;
        let margins: Vec<f64> = chosen.iter().zip(rejected).map(|(c, r)| c - r).collect();
        let accuracy = margins.iter().filter(|m| **m > 0.0).count() as f64 / p;
        let mut metrics = vec![
            ("rewards/chosen".into(), mean(chosen)),
            ("rewards/rejected".into(), mean(rejected)),
            ("rewards/margins".into(), mean(&margins)),
            ("rewards/accuracies".into(), accuracy),
        ];
        if self.loss.has(DpoLossType::Sft) {
            let nll = self.chosen_nll(logp)?.to_dtype(candle_core::DType::F64)?;
            metrics.push(("nll_loss".into(), nll.to_scalar::<f64>()?));
        }
        Ok(metrics)
    }
}

/// `log(1 + eˣ)` without overflow: `max(x, 0) + log(1 + e^{−|x|})`.
pub fn softplus(x: &Tensor) -> candle_core::Result<Tensor> {
    x.relu()? + ((x.abs()?.neg()?.exp()? + 1.0)?.log()?)
}
