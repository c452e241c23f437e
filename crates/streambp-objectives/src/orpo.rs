//! ORPO (Hong et al., 2024) as TRL's `ORPOTrainer` computes it: no reference model; the chosen rows'
//! mean token NLL over *every real token* (prompt included: TRL trains ORPO's NLL on the whole chosen
//! sequence) minus `β ×` the pairs' mean log-sigmoid of the log odds ratio
//!
//! `log_odds = (π_c − π_r) − (log(1 − e^{π_c}) − log(1 − e^{π_r}))`,
//!
//! where `π` is a completion's mean token log-prob (TRL's `average_log_prob=True`). Rows are laid out
//! as DPO's ([`crate::pairs`]); the loss is not a sum over positions, so the engine hands it all of
//! `logp` at once.

use std::ops::Range;

use candle_core::{DType, Device, Tensor};

use crate::checks::{check_all_positions, check_beta, check_nll_tokens};
use crate::dpo_loss::log_sigmoid;
use crate::pairs::{pair_metrics, PairRows};
use crate::{Objective, Result};

/// The ORPO objective of one batch of preference pairs.
#[derive(Debug, Clone)]
pub struct Orpo {
    rows: PairRows,
    beta: f64,
    /// What the chosen rows' summed NLL is divided by (None: their own real tokens).
    nll_tokens: Option<f64>,
}

impl Orpo {
    /// `labels`: the `2P` rows' completion labels (HF-style, chosen rows first); `input_labels`: every
    /// real token of the same rows (their input ids, `-100` on padding), which the NLL covers.
    pub fn new(
        labels: &[Vec<i64>],
        input_labels: &[Vec<i64>],
        beta: f64,
        vocab_size: usize,
        device: &Device,
    ) -> Result<Self> {
        check_beta(beta)?;
        Ok(Self {
            rows: PairRows::new(labels, Some(input_labels), vocab_size, device)?,
            beta,
            nll_tokens: None,
        })
    }

    /// Divides the chosen rows' summed NLL by `tokens` (a data-parallel step: the micro-batch's NLL
    /// tokens over the ranks) instead of this batch's own.
    pub fn with_nll_tokens(mut self, tokens: f64) -> Result<Self> {
        self.nll_tokens = Some(check_nll_tokens(tokens)?);
        Ok(self)
    }

    /// The tokens the chosen rows' NLL averages over on one process.
    pub fn nll_tokens(&self) -> Result<f64> {
        self.rows.nll_tokens()
    }

    /// Each row's mean completion log-prob (`[2P]`) and each pair's log odds ratio (`[P]`).
    fn log_odds(&self, logp: &Tensor) -> Result<(Tensor, Tensor)> {
        let averaged = self.rows.logps(logp, true)?;
        let (chosen, rejected) = self.rows.split(&averaged)?;
        let odds = ((&chosen - &rejected)? - (log1mexp(&chosen)? - log1mexp(&rejected)?)?)?;
        Ok((averaged, odds))
    }
}

/// `log(1 − eˣ)` for `x < 0`, accurate at both ends: `1 − eˣ = −2t / (1 − t)` with `t = tanh(x/2)`
/// has no cancellation near `x = 0` (where `1 − eˣ` loses digits; TRL branches to `expm1` there), and
/// composed ops give autograd its backward.
fn log1mexp(x: &Tensor) -> candle_core::Result<Tensor> {
    let t = (x * 0.5)?.tanh()?;
    ((t.clone() * -2.0)? / (1.0 - t)?)?.log()
}

impl Objective for Orpo {
    fn name(&self) -> &str {
        "orpo"
    }

    fn targets(&self) -> &Tensor {
        &self.rows.targets.ids
    }

    fn separable(&self) -> bool {
        false
    }

    fn loss(&self, logp: &Tensor, cols: Range<usize>) -> Result<Tensor> {
        check_all_positions("ORPO", &cols, &self.rows.targets.ids)?;
        let nll = self.rows.chosen_nll(logp, self.nll_tokens)?;
        let (_, odds) = self.log_odds(logp)?;
        let ratio = log_sigmoid(&odds)?.mean_all()?;
        Ok((nll - (ratio * self.beta)?)?)
    }

    fn metrics(&self, logp: &Tensor) -> Result<Vec<(String, f64)>> {
        let (averaged, odds) = self.log_odds(logp)?;
        let scalar = |t: Tensor| -> Result<f64> { Ok(t.to_dtype(DType::F64)?.to_scalar::<f64>()?) };
        let pairs = self.rows.pairs;
        // As TRL logs them: rewards are β × the mean log-probs.
        let mut metrics = pair_metrics(&(&averaged * self.beta)?, pairs, "rewards", true)?;
        metrics.extend(pair_metrics(&averaged, pairs, "logps", false)?);
        metrics.push((
            "nll_loss".into(),
            scalar(self.rows.chosen_nll(logp, self.nll_tokens)?)?,
        ));
        metrics.push((
            "log_odds_ratio".into(),
            scalar(log_sigmoid(&odds)?.mean_all()?)?,
        ));
        metrics.push(("log_odds_chosen".into(), scalar(odds.mean_all()?)?));
        Ok(metrics)
    }
}
