//! Qwen2.5, Qwen3, Llama-3.x and Gemma3 (text) as decomposed layers that an engine can drive chunk by
//! chunk, loaded from Hugging Face directories or the hub.
//!
//! `examples/generate.rs` loads a model and decodes greedily with the KV cache ([`decode`]);
//! `examples/merge_adapter.rs` puts a PEFT adapter on its base and merges it:
//! `cargo run --release -p streambp-models --example generate`. `examples/decode_speed.rs` times
//! decoding.
//!
//! One set of blocks serves all four families; their differences are data in [`ModelConfig`].
//! Every op records a correct backward: candle's own for composed tensor ops, a written one for the
//! fused ops (attention, RMS norm, rope and SwiGLU from [`streambp_kernels::ops`], the linear
//! projections), so the same code runs the plain full backward, gradient checkpointing and the
//! streamed backward.
//!
//! Main exports: [`ModelConfig`] (read from `config.json`); [`Model`], its parameters named as in the
//! checkpoint and found by role (embedding, layer `i`, final norm, head); [`DecoderLayer`] with the
//! pieces an engine calls per chunk (queries, keys/values, the attention's blockwise op, the rest
//! of the layer) and [`KeyBlock`] saying which keys a query chunk reads; [`Layout`] for padding and packed
//! documents; [`load_model`], [`save_safetensors`] and [`resolve_model_dir`] for directories and hub
//! ids; [`device`] for the `--device`, `--dtype` and byte-size flags; [`init`] for random models.
//!
//! It knows no backward schedule (that is `streambp-core`'s), no objective, optimizer or training data.

#![warn(missing_docs)]

pub mod adapter;
pub mod config;
pub mod decode;
pub mod device;
pub mod error;
pub mod hub;
pub mod in_f32;
pub mod init;
pub mod layer;
pub mod layout;
pub mod linear;
pub mod loader;
pub mod lora;
pub mod model;
pub mod norm;
pub mod rope;
pub mod weights;

pub use config::{
    Activation, Family, Head, LayerKind, ModelConfig, NormStyle, RopeConfig, RopeScaling,
};
pub use error::{ModelError, Result};
pub use hub::{resolve_adapter_dir, resolve_model_dir};
pub use layer::{DecoderLayer, KeyBlock};
pub use layout::{key_validity, Layout};
pub use loader::{load_model, save_safetensors};
pub use lora::{LoraConfig, Projection};
pub use model::Model;
pub use weights::MapWeights;
