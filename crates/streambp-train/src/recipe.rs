//! What every training recipe shares: the run configuration, setup (model, tokenizer, built-in task), the
//! seeded data order, and the optimizer step with clipping, schedule, metrics, progress bar, checkpoints
//! and resume. The recipes (`sft.rs`, `dpo.rs`) are each one readable loop over these.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use streambp_core::{
    backward_with, plan_for_budget, Batch, Chunks, Gradients, Mode, Options, Problem,
};
use streambp_models::{load_model, resolve_model_dir, Model, ModelConfig};
use streambp_objectives::Objective;

use crate::checkpoint::{save_checkpoint, TrainerState, OPTIMIZER_FILE, STATE_FILE};
use crate::data::Overflow;
use crate::device::{parse_device, parse_dtype};
use crate::optim::{clip_grad_norm, learning_rate, AdamW, AdamWConfig, Schedule};
use crate::tokenizer::TextTokenizer;
use crate::{Result, TrainError};

/// Everything a run is configured by (the CLI flags mirror these).
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Model directory or hub id; `None`: the built-in tiny model (see `builtin_model`).
    pub model: Option<String>,
    /// What the built-in model starts from when `model` is `None`.
    pub builtin_model: BuiltinModel,
    /// Training JSONL; `None`: the built-in arithmetic task.
    pub data: Option<PathBuf>,
    /// JSONL scored before and after (prompt/completion: exact-match accuracy of greedy answers).
    pub eval_data: Option<PathBuf>,
    pub output_dir: PathBuf,
    /// Optimizer steps; `None`: `epochs` passes over the data.
    pub max_steps: Option<usize>,
    pub epochs: f64,
    /// Examples (SFT) or pairs (DPO) per micro-batch.
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
    /// SFT: pack whole examples into rows of up to `max_length` tokens (documents kept apart).
    pub packing: bool,
    pub mode: Mode,
    pub chunk: usize,
    pub logits_chunk: usize,
    /// Pick chunk sizes per micro-batch so the backward's estimated peak fits this many bytes
    /// (overrides `chunk` and `logits_chunk`).
    pub memory_budget: Option<u64>,
    /// Keep layer checkpoints in host memory during the backward.
    pub offload_checkpoints: bool,
    pub dtype: String,
    pub device: String,
    pub save_every: usize,
    /// Continue from this checkpoint (weights, optimizer, schedule, data position).
    pub resume: Option<PathBuf>,
    /// DPO: β, and the reference model (default: a frozen copy of the initial policy).
    pub beta: f64,
    /// DPO: weight of the chosen completions' mean token NLL added to the loss (0: plain DPO).
    pub sft_weight: f64,
    pub ref_model: Option<String>,
    pub progress: bool,
}

impl TrainConfig {
    /// The chunk sizes for a micro-batch `input_ids`: as given, or the largest the memory budget
    /// allows for its shape.
    pub fn chunks_for(&self, model: &Model, input_ids: &Tensor) -> Result<Chunks> {
        let Some(budget) = self.memory_budget else {
            return Ok(Chunks {
                chunk: self.chunk,
                logits_chunk: self.logits_chunk,
            });
        };
        let (batch, seq_len) = input_ids.dims2()?;
        let problem = Problem {
            config: &model.config,
            batch,
            seq_len,
            dtype: model.dtype(),
            offloaded: self.options().offloads_from(model.device()),
        };
        Ok(plan_for_budget(problem, budget)?)
    }

    /// The engine's backward of `objective` on `batch` as this run is configured.
    pub fn backward(
        &self,
        model: &Model,
        batch: Batch,
        objective: &dyn Objective,
    ) -> Result<Gradients> {
        let chunks = self.chunks_for(model, batch.input_ids)?;
        Ok(backward_with(
            model,
            batch,
            objective,
            self.mode,
            chunks,
            self.options(),
        )?)
    }

    /// Refuses `--packing` for the objectives that score whole sequences (DPO, GRPO), as TRL does.
    pub fn reject_packing(&self) -> Result<()> {
        match self.packing {
            true => Err(TrainError::Usage(
                "--packing applies to sft only (as in TRL)".into(),
            )),
            false => Ok(()),
        }
    }

    fn options(&self) -> Options {
        Options {
            offload_checkpoints: self.offload_checkpoints,
        }
    }
}

/// The built-in task: files shipped in the repo, embedded so the binary works from anywhere.
mod builtin {
    pub const FILES: [(&str, &str); 7] = [
        (
            "config.json",
            include_str!("../../../assets/arithmetic/config.json"),
        ),
        (
            "tokenizer.json",
            include_str!("../../../assets/arithmetic/tokenizer.json"),
        ),
        (
            "tokenizer_config.json",
            include_str!("../../../assets/arithmetic/tokenizer_config.json"),
        ),
        (
            "train.jsonl",
            include_str!("../../../assets/arithmetic/train.jsonl"),
        ),
        (
            "test.jsonl",
            include_str!("../../../assets/arithmetic/test.jsonl"),
        ),
        (
            "dpo.jsonl",
            include_str!("../../../assets/arithmetic/dpo.jsonl"),
        ),
        (
            "dpo_test.jsonl",
            include_str!("../../../assets/arithmetic/dpo_test.jsonl"),
        ),
    ];

    /// Where [`super::materialize_builtin`] puts the shipped SFT checkpoint.
    pub const SFT_MODEL_DIR: &str = "sft-model";

    /// Written by `streambp-train sft --seed 2` (600 steps, 88.5% held-out accuracy).
    pub const SFT_WEIGHTS: &[u8] =
        include_bytes!("../../../assets/arithmetic/sft-model.safetensors");
}

/// Writes the built-in task's files into `dir` (the shipped SFT checkpoint into `dir/sft-model`) and
/// returns it.
pub fn materialize_builtin(dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dir.join(builtin::SFT_MODEL_DIR))?;
    for (name, text) in builtin::FILES {
        std::fs::write(dir.join(name), text)?;
    }
    let sft = dir.join(builtin::SFT_MODEL_DIR);
    std::fs::write(sft.join("config.json"), builtin::FILES[0].1)?;
    std::fs::write(sft.join("model.safetensors"), builtin::SFT_WEIGHTS)?;
    Ok(dir.to_path_buf())
}

/// The model a run starts from when no `--model` is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuiltinModel {
    /// The built-in config, randomly initialised (`sft`).
    Random,
    /// The shipped SFT checkpoint of the arithmetic task (`dpo`: preference tuning refines a model
    /// that already answers).
    Sft,
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct Summary {
    pub steps: usize,
    pub first_loss: f64,
    pub last_loss: f64,
    /// Held-out metric before and after (exact-match accuracy; DPO: also preference accuracy).
    pub before: Vec<(String, f64)>,
    pub after: Vec<(String, f64)>,
    pub output_dir: PathBuf,
    pub seconds: f64,
}

/// The model, tokenizer and data paths of a run.
pub struct Setup {
    pub device: Device,
    pub dtype: DType,
    pub model: Model,
    /// Where the model's config.json came from (copied into checkpoints).
    pub model_dir: PathBuf,
    pub tokenizer: TextTokenizer,
    /// The built-in task's directory, when the run uses any part of it.
    pub builtin: Option<PathBuf>,
}

impl Setup {
    pub fn new(cfg: &TrainConfig) -> Result<Self> {
        let device = parse_device(&cfg.device)?;
        let dtype = parse_dtype(&cfg.dtype)?;
        std::fs::create_dir_all(&cfg.output_dir)?;
        let builtin = if cfg.model.is_none() || cfg.data.is_none() {
            Some(materialize_builtin(&cfg.output_dir.join("builtin-task"))?)
        } else {
            None
        };
        let (model, model_dir) = match (&cfg.resume, &cfg.model, &builtin) {
            (Some(dir), _, _) => (load_model(dir, dtype, &device)?, dir.clone()),
            (None, Some(spec), _) => {
                let dir = resolve_model_dir(spec)?;
                (load_model(&dir, dtype, &device)?, dir)
            }
            (None, None, Some(dir)) => {
                let model = match cfg.builtin_model {
                    BuiltinModel::Random => {
                        let config = ModelConfig::from_file(&dir.join("config.json"))?;
                        Model::random(config, dtype, &device, cfg.seed)?
                    }
                    BuiltinModel::Sft => {
                        load_model(&dir.join(builtin::SFT_MODEL_DIR), dtype, &device)?
                    }
                };
                (model, dir.clone())
            }
            (None, None, None) => {
                unreachable!("the built-in task is written when no model is given")
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
        tracing::info!(
            model = %model_dir.display(),
            parameters = model.parameters().iter().map(|(_, v)| v.elem_count()).sum::<usize>(),
            "setup"
        );
        Ok(Self {
            device,
            dtype,
            model,
            model_dir,
            tokenizer,
            builtin,
        })
    }

    /// `given`, or the built-in task's `file`.
    pub fn data_path(&self, given: &Option<PathBuf>, file: &str) -> Option<PathBuf> {
        given
            .clone()
            .or_else(|| self.builtin.as_ref().map(|d| d.join(file)))
    }
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

/// Walks the data in a new seeded order every epoch; its position is part of a checkpoint.
pub struct DataOrder {
    len: usize,
    seed: u64,
    order: Vec<usize>,
    pub epoch: u64,
    pub cursor: usize,
}

impl DataOrder {
    pub fn new(len: usize, seed: u64, epoch: u64, cursor: usize) -> Self {
        Self {
            len,
            seed,
            order: shuffled(len, seed.wrapping_add(epoch)),
            epoch,
            cursor,
        }
    }

    /// The next `n` example indices.
    pub fn take(&mut self, n: usize) -> Vec<usize> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            if self.cursor == self.len {
                self.epoch += 1;
                self.order = shuffled(self.len, self.seed.wrapping_add(self.epoch));
                self.cursor = 0;
            }
            out.push(self.order[self.cursor]);
            self.cursor += 1;
        }
        out
    }
}

/// What one optimizer step measured.
pub struct StepReport {
    pub loss: f64,
    pub grads: Vec<(String, Tensor)>,
    pub tokens: usize,
    pub peak_bytes: usize,
    /// Objective metrics (DPO rewards …), averaged over the step's micro-batches.
    pub metrics: Vec<(String, f64)>,
}

/// The optimizer step and its bookkeeping: clipping, schedule, AdamW, metrics.jsonl, progress bar,
/// periodic atomic checkpoints with resumable state.
pub struct Trainer {
    pub optimizer: AdamW,
    pub max_steps: usize,
    pub start_step: usize,
    pub data: DataOrder,
    metrics: std::fs::File,
    bar: indicatif::ProgressBar,
    started: Instant,
    step_started: Instant,
    pub first_loss: f64,
    pub last_loss: f64,
    last_good: Option<PathBuf>,
}

impl Trainer {
    /// `examples`: data set size; `per_step`: examples per optimizer step.
    pub fn new(cfg: &TrainConfig, setup: &Setup, examples: usize) -> Result<Self> {
        let mut optimizer = AdamW::new(
            setup.model.parameters(),
            AdamWConfig {
                lr: cfg.lr,
                weight_decay: cfg.weight_decay,
                ..Default::default()
            },
        )?;
        let per_step = cfg.batch_size * cfg.grad_accum;
        let max_steps = cfg
            .max_steps
            .unwrap_or(((examples as f64 * cfg.epochs) / per_step as f64).ceil() as usize)
            .max(1);
        let (start_step, epoch, cursor) = match &cfg.resume {
            Some(dir) => {
                let state = TrainerState::read(dir)?;
                if state.seed != cfg.seed {
                    tracing::warn!(
                        saved = state.seed,
                        given = cfg.seed,
                        "resuming with a different seed"
                    );
                }
                let path = dir.join(OPTIMIZER_FILE);
                let moments =
                    candle_core::safetensors::load(&path, &setup.device).map_err(|e| {
                        TrainError::Usage(format!("cannot read {}: {e}", path.display()))
                    })?;
                optimizer.load_state(&moments, state.step)?;
                tracing::info!(step = state.step, dir = %dir.display(), "resumed");
                (state.step, state.epoch, state.cursor)
            }
            None => (0, 0, 0),
        };
        let metrics = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(cfg.resume.is_some())
            .truncate(cfg.resume.is_none())
            .open(cfg.output_dir.join("metrics.jsonl"))?;
        let bar = progress_bar(max_steps, cfg.progress);
        bar.set_position(start_step as u64);
        Ok(Self {
            optimizer,
            max_steps,
            start_step,
            data: DataOrder::new(examples, cfg.seed, epoch, cursor),
            metrics,
            bar,
            started: Instant::now(),
            step_started: Instant::now(),
            first_loss: f64::NAN,
            last_loss: f64::NAN,
            last_good: None,
        })
    }

    /// Marks the start of a step (for its timing).
    pub fn begin_step(&mut self) {
        self.step_started = Instant::now();
    }

    /// Clips, schedules and applies the step's gradients, logs it, and checkpoints when due. A
    /// non-finite loss stops the run before any update, naming the last good checkpoint.
    pub fn finish_step(
        &mut self,
        cfg: &TrainConfig,
        setup: &Setup,
        step: usize,
        report: StepReport,
    ) -> Result<()> {
        let StepReport {
            loss,
            mut grads,
            tokens,
            peak_bytes,
            metrics,
        } = report;
        if !loss.is_finite() {
            self.bar.abandon();
            return Err(TrainError::Usage(format!(
                "loss is {loss} at step {}; stopped without updating. Last good checkpoint: {}",
                step + 1,
                self.last_good
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_else(|| "none yet".into())
            )));
        }
        let grad_norm = clip_grad_norm(&mut grads, cfg.max_grad_norm)?;
        let lr = learning_rate(cfg.schedule, cfg.lr, step, cfg.warmup_steps, self.max_steps);
        self.optimizer.apply(&grads, lr)?;
        if step == self.start_step {
            self.first_loss = loss;
        }
        self.last_loss = loss;
        let seconds = self.step_started.elapsed().as_secs_f64();
        let mut record = serde_json::json!({
            "step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
            "tokens_per_sec": tokens as f64 / seconds, "peak_bytes": peak_bytes, "seconds": seconds,
            "epoch": self.data.epoch,
        });
        for (k, v) in &metrics {
            record[k] = serde_json::json!(v);
        }
        writeln!(self.metrics, "{record}")?;
        self.bar.set_message(format!(
            "loss {loss:.4} lr {lr:.2e} {:.0} tok/s peak {:.0} MiB",
            tokens as f64 / seconds,
            peak_bytes as f64 / (1 << 20) as f64
        ));
        self.bar.inc(1);
        if cfg.save_every > 0 && (step + 1) % cfg.save_every == 0 && step + 1 < self.max_steps {
            let dir = cfg.output_dir.join(format!("checkpoint-{}", step + 1));
            let state = TrainerState {
                step: step + 1,
                epoch: self.data.epoch,
                cursor: self.data.cursor,
                seed: cfg.seed,
            };
            let state = serde_json::to_string_pretty(&state)
                .map_err(|e| TrainError::Usage(e.to_string()))?;
            save_checkpoint(
                &setup.model,
                &setup.model_dir.join("config.json"),
                &setup.tokenizer.files,
                &[(STATE_FILE, state)],
                Some(&self.optimizer.state()),
                &dir,
            )?;
            self.last_good = Some(dir);
        }
        Ok(())
    }

    /// Ends the run: the final checkpoint (weights, config, tokenizer) in `output_dir/final`, then its
    /// summary with the held-out metrics `before` and those `after` measures on the trained model.
    pub fn finish(
        &self,
        cfg: &TrainConfig,
        setup: &Setup,
        before: Vec<(String, f64)>,
        after: impl FnOnce() -> Result<Vec<(String, f64)>>,
    ) -> Result<Summary> {
        self.bar.finish();
        let dir = cfg.output_dir.join("final");
        save_checkpoint(
            &setup.model,
            &setup.model_dir.join("config.json"),
            &setup.tokenizer.files,
            &[],
            None,
            &dir,
        )?;
        let seconds = self.started.elapsed().as_secs_f64();
        Ok(Summary {
            steps: self.max_steps,
            first_loss: self.first_loss,
            last_loss: self.last_loss,
            before,
            after: after()?,
            output_dir: dir,
            seconds,
        })
    }
}

/// Sums the micro-batches of one optimizer step into its report.
#[derive(Default)]
pub struct StepAccumulator {
    grads: Option<Vec<(String, Tensor)>>,
    loss: f64,
    tokens: usize,
    peak: usize,
    metrics: Vec<(String, f64)>,
}

impl StepAccumulator {
    /// Adds one micro-batch's backward, its loss, gradients and metrics scaled by `weight` (1 when the
    /// objective already normalised over the whole step, `1 / micro-batches` to average means).
    pub fn add(&mut self, out: streambp_core::Gradients, tokens: usize, weight: f64) -> Result<()> {
        self.loss += out.loss * weight;
        self.tokens += tokens;
        self.peak = self.peak.max(out.phases.overall_peak().unwrap_or(0));
        for (name, value) in out.metrics {
            self.add_metric(&name, value * weight);
        }
        let grads = match weight {
            1.0 => out.grads,
            w => out
                .grads
                .into_iter()
                .map(|(n, g)| Ok((n, (g * w)?)))
                .collect::<Result<Vec<_>>>()?,
        };
        self.grads = Some(match self.grads.take() {
            None => grads,
            Some(acc) => acc
                .into_iter()
                .zip(grads)
                .map(|((n, a), (_, g))| Ok((n, (a + g)?)))
                .collect::<Result<Vec<_>>>()?,
        });
        Ok(())
    }

    /// Adds to a metric of the step (created at 0).
    pub fn add_metric(&mut self, name: &str, value: f64) {
        match self.metrics.iter_mut().find(|(n, _)| n == name) {
            Some((_, acc)) => *acc += value,
            None => self.metrics.push((name.to_string(), value)),
        }
    }

    pub fn into_report(self) -> Result<StepReport> {
        Ok(StepReport {
            loss: self.loss,
            grads: self.grads.ok_or_else(|| {
                TrainError::Usage("an optimizer step without a micro-batch".into())
            })?,
            tokens: self.tokens,
            peak_bytes: self.peak,
            metrics: self.metrics,
        })
    }
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
