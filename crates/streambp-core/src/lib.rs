//! StreamBP for candle: the exact streamed backward of a decoder LM, with plain full backprop and
//! per-layer gradient checkpointing on the same model code as baselines, a chunk planner, and exact
//! memory accounting (host heap or CUDA pool).
//!
//! - [`backward`] / [`backward_with`]: the loss and every parameter's gradient ([`Gradients`]) of a
//!   [`Batch`] for an objective, in a [`Mode`] (`Stream`, `Checkpoint`, `Full`) with [`Chunks`] sizes
//!   and [`Options`] (checkpoint offloading); [`forward_logprobs`]: target log-probs without a graph
//!   (reference models, GRPO's old policy); [`target_logprobs`]: the differentiable
//!   `log softmax(logits)[target]` of one logits chunk. [`backward_sequence_parallel`] and
//!   [`forward_logprobs_sequence_parallel`]: the same on one rank of a sequence group
//!   ([`streambp_dist::Communicator`]), each rank holding about `T / S` of the positions.
//! - [`planner`]: the cost model of the streamed backward's peak ([`estimate`], [`Estimate`],
//!   [`Problem`]) and the chunks that fit a memory budget ([`plan_for_budget`], [`ChunkPolicy`]).
//! - [`memory`]: the counting allocator, per-device meters and the per-phase peak log.
//! - [`workers`]: each phase's host work on rayon's workers ([`on_workers`]), and the thread settings
//!   of candle's CPU backend a binary fixes at start ([`settle_thread_settings`]).
//!
//! The engine knows no model family and no checkpoint name: it drives any
//! [`streambp_models::Model`] through its layers and parameter roles, and any
//! [`streambp_objectives::Objective`] through its target log-probs. It holds no optimizer, data or
//! training loop (those are `streambp-train`'s).
//!
//! `examples/exact_gradients.rs` runs one batch through all three modes side by side (their
//! gradients agree to 1e-15 in f64), the planner for a budget, and sparse checkpoints on disk:
//! `cargo run --release -p streambp-core --example exact_gradients`. `streambp-objectives`'
//! `custom_objective` example writes a loss of one's own against [`streambp_objectives::Objective`]
//! and streams it exactly.
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

#![warn(missing_docs)]

pub mod engine;
pub mod error;
pub mod memory;
pub mod planner;
mod seed;
pub mod workers;

pub use engine::{
    backward, backward_into, backward_sequence_parallel, backward_with, forward_hidden,
    forward_logprobs, forward_logprobs_sequence_parallel, shard_ranges, target_logprobs, Batch,
    CheckpointEvery, CheckpointIo, Chunks, FinishedGradients, Gradients, HiddenStates, Mode,
    Options, Plan,
};
pub use error::{EngineError, Result};
pub use planner::{
    estimate, plan_for_budget, plan_with_checkpoints, CheckpointPlace, ChunkPolicy, Estimate,
    Frozen, Planned, Problem, Tiers,
};
pub use workers::{host_threads, on_workers, settle_thread_settings};
