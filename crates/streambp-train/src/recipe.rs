//! What every training recipe shares: the run configuration, setup (model, tokenizer, built-in task), the
//! seeded data order, and the optimizer step with clipping, schedule, metrics, progress bar, checkpoints
//! and resume. The recipes (`sft.rs`, `dpo.rs`, `grpo.rs`) are each one readable loop over these.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use streambp_core::{backward_with, Batch, ChunkPolicy, Chunks, Gradients, Options, Problem};
use streambp_models::adapter::load_adapter;
use streambp_models::hub::ADAPTER_FILES;
use streambp_models::{
    load_model, resolve_adapter_dir, resolve_model_dir, LoraConfig, Model, ModelConfig,
};
use streambp_objectives::Objective;

use crate::checkpoint::{
    check_resume, data_identity, save_checkpoint, CheckpointFiles, Digest, RunRecord, TrainerState,
    OPTIMIZER_FILE, STATE_FILE,
};
use crate::config::{BuiltinModel, Recipe, TrainConfig};
use crate::device::{parse_device, parse_dtype};
use crate::optim::{clip_grad_norm, learning_rate, AdamW, AdamWConfig};
use crate::output::{OutputDir, TMP_MARK};
use crate::tokenizer::TextTokenizer;
use crate::{Result, TrainError};

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
    let sft = dir.join(builtin::SFT_MODEL_DIR);
    std::fs::create_dir_all(&sft).map_err(TrainError::io("create", &sft))?;
    let write = |path: PathBuf, bytes: &[u8]| {
        std::fs::write(&path, bytes).map_err(TrainError::io("write", &path))
    };
    for (name, text) in builtin::FILES {
        write(dir.join(name), text.as_bytes())?;
    }
    // The SFT checkpoint as a whole model directory: config, weights and the task's tokenizer.
    for (name, text) in &builtin::FILES[..3] {
        write(sft.join(name), text.as_bytes())?;
    }
    write(sft.join("model.safetensors"), builtin::SFT_WEIGHTS)?;
    Ok(dir.to_path_buf())
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct Summary {
    /// The step the run ended at (resumed steps included).
    pub steps: usize,
    /// The loss of the first step this process took (after a resume, the first step after it).
    pub first_loss: f64,
    /// The loss of the last step.
    pub last_loss: f64,
    /// Held-out metric before and after (exact-match accuracy; DPO: also preference accuracy).
    pub before: Vec<(String, f64)>,
    /// The held-out metrics of the trained model, named like `before`.
    pub after: Vec<(String, f64)>,
    /// The final checkpoint's directory (`<output-dir>/final`).
    pub output_dir: PathBuf,
    /// Wall-clock seconds from the trainer's start to the end of the run.
    pub seconds: f64,
}

/// The model, tokenizer, output directory and data paths of a run.
pub struct Setup {
    /// The device the model and batches live on (`--device`).
    pub device: Device,
    /// The model's dtype (`--dtype`).
    pub dtype: DType,
    /// The policy being trained, updated in place.
    pub model: Model,
    /// Where the model's config.json came from (copied into checkpoints).
    pub model_dir: PathBuf,
    /// The model's tokenizer (the built-in task's for the built-in model).
    pub tokenizer: TextTokenizer,
    /// The built-in task's directory, when the run uses any part of it.
    pub builtin: Option<PathBuf>,
    /// The checked output directory, locked while the run lives.
    pub output: OutputDir,
    /// Where the model the run started from comes from (a resumed run's reference is that model).
    pub initial: InitialModel,
}

/// Where a run's starting model comes from.
#[derive(Debug, Clone)]
pub enum InitialModel {
    /// A Hugging Face model directory.
    Dir(PathBuf),
    /// The built-in config in `dir`, initialised from `seed`.
    Random {
        /// The built-in task's directory (its `config.json`, tokenizer).
        dir: PathBuf,
        /// The initialisation's seed.
        seed: u64,
    },
}

impl InitialModel {
    /// The model, loaded (or initialised) anew.
    pub fn load(&self, dtype: DType, device: &Device) -> Result<Model> {
        Ok(match self {
            InitialModel::Dir(dir) => load_model(dir, dtype, device)?,
            InitialModel::Random { dir, seed } => {
                let config = ModelConfig::from_file(&dir.join("config.json"))?;
                Model::random(config, dtype, device, *seed)?
            }
        })
    }

    /// The directory holding its config and tokenizer.
    pub fn dir(&self) -> &Path {
        match self {
            InitialModel::Dir(dir) | InitialModel::Random { dir, .. } => dir,
        }
    }
}

impl Setup {
    /// Validates `cfg` for `recipe`, prepares the output directory, then loads the model and tokenizer.
    pub fn new(cfg: &TrainConfig, recipe: Recipe) -> Result<Self> {
        cfg.validate(recipe)?;
        let device = parse_device(&cfg.device)?;
        let dtype = parse_dtype(&cfg.dtype)?;
        // Resolve what the run reads before anything is written.
        let model_dir = cfg.model.as_deref().map(resolve_model_dir).transpose()?;
        let adapter_dir = cfg
            .adapter
            .as_deref()
            .map(resolve_adapter_dir)
            .transpose()?;
        let output = OutputDir::prepare(&cfg.output_dir)?;
        let builtin = if cfg.model.is_none() || cfg.data.is_none() {
            Some(materialize_builtin(&cfg.output_dir.join("builtin-task"))?)
        } else {
            None
        };
        let initial = match (model_dir, &builtin) {
            (Some(dir), _) => InitialModel::Dir(dir),
            (None, Some(dir)) => match cfg.builtin_model {
                BuiltinModel::Random => InitialModel::Random {
                    dir: dir.clone(),
                    seed: cfg.seed,
                },
                BuiltinModel::Sft => InitialModel::Dir(dir.join(builtin::SFT_MODEL_DIR)),
            },
            (None, None) => {
                return Err(TrainError::Internal(
                    "no model given and no built-in task written".into(),
                ))
            }
        };
        // A LoRA checkpoint holds the adapter only, over the run's model; a full one the whole model.
        let resumed_adapter = cfg
            .resume
            .clone()
            .filter(|dir| dir.join(ADAPTER_FILES[0]).is_file());
        let (model, model_dir) = match (&cfg.resume, &resumed_adapter) {
            (Some(dir), None) => (load_model(dir, dtype, &device)?, dir.clone()),
            _ => (initial.load(dtype, &device)?, initial.dir().to_path_buf()),
        };
        let adapter_dir = resumed_adapter.or(adapter_dir);
        let model = attach_lora(model, adapter_dir, cfg.lora.clone(), cfg.seed)?;
        let tokenizer = TextTokenizer::from_dir(&model_dir)?;
        if tokenizer.vocab_size() > model.config.vocab_size {
            return Err(TrainError::Tokenizer(format!(
                "{}: the tokenizer has {} tokens but the model only {}",
                model_dir.display(),
                tokenizer.vocab_size(),
                model.config.vocab_size
            )));
        }
        let positions = model.config.max_position_embeddings;
        if cfg.max_length > positions {
            tracing::warn!(
                max_length = cfg.max_length,
                max_position_embeddings = positions,
                "--max-length is above the model's max_position_embeddings: longer sequences than it \
                 was trained for"
            );
        }
        let count = |t: &[usize]| t.iter().product::<usize>();
        tracing::info!(
            model = %model_dir.display(),
            weights = model.weights().iter().map(|(_, t)| count(t.dims())).sum::<usize>(),
            trainable = model.parameters().iter().map(|(_, v)| v.elem_count()).sum::<usize>(),
            "setup"
        );
        Ok(Self {
            device,
            dtype,
            model,
            model_dir,
            tokenizer,
            builtin,
            output,
            initial,
        })
    }

    /// `given`, or the built-in task's `file`.
    pub fn data_path(&self, given: &Option<PathBuf>, file: &str) -> Result<PathBuf> {
        match (given, &self.builtin) {
            (Some(path), _) => Ok(path.clone()),
            (None, Some(dir)) => Ok(dir.join(file)),
            (None, None) => Err(TrainError::Internal(format!(
                "no data given and no built-in {file}"
            ))),
        }
    }

    /// The held-out prompt/completion file: `--eval-data`, or the built-in task's test split when the
    /// run trains on the built-in data.
    pub fn eval_path(&self, cfg: &TrainConfig) -> Option<PathBuf> {
        match (&cfg.eval_data, &cfg.data, &self.builtin) {
            (Some(path), _, _) => Some(path.clone()),
            (None, None, Some(dir)) => Some(dir.join("test.jsonl")),
            _ => None,
        }
    }

    /// What a checkpoint of this run holds (the model or its adapter, config, tokenizer), with no
    /// trainer state or optimizer yet; `config_json` is the model's `config.json`.
    pub fn checkpoint_files<'a>(
        &'a self,
        cfg: &'a TrainConfig,
        config_json: &'a Path,
    ) -> CheckpointFiles<'a> {
        CheckpointFiles {
            model: &self.model,
            base_model: cfg.model.as_deref(),
            config_json,
            tokenizer_files: &self.tokenizer.files,
            extra: &[],
            optimizer: None,
        }
    }

    /// The model the run started from, frozen: TRL's default reference. For LoRA the base with the
    /// adapters off (no second copy of the weights); otherwise a copy, since training updates the
    /// policy's weights in place (or, resumed, the starting model loaded again).
    pub fn initial_reference(&self, cfg: &TrainConfig) -> Result<Model> {
        Ok(match (self.model.lora(), &cfg.resume) {
            (Some(_), _) => self.model.without_adapters(),
            // Resumed: the policy has moved; the reference is the model the run began with.
            (None, Some(_)) => self.initial.load(self.dtype, &self.device)?.detached(),
            (None, None) => self.model.frozen_copy()?,
        })
    }

    /// A reference model (DPO's `--ref-model`), checked to fit the policy: the same vocabulary, the
    /// same tokenizer where it ships one. Other architectures are allowed (TRL allows any model that
    /// shares the tokenizer), with a warning.
    pub fn load_reference(&self, spec: &str) -> Result<Model> {
        load_reference(spec, &self.model, Some(&self.tokenizer))
    }
}

/// The reference model `spec` (`--ref-model`), checked to fit `policy`: the same vocabulary size, and
/// the same token ids as `tokenizer` where the reference ships a tokenizer. Other architectures are
/// allowed (TRL allows any model that shares the tokenizer), with a warning.
pub fn load_reference(
    spec: &str,
    policy: &Model,
    tokenizer: Option<&TextTokenizer>,
) -> Result<Model> {
    let dir = resolve_model_dir(spec)?;
    let reference = load_model(&dir, policy.dtype(), policy.device())?;
    let (mine, theirs) = (&policy.config, &reference.config);
    if theirs.vocab_size != mine.vocab_size {
        return Err(TrainError::Reference(format!(
            "--ref-model {spec}: its vocabulary has {} tokens, the policy's {}; the reference must \
             score the policy's token ids",
            theirs.vocab_size, mine.vocab_size
        )));
    }
    if let (Some(tokenizer), true) = (tokenizer, dir.join("tokenizer.json").is_file()) {
        if !TextTokenizer::from_dir(&dir)?.same_vocabulary(tokenizer) {
            return Err(TrainError::Reference(format!(
                "--ref-model {spec}: its tokenizer maps tokens to other ids than the policy's"
            )));
        }
    }
    if (theirs.family, theirs.hidden_size, theirs.num_layers())
        != (mine.family, mine.hidden_size, mine.num_layers())
    {
        tracing::warn!(
            reference = spec,
            "the reference model's architecture differs from the policy's (allowed: it shares the \
             vocabulary)"
        );
    }
    Ok(reference.detached())
}

impl TrainConfig {
    /// The chunk sizes for a micro-batch `input_ids`: as given, or the largest the memory budget
    /// allows for its shape.
    pub fn chunks_for(&self, model: &Model, input_ids: &Tensor) -> Result<Chunks> {
        let policy = match self.memory_budget {
            Some(budget) => ChunkPolicy::Budget(budget),
            None => ChunkPolicy::Fixed(self.chunks()),
        };
        let (batch, seq_len) = input_ids.dims2()?;
        Ok(policy.chunks_for(Problem::of(model, batch, seq_len, self.options()))?)
    }

    /// The engine's backward of `objective` on `batch` as this run is configured.
    /// `micro` is the micro-batch's index in optimizer step `step`: with LoRA dropout, its masks
    /// derive from (seed, step, micro), so every mode and every recomputation sees the same ones.
    pub fn backward(
        &self,
        model: &Model,
        batch: Batch,
        objective: &dyn Objective,
        (step, micro): (usize, usize),
    ) -> Result<Gradients> {
        let chunks = self.chunks_for(model, batch.input_ids)?;
        let options = Options {
            dropout_key: Some(dropout_key(self.seed, step, micro)),
            ..self.options()
        };
        Ok(backward_with(
            model, batch, objective, self.mode, chunks, options,
        )?)
    }

    /// Log-probs under a frozen `model`, streamed with this run's chunks.
    pub fn scorer<'a>(
        &'a self,
        model: &'a Model,
    ) -> impl FnMut(&Tensor, Option<&Tensor>, &Tensor) -> Result<Tensor> + 'a {
        crate::logprobs::scorer(model, move |ids| self.chunks_for(model, ids))
    }

    fn options(&self) -> Options {
        Options {
            offload_checkpoints: self.offload_checkpoints,
            dropout_key: None,
        }
    }

    /// The settings of this run that a checkpoint records, under their flag names.
    pub fn record(&self, recipe: Recipe) -> RunRecord {
        let model = match (&self.model, self.builtin_model) {
            (Some(spec), _) => spec.clone(),
            (None, BuiltinModel::Random) => "built-in (random)".into(),
            (None, BuiltinModel::Sft) => "built-in (sft)".into(),
        };
        let data = match &self.data {
            Some(p) => p.display().to_string(),
            None => "built-in".into(),
        };
        let lower = |x: &dyn std::fmt::Debug| format!("{x:?}").to_lowercase();
        let mut run = RunRecord::new();
        let mut put = |k: &str, v: serde_json::Value| {
            run.insert(k.to_string(), v);
        };
        put("recipe", recipe.name().into());
        put("--model", model.into());
        put("--data", data.into());
        put("--batch-size", self.batch_size.into());
        put("--grad-accum", self.grad_accum.into());
        put("--max-steps", self.max_steps.into());
        put("--epochs", self.epochs.into());
        put("--lr", self.lr.into());
        put("--weight-decay", self.weight_decay.into());
        put("--warmup-steps", self.warmup_steps.into());
        put("--schedule", lower(&self.schedule).into());
        put("--max-grad-norm", self.max_grad_norm.into());
        put("--seed", self.seed.into());
        put("--dtype", self.dtype.clone().into());
        if recipe != Recipe::Sft {
            put("--beta", self.beta.into());
        }
        if recipe == Recipe::Dpo {
            put("--sft-weight", self.sft_weight.into());
            put("--ref-model", self.ref_model.clone().into());
        }
        let lora = self.lora.as_ref();
        let targets: Option<Vec<&str>> = lora.map(|l| l.targets.iter().map(|p| p.name()).collect());
        put("--lora-r", lora.map(|l| l.r).into());
        put("--lora-alpha", lora.map(|l| l.alpha).into());
        put("--lora-target", targets.into());
        put("--use-rslora", lora.map(|l| l.use_rslora).into());
        put("--lora-dropout", lora.map(|l| l.dropout).into());
        put("--adapter", self.adapter.clone().into());
        run
    }
}

/// `model` with the PEFT adapter in `adapter_dir` to train further, or a fresh adapter of `lora`
/// (initialised from `seed`), or as it is.
pub fn attach_lora(
    model: Model,
    adapter_dir: Option<PathBuf>,
    lora: Option<LoraConfig>,
    seed: u64,
) -> Result<Model> {
    Ok(match (adapter_dir, lora) {
        (Some(dir), _) => {
            let adapter = load_adapter(&dir, model.device())?;
            tracing::info!(adapter = %dir.display(), r = adapter.config.r, "LoRA adapter");
            model.with_lora(adapter.config, Some(adapter.tensors), seed)?
        }
        (None, Some(lora)) => model.with_lora(lora, None, seed)?,
        (None, None) => model,
    })
}

/// The key of the LoRA dropout masks of micro-batch `micro` of optimizer step `step` (distinct for
/// every pair; the masks hash it with each token's place).
pub fn dropout_key(seed: u64, step: usize, micro: usize) -> u64 {
    seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ ((step as u64) << 20) ^ micro as u64
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
    /// Passes over the data begun, counted from 0.
    pub epoch: u64,
    /// Position of the next example in the current epoch's order.
    pub cursor: usize,
}

impl DataOrder {
    /// The order of `len` examples at `cursor` in epoch `epoch` (a cursor past the end is an error: the
    /// data is not the one the position was saved with).
    pub fn new(len: usize, seed: u64, epoch: u64, cursor: usize) -> Result<Self> {
        if len == 0 || cursor > len {
            return Err(TrainError::Checkpoint(format!(
                "data position {cursor} does not fit data of {len} examples"
            )));
        }
        Ok(Self {
            len,
            seed,
            order: shuffled(len, seed.wrapping_add(epoch)),
            epoch,
            cursor,
        })
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

/// A run's training items (examples, pairs or prompts), what they are called and where they came from.
pub struct TrainingData<'a, T> {
    /// The items the data order walks.
    pub items: &'a [T],
    /// Their name in messages ("examples", "pairs", "prompts").
    pub what: &'a str,
    /// The file they were read from.
    pub path: &'a Path,
}

/// What one optimizer step measured.
pub struct StepReport {
    /// The step's loss: the micro-batches' losses, weighted as they were added.
    pub loss: f64,
    /// The step's gradient of every parameter, summed over its micro-batches, not yet clipped.
    pub grads: Vec<(String, Tensor)>,
    /// Real (unpadded) tokens of the step.
    pub tokens: usize,
    /// The highest backward peak of the step's micro-batches, in bytes (0 when not measured).
    pub peak_bytes: usize,
    /// Objective metrics (DPO rewards …), averaged over the step's micro-batches.
    pub metrics: Vec<(String, f64)>,
}

/// The optimizer step and its bookkeeping: clipping, schedule, AdamW, metrics.jsonl, progress bar,
/// periodic atomic checkpoints with resumable state.
pub struct Trainer {
    /// AdamW over the policy's parameters.
    pub optimizer: AdamW,
    /// The step the run ends at: `--max-steps`, or `--epochs` over the data.
    pub max_steps: usize,
    /// The first step to take: 0, or the resumed checkpoint's step.
    pub start_step: usize,
    /// Which examples come next.
    pub data: DataOrder,
    /// The run's settings, written into every resumable checkpoint.
    run: RunRecord,
    metrics: MetricsLog,
    bar: indicatif::ProgressBar,
    started: Instant,
    step_started: Instant,
    /// The loss of the first step this process took (NaN before it).
    pub first_loss: f64,
    /// The loss of the latest step.
    pub last_loss: f64,
    last_good: Option<PathBuf>,
}

impl Trainer {
    /// The trainer of a `recipe` run over `data`: checks that a step fits the data, records the run
    /// (its settings, `extra` ones included, and the data's fingerprint) and, resuming, compares that
    /// record with the checkpoint's and restores the optimizer and data position. Call it before any
    /// long work (evaluation), so that a refused run stops at once.
    pub fn new<T: Digest>(
        cfg: &TrainConfig,
        setup: &Setup,
        recipe: Recipe,
        data: &TrainingData<T>,
        extra: RunRecord,
    ) -> Result<Self> {
        let examples = data.items.len();
        cfg.check_data_size(examples, data.what, data.path)?;
        let mut run = cfg.record(recipe);
        run.extend(extra);
        run.insert("data".into(), data_identity(data.items));
        let mut optimizer = AdamW::new(
            setup.model.parameters(),
            AdamWConfig {
                weight_decay: cfg.weight_decay,
                ..Default::default()
            },
        )?;
        let per_step = cfg.examples_per_step()?;
        let max_steps = cfg
            .max_steps
            .unwrap_or(((examples as f64 * cfg.epochs) / per_step as f64).ceil() as usize)
            .max(1);
        let (start_step, epoch, cursor, seed) = match &cfg.resume {
            Some(dir) => {
                let state = TrainerState::read(dir)?;
                check_resume(dir, &state.run, &run)?;
                if state.step >= max_steps {
                    return Err(TrainError::Checkpoint(format!(
                        "{} is at step {}, and the run ends at step {max_steps}: nothing left to \
                         train (raise --max-steps)",
                        dir.display(),
                        state.step
                    )));
                }
                let path = dir.join(OPTIMIZER_FILE);
                let moments =
                    candle_core::safetensors::load(&path, &setup.device).map_err(|e| {
                        TrainError::Checkpoint(format!("cannot read {}: {e}", path.display()))
                    })?;
                optimizer.load_state(&moments, state.step)?;
                tracing::info!(step = state.step, dir = %dir.display(), "resumed");
                // The order the position was saved in is the checkpoint's seed's.
                (state.step, state.epoch, state.cursor, state.seed)
            }
            None => (0, 0, 0, cfg.seed),
        };
        let same_dir = |checkpoint: &&PathBuf| {
            let real = |p: &Path| std::fs::canonicalize(p).ok();
            checkpoint.parent().and_then(real).is_some()
                && checkpoint.parent().and_then(real) == real(&cfg.output_dir)
        };
        let kept_rows = cfg.resume.as_ref().filter(same_dir).map(|_| start_step);
        let metrics = MetricsLog::open(&cfg.output_dir, kept_rows)?;
        let bar = progress_bar(max_steps, cfg.progress);
        bar.set_position(start_step as u64);
        Ok(Self {
            optimizer,
            max_steps,
            start_step,
            data: DataOrder::new(examples, seed, epoch, cursor)?,
            run,
            metrics,
            bar,
            started: Instant::now(),
            step_started: Instant::now(),
            first_loss: f64::NAN,
            last_loss: f64::NAN,
            last_good: None,
        })
    }

    /// The held-out metrics before training, from `measure`; none when resuming (the checkpoint's
    /// model is not the one the run began with).
    pub fn held_out_before(
        &self,
        measure: impl FnOnce() -> Result<Vec<(String, f64)>>,
    ) -> Result<Vec<(String, f64)>> {
        match self.start_step {
            0 => measure(),
            _ => Ok(Vec::new()),
        }
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
            return Err(TrainError::NonFiniteLoss {
                loss,
                step: step + 1,
                last_good: self
                    .last_good
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_else(|| "none yet".into()),
            });
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
        self.metrics.write(&record)?;
        self.bar.set_message(format!(
            "loss {loss:.4} lr {lr:.2e} {:.0} tok/s peak {:.0} MiB",
            tokens as f64 / seconds,
            peak_bytes as f64 / (1 << 20) as f64
        ));
        self.bar.inc(1);
        if cfg.save_every > 0
            && (step + 1).is_multiple_of(cfg.save_every)
            && step + 1 < self.max_steps
        {
            let dir = cfg.output_dir.join(format!("checkpoint-{}", step + 1));
            let state = TrainerState {
                step: step + 1,
                epoch: self.data.epoch,
                cursor: self.data.cursor,
                seed: cfg.seed,
                run: self.run.clone(),
            };
            let state = serde_json::to_string_pretty(&state)
                .map_err(|e| TrainError::Internal(format!("trainer state: {e}")))?;
            let config_json = setup.model_dir.join("config.json");
            let files = CheckpointFiles {
                extra: &[(STATE_FILE, state)],
                optimizer: Some(&self.optimizer.state()),
                ..setup.checkpoint_files(cfg, &config_json)
            };
            save_checkpoint(&files, &dir)?;
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
        let config_json = setup.model_dir.join("config.json");
        save_checkpoint(&setup.checkpoint_files(cfg, &config_json), &dir)?;
        if cfg.merge {
            // The adapter merged into the base: a plain HF model, for tools that know no PEFT.
            let merged = Model::from_tensors(
                setup.model.config.clone(),
                setup.model.merged_weights()?.into_iter().collect(),
            )?;
            let files = CheckpointFiles {
                model: &merged,
                ..setup.checkpoint_files(cfg, &config_json)
            };
            save_checkpoint(&files, &cfg.output_dir.join("merged"))?;
        }
        // The run is saved; a chart that cannot be drawn costs nothing but the chart.
        let plots = cfg.output_dir.join("plots");
        if let Err(e) = crate::plots::plot_metrics(&cfg.output_dir.join("metrics.jsonl"), &plots) {
            tracing::warn!(error = %e, "no metrics plot");
        }
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

/// `metrics.jsonl`: one JSON line per step. A run resumed from a checkpoint of this output directory
/// keeps the rows up to the step it resumes from and drops the later ones (an older checkpoint's later
/// steps are trained again), so every step appears once; any other run starts the file anew.
struct MetricsLog {
    path: PathBuf,
    file: std::fs::File,
}

impl MetricsLog {
    /// Opens `dir/metrics.jsonl`, keeping the rows up to step `keep` when given.
    fn open(dir: &Path, keep: Option<usize>) -> Result<Self> {
        let path = dir.join("metrics.jsonl");
        let kept = match keep {
            None => String::new(),
            Some(step) => match std::fs::read_to_string(&path) {
                Ok(text) => text
                    .lines()
                    .filter(|line| {
                        serde_json::from_str::<serde_json::Value>(line)
                            .ok()
                            .and_then(|v| v["step"].as_u64())
                            .is_some_and(|s| s as usize <= step)
                    })
                    .map(|line| format!("{line}\n"))
                    .collect(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
                Err(e) => return Err(TrainError::io("read", &path)(e)),
            },
        };
        // Rewritten whole, through a temporary file and a rename, so a kill here loses no rows.
        let tmp = dir.join(format!(".metrics.jsonl{TMP_MARK}{}", std::process::id()));
        std::fs::write(&tmp, kept).map_err(TrainError::io("write", &tmp))?;
        std::fs::rename(&tmp, &path).map_err(TrainError::io("write", &path))?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(TrainError::io("open", &path))?;
        Ok(Self { path, file })
    }

    fn write(&mut self, record: &serde_json::Value) -> Result<()> {
        writeln!(self.file, "{record}").map_err(TrainError::io("write", &self.path))
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

    /// The value of a metric of the step so far.
    pub fn metric(&self, name: &str) -> Option<f64> {
        self.metrics
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| *v)
    }

    /// Adds to a metric of the step (created at 0).
    pub fn add_metric(&mut self, name: &str, value: f64) {
        match self.metrics.iter_mut().find(|(n, _)| n == name) {
            Some((_, acc)) => *acc += value,
            None => self.metrics.push((name.to_string(), value)),
        }
    }

    /// The step's report; an internal error when no micro-batch was added.
    pub fn into_report(self) -> Result<StepReport> {
        Ok(StepReport {
            loss: self.loss,
            grads: self.grads.ok_or_else(|| {
                TrainError::Internal("an optimizer step without a micro-batch".into())
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
