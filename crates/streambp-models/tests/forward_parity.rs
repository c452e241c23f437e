//! Logits of every family against transformers' float64 logits (computed with its float32 casts
//! promoted to float64, checked against finite differences: scripts/make_fixtures.py).

mod common;

use candle_core::{DType, Device};
use common::*;
use streambp_models::load_model;

fn logits_err(family: &str, dtype: DType) -> f64 {
    let reference = reference(family);
    let model = load_model(&fixture_dir(family), dtype, &Device::Cpu).unwrap();
    let ids = reference["input_ids"].to_dtype(DType::U32).unwrap();
    let mask = &reference["attention_mask"];
    let logits = model.detached().forward(&ids, Some(mask)).unwrap();
    masked_rel_err(&logits, &reference["logits"], mask)
}

#[test]
fn f64_logits_match_transformers_to_1e10() {
    for family in FAMILIES {
        let err = logits_err(family, DType::F64);
        println!("{family}: f64 rel err {err:.2e}");
        assert!(
            err < 1e-10,
            "{family}: f64 logits differ from transformers by {err:.2e}"
        );
    }
}

/// f32: our error against the exact reference must be no worse than 4x transformers' own float32
/// error on the same model and batch (about 6e-7 here: ~10 roundings of 6e-8 compounded by depth).
#[test]
fn f32_logits_are_as_accurate_as_transformers_f32() {
    for family in FAMILIES {
        let err = logits_err(family, DType::F32);
        let hf = meta(family)["hf_float32_max_rel_err"].as_f64().unwrap();
        println!("{family}: f32 rel err {err:.2e} (transformers f32: {hf:.2e})");
        assert!(
            err < 4.0 * hf,
            "{family}: f32 error {err:.2e} vs transformers' {hf:.2e}"
        );
    }
}

/// bf16 has 8 bits of mantissa (unit roundoff 3.9e-3): logits within 5% of the largest logit.
#[test]
fn bf16_logits_are_close() {
    for family in FAMILIES {
        let err = logits_err(family, DType::BF16);
        println!("{family}: bf16 rel err {err:.2e}");
        assert!(err < 5e-2, "{family}: bf16 error {err:.2e}");
    }
}

/// Padding never changes a real token's logits: each row alone gives the same logits as in the batch.
#[test]
fn padded_rows_match_unpadded_rows() {
    for family in FAMILIES {
        let reference = reference(family);
        let model = load_model(&fixture_dir(family), DType::F64, &Device::Cpu)
            .unwrap()
            .detached();
        let ids = reference["input_ids"].to_dtype(DType::U32).unwrap();
        let mask = &reference["attention_mask"];
        let batch = model.forward(&ids, Some(mask)).unwrap();
        let lengths = meta(family)["lengths"].as_array().unwrap().clone();
        for (row, len) in lengths.iter().enumerate() {
            let len = len.as_u64().unwrap() as usize;
            let alone = model
                .forward(
                    &ids.narrow(0, row, 1).unwrap().narrow(1, 0, len).unwrap(),
                    None,
                )
                .unwrap();
            let in_batch = batch.narrow(0, row, 1).unwrap().narrow(1, 0, len).unwrap();
            let err = rel_err(&alone, &in_batch);
            assert!(err < 1e-12, "{family} row {row}: {err:.2e}");
        }
    }
}
