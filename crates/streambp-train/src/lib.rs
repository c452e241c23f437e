//! The streambp trainer as a library: the training loops, the `grad` command and the pieces they share,
//! everything the `streambp-train` CLI runs. `examples/custom_loop.rs` is a training loop of one's own
//! over these parts in about 80 lines (`cargo run --release -p streambp-train --example custom_loop`),
//! `examples/data_parallel.rs` data parallelism over a `Communicator` of one's own.
//!
//! - Recipes: [`sft::run_sft`], [`dpo::run_dpo`] (and [`orpo::run_orpo`], [`cpo::run_cpo`] through
//!   the same pair loop, [`recipes::pairs`], as [`reward::run_reward`]), [`kto::run_kto`] and
//!   [`grpo::run_grpo`], each one loop over
//!   [`setup::Setup`] (model, tokenizer, data sources) and [`trainer::Trainer`] (the optimizer
//!   step, metrics, evaluation, checkpoints and resume), configured by
//!   [`config::TrainConfig`] / [`config::GrpoConfig`] (defaults in [`config::TrainConfig::defaults`], `--config`
//!   files in [`config_file`]).
//! - Data: [`data`] (TRL-style JSONL, packing), [`tokenizer`] and [`chat`] templates, [`batch`]
//!   (collation into engine tensors), [`logprobs`] (frozen-model log-probs), [`sampling`] and
//!   [`rewards`] (GRPO rollouts), [`generate`] and [`eval`] (held-out accuracy).
//! - Runs: [`optim`] (AdamW, clipping, schedules), [`checkpoint`] (atomic, resumable saves),
//!   [`output`] (the locked output directory), [`plots`] (SVG charts).
//! - [`grad::run_grad`]: one backward on a [`batch_file`], every gradient written under its HF name.
//! - [`TrainError`]: every error names the flag, file, line or path to fix.
//!
//! The backward is `streambp-core`'s, the model code `streambp-models`' and the loss formulas
//! `streambp-objectives`'; this crate knows no model family and runs no backward of its own.

#![warn(missing_docs)]

use std::path::{Path, PathBuf};

pub mod batch;
pub mod batch_file;
pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod config_file;
pub mod data;
pub mod dataset;
pub mod device;
pub mod entropy_control;
pub mod eval;
pub mod generate;
pub mod grad;
pub mod input_file;
pub mod logprobs;
pub mod metrics_log;
pub mod optim;
pub mod output;
pub mod parallel;
pub mod plots;
pub mod recipes;
pub mod rewards;
pub mod sampling;
pub mod setup;
pub mod teacher;
pub mod tensorboard;
pub mod token_store;
pub mod tokenizer;
pub mod trainer;

pub use recipes::{cpo, dpo, grpo, kto, orpo, reward, sft};

/// `["a", "b", "c"]` as "a, b and c" (one word as itself, none as "").
pub(crate) fn and_list(words: &[&str]) -> String {
    match words.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        _ => words.join(""),
    }
}

/// Typed errors of the trainer library: each variant says what went wrong and names the flag, file,
/// line or path a user has to fix.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A flag (or the configuration field it fills) outside its allowed range, or one that does not
    /// apply to this run.
    #[error("{flag}{}: {expected}", if value.is_empty() { String::new() } else { format!(" {value}") })]
    Flag {
        /// The flag as typed, e.g. `--lr`.
        flag: String,
        /// The value given.
        value: String,
        /// The allowed range or the reason it does not apply.
        expected: String,
    },
    /// A data file, or one of its rows: `location` is the file, with its line where there is one.
    #[error("{location}: {reason}")]
    Data {
        /// `file` or `file:line`.
        location: String,
        /// What is wrong there.
        reason: String,
    },
    /// A batch file of the `grad` command.
    #[error("{path}: {reason}")]
    BatchFile {
        /// The batch file.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A file or directory that could not be read, written or created.
    #[error("cannot {action} {}: {error}", path.display())]
    Io {
        /// What was being done: `read`, `write`, `create`, `remove`…
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        error: std::io::Error,
    },
    /// A checkpoint that cannot be resumed from, or does not belong to the run resuming it.
    #[error("{0}")]
    Checkpoint(String),
    /// A tokenizer or chat template that cannot do what the data asks.
    #[error("{0}")]
    Tokenizer(String),
    /// A `--config` TOML file that does not hold flags.
    #[error("{path}: {reason}")]
    ConfigFile {
        /// The TOML file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A reference model that does not fit the policy it scores.
    #[error("{0}")]
    Reference(String),
    /// The loss of a step is not a number; the step was not applied.
    #[error("loss is {loss} at step {step}; stopped without updating. Last good checkpoint: {last_good}")]
    NonFiniteLoss {
        /// The loss (NaN or infinite).
        loss: f64,
        /// The step, counted from 1.
        step: usize,
        /// The newest checkpoint this run saved, or `none yet`.
        last_good: String,
    },
    /// A broken invariant of the trainer itself (a bug, not the input).
    #[error("internal error: {0}")]
    Internal(String),
    /// From the backward engine or its chunk planner.
    #[error(transparent)]
    Engine(#[from] streambp_core::EngineError),
    /// From loading, resolving or running a model.
    #[error(transparent)]
    Model(#[from] streambp_models::ModelError),
    /// From building or evaluating an objective.
    #[error(transparent)]
    Objective(#[from] streambp_objectives::ObjectiveError),
    /// From a candle tensor op.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A collective between the ranks of a data-parallel job failed (a rank died, or the
    /// communication library did).
    #[error("collective between ranks: {0}")]
    Collective(#[from] streambp_dist::DistError),
}

impl TrainError {
    /// A flag outside its range.
    pub fn flag(flag: &str, value: impl std::fmt::Display, expected: impl Into<String>) -> Self {
        Self::Flag {
            flag: flag.to_string(),
            value: value.to_string(),
            expected: expected.into(),
        }
    }

    /// A data problem at `location` (a file, with its line).
    pub fn data(location: impl std::fmt::Display, reason: impl Into<String>) -> Self {
        Self::Data {
            location: location.to_string(),
            reason: reason.into(),
        }
    }

    /// An I/O error on `path`, saying what was being done.
    pub fn io<'a>(
        action: &'static str,
        path: &'a Path,
    ) -> impl FnOnce(std::io::Error) -> Self + 'a {
        move |error| Self::Io {
            action,
            path: path.to_path_buf(),
            error,
        }
    }

    /// Whether the error is in how the command was called (exit status 2, like a flag clap rejects).
    pub fn is_usage(&self) -> bool {
        matches!(self, Self::Flag { .. } | Self::ConfigFile { .. })
    }
}

/// `Result` with [`TrainError`].
pub type Result<T> = std::result::Result<T, TrainError>;
