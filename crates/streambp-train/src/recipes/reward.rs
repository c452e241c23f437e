//! The reward-model recipe (TRL's `RewardTrainer`): a Bradley-Terry model trained on preference
//! pairs, each row's reward the score head's output at its last non-pad token, through the shared
//! pair loop ([`super::pairs`]). A `*ForSequenceClassification` model (one label) trains as it is;
//! a causal LM gets a fresh score head (seeded by `--seed`) in place of its LM head, as transformers'
//! `AutoModelForSequenceClassification` gives it, and its checkpoints are saved as the classifier.
//! A `margin` column (on every pair) asks each chosen reward to beat the rejected one by it.

use streambp_objectives::{pooled_positions, Objective, RewardModel};

use super::pairs::{train_on_pairs, PairBatch, PairJob};
use crate::config::{Recipe, TrainConfig};
use crate::setup::Setup;
use crate::trainer::Summary;
use crate::Result;

/// The reward model's part of the pair loop: the pad token rows are read by, and the centring.
struct RewardJob {
    pad: u32,
    center: Option<f64>,
}

impl PairJob for RewardJob {
    fn averaged(&self) -> bool {
        false
    }

    fn objective(&self, batch: &PairBatch) -> Result<Box<dyn Objective>> {
        let ids = &batch.rows.input_ids;
        let t = ids.first().map(Vec::len).unwrap_or(0);
        let (_, device) = batch.vocab_and_device();
        let mut reward = RewardModel::new(&pooled_positions(ids, self.pad), t, device)?;
        if let Some(margins) = &batch.margins {
            reward = reward.with_margins(margins)?;
        }
        if let Some(c) = self.center {
            reward = reward.with_center(c)?;
        }
        Ok(Box::new(reward))
    }
}

/// Trains a reward model on preference pairs (the built-in pairs by default, from the shipped SFT
/// checkpoint given a fresh score head).
pub fn run_reward(cfg: &TrainConfig) -> Result<Summary> {
    // The setup gives a causal LM its score head (before any adapters) and the tokenizer's pad token.
    let setup = Setup::new(cfg, Recipe::Reward)?;
    let job = RewardJob {
        pad: setup.tokenizer.pad_id,
        center: cfg.center_rewards_coefficient,
    };
    train_on_pairs(cfg, Recipe::Reward, &setup, &job)
}
