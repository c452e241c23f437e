//! The training jobs, each one readable loop in its own file, and the one table of what else
//! differs between them ([`RecipeFacts`]): the flags only some jobs take, β's default and range, the
//! built-in task's settings and the settings a checkpoint records. A new job is its loop's file, a
//! [`Recipe`] variant, its row in the table and its subcommand.

pub mod cpo;
pub mod dpo;
pub mod grpo;
pub mod kto;
pub mod orpo;
pub mod pairs;
pub mod reward;
pub mod sft;

use crate::checkpoint::RunRecord;
use crate::config::{BuiltinModel, TrainConfig};
use crate::{Result, TrainError};

/// The training jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recipe {
    /// Supervised fine-tuning (`sft.rs`).
    Sft,
    /// Direct preference optimisation (`dpo.rs`).
    Dpo,
    /// Group relative policy optimisation (`grpo.rs`).
    Grpo,
    /// Odds ratio preference optimisation, no reference model (`orpo.rs`).
    Orpo,
    /// Contrastive preference optimisation and SimPO/AlphaPO, no reference model (`cpo.rs`).
    Cpo,
    /// Kahneman-Tversky optimisation on unpaired rows (`kto.rs`).
    Kto,
    /// A Bradley-Terry reward model (`reward.rs`).
    Reward,
    /// REINFORCE leave-one-out on sampled completions (`grpo.rs`, with GRPO).
    Rloo,
    /// On-policy distillation from a teacher on the student's sampled completions (`grpo.rs`).
    Distill,
}

/// What `--beta` is to a job.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Beta {
    /// The job has no β.
    Unused,
    /// A scale of the loss's margin that must be above 0 (DPO's), with its default.
    Positive(f64),
    /// A weight that may be 0 (GRPO's KL term), with its default.
    NonNegative(f64),
    /// A mixing weight in [0, 1] (distillation's divergence), with its default.
    UnitInterval(f64),
}

/// One job's row of the table.
pub struct RecipeFacts {
    /// The job.
    pub recipe: Recipe,
    /// The subcommand's name.
    pub name: &'static str,
    /// The flags among [`JOB_FLAGS`] this job takes (the others are refused, naming the jobs that
    /// take them).
    pub flags: &'static [&'static str],
    /// Its β.
    pub beta: Beta,
    /// The built-in task's run of this job: its settings over the task's shared ones.
    pub builtin: fn(TrainConfig) -> TrainConfig,
    /// The settings of this job's own that a checkpoint records (beyond every job's).
    pub record: fn(&TrainConfig, &mut RunRecord),
}

/// RLOO's default β, as TRL's `RLOOConfig`.
pub const RLOO_BETA: f64 = 0.05;

/// DPO's default β, as TRL's `DPOConfig`.
pub const DPO_BETA: f64 = 0.1;

/// The flags some jobs take and others refuse.
pub const JOB_FLAGS: &[&str] = &[
    "--beta",
    "--sft-weight",
    "--ref-model",
    "--dataset-text-field",
    "--packing",
    "--loss-type",
    "--label-smoothing",
    "--cpo-alpha",
    "--simpo-gamma",
    "--alphapo-alpha",
    "--desirable-weight",
    "--undesirable-weight",
    "--center-rewards-coefficient",
];

/// Every job's row, in [`Recipe`]'s order.
static RECIPES: [RecipeFacts; 9] = [
    RecipeFacts {
        recipe: Recipe::Sft,
        name: "sft",
        // TRL's SFTTrainer alone packs, and reads a text column.
        flags: &["--dataset-text-field", "--packing"],
        beta: Beta::Unused,
        builtin: |task| TrainConfig {
            max_steps: Some(600),
            batch_size: 64,
            lr: 5e-3,
            warmup_steps: 20,
            ..task
        },
        record: |_, _| {},
    },
    RecipeFacts {
        recipe: Recipe::Dpo,
        name: "dpo",
        flags: &[
            "--beta",
            "--sft-weight",
            "--ref-model",
            "--loss-type",
            "--label-smoothing",
        ],
        beta: Beta::Positive(DPO_BETA),
        // Refines the shipped SFT checkpoint with TRL's sigmoid + SFT loss, which keeps the correct
        // answers likely.
        builtin: |task| TrainConfig {
            builtin_model: BuiltinModel::Sft,
            max_steps: Some(300),
            batch_size: 32,
            lr: 2e-4,
            sft_weight: 1.0,
            ..task
        },
        record: |cfg, run| {
            run.insert("--beta".into(), cfg.beta.into());
            run.insert("--sft-weight".into(), cfg.sft_weight.into());
            run.insert("--ref-model".into(), cfg.ref_model.clone().into());
            let loss = &cfg.dpo_loss;
            run.insert("--loss-type".into(), loss.describe().into());
            run.insert("--label-smoothing".into(), loss.label_smoothing.into());
            run.insert("--discopop-tau".into(), loss.discopop_tau.into());
        },
    },
    RecipeFacts {
        recipe: Recipe::Grpo,
        name: "grpo",
        flags: &["--beta"],
        // The KL weight is 0 by default, as in TRL.
        beta: Beta::NonNegative(0.0),
        // Refines the shipped SFT checkpoint on the exact-answer reward (measured to raise held-out
        // exact match, as TRL's GRPOTrainer does on the same settings): 32 prompts a step, a small
        // constant learning rate.
        builtin: |task| TrainConfig {
            builtin_model: BuiltinModel::Sft,
            max_steps: Some(300),
            batch_size: 32,
            lr: 3e-5,
            warmup_steps: 0,
            schedule: crate::optim::Schedule::Constant,
            ..task
        },
        // GRPO's own settings (group, sampling, loss) are recorded by its loop.
        record: |cfg, run| {
            run.insert("--beta".into(), cfg.beta.into());
        },
    },
    RecipeFacts {
        recipe: Recipe::Orpo,
        name: "orpo",
        flags: &["--beta"],
        beta: Beta::Positive(DPO_BETA),
        builtin: preference_builtin,
        record: |cfg, run| {
            run.insert("--beta".into(), cfg.beta.into());
        },
    },
    RecipeFacts {
        recipe: Recipe::Cpo,
        name: "cpo",
        flags: &[
            "--beta",
            "--loss-type",
            "--label-smoothing",
            "--cpo-alpha",
            "--simpo-gamma",
            "--alphapo-alpha",
        ],
        beta: Beta::Positive(DPO_BETA),
        builtin: preference_builtin,
        record: |cfg, run| {
            let loss = &cfg.cpo_loss;
            run.insert("--beta".into(), cfg.beta.into());
            run.insert("--loss-type".into(), loss.loss_type.name().into());
            run.insert("--label-smoothing".into(), loss.label_smoothing.into());
            run.insert("--cpo-alpha".into(), loss.cpo_alpha.into());
            run.insert("--simpo-gamma".into(), loss.simpo_gamma.into());
            run.insert("--alphapo-alpha".into(), loss.alpha.into());
        },
    },
    RecipeFacts {
        recipe: Recipe::Kto,
        name: "kto",
        flags: &[
            "--beta",
            "--ref-model",
            "--loss-type",
            "--desirable-weight",
            "--undesirable-weight",
        ],
        beta: Beta::Positive(DPO_BETA),
        builtin: preference_builtin,
        record: |cfg, run| {
            let loss = &cfg.kto_loss;
            run.insert("--beta".into(), cfg.beta.into());
            run.insert("--ref-model".into(), cfg.ref_model.clone().into());
            run.insert("--loss-type".into(), loss.loss_type.name().into());
            run.insert("--desirable-weight".into(), loss.desirable_weight.into());
            run.insert(
                "--undesirable-weight".into(),
                loss.undesirable_weight.into(),
            );
        },
    },
    RecipeFacts {
        recipe: Recipe::Reward,
        name: "reward",
        flags: &["--center-rewards-coefficient"],
        beta: Beta::Unused,
        // The fresh score head needs a larger step than the preference jobs' refinements.
        builtin: |task| TrainConfig {
            lr: 1e-3,
            ..preference_builtin(task)
        },
        record: |cfg, run| {
            let c = cfg.center_rewards_coefficient;
            run.insert("--center-rewards-coefficient".into(), c.into());
        },
    },
    RecipeFacts {
        recipe: Recipe::Rloo,
        name: "rloo",
        flags: &["--beta"],
        // The KL weight in the reward, TRL's RLOOConfig default.
        beta: Beta::NonNegative(RLOO_BETA),
        // GRPO's built-in run (the shipped SFT checkpoint refined on the exact-answer reward).
        builtin: |task| (RECIPES[Recipe::Grpo as usize].builtin)(task),
        // RLOO's own settings are recorded by its loop.
        record: |cfg, run| {
            run.insert("--beta".into(), cfg.beta.into());
        },
    },
    RecipeFacts {
        recipe: Recipe::Distill,
        name: "distill",
        flags: &["--beta"],
        // TRL's DistillationConfig: the reverse KL.
        beta: Beta::UnitInterval(1.0),
        // A randomly initialised student learns the shipped SFT checkpoint's answers from its
        // distributions on the student's own completions: SFT's run, longer.
        builtin: |task| TrainConfig {
            max_steps: Some(DISTILL_BUILTIN_STEPS),
            ..(RECIPES[Recipe::Sft as usize].builtin)(task)
        },
        // The teacher and sampling settings are recorded by its loop.
        record: |cfg, run| {
            run.insert("--beta".into(), cfg.beta.into());
        },
    },
];

/// Steps of the built-in distillation run.
const DISTILL_BUILTIN_STEPS: usize = 1000;

/// The built-in task's run of the other preference jobs: DPO's, from the shipped SFT checkpoint on
/// the same pairs (KTO's unpaired).
fn preference_builtin(task: TrainConfig) -> TrainConfig {
    TrainConfig {
        builtin_model: BuiltinModel::Sft,
        max_steps: Some(300),
        batch_size: 32,
        lr: 2e-4,
        ..task
    }
}

impl Recipe {
    /// Every job, in the table's order.
    pub const ALL: [Recipe; 9] = [
        Recipe::Sft,
        Recipe::Dpo,
        Recipe::Grpo,
        Recipe::Orpo,
        Recipe::Cpo,
        Recipe::Kto,
        Recipe::Reward,
        Recipe::Rloo,
        Recipe::Distill,
    ];

    /// This job's row of the table.
    pub fn facts(self) -> &'static RecipeFacts {
        &RECIPES[self as usize]
    }

    /// The subcommand's name: `sft`, `dpo`, `grpo`, `orpo`, `cpo`, `kto`, `reward`, `rloo` or
    /// `distill`.
    pub fn name(self) -> &'static str {
        self.facts().name
    }

    /// Refuses the first of `given` (flags of [`JOB_FLAGS`] a run sets) that this job does not take,
    /// naming the jobs that do.
    pub fn check_job_flags(self, given: &[&str]) -> Result<()> {
        for flag in given {
            if self.facts().flags.contains(flag) {
                continue;
            }
            let takers: Vec<&str> = Recipe::ALL
                .iter()
                .filter(|r| r.facts().flags.contains(flag))
                .map(|r| r.name())
                .collect();
            let takers = match takers.is_empty() {
                true => "no job".to_string(),
                false => crate::and_list(&takers),
            };
            return Err(TrainError::flag(
                flag,
                "",
                format!("applies to {takers} only, not {}", self.name()),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table's rows are in `Recipe`'s order, and every job flag is some job's.
    #[test]
    fn the_table_is_in_order_and_every_job_flag_has_a_job() {
        for recipe in Recipe::ALL {
            assert_eq!(recipe.facts().recipe, recipe);
        }
        for flag in JOB_FLAGS {
            assert!(
                Recipe::ALL.iter().any(|r| r.facts().flags.contains(flag)),
                "{flag}"
            );
        }
        for recipe in Recipe::ALL {
            for flag in recipe.facts().flags {
                assert!(JOB_FLAGS.contains(flag), "{flag} of {}", recipe.name());
            }
        }
        let refused = Recipe::Sft.check_job_flags(&["--packing", "--beta"]);
        let message = refused.unwrap_err().to_string();
        assert_eq!(
            message,
            "--beta: applies to dpo, grpo, orpo, cpo, kto, rloo and distill only, not sft"
        );
        assert!(Recipe::Grpo.check_job_flags(&["--beta"]).is_ok());
    }
}
