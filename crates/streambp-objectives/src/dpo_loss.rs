//! TRL 1.16's DPO loss types (`DPOConfig.loss_type`), as `DPOTrainer._compute_loss` computes them:
//! each is a loss per pair, averaged over the batch's pairs, and a list of types is summed with
//! `loss_weights`. In terms of the pair's log-ratios `c = π_c − ρ_c` and `r = π_r − ρ_r` (sequence
//! log-probs summed over completion tokens), `z = c − r`, `β`, the label smoothing `ε` and `ls` the
//! log-sigmoid:
//!
//! | type | per pair |
//! |---|---|
//! | `sigmoid` | `−ls(βz)` |
//! | `hinge` | `relu(1 − βz)` |
//! | `ipo` | `(c/n_c − r/n_r − 1/(2β))²`, `n` a row's completion tokens |
//! | `exo_pair` | `σ(βz)(ls(βz) − log(1−ε)) + σ(−βz)(ls(−βz) − log ε)` |
//! | `nca_pair` | `−ls(βc) − ½ls(−βc) − ½ls(−βr)` |
//! | `robust` | `(−(1−ε)ls(βz) + ε ls(−βz)) / (1−2ε)` |
//! | `bco_pair` | `−ls(βc) − ls(−βr)` |
//! | `sppo_hard` | `(c − 1/(2β))² + (r + 1/(2β))²` |
//! | `aot` | `−(1−ε)ls(βδ) − ε ls(−βδ)`, `δ = sort(π_c − π_r) − sort(ρ_c − ρ_r)` over the batch |
//! | `aot_unpaired` | as `aot` with `δ = sort(c) − sort(r)` (TRL's earlier `aot_pair`) |
//! | `apo_zero` | `1 − σ(βc) + σ(βr)` |
//! | `apo_down` | `σ(βc) + 1 − σ(β(c − r))` |
//! | `discopop` | `−ls(x)(1−m) + e^{−x}m`, `x = βz`, `m = σ(x/τ)` |
//! | `sigmoid_norm` | `−ls(β(c/n_c − r/n_r))` |
//! | `sft` | the chosen completions' mean token NLL, pooled over the batch (one scalar) |
//!
//! Nothing is detached but the reference. `aot`'s sorts route each pair's gradient to the place its
//! value sorts into, batch-wide (on one process: its micro-batch, as TRL's per-device batch).

use candle_core::Tensor;

use crate::{ObjectiveError, Result};

/// One of TRL's DPO loss types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DpoLossType {
    /// `−log σ(βz)`: DPO itself.
    Sigmoid,
    /// SLiC's hinge.
    Hinge,
    /// IPO, on length-averaged log-ratios.
    Ipo,
    /// EXO with label smoothing `ε` (above 0).
    ExoPair,
    /// NCA.
    NcaPair,
    /// Robust DPO with label smoothing `ε`.
    Robust,
    /// BCO's pairwise form (TRL 1.16: no running mean).
    BcoPair,
    /// SPPO with hard labels.
    SppoHard,
    /// AOT over the batch's sorted policy and reference margins.
    Aot,
    /// AOT over the batch's sorted chosen and rejected log-ratios.
    AotUnpaired,
    /// APO-zero.
    ApoZero,
    /// APO-down.
    ApoDown,
    /// DiscoPOP with temperature `τ`.
    Discopop,
    /// The chosen completions' mean token NLL (RPO's term with `sigmoid`).
    Sft,
    /// `sigmoid` on length-averaged log-ratios.
    SigmoidNorm,
}

impl DpoLossType {
    /// Every type, in TRL's order.
    pub const ALL: [DpoLossType; 15] = [
        Self::Sigmoid,
        Self::Hinge,
        Self::Ipo,
        Self::ExoPair,
        Self::NcaPair,
        Self::Robust,
        Self::BcoPair,
        Self::SppoHard,
        Self::Aot,
        Self::AotUnpaired,
        Self::ApoZero,
        Self::ApoDown,
        Self::Discopop,
        Self::Sft,
        Self::SigmoidNorm,
    ];

    /// TRL's name of the type.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sigmoid => "sigmoid",
            Self::Hinge => "hinge",
            Self::Ipo => "ipo",
            Self::ExoPair => "exo_pair",
            Self::NcaPair => "nca_pair",
            Self::Robust => "robust",
            Self::BcoPair => "bco_pair",
            Self::SppoHard => "sppo_hard",
            Self::Aot => "aot",
            Self::AotUnpaired => "aot_unpaired",
            Self::ApoZero => "apo_zero",
            Self::ApoDown => "apo_down",
            Self::Discopop => "discopop",
            Self::Sft => "sft",
            Self::SigmoidNorm => "sigmoid_norm",
        }
    }

    /// Whether the type reads the label smoothing `ε`.
    pub fn smoothed(self) -> bool {
        matches!(
            self,
            Self::ExoPair | Self::Robust | Self::Aot | Self::AotUnpaired
        )
    }
}

impl crate::LossSettings for DpoLossType {
    const TYPES: &'static [Self] = &Self::ALL;
    const SETTINGS: &'static [&'static str] = &["label_smoothing", "discopop_tau"];
    fn type_name(self) -> &'static str {
        self.name()
    }
    fn reads(self, setting: &str) -> bool {
        match setting {
            "label_smoothing" => self.smoothed(),
            "discopop_tau" => self == Self::Discopop,
            _ => true,
        }
    }
}

impl std::str::FromStr for DpoLossType {
    type Err = ObjectiveError;
    fn from_str(s: &str) -> Result<Self> {
        // `aot_pair` is the name TRL gave `aot_unpaired` before 1.0.
        let name = if s == "aot_pair" { "aot_unpaired" } else { s };
        Self::ALL
            .into_iter()
            .find(|t| t.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|t| t.name()).collect();
                ObjectiveError::Loss(format!(
                    "unknown DPO loss_type {s:?} (expected one of {})",
                    names.join(", ")
                ))
            })
    }
}

/// What a DPO batch's loss is made of: weighted loss types (TRL's `loss_type` and `loss_weights`),
/// the label smoothing the smoothed types read and DiscoPOP's temperature.
#[derive(Debug, Clone, PartialEq)]
pub struct DpoLoss {
    /// `(type, weight)`, summed.
    pub terms: Vec<(DpoLossType, f64)>,
    /// `ε` of `exo_pair`, `robust`, `aot` and `aot_unpaired` (TRL's default 0).
    pub label_smoothing: f64,
    /// DiscoPOP's `τ` (TRL's default 0.05).
    pub discopop_tau: f64,
}

impl Default for DpoLoss {
    fn default() -> Self {
        Self {
            terms: vec![(DpoLossType::Sigmoid, 1.0)],
            label_smoothing: 0.0,
            discopop_tau: 0.05,
        }
    }
}

impl DpoLoss {
    /// The loss `DPOConfig`'s fields name: the types `names` (TRL's sigmoid when there are none)
    /// with `loss_weights`, and `label_smoothing` and `discopop_tau` where given.
    pub fn from_config(
        names: &[&str],
        weights: Option<&[f64]>,
        label_smoothing: Option<f64>,
        discopop_tau: Option<f64>,
    ) -> Result<Self> {
        let mut loss = match names.is_empty() {
            true => Self::default(),
            false => Self::from_names(names, weights)?,
        };
        if let Some(eps) = label_smoothing {
            loss.label_smoothing = eps;
        }
        if let Some(tau) = discopop_tau {
            let types: Vec<DpoLossType> = loss.terms.iter().map(|(t, _)| *t).collect();
            if let Some(why) = crate::settings::unread("discopop_tau", &types) {
                return Err(ObjectiveError::Loss(format!("discopop_tau {why}")));
            }
            loss.discopop_tau = tau;
        }
        Ok(loss)
    }

    /// This loss with the `sft` term (the chosen completions' mean NLL) weighted `weight` in place
    /// of any it had (none at 0).
    pub fn with_sft(mut self, weight: f64) -> Self {
        self.terms.retain(|(t, _)| *t != DpoLossType::Sft);
        if weight > 0.0 {
            self.terms.push((DpoLossType::Sft, weight));
        }
        self
    }

    /// The types `names` with `weights` (one each; all 1 when `None`), as TRL pairs them.
    pub fn from_names(names: &[&str], weights: Option<&[f64]>) -> Result<Self> {
        if names.is_empty() {
            return Err(ObjectiveError::Loss("loss_type names no loss".into()));
        }
        let weights = match weights {
            Some(w) if w.len() != names.len() => {
                return Err(ObjectiveError::Loss(format!(
                    "{} loss_weights for {} loss types: give one weight per type",
                    w.len(),
                    names.len()
                )))
            }
            Some(w) => w.to_vec(),
            None => vec![1.0; names.len()],
        };
        let terms = names
            .iter()
            .zip(weights)
            .map(|(n, w)| Ok((n.parse()?, w)))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            terms,
            ..Self::default()
        })
    }

    /// Refuses settings TRL refuses, and weights or constants that are not numbers.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(ObjectiveError::Loss(what));
        if self.terms.is_empty() {
            return bad("loss_type names no loss".into());
        }
        if let Some((t, w)) = self.terms.iter().find(|(_, w)| !w.is_finite()) {
            return bad(format!("loss weight {w} of {} is not a number", t.name()));
        }
        if self.terms.iter().all(|(_, w)| *w == 0.0) {
            return bad(
                "every loss weight is 0: the loss would be constant and train nothing".into(),
            );
        }
        let eps = self.label_smoothing;
        if !(0.0..0.5).contains(&eps) {
            return bad(format!("label_smoothing must be in [0, 0.5), got {eps}"));
        }
        if eps > 0.0 {
            let types: Vec<DpoLossType> = self.terms.iter().map(|(t, _)| *t).collect();
            if let Some(why) = crate::settings::unread("label_smoothing", &types) {
                return bad(format!("label_smoothing {eps} {why}"));
            }
        }
        if eps == 0.0 && self.has(DpoLossType::ExoPair) {
            return bad("exo_pair needs label_smoothing above 0 (its log ε)".into());
        }
        if !(self.discopop_tau.is_finite() && self.discopop_tau > 0.0) {
            return bad(format!(
                "discopop_tau must be above 0, got {}",
                self.discopop_tau
            ));
        }
        Ok(())
    }

    /// Whether `kind` is one of the terms.
    pub fn has(&self, kind: DpoLossType) -> bool {
        self.terms.iter().any(|(t, _)| *t == kind)
    }

    /// The summed weight of the `sft` terms (0 without one).
    pub fn sft_weight(&self) -> f64 {
        self.terms
            .iter()
            .filter(|(t, _)| *t == DpoLossType::Sft)
            .map(|(_, w)| w)
            .sum()
    }

    /// `name` or `w*name+…` for the run record and messages.
    pub fn describe(&self) -> String {
        let terms: Vec<String> = self
            .terms
            .iter()
            .map(|(t, w)| match *w == 1.0 {
                true => t.name().to_string(),
                false => format!("{w}*{}", t.name()),
            })
            .collect();
        terms.join("+")
    }
}

/// A batch's pairs as the per-pair losses read them: `[P]` tensors, the policy's differentiable.
pub(crate) struct Pairs {
    /// π_c and π_r: the policy's summed log-probs.
    pub chosen: Tensor,
    pub rejected: Tensor,
    /// ρ_c and ρ_r: the reference's.
    pub ref_chosen: Tensor,
    pub ref_rejected: Tensor,
    /// Completion tokens of each chosen and rejected row.
    pub chosen_tokens: Tensor,
    pub rejected_tokens: Tensor,
    pub beta: f64,
}

/// `log σ(x)`, as `−softplus(−x)`.
pub(crate) fn log_sigmoid(x: &Tensor) -> Result<Tensor> {
    Ok(crate::dpo::softplus(&x.neg()?)?.neg()?)
}

/// `σ(x)`, as `exp(log σ(x))` (composed ops, so autograd has its backward).
pub(crate) fn sigmoid(x: &Tensor) -> Result<Tensor> {
    Ok(log_sigmoid(x)?.exp()?)
}

/// `t` sorted ascending along its one dimension, differentiably (a gather).
fn sorted(t: &Tensor) -> Result<Tensor> {
    let order = t.arg_sort_last_dim(true)?;
    Ok(t.index_select(&order, 0)?)
}

/// TRL's smoothed sigmoid of a margin `δ`: `−(1−ε)ls(βδ) − ε ls(−βδ)`.
fn smoothed_sigmoid(delta: &Tensor, beta: f64, eps: f64) -> Result<Tensor> {
    let x = (delta * beta)?;
    let chosen = (log_sigmoid(&x)? * -(1.0 - eps))?;
    let flipped = (log_sigmoid(&x.neg()?)? * eps)?;
    Ok((chosen - flipped)?)
}

/// The `[P]` losses of `kind` (any type but `sft`, which is no per-pair loss).
pub(crate) fn per_pair(kind: DpoLossType, p: &Pairs, loss: &DpoLoss) -> Result<Tensor> {
    use DpoLossType as T;
    let beta = p.beta;
    let eps = loss.label_smoothing;
    let c = (&p.chosen - &p.ref_chosen)?;
    let r = (&p.rejected - &p.ref_rejected)?;
    let z = (&c - &r)?;
    let bz = (&z * beta)?;
    let averaged =
        || -> Result<Tensor> { Ok(((&c / &p.chosen_tokens)? - (&r / &p.rejected_tokens)?)?) };
    Ok(match kind {
        T::Sigmoid => log_sigmoid(&bz)?.neg()?,
        T::Hinge => (1.0 - bz)?.relu()?,
        T::Ipo => (averaged()? - 1.0 / (2.0 * beta))?.sqr()?,
        T::ExoPair => {
            // TRL makes ε a float32 tensor: its logs are float32 constants.
            let eps32 = eps as f32;
            let (log_keep, log_eps) = ((-eps32).ln_1p() as f64, eps32.ln() as f64);
            let keep = (sigmoid(&bz)? * (log_sigmoid(&bz)? - log_keep)?)?;
            let flip = (sigmoid(&bz.neg()?)? * (log_sigmoid(&bz.neg()?)? - log_eps)?)?;
            (keep + flip)?
        }
        T::NcaPair => {
            let bc = (&c * beta)?;
            let br = (&r * beta)?;
            ((log_sigmoid(&bc)?.neg()? - (log_sigmoid(&bc.neg()?)? * 0.5)?)?
                - (log_sigmoid(&br.neg()?)? * 0.5)?)?
        }
        T::Robust => {
            let chosen = (log_sigmoid(&bz)? * -(1.0 - eps))?;
            ((chosen + (log_sigmoid(&bz.neg()?)? * eps)?)? / (1.0 - 2.0 * eps))?
        }
        T::BcoPair => (log_sigmoid(&(&c * beta)?)?.neg()? - log_sigmoid(&(&r * -beta)?)?)?,
        T::SppoHard => {
            let half = 0.5 / beta;
            ((&c - half)?.sqr()? + (&r + half)?.sqr()?)?
        }
        T::Aot => {
            let policy = (&p.chosen - &p.rejected)?;
            let reference = (&p.ref_chosen - &p.ref_rejected)?;
            smoothed_sigmoid(&(sorted(&policy)? - sorted(&reference)?)?, beta, eps)?
        }
        T::AotUnpaired => smoothed_sigmoid(&(sorted(&c)? - sorted(&r)?)?, beta, eps)?,
        T::ApoZero => ((1.0 - sigmoid(&(&c * beta)?)?)? + sigmoid(&(&r * beta)?)?)?,
        T::ApoDown => ((sigmoid(&(&c * beta)?)? + 1.0)? - sigmoid(&bz)?)?,
        T::Discopop => {
            let m = sigmoid(&(&bz / loss.discopop_tau)?)?;
            let logistic = (log_sigmoid(&bz)?.neg()? * (1.0 - &m)?)?;
            (logistic + (bz.neg()?.exp()? * m)?)?
        }
        T::SigmoidNorm => log_sigmoid(&(averaged()? * beta)?)?.neg()?,
        T::Sft => {
            return Err(ObjectiveError::Loss(
                "sft is the chosen completions' mean NLL, not a per-pair loss".into(),
            ))
        }
    })
}
