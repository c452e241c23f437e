//! Typed errors of the model crate. Every variant names the file (and tensor) it is about, so a user
//! with a broken checkpoint knows what to fix without reading a backtrace.

use std::path::PathBuf;

/// Anything that can go wrong building or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file (config, index, weights) that could not be opened, mapped or read.
    #[error("cannot read {path}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        error: std::io::Error,
    },

    /// [`crate::save_safetensors`] could not write or rename its file.
    #[error("cannot write {path}: {reason}")]
    Write {
        /// The file that was to be written.
        path: PathBuf,
        /// candle's or the operating system's message.
        reason: String,
    },

    /// A `config.json` (or a safetensors index) that is not valid JSON, lacks a required field or
    /// holds a value this crate does not support.
    #[error("{path}: invalid config: {reason}")]
    Config {
        /// The JSON file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// A `config.json` whose `model_type` is none of the four families.
    #[error(
        "{path}: unknown model_type {model_type:?} (supported: qwen2, qwen3, llama, gemma3_text, gemma3)"
    )]
    UnknownModelType {
        /// The config file.
        path: PathBuf,
        /// Its `model_type`.
        model_type: String,
    },

    /// A model directory with neither a single safetensors file nor a sharded index.
    #[error(
        "{path}: no model.safetensors and no model.safetensors.index.json in the model directory"
    )]
    NoWeights {
        /// The model directory.
        path: PathBuf,
    },

    /// A weights file safetensors cannot parse, or a tensor in it that cannot be read.
    #[error("{path}: not a valid safetensors file (truncated or corrupt?): {reason}")]
    BadSafetensors {
        /// The weights file.
        path: PathBuf,
        /// The safetensors or candle message.
        reason: String,
    },

    /// A parameter the config calls for that no weights file (or given tensor map) holds.
    #[error("tensor {name:?} is missing from the checkpoint (looked in {files})")]
    MissingTensor {
        /// The parameter's HF name.
        name: String,
        /// Where it was looked for: the files, comma-separated, or a description.
        files: String,
    },

    /// A tensor whose shape is not the one the config implies.
    #[error(
        "tensor {name:?} in {path} has shape {found:?}, expected {expected:?} from config.json"
    )]
    ShapeMismatch {
        /// The parameter's HF name.
        name: String,
        /// The weights file it came from (`<memory>` for given tensors).
        path: PathBuf,
        /// The shape from the config.
        expected: Vec<usize>,
        /// The shape in the file.
        found: Vec<usize>,
    },

    /// A sharded index that names a shard file absent from the model directory.
    #[error("{path}: the index maps tensor {name:?} to {file:?}, which does not exist")]
    MissingShard {
        /// The index file.
        path: PathBuf,
        /// A tensor mapped to the missing shard.
        name: String,
        /// The missing shard's file name.
        file: String,
    },

    /// A `--model` that is neither a directory nor a hub id found in the hub cache or downloadable.
    #[error("hub: {0}")]
    Hub(String),

    /// An argument this crate cannot use: a device, dtype or byte-size string, or tensors (input
    /// shapes, attention mask, position ids) a forward cannot run on.
    #[error("invalid input: {0}")]
    Input(String),

    /// From a candle tensor op.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// `Result` with [`ModelError`].
pub type Result<T> = std::result::Result<T, ModelError>;
