//! On a CUDA device (a build with `--features cuda`; skipped when no GPU is present): the engine's loss
//! and gradients on CUDA equal the CPU's in f32, for every fixture family, in every mode.
//!
//! To run on the GPU machine, which has no Rust: build the test binary here with
//! `CARGO_TARGET_DIR=target-cuda cargo test --release -p streambp-core --features cuda --test cuda_parity
//! --no-run`, carry it, and run it from the repository root with `STREAMBP_FIXTURES=tests/fixtures`.
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, Tensor};
use common::{fixture, rel_err, FAMILIES};
use streambp_core::{backward, Batch, Chunks, Mode};
use streambp_models::load_model;

#[test]
fn cuda_gradients_equal_cpu_gradients_in_f32() {
    let gpu = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("no CUDA device ({e}): skipped");
            return;
        }
    };
    for family in FAMILIES {
        let f = fixture(family, DType::F32);
        let on_gpu = |t: &Tensor| t.to_device(&gpu).unwrap();
        let model = load_model(&common::fixture_dir(family), DType::F32, &gpu).unwrap();
        let ids = on_gpu(&f.ids);
        let mask = on_gpu(&f.reference["attention_mask"]);
        let labels = f.reference["labels"].to_vec2::<i64>().unwrap();
        let sft =
            streambp_objectives::Sft::new(&labels, model.config.vocab_size, None, &gpu).unwrap();
        for (mode, chunk, logits_chunk) in [
            (Mode::Full, 1, 1),
            (Mode::Checkpoint, 16, 16),
            (Mode::Stream, 3, 4),
        ] {
            let cpu = f.run(mode, chunk, logits_chunk);
            let chunks = Chunks {
                chunk,
                logits_chunk,
            };
            let out = backward(&model, Batch::new(&ids, Some(&mask)), &sft, mode, chunks).unwrap();
            let loss_err = (out.loss - cpu.loss).abs() / cpu.loss.abs();
            let mut worst = (0.0f64, String::new());
            for ((name, g), (_, c)) in out.grads.iter().zip(&cpu.grads) {
                let e = rel_err(&g.to_device(&Device::Cpu).unwrap(), c);
                if e >= worst.0 {
                    worst = (e, name.clone());
                }
            }
            println!(
                "{family} {mode:?} {chunk}/{logits_chunk}: loss {loss_err:.1e}, worst gradient {:.1e} ({})",
                worst.0, worst.1
            );
            assert!(loss_err < 1e-5, "{family} {mode:?}: loss {loss_err}");
            assert!(worst.0 < 1e-4, "{family} {mode:?}: {} {}", worst.1, worst.0);
        }
    }
}
