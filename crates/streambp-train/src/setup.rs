//! What every training recipe sets up before its loop: the model (a directory, the hub or the built-in
//! task's), its tokenizer, LoRA adapters, DPO's reference, the data sources ([`Setup`]), and the
//! engine settings of each micro-batch (chunks, options). The optimizer step, metrics, evaluation,
//! checkpoints and resume are [`crate::trainer`]'s; the recipes (`sft.rs`, `dpo.rs`, `grpo.rs`) are
//! each one readable loop over the two.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use streambp_core::{ChunkPolicy, Chunks, Frozen, Options, Planned, Problem, Tiers};
use streambp_dist::Communicator;
use streambp_models::adapter::load_adapter;
use streambp_models::hub::ADAPTER_FILES;
use streambp_models::lora::DropoutKey;
use streambp_models::{
    load_model, resolve_adapter_dir, resolve_model_dir, LoraConfig, Model, ModelConfig,
};
use streambp_objectives::Objective;

use crate::checkpoint::{CheckpointFiles, RunRecord};
use crate::config::{BuiltinModel, Recipe, TrainConfig};
use crate::dataset::DataSource;
use crate::device::{parse_device, parse_dtype};
use crate::output::OutputDir;
use crate::tokenizer::TextTokenizer;
use crate::trainer::dropout_key;
use crate::{Result, TrainError};

/// The built-in task: files shipped in the repo, embedded so the binary works from anywhere.
mod builtin {
    pub const FILES: [(&str, &str); 7] = [
        (
            "config.json",
            include_str!("../assets/arithmetic/config.json"),
        ),
        (
            "tokenizer.json",
            include_str!("../assets/arithmetic/tokenizer.json"),
        ),
        (
            "tokenizer_config.json",
            include_str!("../assets/arithmetic/tokenizer_config.json"),
        ),
        (
            "train.jsonl",
            include_str!("../assets/arithmetic/train.jsonl"),
        ),
        (
            "test.jsonl",
            include_str!("../assets/arithmetic/test.jsonl"),
        ),
        ("dpo.jsonl", include_str!("../assets/arithmetic/dpo.jsonl")),
        (
            "dpo_test.jsonl",
            include_str!("../assets/arithmetic/dpo_test.jsonl"),
        ),
    ];

    /// Where [`super::materialize_builtin`] puts the shipped SFT checkpoint.
    pub const SFT_MODEL_DIR: &str = "sft-model";

    /// Written by `streambp-train sft --seed 2` (600 steps, 88.5% held-out accuracy).
    pub const SFT_WEIGHTS: &[u8] = include_bytes!("../assets/arithmetic/sft-model.safetensors");
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

/// `model` as the reward model a `reward` run trains: a sequence classifier as it is, a causal LM
/// with a fresh score head (seeded by `seed`) as transformers' `AutoModelForSequenceClassification`
/// gives it; its rows are padded with the tokenizer's pad token, and read before it (TRL sets the
/// model's `pad_token_id` to it).
fn reward_model(model: Model, tokenizer: &TextTokenizer, seed: u64) -> Result<Model> {
    let mut model = match model.scores_positions() {
        true => model,
        false => {
            tracing::info!(seed, "a fresh score head in place of the LM head");
            model.with_score_head(seed)?
        }
    };
    model.config.pad_token_id = Some(tokenizer.pad_id);
    Ok(model)
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
    /// The checked output directory, locked while the run lives (rank 0's; `None` on the others).
    pub output: Option<OutputDir>,
    /// Where the model the run started from comes from (a resumed run's reference is that model).
    pub initial: InitialModel,
    /// The run's ranks (one process, or MPI's world): gradients are reduced over all of them.
    pub comm: Arc<dyn Communicator>,
    /// The data-parallel ranks, each taking its own rows of every global batch: token counts, losses
    /// and metrics are summed over these (all ranks, or one per sequence group with `--sp`).
    pub data: Arc<dyn Communicator>,
    /// The ranks each sequence is split over (`--sp`), when it is.
    pub sequence: Option<Arc<dyn Communicator>>,
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
        let comm = streambp_dist::world();
        let crate::parallel::ParallelGroups { data, sequence } =
            crate::parallel::parallel_groups(comm.clone(), cfg.sp)?;
        let device = run_device(&cfg.device, comm.world_size())?;
        let dtype = parse_dtype(&cfg.dtype)?;
        // Resolve what the run reads before anything is written.
        let model_dir = cfg.model.as_deref().map(resolve_model_dir).transpose()?;
        let adapter_dir = cfg
            .adapter
            .as_deref()
            .map(resolve_adapter_dir)
            .transpose()?;
        // Rank 0 checks, locks and fills the output directory; the others read what it wrote.
        let (output, builtin) = prepare_output(cfg, comm.rank() == 0)?;
        comm.barrier()?;
        let initial = initial_model(cfg, model_dir, builtin.as_ref())?;
        let (model, model_dir, tokenizer) =
            load_for_recipe(cfg, recipe, &initial, adapter_dir, (dtype, &device))?;
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
            comm,
            data,
            sequence,
        })
    }

    /// Log-probs under a frozen `model` during training (references, GRPO's old policy), streamed
    /// with `cfg`'s chunks; on a split sequence every rank of its group runs its span.
    pub fn scorer<'a>(
        &'a self,
        cfg: &'a TrainConfig,
        model: &'a Model,
    ) -> impl FnMut(&Tensor, Option<&Tensor>, &Tensor, f64) -> Result<Tensor> + 'a {
        let chunks = move |ids: &Tensor| cfg.chunks_for(model, ids);
        crate::logprobs::scorer(model, chunks, self.sequence.clone())
    }

    /// The training data: `--data` (its `--split` and `--data-config`), or the built-in task's `file`.
    pub fn data_source(&self, cfg: &TrainConfig, file: &str) -> Result<DataSource> {
        match &cfg.data {
            Some(spec) => DataSource::resolve(spec, &cfg.split, cfg.data_config.as_deref()),
            None => self.builtin_file(file),
        }
    }

    /// A file of the built-in task.
    pub fn builtin_file(&self, file: &str) -> Result<DataSource> {
        match &self.builtin {
            Some(dir) => DataSource::file(&dir.join(file)),
            None => Err(TrainError::Internal(format!(
                "no data given and no built-in {file}"
            ))),
        }
    }

    /// The held-out prompt/completion rows: `--eval-data` (its `--eval-split`, by default `test`), a
    /// split of `--data` (`--eval-split`), or the built-in task's test split when the run trains on
    /// the built-in data.
    pub fn eval_source(&self, cfg: &TrainConfig) -> Result<Option<DataSource>> {
        let split = cfg.eval_split.as_deref();
        match (&cfg.eval_data, split, &cfg.data) {
            (Some(spec), split, _) => {
                DataSource::resolve(spec, split.unwrap_or("test"), None).map(Some)
            }
            (None, Some(split), Some(spec)) => {
                DataSource::resolve(spec, split, cfg.data_config.as_deref()).map(Some)
            }
            (None, _, None) if self.builtin.is_some() => self.builtin_file("test.jsonl").map(Some),
            _ => Ok(None),
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
        }
    }

    /// The built-in task's shipped SFT checkpoint, where the run uses the built-in task.
    pub fn builtin_sft_model(&self) -> Option<PathBuf> {
        self.builtin
            .as_ref()
            .map(|dir| dir.join(builtin::SFT_MODEL_DIR))
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

    /// The reference of a job that scores one against the policy (`--ref-model`, else the model
    /// the run started from) and what it holds beside the policy during the backward, for
    /// `--memory-budget`: its weights, unless they are the policy's own (LoRA's base).
    pub fn reference(&self, cfg: &TrainConfig) -> Result<(Model, Frozen)> {
        let reference = match &cfg.ref_model {
            Some(spec) => self.load_reference(spec)?,
            None => self.initial_reference(cfg)?,
        };
        let shared = cfg.ref_model.is_none() && self.model.lora().is_some();
        let frozen = match shared {
            true => Frozen::default(),
            false => Frozen::weights(&reference.config, reference.dtype()),
        };
        Ok((reference, frozen))
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
    if reference.scores_positions() != policy.scores_positions() {
        return Err(TrainError::Reference(format!(
            "--ref-model {spec}: {}; a reference scores the completions' log-probs as the policy \
             does, so it needs a causal LM's head too",
            match reference.scores_positions() {
                true => "a reward model (a sequence classifier), not a causal LM",
                false => "a causal LM, where the policy is a reward model",
            }
        )));
    }
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
    /// The chunk sizes and layers per stored checkpoint for a micro-batch `input_ids` (the
    /// backward of `objective`, whose head may hold more; `None`: a forward): as given, or what the
    /// memory budget allows for its shape (the largest chunks, and fewer stored checkpoints where
    /// the chunks would otherwise be small).
    pub fn plan_for(
        &self,
        model: &Model,
        input_ids: &Tensor,
        objective: Option<&dyn Objective>,
    ) -> Result<Planned> {
        let policy = match self.memory_budget {
            Some(budget) => {
                ChunkPolicy::Budget(budget, Tiers::of(&self.options(), self.host_memory_budget))
            }
            None => ChunkPolicy::Fixed(self.chunks()),
        };
        let (batch, seq_len) = input_ids.dims2()?;
        let mut problem =
            Problem::of(model, batch, seq_len, &self.options()).with_frozen(self.frozen);
        if let Some(objective) = objective {
            problem = problem.with_objective(objective);
        }
        Ok(policy.plan_for(problem)?)
    }

    /// The chunk sizes of [`TrainConfig::plan_for`] (for forwards, which store no checkpoints).
    pub fn chunks_for(&self, model: &Model, input_ids: &Tensor) -> Result<Chunks> {
        Ok(self.plan_for(model, input_ids, None)?.chunks)
    }

    /// The engine options of micro-batch `micro` of optimizer step `step`, whose rows start at
    /// `first_row` of the global batch: with LoRA dropout, its masks derive from (seed, step, micro)
    /// and each row's place, so every mode, every recomputation and every rank count sees the same.
    pub fn options_for(&self, step: usize, micro: usize, first_row: usize) -> Options {
        Options {
            dropout: Some(DropoutKey {
                key: dropout_key(self.seed, step, micro),
                first_row,
            }),
            ..self.options()
        }
    }

    /// Log-probs under a frozen `model`, streamed with this run's chunks, on this process alone
    /// (held-out evaluation, which rank 0 runs by itself; [`Setup::scorer`] for training).
    pub fn local_scorer<'a>(
        &'a self,
        model: &'a Model,
    ) -> impl FnMut(&Tensor, Option<&Tensor>, &Tensor, f64) -> Result<Tensor> + 'a {
        crate::logprobs::scorer(model, move |ids| self.chunks_for(model, ids), None)
    }

    fn options(&self) -> Options {
        Options {
            offload_checkpoints: self.offload_checkpoints,
            checkpoint_every: self.checkpoint_every,
            checkpoint_dir: self.checkpoint_dir.as_deref().map(Into::into),
            dropout: None,
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
        let lora = self.lora.as_ref();
        let targets: Option<Vec<&str>> = lora.map(|l| l.targets.iter().map(|p| p.name()).collect());
        put("--lora-r", lora.map(|l| l.r).into());
        put("--lora-alpha", lora.map(|l| l.alpha).into());
        put("--lora-target", targets.into());
        put("--use-rslora", lora.map(|l| l.use_rslora).into());
        put("--lora-dropout", lora.map(|l| l.dropout).into());
        put("--adapter", self.adapter.clone().into());
        put("--zero", self.zero.to_string().into());
        put("--sp", self.sp.into());
        (recipe.facts().record)(self, &mut run);
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
        (None, Some(lora)) => {
            if let Some(limit) = model.lora_rank_limit(&lora.targets) {
                if lora.r > limit {
                    return Err(TrainError::flag(
                        "--lora-r",
                        lora.r,
                        format!(
                            "must be at most {limit} for this model: the smallest dimension of a \
                             targeted projection (a higher rank adds parameters, not expressiveness)"
                        ),
                    ));
                }
            }
            model.with_lora(lora, None, seed)?
        }
        (None, None) => model,
    })
}

/// The device of `spec`; data parallel on GPUs (`cuda` over several processes): each rank on its
/// node's GPU of its local rank.
fn run_device(spec: &str, world_size: usize) -> Result<Device> {
    Ok(match (spec, world_size) {
        ("cuda", n) if n > 1 => parse_device(&format!("cuda:{}", streambp_dist::local_rank()))?,
        (spec, _) => parse_device(spec)?,
    })
}

/// On the main rank, the output directory checked and locked (an earlier run's files replaced
/// unless resuming) and, where no model or data is given, the built-in task written into it; its
/// directory on every rank.
fn prepare_output(
    cfg: &TrainConfig,
    is_main: bool,
) -> Result<(Option<OutputDir>, Option<PathBuf>)> {
    let output = is_main
        .then(|| OutputDir::prepare(&cfg.output_dir))
        .transpose()?;
    if let (Some(out), None) = (&output, &cfg.resume) {
        out.replace_earlier_run(cfg.overwrite_output_dir)?;
    }
    let builtin_dir = cfg.output_dir.join("builtin-task");
    let builtin = match (cfg.model.is_none() || cfg.data.is_none(), is_main) {
        (true, true) => Some(materialize_builtin(&builtin_dir)?),
        (true, false) => Some(builtin_dir),
        (false, _) => None,
    };
    Ok((output, builtin))
}

/// The model the run starts from: the given directory, else the built-in task's (random or its
/// SFT model, as `--builtin-model` says).
fn initial_model(
    cfg: &TrainConfig,
    model_dir: Option<PathBuf>,
    builtin: Option<&PathBuf>,
) -> Result<InitialModel> {
    Ok(match (model_dir, builtin) {
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
    })
}

/// The model `recipe` trains (resumed from `cfg.resume` where that holds a whole model; a reward
/// model's score head; LoRA's adapters, resumed, given or fresh), its directory and its tokenizer;
/// an error where the model is a reward model for another recipe or the tokenizer outgrows its
/// vocabulary.
fn load_for_recipe(
    cfg: &TrainConfig,
    recipe: Recipe,
    initial: &InitialModel,
    adapter_dir: Option<PathBuf>,
    (dtype, device): (DType, &Device),
) -> Result<(Model, PathBuf, TextTokenizer)> {
    // A LoRA checkpoint holds the adapter only, over the run's model; a full one the whole model.
    let resumed_adapter = cfg
        .resume
        .clone()
        .filter(|dir| dir.join(ADAPTER_FILES[0]).is_file());
    let (model, model_dir) = match (&cfg.resume, &resumed_adapter) {
        (Some(dir), None) => (load_model(dir, dtype, device)?, dir.clone()),
        _ => (initial.load(dtype, device)?, initial.dir().to_path_buf()),
    };
    if model.scores_positions() && recipe != Recipe::Reward {
        return Err(TrainError::flag(
            "--model",
            model_dir.display(),
            format!(
                "is a reward model (a sequence classifier with a score head): {} trains a \
                 causal LM",
                recipe.name()
            ),
        ));
    }
    let tokenizer = TextTokenizer::from_dir(&model_dir)?;
    let model = match recipe {
        Recipe::Reward => reward_model(model, &tokenizer, cfg.seed)?,
        _ => model,
    };
    let adapter_dir = resumed_adapter.or(adapter_dir);
    let model = attach_lora(model, adapter_dir, cfg.lora.clone(), cfg.seed)?;
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
    Ok((model, model_dir, tokenizer))
}
