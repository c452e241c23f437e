//! Helpers shared by this crate's tests: the committed fixtures under `tests/fixtures`.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};

pub const FAMILIES: [&str; 4] = ["qwen2", "qwen3", "llama3", "gemma3"];

pub fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// The fixture's float64 references (batch, logits, losses, gradients).
pub fn reference(name: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(
        fixture_dir(name).join("reference.safetensors"),
        &Device::Cpu,
    )
    .unwrap()
}

/// Max relative error of two tensors of any shape: `max |a - b| / max |b|`.
pub fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let max = |t: Tensor| t.abs().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap();
    max((a - &b).unwrap()) / max(b).max(f64::MIN_POSITIVE)
}
