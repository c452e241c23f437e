//! Packed rows (several documents per row, positions restarting at 0 at each, transformers'
//! padding-free convention) compute exactly what the documents compute as rows of their own: same
//! loss, same gradients, in every mode and for every family (Gemma3's window included), full
//! fine-tuning and LoRA alike.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{fixture, fixture_dir, pack, worst_grad_err, Fixture, Packed, FAMILIES};
use streambp_core::{backward, Batch, Chunks, Gradients, Mode};
use streambp_models::adapter::load_adapter;
use streambp_objectives::Sft;

fn run_packed(f: &Fixture, p: &Packed, mode: Mode, chunk: usize, logits_chunk: usize) -> Gradients {
    let batch = Batch {
        input_ids: &p.ids,
        attention_mask: Some(&p.mask),
        position_ids: Some(&p.positions),
    };
    let sft = Sft::new(&p.labels, f.model.config.vocab_size, None, &Device::Cpu).unwrap();
    let chunks = Chunks {
        chunk,
        logits_chunk,
    };
    backward(&f.model, batch, &sft, mode, chunks).unwrap()
}

#[test]
fn packed_rows_equal_separate_rows_in_every_mode() {
    for family in FAMILIES {
        assert_packing_is_exact(family, fixture(family, DType::F64));
    }
}

/// The same with the family's PEFT adapter (non-zero `B`, so every adapter tensor has a gradient): the
/// adapters' gradients, the only ones, agree as well.
#[test]
fn lora_packed_rows_equal_separate_rows_in_every_mode() {
    for family in FAMILIES {
        let mut f = fixture(family, DType::F64);
        let adapter = load_adapter(&fixture_dir(family).join("lora"), &Device::Cpu).unwrap();
        f.model = f
            .model
            .with_lora(adapter.config, Some(adapter.tensors), 0)
            .unwrap();
        assert_packing_is_exact(family, f);
    }
}

fn assert_packing_is_exact(family: &str, f: Fixture) {
    {
        let separate = f.run(Mode::Full, 1, 1);
        let packed = pack(&f);
        for (mode, chunk, logits_chunk) in [
            (Mode::Full, 1, 1),
            (Mode::Checkpoint, 16, 16),
            (Mode::Stream, 1, 1),
            (Mode::Stream, 3, 4),
            (Mode::Stream, 5, 16),
            (Mode::Stream, 16, 7),
        ] {
            let out = run_packed(&f, &packed, mode, chunk, logits_chunk);
            let loss_err = (out.loss - separate.loss).abs() / separate.loss.abs();
            let (err, name) = worst_grad_err(&out, &separate);
            println!(
                "{family} {mode:?} chunk {chunk}/{logits_chunk}: loss {loss_err:.1e}, grads {err:.1e} ({name})"
            );
            assert!(loss_err < 1e-12, "{family} {mode:?}: loss {loss_err}");
            assert!(err < 1e-10, "{family} {mode:?} {chunk}: {name} {err}");
        }
    }
}

#[test]
fn positions_that_do_not_count_up_are_rejected() {
    let f = fixture("qwen3", DType::F64);
    let p = pack(&f);
    let bad = Tensor::new(&[[0i64, 1, 3], [0, 1, 2]], &Device::Cpu).unwrap();
    let ids = p.ids.narrow(1, 0, 3).unwrap();
    let batch = Batch {
        input_ids: &ids,
        attention_mask: None,
        position_ids: Some(&bad),
    };
    let sft = Sft::new(&[vec![1, 2, 3], vec![1, 2, 3]], 128, None, &Device::Cpu).unwrap();
    let chunks = Chunks {
        chunk: 2,
        logits_chunk: 2,
    };
    let err = backward(&f.model, batch, &sft, Mode::Stream, chunks)
        .unwrap_err()
        .to_string();
    assert!(err.contains("position_ids row 0, index 2"), "{err}");
}
