//! The streambp trainer as a library: batch files, the `grad` command, and (soon) the training loops
//! the CLI runs.

pub mod batch_file;
pub mod chat;
pub mod checkpoint;
pub mod config_file;
pub mod data;
pub mod device;
pub mod dpo;
pub mod generate;
pub mod grad;
pub mod grpo;
pub mod optim;
pub mod recipe;
pub mod rewards;
pub mod sampling;
pub mod sft;
pub mod tokenizer;

/// Typed errors of the trainer library.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("{path}: {reason}")]
    BatchFile { path: String, reason: String },
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Engine(#[from] streambp_core::EngineError),
    #[error(transparent)]
    Model(#[from] streambp_models::ModelError),
    #[error(transparent)]
    Objective(#[from] streambp_objectives::ObjectiveError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

pub type Result<T> = std::result::Result<T, TrainError>;
