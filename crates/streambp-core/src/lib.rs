//! StreamBP for candle: the exact streamed backward of a decoder LM, with plain full backprop and
//! per-layer gradient checkpointing on the same model code as baselines, a chunk planner, and exact
//! host-memory accounting.
//!
//! ```no_run
//! # use streambp_core::{backward, Batch, Chunks, Mode};
//! # fn run(model: &streambp_models::Model, ids: &candle_core::Tensor, sft: &streambp_objectives::Sft)
//! #     -> streambp_core::Result<()> {
//! let out = backward(model, Batch::new(ids, None), sft, Mode::Stream,
//!                    Chunks { chunk: 512, logits_chunk: 128 })?;
//! println!("loss {} over {} parameters", out.loss, out.grads.len());
//! # Ok(()) }
//! ```

pub mod engine;
pub mod error;
pub mod memory;
pub mod planner;

pub use engine::{
    backward, backward_with, forward_logprobs, target_logprobs, Batch, Chunks, Gradients, Mode,
    Options,
};
pub use error::{EngineError, Result};
pub use planner::{estimate, plan_for_budget, ChunkPolicy, Estimate, Problem};
