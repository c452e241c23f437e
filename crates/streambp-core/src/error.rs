//! Typed errors of the engine.

/// What can go wrong in a backward or in planning its chunks.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A batch tensor (mask, position ids, objective targets) whose shape does not match `input_ids`.
    #[error("shape: {0}")]
    Shape(String),
    /// Chunk sizes the engine cannot use (a chunk of 0 tokens).
    #[error("chunk plan: {0}")]
    Plan(String),
    /// [`crate::plan_for_budget`] cannot fit even chunks of one token into the memory budget.
    #[error("memory budget of {budget} bytes is too small: the smallest chunks (1 and 1) need an estimated {needed} bytes")]
    BudgetTooSmall {
        /// The budget asked for, in bytes.
        budget: u64,
        /// The smallest budget, in bytes, that the cost model says chunks of 1 and 1 fit in (the
        /// planning margin included).
        needed: u64,
    },
    /// A parameter or activation (named) got no gradient from candle's backward: some op on its path
    /// records none.
    #[error("no gradient reached {0}: an op on its path records no backward")]
    MissingGradient(String),
    /// The checkpoint directory (`--checkpoint-dir`) cannot hold a step's checkpoints.
    #[error("checkpoint directory {dir}: {reason}")]
    CheckpointDir {
        /// The directory.
        dir: std::path::PathBuf,
        /// What went wrong (no space: the bytes needed).
        reason: String,
    },
    /// Writing a checkpoint to its scratch file or reading it back failed.
    #[error("checkpoint scratch file: {0}")]
    CheckpointIo(String),
    /// From the model (loading, layout, a layer's forward).
    #[error(transparent)]
    Model(#[from] streambp_models::ModelError),
    /// From the objective (its batch or its loss).
    #[error(transparent)]
    Objective(#[from] streambp_objectives::ObjectiveError),
    /// A collective of sequence parallelism failed.
    #[error(transparent)]
    Collective(#[from] streambp_dist::DistError),
    /// From a candle tensor op.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// `Result` with [`EngineError`].
pub type Result<T> = std::result::Result<T, EngineError>;
