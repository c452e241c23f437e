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

/// The fixture's three right-padded rows as two packed rows: `[doc 1, doc 2]` and `[doc 0, padding]`.
pub struct Packed {
    pub ids: Tensor,
    pub mask: Tensor,
    pub positions: Tensor,
    pub labels: Vec<Vec<i64>>,
}

pub fn pack(f: &Fixture) -> Packed {
    let ids = f
        .ids
        .to_dtype(DType::I64)
        .unwrap()
        .to_vec2::<i64>()
        .unwrap();
    let labels = f.reference["labels"].to_vec2::<i64>().unwrap();
    let mask = f.reference["attention_mask"]
        .to_dtype(DType::I64)
        .unwrap()
        .to_vec2::<i64>()
        .unwrap();
    let len = |r: usize| mask[r].iter().filter(|&&m| m != 0).count();
    let rows: [&[usize]; 2] = [&[1, 2], &[0]];
    let width = rows
        .iter()
        .map(|docs| docs.iter().map(|&d| len(d)).sum::<usize>())
        .max()
        .unwrap();
    let (mut out_ids, mut out_mask, mut out_pos, mut out_labels) = (vec![], vec![], vec![], vec![]);
    for docs in rows {
        let (mut i, mut m, mut p, mut l) = (vec![], vec![], vec![], vec![]);
        for &d in docs {
            let n = len(d);
            i.extend(&ids[d][..n]);
            m.extend(std::iter::repeat_n(1i64, n));
            p.extend(0..n as i64);
            // The first token of a document is no target of the previous one.
            l.push(-100);
            l.extend(&labels[d][1..n]);
        }
        while i.len() < width {
            i.push(0);
            m.push(0);
            p.push(1); // what transformers writes at padding
            l.push(-100);
        }
        out_ids.push(i);
        out_mask.push(m);
        out_pos.push(p);
        out_labels.push(l);
    }
    let t = |rows: &Vec<Vec<i64>>| Tensor::new(rows.clone(), &Device::Cpu).unwrap();
    Packed {
        ids: t(&out_ids).to_dtype(DType::U32).unwrap(),
        mask: t(&out_mask),
        positions: t(&out_pos),
        labels: out_labels,
    }
}
