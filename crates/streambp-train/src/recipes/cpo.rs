//! The CPO recipe (TRL's `CPOTrainer`, which SimPO and AlphaPO run through): preference pairs without
//! a reference model, a loss on the policy's own margin plus `cpo_alpha ×` the chosen completions'
//! NLL, through the shared pair loop ([`super::pairs`]).

use streambp_objectives::{Cpo, CpoLoss, Objective};

use super::pairs::{train_on_pairs, PairBatch, PairJob};
use crate::config::{Recipe, TrainConfig};
use crate::setup::Setup;
use crate::trainer::Summary;
use crate::Result;

/// CPO's part of the pair loop: β and the loss.
struct CpoJob {
    beta: f64,
    loss: CpoLoss,
}

impl PairJob for CpoJob {
    fn averaged(&self) -> bool {
        self.loss.loss_type.averaged()
    }

    fn objective(&self, batch: &PairBatch) -> Result<Box<dyn Objective>> {
        let (vocab, device) = batch.vocab_and_device();
        let cpo = Cpo::new(&batch.rows.labels, self.beta, self.loss, vocab, device)?;
        let pooled = match self.loss.cpo_alpha == 0.0 {
            true => None,
            false => batch.pooled_nll_tokens(cpo.nll_tokens()?)?,
        };
        Ok(match pooled {
            Some(tokens) => Box::new(cpo.with_nll_tokens(tokens)?),
            None => Box::new(cpo),
        })
    }
}

/// Trains `cfg`'s model on preference pairs with CPO, SimPO or AlphaPO as `cfg.cpo_loss` says (the
/// built-in pairs by default).
pub fn run_cpo(cfg: &TrainConfig) -> Result<Summary> {
    let setup = Setup::new(cfg, Recipe::Cpo)?;
    let job = CpoJob {
        beta: cfg.beta,
        loss: cfg.cpo_loss,
    };
    train_on_pairs(cfg, Recipe::Cpo, &setup, &job)
}
