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

use candle_core::{DType, Device, Tensor};

use crate::checks::{check_all_positions, check_beta, check_finite, check_nll_tokens};
use crate::dpo_loss::{per_pair, DpoLoss, DpoLossType, Pairs};
use crate::pairs::{pair_metrics, PairRows};
use crate::{Objective, ObjectiveError, Result};

/// The DPO (optionally RPO) objective of one batch of preference pairs.
#[derive(Debug, Clone)]
pub struct Dpo {
    rows: PairRows,
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
        check_beta(beta)?;
        check_finite("reference log-prob", ref_chosen.iter().chain(ref_rejected))?;
        let rows = PairRows::new(labels, None, vocab_size, device)?;
        let reference: Vec<f64> = ref_chosen.iter().chain(ref_rejected).copied().collect();
        Ok(Self {
            rows,
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
        self.nll_tokens = Some(check_nll_tokens(tokens)?);
        Ok(self)
    }

    /// The chosen rows' target tokens (what the NLL's mean is over on one process).
    pub fn chosen_tokens(&self) -> Result<f64> {
        self.rows.nll_tokens()
    }

    /// `β (π − ρ)` per row: chosen rewards then rejected rewards.
    fn rewards(&self, logp: &Tensor) -> Result<Tensor> {
        let rho = self.reference.to_dtype(logp.dtype())?;
        Ok(((self.rows.logps(logp, false)? - rho)? * self.beta)?)
    }
}

impl Objective for Dpo {
    fn name(&self) -> &str {
        "dpo"
    }

    fn targets(&self) -> &Tensor {
        &self.rows.targets.ids
    }

    fn separable(&self) -> bool {
        false
    }

    fn loss(&self, logp: &Tensor, cols: Range<usize>) -> Result<Tensor> {
        check_all_positions("DPO", &cols, &self.rows.targets.ids)?;
        let rows = &self.rows;
        let (chosen, rejected) = rows.split(&rows.logps(logp, false)?)?;
        let (ref_chosen, ref_rejected) = rows.split(&self.reference.to_dtype(logp.dtype())?)?;
        let (chosen_tokens, rejected_tokens) =
            rows.split(&rows.completion_tokens(logp.dtype())?)?;
        let pairs = Pairs {
            chosen,
            rejected,
            ref_chosen,
            ref_rejected,
            chosen_tokens,
            rejected_tokens,
            beta: self.beta,
        };
        // As TRL: each type's mean over the pairs, times its weight, summed.
        let mut total: Option<Tensor> = None;
        for &(kind, weight) in &self.loss.terms {
            let term = match kind {
                DpoLossType::Sft => self.rows.chosen_nll(logp, self.nll_tokens)?,
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
        let mut metrics = pair_metrics(&self.rewards(logp)?, self.rows.pairs, "rewards", true)?;
        if self.loss.has(DpoLossType::Sft) {
            let nll = self.rows.chosen_nll(logp, self.nll_tokens)?;
            metrics.push(("nll_loss".into(), nll.to_dtype(DType::F64)?.to_scalar()?));
        }
        Ok(metrics)
    }
}

/// `log(1 + eˣ)` without overflow: `max(x, 0) + log(1 + e^{−|x|})`.
pub fn softplus(x: &Tensor) -> candle_core::Result<Tensor> {
    x.relu()? + ((x.abs()?.neg()?.exp()? + 1.0)?.log()?)
}
