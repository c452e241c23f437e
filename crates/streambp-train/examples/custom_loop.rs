//! A training loop of your own over the library's parts, the way a torchtune recipe is copied and
//! edited: data in TRL's formats, collation, the streamed exact backward, clipping, AdamW with a
//! schedule, TensorBoard scalars and an HF checkpoint, then the trained model answering a prompt.
//!
//! With no arguments it trains a tiny Qwen3-shaped model from scratch on the arithmetic task the repo
//! ships (`assets/arithmetic`) for 600 steps (seconds on a CPU):
//!
//! ```sh
//! cargo run --release -p streambp-train --example custom_loop [-- OUTPUT_DIR]
//! ```

use std::path::{Path, PathBuf};

use anyhow::Result;
use candle_core::{DType, Device};
use streambp_core::{backward, Chunks, Mode};
use streambp_models::{decode, load_model, Model, ModelConfig};
use streambp_objectives::Sft;
use streambp_train::batch::collate;
use streambp_train::checkpoint::{save_checkpoint, CheckpointFiles};
use streambp_train::data::{load_sft, Overflow};
use streambp_train::dataset::DataSource;
use streambp_train::optim::{clip_grad_norm, learning_rate, AdamW, AdamWConfig, Schedule};
use streambp_train::tensorboard::EventWriter;
use streambp_train::tokenizer::TextTokenizer;

fn main() -> Result<()> {
    let task = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/arithmetic");
    let scratch = tempfile::tempdir()?;
    let out = std::env::args()
        .nth(1)
        .map_or(scratch.path().to_path_buf(), PathBuf::from);
    let (steps, batch, max_length) = (600, 64, 16);

    // The model (random, seeded), its tokenizer, and the data as token ids.
    let config = ModelConfig::from_file(&task.join("config.json"))?;
    let model = Model::random(config, DType::F32, &Device::Cpu, 42)?;
    let tokenizer = TextTokenizer::from_dir(&task)?;
    let source = DataSource::file(&task.join("train.jsonl"))?;
    let examples = load_sft(&source, &tokenizer, max_length, Overflow::Truncate, "text")?;

    let mut optimizer = AdamW::new(model.parameters(), AdamWConfig::default())?;
    let mut metrics = EventWriter::create(&out, 0, true)?;
    for step in 0..steps {
        // Collate a micro-batch (right-padded) and build the objective over it.
        let first = step * batch % (examples.len() - batch);
        let rows: Vec<_> = examples[first..first + batch].iter().collect();
        let collated = collate(&rows, tokenizer.pad_id);
        let tensors = collated.tensors(model.device())?;
        let sft = Sft::new(
            &collated.labels,
            model.config.vocab_size,
            None,
            model.device(),
        )?;

        // The exact gradient, streamed over chunks of 8 positions (and of the LM head).
        let chunks = Chunks {
            chunk: 8,
            logits_chunk: 8,
        };
        let mut out = backward(&model, tensors.batch(), &sft, Mode::Stream, chunks)?;
        let norm = clip_grad_norm(&mut out.grads, 1.0)?;
        let lr = learning_rate(Schedule::Cosine, 5e-3, step, 20, steps);
        optimizer.apply(&out.grads, lr)?;

        let scalars = [
            ("train/loss".to_string(), out.loss),
            ("train/grad_norm".to_string(), norm),
            ("train/lr".to_string(), lr),
        ];
        metrics.scalars(step + 1, &scalars)?;
        if step % 100 == 0 || step + 1 == steps {
            println!(
                "step {:>3}: loss {:.4}, grad norm {norm:.3}, lr {lr:.2e}",
                step + 1,
                out.loss
            );
        }
    }

    // An HF checkpoint (weights, config, tokenizer), written atomically; transformers loads it.
    let files = CheckpointFiles {
        model: &model,
        base_model: None,
        config_json: &task.join("config.json"),
        tokenizer_files: &tokenizer.files,
        extra: &[],
    };
    let final_dir = out.join("final");
    save_checkpoint(&files, &final_dir)?;
    let trained = load_model(&final_dir, DType::F32, &Device::Cpu)?;
    let prompt = tokenizer.encode("12+34=")?;
    let answer = decode::greedy(&trained, &prompt, tokenizer.eos_id, 4)?;
    println!("12+34={}", tokenizer.decode(&answer)?);
    println!("checkpoint and TensorBoard events in {}", out.display());
    Ok(())
}
