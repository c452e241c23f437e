//! The DPO recipe (TRL's loss types, sigmoid by default): pairs of completions of one prompt against
//! a frozen reference model (default: a copy of the initial policy, as in TRL), through the shared
//! pair loop ([`super::pairs`]).

use streambp_models::Model;
use streambp_objectives::{Dpo, DpoLoss, DpoLossType, Objective};

use super::pairs::{train_on_pairs, PairBatch, PairJob};
use crate::config::{Recipe, TrainConfig};
use crate::setup::Setup;
use crate::trainer::Summary;
use crate::{Result, TrainError};

/// DPO's part of the pair loop: the reference, β and the loss.
struct DpoJob {
    reference: Model,
    beta: f64,
    loss: DpoLoss,
}

impl PairJob for DpoJob {
    fn reference(&self) -> Option<&Model> {
        Some(&self.reference)
    }

    fn averaged(&self) -> bool {
        false
    }

    fn objective(&self, batch: &PairBatch) -> Result<Box<dyn Objective>> {
        let n = batch.pairs();
        let reference = batch
            .reference_logps
            .as_deref()
            .ok_or_else(|| TrainError::Internal("DPO's micro-batch came unscored".into()))?;
        let (vocab, device) = batch.vocab_and_device();
        let labels = &batch.rows.labels;
        let dpo = Dpo::new(
            labels,
            &reference[..n],
            &reference[n..],
            self.beta,
            vocab,
            device,
        )?
        .with_loss(self.loss.clone())?;
        // The NLL is a mean over the whole micro-batch's chosen tokens, whichever rank holds them.
        let pooled = match self.loss.has(DpoLossType::Sft) {
            true => batch.pooled_nll_tokens(dpo.chosen_tokens()?)?,
            false => None,
        };
        Ok(match pooled {
            Some(tokens) => Box::new(dpo.with_nll_tokens(tokens)?),
            None => Box::new(dpo),
        })
    }
}

/// Trains `cfg`'s model on preference pairs against a frozen reference (the built-in pairs by
/// default, from the shipped SFT checkpoint).
pub fn run_dpo(cfg: &TrainConfig) -> Result<Summary> {
    let setup = Setup::new(cfg, Recipe::Dpo)?;
    let (reference, frozen) = setup.reference(cfg)?;
    let cfg = &TrainConfig {
        frozen,
        ..cfg.clone()
    };
    let job = DpoJob {
        reference,
        beta: cfg.beta,
        loss: cfg.dpo_loss_with_sft(),
    };
    train_on_pairs(cfg, Recipe::Dpo, &setup, &job)
}
