//! Typed errors of the engine.

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("shape: {0}")]
    Shape(String),
    #[error("chunk plan: {0}")]
    Plan(String),
    #[error("memory budget of {budget} bytes is too small: the smallest chunks (1 and 1) need an estimated {needed} bytes")]
    BudgetTooSmall { budget: u64, needed: u64 },
    #[error("no gradient reached {0}: an op on its path records no backward")]
    MissingGradient(String),
    #[error(transparent)]
    Model(#[from] streambp_models::ModelError),
    #[error(transparent)]
    Objective(#[from] streambp_objectives::ObjectiveError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, EngineError>;
