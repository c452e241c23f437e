//! What a run is configured by, validated in one place before anything is loaded: every numeric flag
//! against its range (each error names the flag and the range), and the settings TRL or transformers
//! refuse. The defaults live here too ([`TrainConfig::defaults`], [`GrpoConfig::defaults`]); each
//! job's own (β, the built-in task's run) are its row of the recipe table ([`crate::recipes`]).

use std::path::PathBuf;

use streambp_core::{CheckpointEvery, Chunks, Mode};
use streambp_models::{LoraConfig, ModelError, Projection};
use streambp_objectives::{
    CpoLoss, DpoLoss, DpoLossType, GrpoLossType, ImportanceSampling, KtoLoss, VespoGamma,
};

use crate::data::Overflow;
use crate::optim::Schedule;
use crate::parallel::ZeroStage;
use crate::sampling::SamplingConfig;
use crate::{Result, TrainError};

use crate::recipes::Beta;
pub use crate::recipes::Recipe;

/// Everything a run is configured by (the CLI flags mirror these).
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Model directory or hub id; `None`: the built-in tiny model (see `builtin_model`).
    pub model: Option<String>,
    /// What the built-in model starts from when `model` is `None`.
    pub builtin_model: BuiltinModel,
    /// Training data: a JSONL, JSON or Parquet file, a directory of shards or a hub dataset id;
    /// `None`: the built-in arithmetic task.
    pub data: Option<PathBuf>,
    /// The split of `data` to train on (a directory or hub data set).
    pub split: String,
    /// The configuration of a data set that has several (its top-level directory).
    pub data_config: Option<String>,
    /// The column SFT trains on as plain text where a row has no other TRL field (TRL's
    /// `dataset_text_field`).
    pub text_field: String,
    /// Held-out prompt/completion rows scored before and after (exact-match accuracy of greedy
    /// answers): a file, directory or hub id like `data`.
    pub eval_data: Option<PathBuf>,
    /// The split of the held-out data; given without `eval_data`, a split of `data`.
    pub eval_split: Option<String>,
    /// Where `metrics.jsonl`, the plots and the checkpoints go.
    pub output_dir: PathBuf,
    /// Replace an earlier run's outputs in `output_dir` (else a fresh run refuses such a directory).
    pub overwrite_output_dir: bool,
    /// Optimizer steps; `None`: `epochs` passes over the data.
    pub max_steps: Option<usize>,
    /// Passes over the data when `max_steps` is `None` (above 0; fractions allowed).
    pub epochs: f64,
    /// Examples (SFT), pairs (DPO) or prompts (GRPO) per micro-batch.
    pub batch_size: usize,
    /// Micro-batches per optimizer step (the loss is normalised over all their target tokens).
    pub grad_accum: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// AdamW's decoupled weight decay (not on biases and norms).
    pub weight_decay: f64,
    /// Steps of linear warmup to `lr`.
    pub warmup_steps: usize,
    /// How the learning rate decays from `lr` after warmup.
    pub schedule: Schedule,
    /// Global gradient-norm clip (0: off).
    pub max_grad_norm: f64,
    /// Seeds the data order, the built-in model's random init and GRPO's sampling.
    pub seed: u64,
    /// Longest sequence in tokens (GRPO: prompt + completion).
    pub max_length: usize,
    /// What to do with examples longer than `max_length`.
    pub overflow: Overflow,
    /// SFT: pack whole examples into rows of up to `max_length` tokens (documents kept apart).
    pub packing: bool,
    /// How the backward is computed (stream, checkpoint or full).
    pub mode: Mode,
    /// Query chunk of the streamed backward, in tokens.
    pub chunk: usize,
    /// Positions per LM-head chunk.
    pub logits_chunk: usize,
    /// Pick chunk sizes per micro-batch so the backward's estimated peak fits this many bytes
    /// (overrides `chunk` and `logits_chunk`).
    pub memory_budget: Option<u64>,
    /// Host memory the memory budget may move the stored checkpoints into, off an accelerator.
    pub host_memory_budget: Option<u64>,
    /// What frozen models the objective reads hold beside the policy during its backward, counted
    /// against `memory_budget` (distillation's teacher, a reference's weights; set by the job that loads it).
    pub frozen: streambp_core::Frozen,
    /// Keep layer checkpoints in host memory during the backward.
    pub offload_checkpoints: bool,
    /// Store every K-th layer's input only, recomputing the others' a segment at a time in the
    /// backward (the same gradients; less memory for one more forward of the layers between).
    pub checkpoint_every: CheckpointEvery,
    /// Keep the stored checkpoints in a scratch file in this directory instead of memory (written
    /// in the forward, read back in the backward, freed after each step even if killed).
    pub checkpoint_dir: Option<PathBuf>,
    /// `f32`, `bf16` or `f64`, parsed by [`crate::device::parse_dtype`].
    pub dtype: String,
    /// `cpu`, `cuda` or `cuda:N`, parsed by [`crate::device::parse_device`].
    pub device: String,
    /// Save a resumable checkpoint every this many steps (0: none but the last step's, which a run
    /// always saves).
    pub save_every: usize,
    /// Measure the held-out metrics every this many steps (0: before and after training only).
    pub eval_every: usize,
    /// Continue from this checkpoint (weights, optimizer, schedule, data position).
    pub resume: Option<PathBuf>,
    /// DPO: β (above 0). GRPO: the KL weight β (0: no reference model).
    pub beta: f64,
    /// DPO: weight of the chosen completions' mean token NLL added to the loss (0: plain DPO).
    pub sft_weight: f64,
    /// DPO: TRL's loss types and weights, label smoothing and DiscoPOP's τ (default: sigmoid);
    /// `sft_weight` adds its `sft` term to these.
    pub dpo_loss: DpoLoss,
    /// CPO's loss (`cpo`: `--loss-type`, `--label-smoothing`, `--cpo-alpha`, `--simpo-gamma`,
    /// `--alphapo-alpha`).
    pub cpo_loss: CpoLoss,
    /// KTO's loss (`kto`: `--loss-type`, `--desirable-weight`, `--undesirable-weight`).
    pub kto_loss: KtoLoss,
    /// The reward model's `center_rewards_coefficient` (`reward`; none by default, as TRL's).
    pub center_rewards_coefficient: Option<f64>,
    /// DPO: the reference model's directory or hub id; `None`: a frozen copy of the initial policy.
    pub ref_model: Option<String>,
    /// Show the progress bar.
    pub progress: bool,
    /// Train a fresh LoRA adapter with these settings instead of every weight.
    pub lora: Option<LoraConfig>,
    /// Continue training this PEFT LoRA adapter (a directory or hub id) on the model.
    pub adapter: Option<String>,
    /// With LoRA: also write the model with the adapter merged in (`<output-dir>/merged`).
    pub merge: bool,
    /// What each data-parallel rank keeps (ZeRO 0, 1 or 2); nothing changes with one process.
    pub zero: ZeroStage,
    /// Ranks each sequence is split over (sequence parallelism, `--sp`): a divisor of the job's ranks,
    /// the other factor data parallelism.
    pub sp: usize,
}

/// Which loss a run on sampled completions trains with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// GRPO: group-normalised advantages, `--loss-type` and its settings, the KL in the loss.
    Grpo,
    /// RLOO: the KL in the reward, leave-one-out advantages (normalised over the step's batch
    /// when asked), one clipped ratio per completion.
    Rloo {
        /// TRL's `normalize_advantages`.
        normalize_advantages: bool,
    },
    /// On-policy distillation (TRL's `DistillationTrainer`): one completion per prompt from the
    /// student, which learns the teacher's next-token distributions on it (`--beta` selects the
    /// divergence).
    Distill,
}

impl Algorithm {
    /// The job that trains with it.
    pub fn recipe(self) -> Recipe {
        match self {
            Algorithm::Grpo => Recipe::Grpo,
            Algorithm::Rloo { .. } => Recipe::Rloo,
            Algorithm::Distill => Recipe::Distill,
        }
    }
}

/// The settings of the jobs that sample completions from the policy and learn from them (`grpo`,
/// `rloo` from their rewards, `distill` from a teacher) beyond the shared ones.
#[derive(Debug, Clone)]
pub struct GrpoConfig {
    /// GRPO, RLOO or distillation.
    pub algorithm: Algorithm,
    /// `distill`'s teacher (a model directory or hub id); on the built-in task, the shipped SFT
    /// checkpoint where none is given.
    pub teacher: Option<String>,
    /// Completions sampled per prompt (at least 2; distillation's 1).
    pub group_size: usize,
    /// Temperature, top-p and the longest completion.
    pub sampling: SamplingConfig,
    /// `exact:COLUMN` / `format:REGEX`, summed.
    pub rewards: Vec<String>,
    /// How per-token losses are reduced.
    pub loss_type: GrpoLossType,
    /// Clipping ε of the probability ratio, below (and above unless `epsilon_high` is given).
    pub epsilon: f64,
    /// The upper clip `1 + ε_high`, or cispo's cap on the ratio `ε_high` itself [default: ε].
    pub epsilon_high: Option<f64>,
    /// What each group's centred rewards are divided by (TRL's `scale_rewards`).
    pub scale_rewards: crate::rewards::ScaleRewards,
    /// Completions cut at `max_new_tokens` (no EOS) leave the loss (TRL's
    /// `mask_truncated_completions`).
    pub mask_truncated_completions: bool,
    /// sapo's gate temperatures for positive and negative advantages (TRL's
    /// `sapo_temperature_pos` / `_neg`: 1.0 and 1.05).
    pub sapo_temperatures: (f64, f64),
    /// One importance weight per token or per completion (GSPO; TRL's
    /// `importance_sampling_level`).
    pub importance_sampling: ImportanceSampling,
    /// vespo's gamma weights (TRL's `vespo_k_pos`, `vespo_lambda_pos`, `_neg`).
    pub vespo_gamma: VespoGamma,
    /// Completions with a negative advantage that drifted further than this from the policy that
    /// sampled them leave the policy term (TRL's `off_policy_mask_threshold`).
    pub off_policy_mask_threshold: Option<f64>,
    /// The weight of the completion tokens' mean entropy subtracted from the loss (TRL's
    /// `entropy_coef`).
    pub entropy_coef: f64,
    /// Only the completion tokens in this top quantile by entropy keep their policy term (TRL's
    /// `top_entropy_quantile`, in [0, 1]).
    pub top_entropy_quantile: f64,
    /// `entropy_coef` moved each optimizer step by the entropy seen (TRL's `use_adaptive_entropy`);
    /// `None`: a fixed coefficient.
    pub adaptive_entropy: Option<AdaptiveEntropy>,
    /// Optimizer steps per batch of rollouts (old log-probs fixed before the first).
    pub num_iterations: usize,
}

/// TRL's adaptive entropy control (Skywork-OR1): after each optimizer step the entropy
/// coefficient rises by `delta` (to at most `max`) when the step's mean entropy over the tokens the
/// bonus acts on is at most `target`, and falls by `delta` (to at least `min`) otherwise; the bonus
/// applies only while that entropy is at most `target`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveEntropy {
    /// The lowest coefficient (TRL's `entropy_coef_min`, 0).
    pub min: f64,
    /// The highest coefficient (`entropy_coef_max`, 1).
    pub max: f64,
    /// The step of the coefficient (`entropy_coef_delta`, 0.005).
    pub delta: f64,
    /// The entropy, in nats, at or below which the bonus applies (`entropy_target`, 0.2).
    pub target: f64,
}

impl Default for AdaptiveEntropy {
    fn default() -> Self {
        Self {
            min: 0.0,
            max: 1.0,
            delta: 0.005,
            target: 0.2,
        }
    }
}

/// The model a run starts from when no `--model` is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuiltinModel {
    /// The built-in config, randomly initialised (`sft`, `grpo`).
    Random,
    /// The shipped SFT checkpoint of the arithmetic task (`dpo`: preference tuning refines a model
    /// that already answers).
    Sft,
}

impl TrainConfig {
    /// The configuration of `recipe` with nothing given: on the built-in task when `builtin` (no
    /// model, no data), else the defaults for a user's own model and data (who then sets `model` and
    /// `data`). The one place the defaults are written down: the command line starts from here and
    /// overrides what is typed.
    pub fn defaults(recipe: Recipe, builtin: bool) -> Self {
        let own = TrainConfig {
            model: None,
            builtin_model: BuiltinModel::Random,
            data: None,
            split: "train".into(),
            data_config: None,
            text_field: "text".into(),
            eval_data: None,
            eval_split: None,
            output_dir: format!("runs/{}", recipe.name()).into(),
            overwrite_output_dir: false,
            max_steps: None,
            epochs: 1.0,
            batch_size: 8,
            grad_accum: 1,
            lr: 2e-5,
            weight_decay: 0.0,
            warmup_steps: 0,
            schedule: Schedule::Cosine,
            max_grad_norm: 1.0,
            seed: 42,
            max_length: 2048,
            // TRL's RewardTrainer drops pairs longer than max_length; its other trainers cut them.
            overflow: match recipe {
                Recipe::Reward => Overflow::Skip,
                _ => Overflow::Truncate,
            },
            packing: false,
            mode: Mode::Stream,
            chunk: 512,
            logits_chunk: 128,
            memory_budget: None,
            host_memory_budget: None,
            frozen: Default::default(),
            offload_checkpoints: false,
            checkpoint_every: CheckpointEvery::default(),
            checkpoint_dir: None,
            dtype: "f32".into(),
            device: "cpu".into(),
            save_every: 0,
            eval_every: 0,
            resume: None,
            beta: match recipe.facts().beta {
                Beta::Positive(b) | Beta::NonNegative(b) | Beta::UnitInterval(b) => b,
                // A job without β keeps DPO's, so that its configuration can be turned into a DPO
                // run's by changing the fields DPO reads.
                Beta::Unused => crate::recipes::DPO_BETA,
            },
            sft_weight: 0.0,
            dpo_loss: DpoLoss::default(),
            cpo_loss: CpoLoss::default(),
            kto_loss: KtoLoss::default(),
            center_rewards_coefficient: None,
            ref_model: None,
            progress: true,
            lora: None,
            adapter: None,
            merge: false,
            zero: ZeroStage::Zero0,
            sp: 1,
        };
        if !builtin {
            return own;
        }
        // The built-in task: 16-token sums, tiny chunks so the streamed backward really streams.
        let task = TrainConfig {
            max_length: 16,
            chunk: 8,
            logits_chunk: 8,
            ..own
        };
        (recipe.facts().builtin)(task)
    }
}

/// The largest `--group-size`: far above TRL's usual 8..64, and small enough that a typo (`100000000`)
/// is an error rather than an allocation failure.
pub const MAX_GROUP_SIZE: usize = 1024;

impl GrpoConfig {
    /// GRPO's settings with nothing given (TRL's defaults where it has them); on the built-in task,
    /// answers of at most 5 tokens.
    pub fn defaults(builtin: bool) -> Self {
        GrpoConfig {
            algorithm: Algorithm::Grpo,
            teacher: None,
            group_size: 8,
            sampling: SamplingConfig {
                temperature: 1.0,
                top_p: 1.0,
                max_new_tokens: if builtin { 5 } else { 256 },
            },
            rewards: Vec::new(),
            // TRL 1.16's default.
            loss_type: GrpoLossType::Dapo,
            epsilon: 0.2,
            epsilon_high: None,
            scale_rewards: crate::rewards::ScaleRewards::Group,
            mask_truncated_completions: false,
            sapo_temperatures: (1.0, 1.05),
            importance_sampling: ImportanceSampling::Token,
            vespo_gamma: VespoGamma::default(),
            off_policy_mask_threshold: None,
            entropy_coef: 0.0,
            top_entropy_quantile: 1.0,
            adaptive_entropy: None,
            num_iterations: 1,
        }
    }

    /// RLOO's settings with nothing given (TRL's `RLOOConfig` defaults: two completions a prompt;
    /// the built-in task's, eight), advantages normalised when `normalize_advantages`.
    pub fn rloo_defaults(builtin: bool, normalize_advantages: bool) -> Self {
        GrpoConfig {
            algorithm: Algorithm::Rloo {
                normalize_advantages,
            },
            group_size: if builtin { 8 } else { 2 },
            ..Self::defaults(builtin)
        }
    }

    /// Distillation's settings with nothing given (TRL's `DistillationConfig` defaults: one
    /// completion per prompt of at most 512 tokens; the built-in task's, 5), from `teacher`.
    pub fn distill_defaults(builtin: bool, teacher: Option<String>) -> Self {
        let d = Self::defaults(builtin);
        GrpoConfig {
            algorithm: Algorithm::Distill,
            teacher,
            group_size: 1,
            sampling: SamplingConfig {
                max_new_tokens: if builtin { 5 } else { 512 },
                ..d.sampling
            },
            ..d
        }
    }
}

/// The LoRA flags of `sft`, `dpo`, `grpo` and `grad`.
#[derive(Debug, Clone, Default, clap::Args)]
#[command(next_help_heading = "Model")]
pub struct LoraArgs {
    /// Train a LoRA adapter of this rank instead of every weight (PEFT's semantics and file format).
    #[arg(long)]
    pub lora_r: Option<usize>,
    /// LoRA's alpha: the adapter's output is scaled by alpha / r [default: 2 × r, as TRL's defaults].
    #[arg(long, allow_negative_numbers = true)]
    pub lora_alpha: Option<f64>,
    /// The projections that get adapters: all-linear (every one, never the LM head, as PEFT
    /// resolves it) or names among q_proj k_proj v_proj o_proj gate_proj up_proj down_proj
    /// (repeat the flag or separate with commas) [default: all-linear].
    #[arg(long)]
    pub lora_target: Vec<String>,
    /// rsLoRA: scale by alpha / √r.
    #[arg(long)]
    pub use_rslora: bool,
    /// Dropout on the adapters' inputs, in [0, 1) [default: 0]; exact in every engine mode.
    #[arg(long, allow_negative_numbers = true)]
    pub lora_dropout: Option<f64>,
    /// Start from this PEFT LoRA adapter (a directory or hub id) and train it further; it brings its
    /// own r, alpha, targets and dropout.
    #[arg(long)]
    pub adapter: Option<String>,
}

impl LoraArgs {
    /// The fresh adapter's settings, `None` without `--lora-r`; the other LoRA flags need it.
    pub fn config(&self) -> Result<Option<LoraConfig>> {
        let Some(r) = self.lora_r else {
            let stray = [
                ("--lora-alpha", self.lora_alpha.is_some()),
                ("--lora-target", !self.lora_target.is_empty()),
                ("--use-rslora", self.use_rslora),
                ("--lora-dropout", self.lora_dropout.is_some()),
            ];
            return match stray.into_iter().find(|(_, given)| *given) {
                Some((flag, _)) => Err(TrainError::flag(flag, "", "needs --lora-r")),
                None => Ok(None),
            };
        };
        let targets = match self.lora_target.is_empty() {
            true => vec!["all-linear".to_string()],
            false => self.lora_target.clone(),
        };
        let targets = Projection::parse_targets(&targets)
            .map_err(|e| TrainError::flag("--lora-target", targets.join(","), e.to_string()))?;
        Ok(Some(LoraConfig {
            r,
            alpha: self.lora_alpha.unwrap_or(2.0 * r as f64),
            targets,
            use_rslora: self.use_rslora,
            dropout: self.lora_dropout.unwrap_or(0.0),
        }))
    }
}

/// A finite number above 0.
fn positive(x: f64) -> bool {
    x.is_finite() && x > 0.0
}

/// A finite number at least 0.
fn non_negative(x: f64) -> bool {
    x.is_finite() && x >= 0.0
}

/// `Err` naming `flag`, its value and the allowed range unless `ok`.
fn require(ok: bool, flag: &str, value: impl std::fmt::Display, expected: &str) -> Result<()> {
    match ok {
        true => Ok(()),
        false => Err(TrainError::flag(flag, value, expected)),
    }
}

/// The data a flag names must be there before the run starts: a file, a directory, or a hub dataset
/// id (`owner/name`, resolved when the data is read).
fn require_data(flag: &str, path: &Option<PathBuf>) -> Result<()> {
    match path {
        Some(p) if !p.exists() && !crate::dataset::looks_like_hub_id(&p.to_string_lossy()) => {
            Err(TrainError::flag(
                flag,
                p.display(),
                "no such file or directory, and not a hub dataset id (owner/name)",
            ))
        }
        _ => Ok(()),
    }
}

impl TrainConfig {
    /// DPO's loss: `dpo_loss` with `sft_weight`'s NLL term.
    pub fn dpo_loss_with_sft(&self) -> DpoLoss {
        match self.sft_weight > 0.0 {
            // `validate` refuses an `sft` term beside `sft_weight`: nothing is replaced.
            true => self.dpo_loss.clone().with_sft(self.sft_weight),
            false => self.dpo_loss.clone(),
        }
    }

    /// The job flags ([`crate::recipes::JOB_FLAGS`]) whose settings here are not their off values,
    /// so a job that does not take one refuses it (β has no off value: the command line checks it).
    fn job_flags_set(&self) -> Vec<&'static str> {
        let cpo = CpoLoss::default();
        let kto = KtoLoss::default();
        [
            ("--sft-weight", self.sft_weight != 0.0),
            ("--loss-type", self.dpo_loss != DpoLoss::default()),
            ("--loss-type", self.cpo_loss.loss_type != cpo.loss_type),
            ("--label-smoothing", self.cpo_loss.label_smoothing != 0.0),
            ("--cpo-alpha", self.cpo_loss.cpo_alpha != cpo.cpo_alpha),
            (
                "--simpo-gamma",
                self.cpo_loss.simpo_gamma != cpo.simpo_gamma,
            ),
            ("--alphapo-alpha", self.cpo_loss.alpha != cpo.alpha),
            (
                "--center-rewards-coefficient",
                self.center_rewards_coefficient.is_some(),
            ),
            ("--loss-type", self.kto_loss.loss_type != kto.loss_type),
            (
                "--desirable-weight",
                self.kto_loss.desirable_weight != kto.desirable_weight,
            ),
            (
                "--undesirable-weight",
                self.kto_loss.undesirable_weight != kto.undesirable_weight,
            ),
            ("--ref-model", self.ref_model.is_some()),
            ("--dataset-text-field", self.text_field != "text"),
            ("--packing", self.packing),
        ]
        .into_iter()
        .filter_map(|(flag, set)| set.then_some(flag))
        .collect()
    }

    /// Checks every setting of a `recipe` run against its range before anything is loaded.
    pub fn validate(&self, recipe: Recipe) -> Result<()> {
        self.check_step_settings()?;
        self.check_engine_settings()?;
        self.check_job_settings(recipe)?;
        self.check_lora_settings()?;
        self.check_data_settings()?;
        self.check_resume_settings()
    }

    /// How a step is made: batch, accumulation, length of the run, the optimizer and its schedule.
    fn check_step_settings(&self) -> Result<()> {
        require(
            self.batch_size >= 1,
            "--batch-size",
            self.batch_size,
            "must be at least 1",
        )?;
        require(
            self.grad_accum >= 1,
            "--grad-accum",
            self.grad_accum,
            "must be at least 1",
        )?;
        self.examples_per_step()?;
        if let Some(steps) = self.max_steps {
            require(steps >= 1, "--max-steps", steps, "must be at least 1")?;
        }
        require(
            positive(self.epochs),
            "--epochs",
            self.epochs,
            "must be a number above 0",
        )?;
        require(
            positive(self.lr),
            "--lr",
            self.lr,
            "must be a number above 0",
        )?;
        require(
            non_negative(self.weight_decay),
            "--weight-decay",
            self.weight_decay,
            "must be a number at least 0",
        )?;
        require(
            non_negative(self.max_grad_norm),
            "--max-grad-norm",
            self.max_grad_norm,
            "must be a number at least 0 (0 turns clipping off)",
        )?;
        Ok(())
    }

    /// What the engine is given: lengths, chunks, memory budget, dtype and device.
    fn check_engine_settings(&self) -> Result<()> {
        let reason = |e: ModelError| match e {
            ModelError::Input(reason) => reason,
            other => other.to_string(),
        };
        require(
            self.max_length >= 2,
            "--max-length",
            self.max_length,
            "must be at least 2 (a token to predict and one before it)",
        )?;
        require(self.chunk >= 1, "--chunk", self.chunk, "must be at least 1")?;
        require(
            self.logits_chunk >= 1,
            "--logits-chunk",
            self.logits_chunk,
            "must be at least 1",
        )?;
        if let Some(budget) = self.memory_budget {
            require(
                budget >= 1,
                "--memory-budget",
                budget,
                "must be above 0 bytes",
            )?;
        }
        if let Some(host) = self.host_memory_budget {
            require(
                self.memory_budget.is_some(),
                "--host-memory-budget",
                host,
                "needs --memory-budget (the plan it gives room to)",
            )?;
        }
        require(
            self.mode != Mode::Full || self.checkpoint_dir.is_none(),
            "--checkpoint-dir",
            self.checkpoint_dir
                .as_deref()
                .map_or(String::new(), |d| d.display().to_string()),
            "stores the layers' checkpoints of --mode stream or checkpoint; --mode full keeps none",
        )?;
        require(
            self.mode != Mode::Full || self.checkpoint_every == CheckpointEvery::default(),
            "--checkpoint-every",
            match self.checkpoint_every {
                CheckpointEvery::Layers(k) => k.to_string(),
                CheckpointEvery::Sqrt => "sqrt".into(),
            },
            "spaces the layers' checkpoints of --mode stream or checkpoint; --mode full keeps none",
        )?;
        require(self.sp >= 1, "--sp", self.sp, "must be at least 1")?;
        require(
            self.sp == 1 || self.mode != Mode::Full,
            "--sp",
            self.sp,
            "needs --mode stream or checkpoint (full backprop builds one graph of the whole rows)",
        )?;
        crate::device::parse_dtype(&self.dtype)
            .map_err(|e| TrainError::flag("--dtype", &self.dtype, reason(e)))?;
        crate::device::parse_device(&self.device)
            .map_err(|e| TrainError::flag("--device", &self.device, reason(e)))?;
        Ok(())
    }

    /// The job's own settings: β's range, the NLL weight, and the job flags it takes.
    fn check_job_settings(&self, recipe: Recipe) -> Result<()> {
        match recipe.facts().beta {
            Beta::Positive(_) => require(
                positive(self.beta),
                "--beta",
                self.beta,
                "must be a number above 0",
            )?,
            Beta::UnitInterval(_) => require(
                (0.0..=1.0).contains(&self.beta),
                "--beta",
                self.beta,
                "must be in [0, 1] (0: forward KL, 1: reverse KL, between: generalized JSD)",
            )?,
            Beta::NonNegative(_) | Beta::Unused => require(
                non_negative(self.beta),
                "--beta",
                self.beta,
                "must be a number at least 0",
            )?,
        }
        require(
            non_negative(self.sft_weight),
            "--sft-weight",
            self.sft_weight,
            "must be a number at least 0",
        )?;
        if self.sft_weight > 0.0 && self.dpo_loss.has(DpoLossType::Sft) {
            return Err(TrainError::flag(
                "--sft-weight",
                self.sft_weight,
                "and an sft in --loss-type both weigh the NLL: give one (--loss-type sigmoid,sft \
                 --loss-weights 1,W is --sft-weight W)",
            ));
        }
        self.dpo_loss.validate().map_err(|e| {
            TrainError::flag("--loss-type", self.dpo_loss.describe(), e.to_string())
        })?;
        if let Some(c) = self.center_rewards_coefficient {
            require(
                non_negative(c),
                "--center-rewards-coefficient",
                c,
                "must be a number at least 0",
            )?;
        }
        self.kto_loss.validate().map_err(|e| {
            let name = self.kto_loss.loss_type.name();
            TrainError::flag("--loss-type", name, e.to_string())
        })?;
        if recipe == Recipe::Kto && self.kto_loss.loss_type.uses_kl() {
            // TRL refuses it too ("Actual (not effective) batch size must be > 1").
            require(
                self.batch_size >= 2,
                "--batch-size",
                self.batch_size,
                "must be at least 2 for KTO's loss: its KL baseline pairs each prompt with another \
                 row's completion of the micro-batch, and with one row that is the row itself \
                 (raise --batch-size and lower --grad-accum, or give --loss-type apo_zero_unpaired)",
            )?;
        }
        self.cpo_loss.validate().map_err(|e| {
            let name = self.cpo_loss.loss_type.name();
            TrainError::flag("--loss-type", name, e.to_string())
        })?;
        recipe.check_job_flags(&self.job_flags_set())?;
        Ok(())
    }

    /// LoRA: a fresh adapter's rank, alpha and dropout, or an adapter to train further, and merging.
    fn check_lora_settings(&self) -> Result<()> {
        if let Some(lora) = &self.lora {
            require(lora.r >= 1, "--lora-r", lora.r, "must be at least 1")?;
            require(
                lora.alpha.is_finite() && lora.alpha > 0.0,
                "--lora-alpha",
                lora.alpha,
                "must be a number above 0",
            )?;
            require(
                lora.dropout >= 0.0 && lora.dropout < 1.0,
                "--lora-dropout",
                lora.dropout,
                "must be in [0, 1)",
            )?;
        }
        require(
            !(self.lora.is_some() && self.adapter.is_some()),
            "--adapter",
            self.adapter.as_deref().unwrap_or(""),
            "brings its own r, alpha and targets: give it without --lora-r",
        )?;
        require(
            !self.merge || self.lora.is_some() || self.adapter.is_some(),
            "--merge",
            "",
            "merges a LoRA adapter: give --lora-r or --adapter",
        )?;
        Ok(())
    }

    /// Training and held-out data: the sources exist, and splits and configs apply to them.
    fn check_data_settings(&self) -> Result<()> {
        require_data("--data", &self.data)?;
        require_data("--eval-data", &self.eval_data)?;
        for (flag, value) in [
            ("--split", Some(&self.split)),
            ("--eval-split", self.eval_split.as_ref()),
            ("--data-config", self.data_config.as_ref()),
            ("--dataset-text-field", Some(&self.text_field)),
        ] {
            if let Some(v) = value {
                require(!v.trim().is_empty(), flag, v, "a name, not empty")?;
            }
        }
        let names_a_data_set = |d: &Option<PathBuf>| d.as_ref().is_some_and(|p| !p.is_file());
        if self.data_config.is_some() && !names_a_data_set(&self.data) {
            return Err(TrainError::flag(
                "--data-config",
                self.data_config.as_deref().unwrap_or_default(),
                "applies to --data naming a directory or a hub dataset, not a file",
            ));
        }
        // A file has no splits: its rows are all used, so a split named for one would be ignored.
        if self.split != "train" && !names_a_data_set(&self.data) {
            return Err(TrainError::flag(
                "--split",
                &self.split,
                "applies to --data naming a directory or a hub dataset; a single file is used whole",
            ));
        }
        if let (Some(split), Some(file)) = (&self.eval_split, &self.eval_data) {
            if file.is_file() {
                return Err(TrainError::flag(
                    "--eval-split",
                    split,
                    format!(
                        "applies to --eval-data naming a directory or a hub dataset; {} is a file, used whole",
                        file.display()
                    ),
                ));
            }
        }
        if self.eval_split.is_some() && self.eval_data.is_none() && !names_a_data_set(&self.data) {
            return Err(TrainError::flag(
                "--eval-split",
                self.eval_split.as_deref().unwrap_or_default(),
                "needs --eval-data, or --data naming a directory or a hub dataset",
            ));
        }
        let held_out = self.eval_data.is_some()
            || self.data.is_none()
            || (self.eval_split.is_some() && names_a_data_set(&self.data));
        require(
            self.eval_every == 0 || held_out,
            "--eval-every",
            self.eval_every,
            "needs held-out data: give --eval-data, or --eval-split of a --data directory or hub \
             dataset",
        )?;
        Ok(())
    }

    /// A checkpoint to resume from is one.
    fn check_resume_settings(&self) -> Result<()> {
        if let Some(dir) = &self.resume {
            require(dir.is_dir(), "--resume", dir.display(), "no such directory")?;
            let state = dir.join(crate::checkpoint::STATE_FILE);
            require(
                state.is_file(),
                "--resume",
                dir.display(),
                &format!(
                    "is not a resumable checkpoint (no {}); give a checkpoint-N directory (a run \
                     writes one at its last step, and every --save-every steps; final/ holds the \
                     model only)",
                    crate::checkpoint::STATE_FILE
                ),
            )?;
        }
        Ok(())
    }

    /// Examples an optimizer step consumes (`--batch-size` × `--grad-accum`).
    pub fn examples_per_step(&self) -> Result<usize> {
        self.batch_size.checked_mul(self.grad_accum).ok_or_else(|| {
            TrainError::flag(
                "--batch-size × --grad-accum",
                format!("{} × {}", self.batch_size, self.grad_accum),
                "is too large to count",
            )
        })
    }

    /// Refuses a step that would need more examples than the data holds (the batch would repeat
    /// examples within one step); `ranks` data-parallel processes each take `--batch-size` rows.
    pub fn check_data_size(
        &self,
        examples: usize,
        what: &str,
        data: &str,
        ranks: usize,
    ) -> Result<()> {
        let per_step = self.examples_per_step()?.saturating_mul(ranks);
        let product = match ranks {
            1 => format!("{} × {} = {per_step}", self.batch_size, self.grad_accum),
            n => format!(
                "{} × {} × {n} ranks = {per_step}",
                self.batch_size, self.grad_accum
            ),
        };
        require(
            per_step <= examples,
            "--batch-size × --grad-accum",
            product,
            &format!(
                "is more than the {examples} {what} of {} (a step would repeat {what}); \
                 lower --batch-size or --grad-accum",
                data
            ),
        )
    }

    /// The chunk sizes as given (a memory budget replaces them per micro-batch).
    pub fn chunks(&self) -> Chunks {
        Chunks {
            chunk: self.chunk,
            logits_chunk: self.logits_chunk,
        }
    }
}

impl GrpoConfig {
    /// Checks GRPO's settings against their ranges (TRL refuses groups of one: their advantages are
    /// always zero) and parses the reward specs.
    pub fn validate(&self, train: &TrainConfig) -> Result<()> {
        require(
            self.group_size >= 2 || self.algorithm == Algorithm::Distill,
            "--group-size",
            self.group_size,
            "must be at least 2 (advantages compare completions within a group, as in TRL)",
        )?;
        require(
            self.group_size <= MAX_GROUP_SIZE,
            "--group-size",
            self.group_size,
            &format!(
                "must be at most {MAX_GROUP_SIZE} (each step samples and keeps every completion of a group)"
            ),
        )?;
        let t = self.sampling.temperature;
        require(
            t.is_finite() && t > 0.0,
            "--temperature",
            t,
            "must be a number above 0 (a group of greedy completions is all alike)",
        )?;
        let p = self.sampling.top_p;
        require(p > 0.0 && p <= 1.0, "--top-p", p, "must be in (0, 1]")?;
        let new = self.sampling.max_new_tokens;
        require(new >= 1, "--max-new-tokens", new, "must be at least 1")?;
        require(
            new < train.max_length,
            "--max-new-tokens",
            new,
            &format!(
                "must be below --max-length ({}), which bounds prompt + completion",
                train.max_length
            ),
        )?;
        require(
            self.num_iterations >= 1,
            "--num-iterations",
            self.num_iterations,
            "must be at least 1",
        )?;
        require(
            train.save_every.is_multiple_of(self.num_iterations),
            "--save-every",
            train.save_every,
            &format!(
                "must be a multiple of --num-iterations ({}): checkpoints fall between batches of \
                 rollouts, so that a resumed run draws what the uninterrupted one drew",
                self.num_iterations
            ),
        )?;
        require(
            self.epsilon.is_finite() && self.epsilon > 0.0,
            "--epsilon",
            self.epsilon,
            "must be a number above 0",
        )?;
        for (flag, value) in [
            ("--sapo-temperature-pos", self.sapo_temperatures.0),
            ("--sapo-temperature-neg", self.sapo_temperatures.1),
        ] {
            require(
                value.is_finite() && value > 0.0,
                flag,
                value,
                "must be a number above 0",
            )?;
        }
        let VespoGamma { positive, negative } = self.vespo_gamma;
        for (flag, value) in [
            ("--vespo-k-pos", positive.0),
            ("--vespo-lambda-pos", positive.1),
            ("--vespo-k-neg", negative.0),
            ("--vespo-lambda-neg", negative.1),
        ] {
            require(
                value.is_finite() && value >= 0.0,
                flag,
                value,
                "must be a number at least 0",
            )?;
        }
        if let Some(threshold) = self.off_policy_mask_threshold {
            require(
                threshold.is_finite(),
                "--off-policy-mask-threshold",
                threshold,
                "must be a number",
            )?;
        }
        require(
            self.entropy_coef.is_finite(),
            "--entropy-coef",
            self.entropy_coef,
            "must be a number",
        )?;
        require(
            (0.0..=1.0).contains(&self.top_entropy_quantile),
            "--top-entropy-quantile",
            self.top_entropy_quantile,
            "must be in [0, 1]",
        )?;
        if let Some(a) = self.adaptive_entropy {
            for (flag, value) in [
                ("--entropy-coef-min", a.min),
                ("--entropy-target", a.target),
            ] {
                require(value.is_finite(), flag, value, "must be a number")?;
            }
            require(
                a.delta.is_finite() && a.delta >= 0.0,
                "--entropy-coef-delta",
                a.delta,
                "must be a number at least 0",
            )?;
            require(
                a.max.is_finite() && a.max >= a.min,
                "--entropy-coef-max",
                a.max,
                &format!("must be a number at least --entropy-coef-min ({})", a.min),
            )?;
        }
        if let Some(high) = self.epsilon_high {
            require(
                high.is_finite() && high > 0.0,
                "--epsilon-high",
                high,
                "must be a number above 0",
            )?;
        }
        // A setting of another loss type's (one left at its default is not told from one not given).
        let d = GrpoConfig::defaults(false);
        let given = [
            (
                "epsilon",
                (self.epsilon != d.epsilon).then_some(self.epsilon),
            ),
            ("epsilon_high", self.epsilon_high),
            (
                "sapo_temperature_pos",
                (self.sapo_temperatures.0 != d.sapo_temperatures.0)
                    .then_some(self.sapo_temperatures.0),
            ),
            (
                "sapo_temperature_neg",
                (self.sapo_temperatures.1 != d.sapo_temperatures.1)
                    .then_some(self.sapo_temperatures.1),
            ),
            (
                "vespo_k_pos",
                (positive.0 != d.vespo_gamma.positive.0).then_some(positive.0),
            ),
            (
                "vespo_lambda_pos",
                (positive.1 != d.vespo_gamma.positive.1).then_some(positive.1),
            ),
            (
                "vespo_k_neg",
                (negative.0 != d.vespo_gamma.negative.0).then_some(negative.0),
            ),
            (
                "vespo_lambda_neg",
                (negative.1 != d.vespo_gamma.negative.1).then_some(negative.1),
            ),
        ];
        for (setting, value) in given {
            let why = value
                .and_then(|_| streambp_objectives::settings::unread(setting, &[self.loss_type]));
            if let (Some(value), Some(why)) = (value, why) {
                let flag = format!("--{}", setting.replace('_', "-"));
                return Err(TrainError::flag(&flag, value, why));
            }
        }
        for spec in &self.rewards {
            crate::rewards::parse_reward(spec)?;
        }
        Ok(())
    }
}
