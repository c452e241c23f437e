//! Typed errors of the model crate. Every variant names the file (and tensor) it is about, so a user
//! with a broken checkpoint knows what to fix without reading a backtrace.

use std::path::PathBuf;

/// Anything that can go wrong building or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot read {path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },

    #[error("cannot write {path}: {reason}")]
    Write { path: PathBuf, reason: String },

    #[error("{path}: invalid config: {reason}")]
    Config { path: PathBuf, reason: String },

    #[error(
        "{path}: unknown model_type {model_type:?} (supported: qwen2, qwen3, llama, gemma3_text, gemma3)"
    )]
    UnknownModelType { path: PathBuf, model_type: String },

    #[error(
        "{path}: no model.safetensors and no model.safetensors.index.json in the model directory"
    )]
    NoWeights { path: PathBuf },

    #[error("{path}: not a valid safetensors file (truncated or corrupt?): {reason}")]
    BadSafetensors { path: PathBuf, reason: String },

    #[error("tensor {name:?} is missing from the checkpoint (looked in {files})")]
    MissingTensor { name: String, files: String },

    #[error(
        "tensor {name:?} in {path} has shape {found:?}, expected {expected:?} from config.json"
    )]
    ShapeMismatch {
        name: String,
        path: PathBuf,
        expected: Vec<usize>,
        found: Vec<usize>,
    },

    #[error("{path}: the index maps tensor {name:?} to {file:?}, which does not exist")]
    MissingShard {
        path: PathBuf,
        name: String,
        file: String,
    },

    #[error("hub: {0}")]
    Hub(String),

    #[error("invalid input: {0}")]
    Input(String),

    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, ModelError>;
