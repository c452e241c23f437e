//! Shared helpers of the engine's tests: committed fixtures under `tests/fixtures`.

#![allow(dead_code)]

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use streambp_core::{backward, Batch, Chunks, Gradients, Mode};
use streambp_models::{load_model, Model};
use streambp_objectives::Sft;
pub use streambp_testkit::*;

pub struct Fixture {
    pub model: Model,
    pub reference: HashMap<String, Tensor>,
    pub ids: Tensor,
}

pub fn fixture(name: &str, dtype: DType) -> Fixture {
    let dir = fixture_dir(name);
    let reference =
        candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
    let ids = reference["input_ids"].to_dtype(DType::U32).unwrap();
    Fixture {
        model: load_model(&dir, dtype, &Device::Cpu).unwrap(),
        reference,
        ids,
    }
}

impl Fixture {
    pub fn sft(&self) -> Sft {
        let labels = self.reference["labels"].to_vec2::<i64>().unwrap();
        Sft::new(&labels, self.model.config.vocab_size, None, &Device::Cpu).unwrap()
    }

    pub fn run(&self, mode: Mode, chunk: usize, logits_chunk: usize) -> Gradients {
        let batch = Batch::new(&self.ids, Some(&self.reference["attention_mask"]));
        let chunks = Chunks {
            chunk,
            logits_chunk,
        };
        backward(&self.model, batch, &self.sft(), mode, chunks).unwrap()
    }
}

/// The worst per-tensor relative error between two gradient sets (same names, same order).
pub fn worst_grad_err(a: &Gradients, b: &Gradients) -> (f64, String) {
    assert_eq!(a.grads.len(), b.grads.len());
    let mut worst = (0.0, String::new());
    for ((na, ga), (nb, gb)) in a.grads.iter().zip(&b.grads) {
        assert_eq!(na, nb);
        let e = rel_err(ga, gb);
        if e > worst.0 || worst.1.is_empty() {
            worst = (e.max(worst.0), na.clone());
        }
    }
    worst
}
