//! The ORPO recipe (TRL's `ORPOTrainer`): preference pairs without a reference model, the chosen
//! sequences' NLL plus β × the odds-ratio term, through the shared pair loop ([`super::pairs`]).

use streambp_objectives::{Objective, Orpo};

use super::pairs::{train_on_pairs, PairBatch, PairJob};
use crate::batch::masked_labels;
use crate::config::{Recipe, TrainConfig};
use crate::setup::Setup;
use crate::trainer::Summary;
use crate::Result;

/// ORPO's part of the pair loop: β.
struct OrpoJob {
    beta: f64,
}

impl PairJob for OrpoJob {
    fn averaged(&self) -> bool {
        true
    }

    fn objective(&self, batch: &PairBatch) -> Result<Box<dyn Objective>> {
        let (vocab, device) = batch.vocab_and_device();
        // TRL's ORPO NLL covers every real token of the chosen rows, prompt included.
        let rows = batch.rows;
        let every_token = masked_labels(&rows.input_ids, &rows.attention_mask);
        let orpo = Orpo::new(&batch.rows.labels, &every_token, self.beta, vocab, device)?;
        Ok(match batch.pooled_nll_tokens(orpo.nll_tokens()?)? {
            Some(tokens) => Box::new(orpo.with_nll_tokens(tokens)?),
            None => Box::new(orpo),
        })
    }
}

/// Trains `cfg`'s model on preference pairs with ORPO (the built-in pairs by default).
pub fn run_orpo(cfg: &TrainConfig) -> Result<Summary> {
    let setup = Setup::new(cfg, Recipe::Orpo)?;
    let job = OrpoJob { beta: cfg.beta };
    train_on_pairs(cfg, Recipe::Orpo, &setup, &job)
}
