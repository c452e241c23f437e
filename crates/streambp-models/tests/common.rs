//! Shared helpers of the model crate's tests: the committed fixtures under `tests/fixtures`.

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

pub fn reference(name: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(
        fixture_dir(name).join("reference.safetensors"),
        &Device::Cpu,
    )
    .expect("fixture reference")
}

pub fn meta(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(fixture_dir(name).join("meta.json")).expect("meta.json");
    serde_json::from_str(&text).expect("meta.json is JSON")
}

/// `max |a - b| / max |b|` over the positions where `mask` (`[b, t]`) is 1; `a`, `b` are `[b, t, v]`.
pub fn masked_rel_err(a: &Tensor, b: &Tensor, mask: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap();
    let b = b.to_dtype(DType::F64).unwrap();
    let m = mask.to_dtype(DType::F64).unwrap().unsqueeze(2).unwrap();
    let diff = (a - &b).unwrap().abs().unwrap().broadcast_mul(&m).unwrap();
    let scale = b.abs().unwrap().broadcast_mul(&m).unwrap();
    let max = |t: Tensor| {
        t.flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    };
    max(diff) / max(scale)
}

/// Max relative error of two tensors of any shape: `max |a - b| / max |b|`.
pub fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let diff = (a - &b)
        .unwrap()
        .abs()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    let scale = b.abs().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap();
    diff / scale.max(f64::MIN_POSITIVE)
}
