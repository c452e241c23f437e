//! CPO (Xu et al., 2024) and its relatives as TRL's `CPOTrainer` computes them: no reference model;
//! a per-pair loss on the policy's own margin, averaged over the pairs, plus `cpo_alpha ×` the chosen
//! completions' mean token NLL. With `π` a completion's log-prob (summed over its tokens; averaged for
//! `ipo` and `simpo`), `z = π_c − π_r`, `β`, the label smoothing `ε` and `ls` the log-sigmoid:
//!
//! | `loss_type` | per pair |
//! |---|---|
//! | `sigmoid` | `−(1−ε) ls(βz) − ε ls(−βz)` |
//! | `hinge` | `relu(1 − βz)` |
//! | `ipo` | `(z − 1/(2β))²` |
//! | `simpo` | as `sigmoid` with `z − γ/β` (SimPO: `cpo_alpha = 0`) |
//!
//! AlphaPO (`alpha ≠ 0`) replaces each `π` by the reward `(1 − e^{−α π}) / α` in `z`, for every type;
//! TRL's `loss_type="alphapo"` is `simpo` with `cpo_alpha = 0`.

use std::ops::Range;

use candle_core::{DType, Device, Tensor};

use crate::checks::{check_all_positions, check_beta, check_nll_tokens};
use crate::dpo_loss::log_sigmoid;
use crate::pairs::{pair_metrics, PairRows};
use crate::{Objective, ObjectiveError, Result};

/// One of TRL's CPO loss types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpoLossType {
    /// CPO's own: the smoothed sigmoid of the summed log-prob margin.
    Sigmoid,
    /// SLiC's hinge.
    Hinge,
    /// IPO on length-averaged log-probs.
    Ipo,
    /// SimPO: the sigmoid of the length-averaged margin less a target margin `γ/β`.
    Simpo,
}

impl CpoLossType {
    /// TRL's name of the type.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sigmoid => "sigmoid",
            Self::Hinge => "hinge",
            Self::Ipo => "ipo",
            Self::Simpo => "simpo",
        }
    }

    /// Whether the type reads length-averaged log-probs (TRL's `average_log_prob`).
    pub fn averaged(self) -> bool {
        matches!(self, Self::Ipo | Self::Simpo)
    }
}

impl crate::LossSettings for CpoLossType {
    const TYPES: &'static [Self] = &[Self::Sigmoid, Self::Hinge, Self::Ipo, Self::Simpo];
    const SETTINGS: &'static [&'static str] = &["label_smoothing", "simpo_gamma"];
    fn type_name(self) -> &'static str {
        self.name()
    }
    fn reads(self, setting: &str) -> bool {
        match setting {
            "label_smoothing" => matches!(self, Self::Sigmoid | Self::Simpo),
            "simpo_gamma" => self == Self::Simpo,
            _ => true,
        }
    }
}

/// CPO's settings, as TRL's `CPOConfig` names them (β is the objective's own argument).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CpoLoss {
    /// The per-pair loss.
    pub loss_type: CpoLossType,
    /// Label smoothing `ε` of `sigmoid` and `simpo`, in `[0, 0.5)`.
    pub label_smoothing: f64,
    /// The weight of the chosen completions' NLL (CPO's behaviour-cloning term), at least 0.
    pub cpo_alpha: f64,
    /// SimPO's target margin `γ`.
    pub simpo_gamma: f64,
    /// AlphaPO's reward shape `α` (0: the log-probs themselves).
    pub alpha: f64,
}

impl Default for CpoLoss {
    /// TRL's defaults: `sigmoid`, no smoothing, `cpo_alpha` 1, `simpo_gamma` 0.5, `alpha` 0.
    fn default() -> Self {
        Self {
            loss_type: CpoLossType::Sigmoid,
            label_smoothing: 0.0,
            cpo_alpha: 1.0,
            simpo_gamma: 0.5,
            alpha: 0.0,
        }
    }
}

impl CpoLoss {
    /// The settings of TRL's `loss_type` name: `alphapo` is `simpo` without the NLL, as TRL's
    /// `CPOConfig` makes it.
    pub fn of_type(name: &str) -> Result<Self> {
        let loss_type = match name {
            "sigmoid" => CpoLossType::Sigmoid,
            "hinge" => CpoLossType::Hinge,
            "ipo" => CpoLossType::Ipo,
            "simpo" | "alphapo" => CpoLossType::Simpo,
            other => {
                return Err(ObjectiveError::Loss(format!(
                "unknown CPO loss type {other:?}: expected sigmoid, hinge, ipo, simpo or alphapo"
            )))
            }
        };
        let cpo_alpha = if name == "alphapo" { 0.0 } else { 1.0 };
        Ok(Self {
            loss_type,
            cpo_alpha,
            ..Self::default()
        })
    }

    /// The loss TRL's `CPOConfig` fields say: `loss_type`'s settings (sigmoid when `None`), then each
    /// field given; checked ([`CpoLoss::validate`]).
    pub fn from_config(
        loss_type: Option<&str>,
        label_smoothing: Option<f64>,
        cpo_alpha: Option<f64>,
        simpo_gamma: Option<f64>,
        alpha: Option<f64>,
    ) -> Result<Self> {
        let of_type = Self::of_type(loss_type.unwrap_or("sigmoid"))?;
        if simpo_gamma.is_some() {
            if let Some(why) = crate::settings::unread("simpo_gamma", &[of_type.loss_type]) {
                return Err(ObjectiveError::Loss(format!("simpo_gamma {why}")));
            }
        }
        let loss = Self {
            label_smoothing: label_smoothing.unwrap_or(of_type.label_smoothing),
            cpo_alpha: cpo_alpha.unwrap_or(of_type.cpo_alpha),
            simpo_gamma: simpo_gamma.unwrap_or(of_type.simpo_gamma),
            alpha: alpha.unwrap_or(of_type.alpha),
            ..of_type
        };
        loss.validate()?;
        Ok(loss)
    }

    /// Refuses settings TRL would reject or ignore: label smoothing outside `[0, 0.5)` or on a type
    /// that does not read it, a negative NLL weight, non-finite values.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str, v: f64, range: &str| {
            Err(ObjectiveError::Loss(format!(
                "{what} {v} is outside {range}"
            )))
        };
        let eps = self.label_smoothing;
        if !(0.0..0.5).contains(&eps) {
            return bad("label_smoothing", eps, "[0, 0.5)");
        }
        if eps > 0.0 {
            if let Some(why) = crate::settings::unread("label_smoothing", &[self.loss_type]) {
                return Err(ObjectiveError::Loss(format!("label_smoothing {why}")));
            }
        }
        if !self.cpo_alpha.is_finite() || self.cpo_alpha < 0.0 {
            return bad("cpo_alpha", self.cpo_alpha, "[0, ∞)");
        }
        if !self.simpo_gamma.is_finite() {
            return bad("simpo_gamma", self.simpo_gamma, "the finite numbers");
        }
        if !self.alpha.is_finite() {
            return bad("alpha", self.alpha, "the finite numbers");
        }
        Ok(())
    }
}

/// The CPO objective of one batch of preference pairs.
#[derive(Debug, Clone)]
pub struct Cpo {
    rows: PairRows,
    beta: f64,
    loss: CpoLoss,
    /// What the chosen rows' summed NLL is divided by (None: their completion tokens).
    nll_tokens: Option<f64>,
}

impl Cpo {
    /// `labels`: the `2P` rows' completion labels (HF-style, chosen rows first).
    pub fn new(
        labels: &[Vec<i64>],
        beta: f64,
        loss: CpoLoss,
        vocab_size: usize,
        device: &Device,
    ) -> Result<Self> {
        check_beta(beta)?;
        loss.validate()?;
        Ok(Self {
            rows: PairRows::new(labels, None, vocab_size, device)?,
            beta,
            loss,
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

    /// Each row's reward before β (`[2P]`): its log-prob, or AlphaPO's `(1 − e^{−α π}) / α`.
    fn rewards(&self, logp: &Tensor) -> Result<Tensor> {
        let logps = self.rows.logps(logp, self.loss.loss_type.averaged())?;
        let alpha = self.loss.alpha;
        Ok(match alpha == 0.0 {
            true => logps,
            false => ((1.0 - (logps * -alpha)?.exp()?)? / alpha)?,
        })
    }

    /// The `[P]` losses.
    fn per_pair(&self, logp: &Tensor) -> Result<Tensor> {
        let (beta, eps) = (self.beta, self.loss.label_smoothing);
        let (chosen, rejected) = self.rows.split(&self.rewards(logp)?)?;
        let z = (chosen - rejected)?;
        let smoothed = |z: &Tensor| -> Result<Tensor> {
            let bz = (z * beta)?;
            let keep = (log_sigmoid(&bz)? * -(1.0 - eps))?;
            Ok((keep - (log_sigmoid(&bz.neg()?)? * eps)?)?)
        };
        Ok(match self.loss.loss_type {
            CpoLossType::Sigmoid => smoothed(&z)?,
            CpoLossType::Simpo => smoothed(&(z - self.loss.simpo_gamma / beta)?)?,
            CpoLossType::Hinge => (1.0 - (z * beta)?)?.relu()?,
            CpoLossType::Ipo => (z - 1.0 / (2.0 * beta))?.sqr()?,
        })
    }
}

impl Objective for Cpo {
    fn name(&self) -> &str {
        "cpo"
    }

    fn targets(&self) -> &Tensor {
        &self.rows.targets.ids
    }

    fn separable(&self) -> bool {
        false
    }

    fn loss(&self, logp: &Tensor, cols: Range<usize>) -> Result<Tensor> {
        check_all_positions("CPO", &cols, &self.rows.targets.ids)?;
        let losses = self.per_pair(logp)?.mean_all()?;
        // TRL skips the NLL when its weight is 0 (SimPO, AlphaPO).
        Ok(match self.loss.cpo_alpha == 0.0 {
            true => losses,
            false => {
                let nll = self.rows.chosen_nll(logp, self.nll_tokens)?;
                (losses + (nll * self.loss.cpo_alpha)?)?
            }
        })
    }

    fn metrics(&self, logp: &Tensor) -> Result<Vec<(String, f64)>> {
        let pairs = self.rows.pairs;
        let rewards = (self.rewards(logp)? * self.beta)?;
        let mut metrics = pair_metrics(&rewards, pairs, "rewards", true)?;
        let logps = self.rows.logps(logp, self.loss.loss_type.averaged())?;
        metrics.extend(pair_metrics(&logps, pairs, "logps", false)?);
        let nll = match self.loss.cpo_alpha == 0.0 {
            true => 0.0,
            false => self
                .rows
                .chosen_nll(logp, self.nll_tokens)?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()?,
        };
        metrics.push(("nll_loss".into(), nll));
        Ok(metrics)
    }
}
