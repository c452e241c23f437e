//! On a CUDA device (a build with `--features cuda`; skipped when no GPU is present): the engine's loss
//! and gradients on CUDA equal the CPU's in f32, for every fixture family, in every mode, with the
//! checkpoints on the card, in host memory or on disk, one per layer or one per segment; and bf16 on
//! the card stays within bf16's rounding of the CPU's f32.
//!
//! To run on the GPU machine, which has no Rust: build the test binary here with
//! `CARGO_TARGET_DIR=target-cuda cargo test --release -p streambp-core --features cuda --test cuda_parity
//! --no-run`, carry it, and run it from the repository root with `STREAMBP_FIXTURES=tests/fixtures`.
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, Tensor};
use common::{fixture, rel_err, FAMILIES};
use streambp_core::{
    backward_with, Batch, CheckpointEvery, Chunks, Gradients, Mode, Options, Plan,
};
use streambp_models::{load_model, Model};

/// The first CUDA device, or `None` (the test is skipped) on a machine without one.
fn cuda() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("no CUDA device ({e}): skipped");
            None
        }
    }
}

/// One SFT backward of `family`'s fixture batch on `model` (on any device) as `plan` says.
fn run_on(model: &Model, family: &str, plan: Plan) -> Gradients {
    let f = fixture(family, DType::F32);
    let dev = model.device();
    let ids = f.ids.to_device(dev).unwrap();
    let mask = f.reference["attention_mask"].to_device(dev).unwrap();
    let labels = f.reference["labels"].to_vec2::<i64>().unwrap();
    let sft = streambp_objectives::Sft::new(&labels, model.config.vocab_size, None, dev).unwrap();
    backward_with(model, Batch::new(&ids, Some(&mask)), &sft, plan).unwrap()
}

/// The loss's relative difference and the worst gradient's (with its name), `b` being the reference.
fn compare(a: &Gradients, b: &Gradients) -> (f64, f64, String) {
    let loss = (a.loss - b.loss).abs() / b.loss.abs();
    let mut worst = (0.0f64, String::new());
    for ((name, g), (_, c)) in a.grads.iter().zip(&b.grads) {
        let to_f32 = |t: &Tensor| {
            t.to_device(&Device::Cpu)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
        };
        let e = rel_err(&to_f32(g), &to_f32(c));
        if e >= worst.0 {
            worst = (e, name.clone());
        }
    }
    (loss, worst.0, worst.1)
}

fn chunks(chunk: usize, logits_chunk: usize) -> Chunks {
    Chunks {
        chunk,
        logits_chunk,
    }
}

#[test]
fn cuda_gradients_equal_cpu_gradients_in_f32() {
    let Some(gpu) = cuda() else { return };
    for family in FAMILIES {
        let dir = common::fixture_dir(family);
        let on_gpu = load_model(&dir, DType::F32, &gpu).unwrap();
        let on_cpu = load_model(&dir, DType::F32, &Device::Cpu).unwrap();
        // Chunk 1, a chunk that does not divide T, and one past T.
        for (mode, c, lc) in [
            (Mode::Full, 1, 1),
            (Mode::Checkpoint, 16, 16),
            (Mode::Stream, 3, 4),
            (Mode::Stream, 1, 1),
            (Mode::Stream, 4096, 4096),
        ] {
            let plan = Plan::new(mode, chunks(c, lc));
            let cpu = run_on(&on_cpu, family, plan.clone());
            let out = run_on(&on_gpu, family, plan);
            let (loss, worst, name) = compare(&out, &cpu);
            println!(
                "{family} {mode:?} {c}/{lc}: loss {loss:.1e}, worst gradient {worst:.1e} ({name})"
            );
            assert!(loss < 1e-5, "{family} {mode:?}: loss {loss}");
            assert!(worst < 1e-4, "{family} {mode:?}: {name} {worst}");
        }
    }
}

/// Sparse checkpoints and the three places they are kept in change nothing on the card either: each
/// equals the card's own dense run (one checkpoint per layer, on the card) to f32 rounding, and the
/// disk tier writes and reads back every byte.
#[test]
fn cuda_checkpoint_tiers_equal_dense_checkpoints() {
    let Some(gpu) = cuda() else { return };
    let scratch = tempfile::tempdir().unwrap();
    for family in FAMILIES {
        let model = load_model(&common::fixture_dir(family), DType::F32, &gpu).unwrap();
        for mode in [Mode::Stream, Mode::Checkpoint] {
            let dense = run_on(&model, family, Plan::new(mode, chunks(3, 4)));
            for (every, host, disk) in [
                (CheckpointEvery::Layers(1), true, false),
                (CheckpointEvery::Layers(2), false, false),
                (CheckpointEvery::Layers(2), true, false),
                (CheckpointEvery::Sqrt, false, true),
                (CheckpointEvery::Layers(1), false, true),
            ] {
                let options = Options {
                    checkpoint_every: every,
                    offload_checkpoints: host,
                    checkpoint_dir: disk.then(|| scratch.path().into()),
                    ..Default::default()
                };
                let plan = Plan::new(mode, chunks(3, 4)).with(options);
                let out = run_on(&model, family, plan);
                let (loss, worst, name) = compare(&out, &dense);
                let io = out.checkpoint_io;
                println!(
                    "{family} {mode:?} every {every} host {host} disk {disk}: loss {loss:.1e}, \
                     worst gradient {worst:.1e} ({name}), written {} read {}",
                    io.written, io.read
                );
                assert!(
                    loss < 1e-6 && worst < 1e-5,
                    "{family} {mode:?} {every}: {name}"
                );
                if disk {
                    assert!(io.written > 0 && io.read == io.written, "{io:?}");
                }
            }
        }
    }
    assert_eq!(std::fs::read_dir(scratch.path()).unwrap().count(), 0);
}

/// The disk tier while the card is busy: at these sizes the host queues a layer's kernels well
/// ahead of the card, so a checkpoint written (or a buffer reused) before the card's copy is done
/// would give other gradients. Stream mode with one checkpoint per layer on disk equals the same run
/// with them on the card (bit for bit when the card's kernels are deterministic, as they were on an
/// H200; the bound leaves room for any that are not, far below what stale bytes give).
#[test]
fn cuda_disk_tier_waits_for_the_card() {
    let Some(gpu) = cuda() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let config = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../benches/configs/qwen3-small.json"
    ));
    let path = scratch.path().join("config.json");
    std::fs::write(&path, config).unwrap();
    let cfg = streambp_models::ModelConfig::from_file(&path).unwrap();
    let model = Model::random(cfg, DType::F32, &gpu, 7).unwrap();
    let t = 4096;
    let tokens: Vec<u32> = (0..t as u32).map(|i| (i * 7919) % 16384).collect();
    let labels = vec![tokens.iter().map(|&x| x as i64).collect::<Vec<_>>()];
    let ids = Tensor::from_vec(tokens, (1, t), &gpu).unwrap();
    let sft = streambp_objectives::Sft::new(&labels, model.config.vocab_size, None, &gpu).unwrap();
    let run = |dir: Option<&std::path::Path>| {
        let options = Options {
            checkpoint_dir: dir.map(Into::into),
            ..Default::default()
        };
        let plan = Plan::new(Mode::Stream, chunks(512, 512)).with(options);
        backward_with(&model, Batch::new(&ids, None), &sft, plan).unwrap()
    };
    let (dense, disk) = (run(None), run(Some(scratch.path())));
    let (loss, worst, name) = compare(&disk, &dense);
    println!("busy card, disk tier: loss {loss:.1e}, worst gradient {worst:.1e} ({name})");
    assert!(loss < 1e-6 && worst < 1e-6, "{name}: {worst}");
    assert_eq!(disk.checkpoint_io.read, disk.checkpoint_io.written);
}

/// bf16 on the card (the production setting): every mode within bf16's rounding of the CPU's f32, and
/// the streamed gradients within it of the card's own full backward.
#[test]
fn cuda_bf16_stays_within_bf16_rounding() {
    let Some(gpu) = cuda() else { return };
    for family in FAMILIES {
        let dir = common::fixture_dir(family);
        let half = load_model(&dir, DType::BF16, &gpu).unwrap();
        let exact = load_model(&dir, DType::F32, &Device::Cpu).unwrap();
        let cpu = run_on(&exact, family, Plan::new(Mode::Full, chunks(1, 1)));
        let full = run_on(&half, family, Plan::new(Mode::Full, chunks(1, 1)));
        for (mode, c, lc) in [(Mode::Checkpoint, 16, 16), (Mode::Stream, 3, 4)] {
            let out = run_on(&half, family, Plan::new(mode, chunks(c, lc)));
            assert!(out.grads.iter().all(|(_, g)| g.dtype() == DType::BF16));
            let (loss, worst, name) = compare(&out, &full);
            let (loss_cpu, worst_cpu, name_cpu) = compare(&out, &cpu);
            println!(
                "{family} bf16 {mode:?}: vs bf16 full loss {loss:.1e} worst {worst:.1e} ({name}); \
                 vs f32 CPU loss {loss_cpu:.1e} worst {worst_cpu:.1e} ({name_cpu})"
            );
            assert!(worst < 6e-2, "{family} {mode:?}: {name} {worst}");
            assert!(
                loss_cpu < 1e-2 && worst_cpu < 1e-1,
                "{family} {mode:?}: {name_cpu}"
            );
        }
    }
}
