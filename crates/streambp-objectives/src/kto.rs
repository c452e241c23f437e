//! KTO (Ethayarajh et al., 2024) as TRL's `KTOTrainer` computes it: unpaired rows, each a desirable
//! or an undesirable completion of its prompt. With `r` a row's log-ratio against a frozen reference
//! (completion log-probs summed, `π − ρ`), `β`, and the KL baseline `z`:
//!
//! | `loss_type` | desirable row | undesirable row |
//! |---|---|---|
//! | `kto` | `1 − σ(β(r − z))` | `1 − σ(β(z − r))` |
//! | `apo_zero_unpaired` | `1 − σ(βr)` | `σ(βr)` |
//!
//! each times `desirable_weight` or `undesirable_weight`, and the loss is their mean over *all* rows.
//! `z` is a constant here: the recipe estimates it as TRL does (the policy's and the reference's
//! log-probs of mismatched prompt/completion pairs, their mean difference over the micro-batch,
//! detached and clamped at 0); `apo_zero_unpaired` has none (`z = 0`). Both types are
//! `1 − σ(sβ(r − z))` with `s = ±1` by the row's kind.

use std::ops::Range;

use candle_core::{DType, Device, Tensor};

use crate::checks::{check_all_positions, check_beta, check_finite};
use crate::dpo_loss::sigmoid;
use crate::{Objective, ObjectiveError, Result, TokenTargets};

/// One of TRL's KTO loss types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KtoLossType {
    /// KTO itself, with the KL baseline.
    Kto,
    /// APO-zero on unpaired rows (no KL baseline).
    ApoZeroUnpaired,
}

impl KtoLossType {
    /// TRL's name of the type.
    pub fn name(self) -> &'static str {
        match self {
            Self::Kto => "kto",
            Self::ApoZeroUnpaired => "apo_zero_unpaired",
        }
    }

    /// Whether the type reads the KL baseline (TRL's `calculate_KL`).
    pub fn uses_kl(self) -> bool {
        self == Self::Kto
    }
}

impl crate::LossSettings for KtoLossType {
    const TYPES: &'static [Self] = &[Self::Kto, Self::ApoZeroUnpaired];
    const SETTINGS: &'static [&'static str] = &[];
    fn type_name(self) -> &'static str {
        self.name()
    }
    fn reads(self, _: &str) -> bool {
        true
    }
}

impl std::str::FromStr for KtoLossType {
    type Err = ObjectiveError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "kto" => Ok(Self::Kto),
            "apo_zero_unpaired" => Ok(Self::ApoZeroUnpaired),
            other => Err(ObjectiveError::Loss(format!(
                "unknown KTO loss type {other:?}: expected kto or apo_zero_unpaired"
            ))),
        }
    }
}

/// KTO's settings, as TRL's `KTOConfig` names them (β is the objective's own argument).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KtoLoss {
    /// The per-row loss.
    pub loss_type: KtoLossType,
    /// The weight of desirable rows (above 0).
    pub desirable_weight: f64,
    /// The weight of undesirable rows (above 0).
    pub undesirable_weight: f64,
}

impl Default for KtoLoss {
    /// TRL's defaults: `kto`, both weights 1.
    fn default() -> Self {
        Self {
            loss_type: KtoLossType::Kto,
            desirable_weight: 1.0,
            undesirable_weight: 1.0,
        }
    }
}

impl KtoLoss {
    /// The loss TRL's `KTOConfig` fields say, TRL's defaults for those not given (unchecked: see
    /// [`KtoLoss::validate`]).
    pub fn from_config(
        loss_type: Option<KtoLossType>,
        desirable_weight: Option<f64>,
        undesirable_weight: Option<f64>,
    ) -> Self {
        let d = Self::default();
        Self {
            loss_type: loss_type.unwrap_or(d.loss_type),
            desirable_weight: desirable_weight.unwrap_or(d.desirable_weight),
            undesirable_weight: undesirable_weight.unwrap_or(d.undesirable_weight),
        }
    }

    /// Refuses weights that are not finite and above 0.
    pub fn validate(&self) -> Result<()> {
        for (name, w) in [
            ("desirable_weight", self.desirable_weight),
            ("undesirable_weight", self.undesirable_weight),
        ] {
            if !w.is_finite() || w <= 0.0 {
                return Err(ObjectiveError::Loss(format!(
                    "{name} must be a number above 0, got {w}"
                )));
            }
        }
        Ok(())
    }
}

/// The KTO objective of one batch of unpaired rows.
#[derive(Debug, Clone)]
pub struct Kto {
    targets: TokenTargets,
    /// Each row's kind: desirable (true) or not.
    desirable: Vec<bool>,
    /// `[B]`: the reference's summed completion log-probs `ρ`.
    reference: Tensor,
    /// The KL baseline `z` (0 for `apo_zero_unpaired`).
    kl: f64,
    beta: f64,
    loss: KtoLoss,
}

impl Kto {
    /// `labels`: the rows' completion labels (HF-style); `desirable`: each row's kind; `reference`:
    /// the reference's summed completion log-prob of each row; `kl`: the baseline `z` (at least 0;
    /// ignored by `apo_zero_unpaired`).
    pub fn new(
        labels: &[Vec<i64>],
        desirable: &[bool],
        reference: &[f64],
        kl: f64,
        beta: f64,
        loss: KtoLoss,
        (vocab_size, device): (usize, &Device),
    ) -> Result<Self> {
        check_beta(beta)?;
        loss.validate()?;
        if desirable.len() != labels.len() || reference.len() != labels.len() {
            return Err(ObjectiveError::Batch(format!(
                "{} label rows, {} desirable flags and {} reference log-probs: one each per row",
                labels.len(),
                desirable.len(),
                reference.len()
            )));
        }
        check_finite("reference log-prob", reference)?;
        if !kl.is_finite() || kl < 0.0 {
            return Err(ObjectiveError::Batch(format!(
                "the KL baseline must be a number at least 0, got {kl}"
            )));
        }
        let targets = TokenTargets::from_labels(labels, vocab_size, device)?;
        if let Some(row) = targets.rows_without_target().first() {
            return Err(ObjectiveError::Batch(format!(
                "row {row} has no completion token"
            )));
        }
        let rows = labels.len();
        Ok(Self {
            targets,
            desirable: desirable.to_vec(),
            reference: Tensor::from_vec(reference.to_vec(), rows, device)?,
            kl: if loss.loss_type.uses_kl() { kl } else { 0.0 },
            beta,
            loss,
        })
    }

    /// `π` per row (`[B]`): the completion's summed log-prob.
    fn sequence_logps(&self, logp: &Tensor) -> Result<Tensor> {
        Ok((logp * self.targets.mask.to_dtype(logp.dtype())?)?.sum(1)?)
    }

    /// `r = π − ρ` per row (`[B]`) from the rows' `π`.
    fn log_ratios(&self, policy: &Tensor) -> Result<Tensor> {
        Ok((policy - self.reference.to_dtype(policy.dtype())?)?)
    }

    /// A per-row constant: `desirable` for desirable rows, `undesirable` for the others.
    fn by_kind(&self, desirable: f64, undesirable: f64, like: &Tensor) -> Result<Tensor> {
        let values: Vec<f64> = self
            .desirable
            .iter()
            .map(|&d| if d { desirable } else { undesirable })
            .collect();
        let n = values.len();
        Ok(Tensor::from_vec(values, n, like.device())?.to_dtype(like.dtype())?)
    }
}

impl Objective for Kto {
    fn name(&self) -> &str {
        "kto"
    }

    fn targets(&self) -> &Tensor {
        &self.targets.ids
    }

    fn separable(&self) -> bool {
        false
    }

    fn loss(&self, logp: &Tensor, cols: Range<usize>) -> Result<Tensor> {
        check_all_positions("KTO", &cols, &self.targets.ids)?;
        let r = self.log_ratios(&self.sequence_logps(logp)?)?;
        let sign = self.by_kind(self.beta, -self.beta, &r)?;
        let per_row = (1.0 - sigmoid(&((r - self.kl)? * sign)?)?)?;
        let weights = self.by_kind(
            self.loss.desirable_weight,
            self.loss.undesirable_weight,
            &per_row,
        )?;
        Ok((per_row * weights)?.mean_all()?)
    }

    fn metrics(&self, logp: &Tensor) -> Result<Vec<(String, f64)>> {
        let policy = self.sequence_logps(logp)?;
        let r = self
            .log_ratios(&policy)?
            .to_dtype(DType::F64)?
            .to_vec1::<f64>()?;
        let policy = policy.to_dtype(DType::F64)?.to_vec1::<f64>()?;
        // As TRL logs them: each kind's mean (β r, π), where the batch has rows of that kind.
        let mean_of = |values: &[f64], kind: bool| -> Option<f64> {
            let picked: Vec<f64> = values
                .iter()
                .zip(&self.desirable)
                .filter(|(_, &d)| d == kind)
                .map(|(v, _)| *v)
                .collect();
            (!picked.is_empty()).then(|| picked.iter().sum::<f64>() / picked.len() as f64)
        };
        let rewards: Vec<f64> = r.iter().map(|v| self.beta * v).collect();
        let mut metrics = vec![("kl".to_string(), self.kl)];
        let (chosen, rejected) = (mean_of(&rewards, true), mean_of(&rewards, false));
        for (name, value) in [
            ("rewards/chosen", chosen),
            ("rewards/rejected", rejected),
            ("logps/chosen", mean_of(&policy, true)),
            ("logps/rejected", mean_of(&policy, false)),
        ] {
            metrics.extend(value.map(|v| (name.to_string(), v)));
        }
        if let (Some(c), Some(r)) = (chosen, rejected) {
            metrics.push(("rewards/margins".into(), c - r));
        }
        Ok(metrics)
    }
}
