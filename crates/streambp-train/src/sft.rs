//! The SFT recipe: one readable loop over shared components (data, engine, optimizer, schedule,
//! checkpoints, progress), in the manner of a torchtune recipe.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use streambp_core::{backward, Batch, Chunks, Mode};
use streambp_models::{load_model, resolve_model_dir, Model, ModelConfig};
use streambp_objectives::Sft;

use crate::checkpoint::{save_checkpoint, TrainerState, OPTIMIZER_FILE, STATE_FILE};
use crate::data::{collate, load_sft, read_jsonl, Collated, Example, Overflow};
use crate::device::{parse_device, parse_dtype};
use crate::generate::greedy;
use crate::optim::{clip_grad_norm, learning_rate, AdamW, AdamWConfig, Schedule};
use crate::tokenizer::TextTokenizer;
use crate::{Result, TrainError};

/// Everything an SFT run is configured by (the CLI flags mirror these).
#[derive(Debug, Clone)]
pub struct SftConfig {
    /// Model directory or hub id; `None`: the built-in tiny model, randomly initialised.
    pub model: Option<String>,
    /// Training JSONL; `None`: the built-in arithmetic task.
    pub data: Option<PathBuf>,
    /// Prompt/completion JSONL scored by exact-match accuracy of greedy answers, before and after.
    pub eval_data: Option<PathBuf>,
    pub output_dir: PathBuf,
    /// Optimizer steps; `None`: `epochs` passes over the data.
    pub max_steps: Option<usize>,
    pub epochs: f64,
    pub batch_size: usize,
    pub grad_accum: usize,
    pub lr: f64,
    pub weight_decay: f64,
    pub warmup_steps: usize,
    pub schedule: Schedule,
    pub max_grad_norm: f64,
    pub seed: u64,
    pub max_length: usize,
    pub overflow: Overflow,
    pub mode: Mode,
    pub chunk: usize,
    pub logits_chunk: usize,
    pub dtype: String,
    pub device: String,
    pub save_every: usize,
    /// Continue from this checkpoint (weights, optimizer, schedule, data position).
    pub resume: Option<PathBuf>,
    pub log_every: usize,
    pub progress: bool,
}

/// The built-in task: files shipped in the repo, embedded so the binary works from anywhere.
mod builtin {
    pub const CONFIG: &str = include_str!("../../../assets/arithmetic/config.json");
    pub const TOKENIZER: &str = include_str!("../../../assets/arithmetic/tokenizer.json");
    pub const TOKENIZER_CONFIG: &str =
        include_str!("../../../assets/arithmetic/tokenizer_config.json");
    pub const TRAIN: &str = include_str!("../../../assets/arithmetic/train.jsonl");
    pub const TEST: &str = include_str!("../../../assets/arithmetic/test.jsonl");
}

/// Writes the built-in task's files into `dir` and returns it.
pub fn materialize_builtin(dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    for (name, text) in [
        ("config.json", builtin::CONFIG),
        ("tokenizer.json", builtin::TOKENIZER),
        ("tokenizer_config.json", builtin::TOKENIZER_CONFIG),
        ("train.jsonl", builtin::TRAIN),
        ("test.jsonl", builtin::TEST),
    ] {
        std::fs::write(dir.join(name), text)?;
    }
    Ok(dir.to_path_buf())
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct SftSummary {
    pub steps: usize,
    pub first_loss: f64,
    pub last_loss: f64,
    pub accuracy_before: Option<f64>,
    pub accuracy_after: Option<f64>,
    pub output_dir: PathBuf,
    pub seconds: f64,
}

/// Exact-match accuracy of greedy answers on prompt/completion rows.
pub fn accuracy(model: &Model, tok: &TextTokenizer, rows: &[(String, String)]) -> Result<f64> {
    let mut correct = 0;
    for (prompt, answer) in rows {
        let ids = tok.encode(prompt)?;
        let max_new = tok.encode(answer)?.len() + 2;
        let out = greedy(model, &ids, tok.eos_id, max_new)?;
        if tok.decode(&out)?.trim() == answer.trim() {
            correct += 1;
        }
    }
    Ok(correct as f64 / rows.len().max(1) as f64)
}

fn eval_rows(path: &Path) -> Result<Vec<(String, String)>> {
    read_jsonl(path)?
        .iter()
        .enumerate()
        .map(|(i, r)| {
            match (
                r.get("prompt").and_then(|v| v.as_str()),
                r.get("completion").and_then(|v| v.as_str()),
            ) {
                (Some(p), Some(c)) => Ok((p.to_string(), c.to_string())),
                _ => Err(TrainError::Usage(format!(
                    "{} line {}: eval data needs \"prompt\" and \"completion\" strings",
                    path.display(),
                    i + 1
                ))),
            }
        })
        .collect()
}

/// A seeded permutation (Fisher-Yates over SplitMix64), so runs are reproducible.
fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut rng = streambp_models::init::NormalRng::new(seed);
    let mut idx: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (rng.uniform() * (i + 1) as f64) as usize;
        idx.swap(i, j.min(i));
    }
    idx
}

pub fn run_sft(cfg: &SftConfig) -> Result<SftSummary> {
    let device: Device = parse_device(&cfg.device)?;
    let dtype: DType = parse_dtype(&cfg.dtype)?;
    std::fs::create_dir_all(&cfg.output_dir)?;

    // Model, tokenizer and data: given, or the built-in task.
    let builtin_dir = if cfg.model.is_none() || cfg.data.is_none() {
        Some(materialize_builtin(&cfg.output_dir.join("builtin-task"))?)
    } else {
        None
    };
    let (model, model_dir) = match (&cfg.resume, &cfg.model) {
        (Some(dir), _) => (load_model(dir, dtype, &device)?, dir.clone()),
        (None, Some(spec)) => {
            let dir = resolve_model_dir(spec)?;
            (load_model(&dir, dtype, &device)?, dir)
        }
        (None, None) => {
            let dir = builtin_dir.clone().expect("built-in task written");
            let config = ModelConfig::from_file(&dir.join("config.json"))?;
            (Model::random(config, dtype, &device, cfg.seed)?, dir)
        }
    };
    let tokenizer = TextTokenizer::from_dir(&model_dir)?;
    if tokenizer.vocab_size() > model.config.vocab_size {
        return Err(TrainError::Usage(format!(
            "the tokenizer has {} tokens but the model only {}",
            tokenizer.vocab_size(),
            model.config.vocab_size
        )));
    }
    let data_path = match &cfg.data {
        Some(p) => p.clone(),
        None => builtin_dir
            .clone()
            .expect("built-in task written")
            .join("train.jsonl"),
    };
    let eval_path = cfg.eval_data.clone().or_else(|| {
        cfg.data
            .is_none()
            .then(|| builtin_dir.clone().expect("built-in").join("test.jsonl"))
    });
    let examples = load_sft(&data_path, &tokenizer, cfg.max_length, cfg.overflow)?;
    let eval = eval_path.as_deref().map(eval_rows).transpose()?;
    tracing::info!(
        examples = examples.len(),
        data = %data_path.display(),
        parameters = model.parameters().iter().map(|(_, v)| v.elem_count()).sum::<usize>(),
        "sft"
    );

    let resumed = cfg.resume.as_deref().map(TrainerState::read).transpose()?;
    let accuracy_before = match resumed {
        Some(_) => None,
        None => eval
            .as_ref()
            .map(|rows| accuracy(&model, &tokenizer, rows))
            .transpose()?,
    };
    if let Some(a) = accuracy_before {
        tracing::info!(accuracy = a, "held-out accuracy before training");
    }

    let mut optimizer = AdamW::new(
        model.parameters(),
        AdamWConfig {
            lr: cfg.lr,
            weight_decay: cfg.weight_decay,
            ..Default::default()
        },
    )?;
    let chunks = Chunks {
        chunk: cfg.chunk,
        logits_chunk: cfg.logits_chunk,
    };
    let per_step = cfg.batch_size * cfg.grad_accum;
    let max_steps = cfg
        .max_steps
        .unwrap_or(((examples.len() as f64 * cfg.epochs) / per_step as f64).ceil() as usize)
        .max(1);
    let (start, mut epoch, mut cursor) = match (&resumed, &cfg.resume) {
        (Some(state), Some(dir)) => {
            if state.seed != cfg.seed {
                tracing::warn!(
                    saved = state.seed,
                    given = cfg.seed,
                    "resuming with a different seed"
                );
            }
            let path = dir.join(OPTIMIZER_FILE);
            let moments = candle_core::safetensors::load(&path, &device)
                .map_err(|e| TrainError::Usage(format!("cannot read {}: {e}", path.display())))?;
            optimizer.load_state(&moments, state.step)?;
            tracing::info!(step = state.step, dir = %dir.display(), "resumed");
            (state.step, state.epoch, state.cursor)
        }
        _ => (0, 0, 0),
    };
    let mut order = shuffled(examples.len(), cfg.seed.wrapping_add(epoch));
    let mut metrics = std::fs::OpenOptions::new()
        .create(true)
        .append(resumed.is_some())
        .write(true)
        .truncate(resumed.is_none())
        .open(cfg.output_dir.join("metrics.jsonl"))?;
    let bar = progress_bar(max_steps, cfg.progress);
    let started = Instant::now();
    let (mut first_loss, mut last_loss) = (f64::NAN, f64::NAN);
    let mut last_good: Option<PathBuf> = None;

    bar.set_position(start as u64);
    for step in start..max_steps {
        let step_start = Instant::now();
        // The examples of this optimizer step, split into micro-batches.
        let mut picked: Vec<&Example> = Vec::with_capacity(per_step);
        while picked.len() < per_step {
            if cursor == order.len() {
                epoch += 1;
                order = shuffled(examples.len(), cfg.seed.wrapping_add(epoch));
                cursor = 0;
            }
            picked.push(&examples[order[cursor]]);
            cursor += 1;
        }
        // The loss is the mean over every target token of the step, across micro-batches.
        let targets: usize = picked
            .iter()
            .map(|e| e.labels.iter().skip(1).filter(|&&l| l != -100).count())
            .sum();
        let mut grads: Option<Vec<(String, Tensor)>> = None;
        let mut loss = 0.0;
        let mut tokens = 0usize;
        let mut peak = 0usize;
        for micro in picked.chunks(cfg.batch_size) {
            let Collated {
                input_ids: ids,
                labels,
                attention_mask: mask,
            } = collate(micro, tokenizer.pad_id);
            tokens += mask.iter().flatten().filter(|&&m| m == 1).count();
            let sft = Sft::new(
                &labels,
                model.config.vocab_size,
                Some(targets as f64),
                &device,
            )?;
            let input_ids = crate::batch_file::to_u32_tensor(&ids, &device)?;
            let attention_mask = crate::batch_file::to_u32_tensor(&mask, &device)?;
            let out = backward(
                &model,
                Batch {
                    input_ids: &input_ids,
                    attention_mask: Some(&attention_mask),
                },
                &sft,
                cfg.mode,
                chunks,
            )?;
            loss += out.loss;
            peak = peak.max(out.phases.overall_peak().unwrap_or(0));
            grads = Some(match grads {
                None => out.grads,
                Some(acc) => acc
                    .into_iter()
                    .zip(out.grads)
                    .map(|((n, a), (_, g))| Ok((n, (a + g)?)))
                    .collect::<Result<Vec<_>>>()?,
            });
        }
        if !loss.is_finite() {
            bar.abandon();
            return Err(TrainError::Usage(format!(
                "loss is {loss} at step {}; stopped without updating. Last good checkpoint: {}",
                step + 1,
                last_good
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_else(|| "none yet".into())
            )));
        }
        let mut grads = grads.expect("at least one micro-batch");
        let grad_norm = clip_grad_norm(&mut grads, cfg.max_grad_norm)?;
        let lr = learning_rate(cfg.schedule, cfg.lr, step, cfg.warmup_steps, max_steps);
        optimizer.apply(&grads, lr)?;
        if step == 0 {
            first_loss = loss;
        }
        last_loss = loss;

        let seconds = step_start.elapsed().as_secs_f64();
        let record = serde_json::json!({
            "step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
            "tokens_per_sec": tokens as f64 / seconds, "peak_bytes": peak, "seconds": seconds, "epoch": epoch,
        });
        writeln!(metrics, "{record}")?;
        bar.set_message(format!(
            "loss {loss:.4} lr {lr:.2e} {:.0} tok/s peak {:.0} MiB",
            tokens as f64 / seconds,
            peak as f64 / (1 << 20) as f64
        ));
        bar.inc(1);
        if cfg.log_every > 0 && (step + 1) % cfg.log_every == 0 {
            tracing::debug!(step = step + 1, loss, lr, grad_norm, "step");
        }
        if cfg.save_every > 0 && (step + 1) % cfg.save_every == 0 && step + 1 < max_steps {
            let dir = cfg.output_dir.join(format!("checkpoint-{}", step + 1));
            let state = TrainerState {
                step: step + 1,
                epoch,
                cursor,
                seed: cfg.seed,
            };
            let state = serde_json::to_string_pretty(&state)
                .map_err(|e| TrainError::Usage(e.to_string()))?;
            save_checkpoint(
                &model,
                &model_dir.join("config.json"),
                &tokenizer.files,
                &[(STATE_FILE, state)],
                Some(&optimizer.state()),
                &dir,
            )?;
            last_good = Some(dir);
        }
    }
    bar.finish();
    let final_dir = cfg.output_dir.join("final");
    save_checkpoint(
        &model,
        &model_dir.join("config.json"),
        &tokenizer.files,
        &[],
        None,
        &final_dir,
    )?;
    let accuracy_after = eval
        .as_ref()
        .map(|rows| accuracy(&model, &tokenizer, rows))
        .transpose()?;
    Ok(SftSummary {
        steps: max_steps,
        first_loss,
        last_loss,
        accuracy_before,
        accuracy_after,
        output_dir: final_dir,
        seconds: started.elapsed().as_secs_f64(),
    })
}

fn progress_bar(steps: usize, visible: bool) -> indicatif::ProgressBar {
    if !visible {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(steps as u64);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{bar:30} {pos}/{len} [{elapsed_precise} < {eta_precise}] {msg}",
    ) {
        bar.set_style(style);
    }
    bar
}
