//! The command line's flags: one struct per job, each turned into the library's run configuration with
//! the library's defaults (`TrainConfig::defaults`, `GrpoConfig::defaults`) for what is left out.

use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand};
use streambp_core::{CheckpointEvery, Mode};
use streambp_objectives::{
    CpoLoss, DpoLoss, GrpoLossType, ImportanceSampling, KtoLoss, KtoLossType, VespoGamma,
};
use streambp_train::config::{AdaptiveEntropy, GrpoConfig, LoraArgs, Recipe, TrainConfig};
use streambp_train::data::Overflow;
use streambp_train::grad::GradArgs;
use streambp_train::optim::Schedule;
use streambp_train::sampling::SamplingConfig;
use streambp_train::TrainError;

#[derive(Parser)]
#[command(
    name = "streambp-train",
    version,
    about = "Exact long-sequence training with StreamBP"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Supervised fine-tuning. With no arguments: a tiny Qwen3-shaped model learns two-digit addition
    /// (shipped in the repo) on the CPU in a minute or two, with held-out accuracy before and after.
    Sft(TrainArgs),
    /// Direct preference optimisation (TRL's loss types, sigmoid by default) on prompt/chosen/rejected
    /// rows, against a frozen reference. With no arguments: the built-in arithmetic pairs (correct vs
    /// wrong sums), from the shipped SFT checkpoint of the task.
    Dpo {
        #[command(flatten)]
        train: TrainArgs,
        #[command(flatten)]
        dpo: DpoArgs,
    },
    /// GRPO (TRL's loss): sample a group per prompt with a KV cache, reward it, learn from the
    /// group-normalised advantages. With no arguments: the shipped SFT checkpoint of the arithmetic
    /// task on its prompts, rewarded for the exact sum (exact:completion).
    Grpo {
        #[command(flatten)]
        train: TrainArgs,
        /// Boxed: GRPO's many flags would make every command as large.
        #[command(flatten)]
        grpo: Box<GrpoArgs>,
    },
    /// RLOO (TRL's RLOOTrainer): sample a group per prompt, reward it less --beta × its KL to the
    /// reference, learn from each completion's reward less the mean of the others' with one
    /// clipped ratio per completion. With no arguments: the shipped SFT checkpoint of the
    /// arithmetic task on its prompts, rewarded for the exact sum (exact:completion).
    Rloo {
        #[command(flatten)]
        train: TrainArgs,
        #[command(flatten)]
        rloo: RlooArgs,
    },
    /// On-policy distillation (TRL's DistillationTrainer): sample one completion per prompt from
    /// the model, which learns the --teacher's next-token distributions on it (--beta 1: reverse
    /// KL, 0: forward KL, between: generalized JSD). With no arguments: a randomly initialised
    /// model learns the arithmetic task from the shipped SFT checkpoint as teacher.
    Distill {
        #[command(flatten)]
        train: TrainArgs,
        #[command(flatten)]
        distill: DistillArgs,
    },
    /// ORPO (TRL's ORPOTrainer): the chosen sequences' NLL plus β × an odds-ratio term on
    /// prompt/chosen/rejected rows, no reference model. With no arguments: the built-in arithmetic
    /// pairs, from the shipped SFT checkpoint of the task.
    Orpo(TrainArgs),
    /// CPO (TRL's CPOTrainer): a loss on the policy's own margin plus --cpo-alpha × the chosen
    /// completions' NLL, no reference model; `--loss-type simpo --cpo-alpha 0` is SimPO. With no
    /// arguments: the built-in arithmetic pairs, from the shipped SFT checkpoint of the task.
    Cpo {
        #[command(flatten)]
        train: TrainArgs,
        #[command(flatten)]
        cpo: CpoArgs,
    },
    /// KTO (TRL's KTOTrainer) on unpaired prompt/completion/label rows (or pairs, unpaired) against a
    /// frozen reference. With no arguments: the built-in arithmetic pairs unpaired, from the shipped
    /// SFT checkpoint of the task.
    Kto {
        #[command(flatten)]
        train: TrainArgs,
        #[command(flatten)]
        kto: KtoArgs,
    },
    /// A reward model (TRL's RewardTrainer): Bradley-Terry on prompt/chosen/rejected rows, each row's
    /// reward the score head's output at its last token; a causal LM gets a fresh score head and is
    /// saved as a *ForSequenceClassification model. With no arguments: the built-in arithmetic pairs,
    /// from the shipped SFT checkpoint of the task.
    Reward {
        #[command(flatten)]
        train: TrainArgs,
        /// Adds this times the mean squared sum of each pair's rewards (TRL's
        /// center_rewards_coefficient; 0.01 is its suggestion), at least 0 [default: none].
        #[arg(long, allow_negative_numbers = true)]
        center_rewards_coefficient: Option<f64>,
    },
    /// One backward on a batch file; writes every gradient under its HF name and prints one JSON line
    /// {"loss","mode","peak_bytes","seconds","tokens",...}.
    Grad(GradArgs),
}

#[derive(clap::Args)]
pub struct TrainArgs {
    /// Training data in TRL's formats (sft: messages, prompt/completion or text; dpo:
    /// prompt/chosen/rejected or chosen/rejected with the prompt implicit; grpo: prompt, other columns
    /// go to the rewards): a .jsonl, .json or .parquet file, a directory of shards, or a hub dataset id
    /// such as trl-lib/Capybara [default: the built-in arithmetic task].
    #[arg(long, help_heading = "Data")]
    pub data: Option<PathBuf>,
    /// The split of --data to train on, where it is a directory or a hub dataset [default: train].
    #[arg(long, help_heading = "Data")]
    split: Option<String>,
    /// The configuration of a data set that has several (its top-level directory).
    #[arg(long, help_heading = "Data")]
    data_config: Option<String>,
    /// sft: the column trained on as plain text where a row has none of TRL's fields [default: text].
    #[arg(long, help_heading = "Data")]
    dataset_text_field: Option<String>,
    /// Prompt/completion rows scored by exact-match accuracy of greedy answers before and after: a
    /// file, directory or hub dataset id like --data.
    #[arg(long, help_heading = "Data")]
    eval_data: Option<PathBuf>,
    /// The split of the held-out data (of --eval-data, or else of --data) [default with --eval-data
    /// naming a directory or hub dataset: test].
    #[arg(long, help_heading = "Data")]
    eval_split: Option<String>,
    /// Longest sequence in tokens [default: 2048; built-in task: 16].
    #[arg(long, help_heading = "Data")]
    max_length: Option<usize>,
    /// What to do with longer examples: truncate or skip (the log says how many) [default: truncate;
    /// reward: skip, as TRL's RewardTrainer drops them].
    #[arg(long, help_heading = "Data")]
    overflow: Option<Overflow>,
    /// sft: pack whole examples into rows of up to --max-length tokens, best-fit decreasing; each
    /// example still sees only itself (positions restart, attention stays inside it), with less padding.
    #[arg(long, help_heading = "Data")]
    packing: bool,
    /// Model directory (HF format) or hub id [default: the built-in tiny model: random init for sft,
    /// the shipped SFT checkpoint of the task for dpo and grpo].
    #[arg(long, help_heading = "Model")]
    pub model: Option<String>,
    /// f32, bf16 or f64 [default: f32].
    #[arg(long, help_heading = "Model")]
    dtype: Option<String>,
    /// cpu, cuda or cuda:N (a build with --features cuda) [default: cpu].
    #[arg(long, help_heading = "Model")]
    device: Option<String>,
    /// DPO reference model [default: a frozen copy of the initial policy].
    #[arg(long, help_heading = "Model")]
    ref_model: Option<String>,
    #[command(flatten)]
    lora: LoraArgs,
    /// With LoRA: also write the model with the adapter merged in (W + s·B·A) as a plain HF model
    /// directory, <output-dir>/merged.
    #[arg(long, help_heading = "Model")]
    merge: bool,
    /// DPO β, above 0 [default: 0.1]; GRPO's KL weight β, at least 0 [default: 0, as in TRL];
    /// RLOO's KL weight in the reward, at least 0 [default: 0.05, as in TRL]; distill's divergence,
    /// in [0, 1]: 1 the reverse KL, 0 the forward KL, between the generalized JSD [default: 1, as
    /// in TRL].
    #[arg(long, help_heading = "Objective", allow_negative_numbers = true)]
    beta: Option<f64>,
    /// DPO: add this weight times the chosen completions' mean token NLL to the loss (TRL's
    /// loss_type=["sigmoid", "sft"] with loss_weights=[1, W]; RPO) [default: 0, plain DPO; built-in
    /// task: 1, unless --loss-type is given].
    #[arg(long, help_heading = "Objective", allow_negative_numbers = true)]
    sft_weight: Option<f64>,
    /// Optimizer steps [default: --epochs over the data; built-in task: sft 600, dpo 300, grpo 300].
    #[arg(long, help_heading = "Optimisation")]
    max_steps: Option<usize>,
    /// Passes over the data when --max-steps is not given (above 0) [default: 1].
    #[arg(long, help_heading = "Optimisation", allow_negative_numbers = true)]
    epochs: Option<f64>,
    /// Sequences per micro-batch (dpo: pairs, grpo: prompts) [default: 8; built-in task: sft 64, dpo
    /// 32, grpo 32].
    #[arg(long, help_heading = "Optimisation")]
    batch_size: Option<usize>,
    /// Micro-batches per optimizer step (the loss is normalised over all their target tokens)
    /// [default: 1].
    #[arg(long, help_heading = "Optimisation")]
    grad_accum: Option<usize>,
    /// Peak learning rate, above 0 [default: 2e-5; built-in task: sft 5e-3, dpo 2e-4, grpo 3e-5].
    #[arg(long, help_heading = "Optimisation", allow_negative_numbers = true)]
    lr: Option<f64>,
    /// AdamW's decoupled weight decay (at least 0; not on biases and norms) [default: 0].
    #[arg(long, help_heading = "Optimisation", allow_negative_numbers = true)]
    weight_decay: Option<f64>,
    /// Warmup steps [default: 0; built-in task: sft and dpo 20].
    #[arg(long, help_heading = "Optimisation")]
    warmup_steps: Option<usize>,
    /// cosine, linear or constant [default: cosine; built-in grpo: constant].
    #[arg(long, help_heading = "Optimisation")]
    schedule: Option<Schedule>,
    /// Global gradient-norm clip (0: off) [default: 1].
    #[arg(long, help_heading = "Optimisation", allow_negative_numbers = true)]
    max_grad_norm: Option<f64>,
    /// Seeds the data order, the built-in model's initialisation and GRPO's sampling [default: 42].
    #[arg(long, help_heading = "Optimisation")]
    seed: Option<u64>,
    /// stream (StreamBP), checkpoint or full [default: stream].
    #[arg(long, help_heading = "Memory")]
    mode: Option<Mode>,
    /// Query chunk of the streamed backward [default: 512; built-in task: 8].
    #[arg(long, help_heading = "Memory")]
    chunk: Option<usize>,
    /// LM-head chunk [default: 128; built-in task: 8].
    #[arg(long, help_heading = "Memory")]
    logits_chunk: Option<usize>,
    /// Pick the largest chunks whose estimated backward peak (weights, gradients, activations; not
    /// the optimizer state) fits this budget, e.g. 8GiB. Overrides --chunk and --logits-chunk.
    #[arg(long, help_heading = "Memory", value_parser = streambp_train::device::parse_budget)]
    memory_budget: Option<u64>,
    /// With --memory-budget on an accelerator: host memory the plan may keep layer checkpoints in
    /// (where the card alone would need small chunks), e.g. 100GiB.
    #[arg(long, help_heading = "Memory", value_parser = streambp_train::device::parse_budget)]
    host_memory_budget: Option<u64>,
    /// Keep layer checkpoints in host memory during the backward (accelerator memory then no longer
    /// grows with layers x sequence x hidden size).
    #[arg(long, help_heading = "Memory")]
    offload_checkpoints: bool,
    /// Store the input of every K-th layer only and recompute the others' during the backward, one
    /// segment of K layers at a time (`sqrt`: K = ⌈√layers⌉, the least memory): fewer checkpoints for
    /// one more forward of the layers between; the gradients are the same [default: 1].
    #[arg(long, help_heading = "Memory")]
    checkpoint_every: Option<CheckpointEvery>,
    /// Keep the stored layer checkpoints in a scratch file in this directory instead of memory:
    /// written in the forward, read back in the backward, its space reserved up front and freed
    /// after each step (also if the run is killed), so host memory no longer bounds T.
    #[arg(long, help_heading = "Memory")]
    checkpoint_dir: Option<PathBuf>,
    /// Data parallel (under mpiexec): 0 all-reduces gradients, 1 also shards AdamW's state over the
    /// ranks, 2 also shards the gradients, reduced layer by layer as the backward finishes each
    /// [default: 0].
    #[arg(long, help_heading = "Memory")]
    zero: Option<streambp_train::parallel::ZeroStage>,
    /// Sequence parallel (under mpiexec): split every sequence over this many consecutive ranks, each
    /// holding T / S of its positions' activations; it divides the number of ranks, the other factor
    /// being data parallelism [default: 1].
    #[arg(long, help_heading = "Memory")]
    sp: Option<usize>,
    /// A TOML file whose keys mirror these flags (max_steps = 100, lr = 1e-5, …); flags typed on the
    /// command line override it.
    #[arg(long, help_heading = "Output", value_name = "FILE.toml")]
    config: Option<PathBuf>,
    /// Where metrics.jsonl and checkpoints go [default: a new runs/<job>-<UTC date-time> per run;
    /// with --resume, the checkpoint's run directory].
    #[arg(long, help_heading = "Output")]
    output_dir: Option<PathBuf>,
    /// Replace an earlier run's checkpoints and final model in --output-dir (without it such a
    /// directory is refused, unless --resume continues that run).
    #[arg(long, help_heading = "Output")]
    overwrite_output_dir: bool,
    /// Save a resumable checkpoint-N every N steps (0: none but the last step's, which is always
    /// saved, so that a finished run can be extended with --resume) [default: 0].
    #[arg(long, help_heading = "Output")]
    save_every: Option<usize>,
    /// Measure the held-out metrics every N steps, into metrics.jsonl and TensorBoard (0: before
    /// and after training only) [default: 0].
    #[arg(long, help_heading = "Output")]
    eval_every: Option<usize>,
    /// Continue from a checkpoint-N directory of an earlier run (weights, optimizer, schedule, data
    /// position); give the same flags as that run.
    #[arg(long, help_heading = "Output")]
    resume: Option<PathBuf>,
    /// Hide the progress bar.
    #[arg(long, help_heading = "Output")]
    no_progress: bool,
}

#[derive(clap::Args)]
#[command(next_help_heading = "Objective")]
pub struct DpoArgs {
    /// TRL's DPO loss types, one or a comma list summed with --loss-weights: sigmoid, hinge, ipo,
    /// exo_pair, nca_pair, robust, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down,
    /// discopop, sft, sigmoid_norm [default: sigmoid].
    #[arg(long, value_delimiter = ',')]
    loss_type: Vec<String>,
    /// One weight per --loss-type entry [default: 1 each].
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true)]
    loss_weights: Vec<f64>,
    /// Label smoothing ε of exo_pair (above 0), robust, aot and aot_unpaired, in [0, 0.5) [default: 0].
    #[arg(long, allow_negative_numbers = true)]
    label_smoothing: Option<f64>,
    /// DiscoPOP's temperature τ (above 0) [default: 0.05].
    #[arg(long, allow_negative_numbers = true)]
    discopop_tau: Option<f64>,
}

impl DpoArgs {
    /// The DPO loss the flags name (TRL's sigmoid with none); checked with the run's settings.
    fn into_loss(self) -> Result<DpoLoss, TrainError> {
        if self.loss_type.is_empty() && !self.loss_weights.is_empty() {
            return Err(TrainError::flag("--loss-weights", "", "needs --loss-type"));
        }
        let names: Vec<&str> = self.loss_type.iter().map(String::as_str).collect();
        let weights = (!self.loss_weights.is_empty()).then_some(self.loss_weights.as_slice());
        DpoLoss::from_config(&names, weights, self.label_smoothing, self.discopop_tau)
            .map_err(|e| TrainError::flag("--loss-type", self.loss_type.join(","), e.to_string()))
    }
}

#[derive(clap::Args)]
#[command(next_help_heading = "Objective")]
pub struct CpoArgs {
    /// TRL's CPO loss types: sigmoid, hinge, ipo, simpo, or alphapo (simpo with --cpo-alpha 0; give
    /// --alphapo-alpha) [default: sigmoid].
    #[arg(long = "loss-type")]
    loss_type: Option<String>,
    /// Label smoothing ε of sigmoid and simpo, in [0, 0.5) [default: 0].
    #[arg(long, allow_negative_numbers = true)]
    label_smoothing: Option<f64>,
    /// Weight of the chosen completions' NLL, at least 0 [default: 1; alphapo: 0].
    #[arg(long, allow_negative_numbers = true)]
    cpo_alpha: Option<f64>,
    /// SimPO's target reward margin γ [default: 0.5].
    #[arg(long, allow_negative_numbers = true)]
    simpo_gamma: Option<f64>,
    /// AlphaPO's reward shape α: rewards (1 − p^(−α)) / α instead of log p (TRL's `alpha`)
    /// [default: 0].
    #[arg(long, allow_negative_numbers = true)]
    alphapo_alpha: Option<f64>,
}

impl CpoArgs {
    /// CPO's loss: `--loss-type`'s settings (TRL's defaults for it), then the flags given; checked.
    fn into_loss(self) -> Result<CpoLoss, TrainError> {
        let name = self.loss_type.as_deref();
        let (smoothing, alpha, gamma) = (self.label_smoothing, self.cpo_alpha, self.simpo_gamma);
        CpoLoss::from_config(name, smoothing, alpha, gamma, self.alphapo_alpha)
            .map_err(|e| TrainError::flag("--loss-type", name.unwrap_or("sigmoid"), e.to_string()))
    }
}

#[derive(clap::Args)]
#[command(next_help_heading = "Objective")]
pub struct KtoArgs {
    /// kto (with the KL baseline) or apo_zero_unpaired [default: kto].
    #[arg(long = "loss-type", value_parser = kto_loss_type)]
    loss_type: Option<KtoLossType>,
    /// Weight of the desirable rows' losses, above 0 [default: 1].
    #[arg(long, allow_negative_numbers = true)]
    desirable_weight: Option<f64>,
    /// Weight of the undesirable rows' losses, above 0 [default: 1].
    #[arg(long, allow_negative_numbers = true)]
    undesirable_weight: Option<f64>,
}

/// KTO's `--loss-type`, or the accepted ones.
fn kto_loss_type(s: &str) -> Result<KtoLossType, String> {
    s.parse()
        .map_err(|_| "expected kto or apo_zero_unpaired".to_string())
}

/// The sampling flags of the jobs that sample completions from the model (grpo, rloo, distill).
#[derive(clap::Args)]
pub struct SamplingArgs {
    /// Sampling temperature (above 0; distill's loss reads both distributions at it too)
    /// [default: 1].
    #[arg(long, allow_negative_numbers = true)]
    temperature: Option<f64>,
    /// Nucleus sampling: the smallest set of tokens with this much probability, in (0, 1]
    /// [default: 1].
    #[arg(long, allow_negative_numbers = true)]
    top_p: Option<f64>,
    /// Longest completion, below --max-length [default: grpo and rloo 256, distill 512, as TRL's;
    /// built-in task: 5].
    #[arg(long)]
    max_new_tokens: Option<usize>,
}

impl SamplingArgs {
    /// `d` with the flags given.
    fn into_config(self, d: SamplingConfig) -> SamplingConfig {
        SamplingConfig {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_p: self.top_p.unwrap_or(d.top_p),
            max_new_tokens: self.max_new_tokens.unwrap_or(d.max_new_tokens),
        }
    }
}

/// The flags of the jobs that sample completions and learn from their rewards (grpo, rloo).
#[derive(clap::Args)]
#[command(next_help_heading = "Objective")]
pub struct RolloutArgs {
    /// Completions sampled per prompt (at least 2) [default: grpo 8, rloo 2; built-in task: 8].
    #[arg(long)]
    group_size: Option<usize>,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Reward functions, summed: exact:COLUMN (completion equals the row's COLUMN) or format:REGEX
    /// (the whole completion matches). Repeat the flag for several.
    #[arg(long = "reward")]
    rewards: Vec<String>,
    /// Clipping ε of the probability ratio (above 0) [default: 0.2].
    #[arg(long, allow_negative_numbers = true)]
    epsilon: Option<f64>,
    /// The upper clip 1 + ε_high, or grpo's cispo's cap on the ratio (TRL recommends 0.28 for dapo
    /// and 5 for cispo) [default: --epsilon].
    #[arg(long, allow_negative_numbers = true)]
    epsilon_high: Option<f64>,
    /// Leave completions cut at --max-new-tokens (no EOS) out of the loss; their rewards still
    /// count in their group's advantages, as in TRL.
    #[arg(long)]
    mask_truncated_completions: bool,
    /// Optimizer steps per batch of rollouts (old log-probs fixed before the first) [default: 1].
    #[arg(long)]
    num_iterations: Option<usize>,
}

impl RolloutArgs {
    /// `defaults` with the flags given.
    fn into_config(self, d: GrpoConfig) -> GrpoConfig {
        GrpoConfig {
            group_size: self.group_size.unwrap_or(d.group_size),
            sampling: self.sampling.into_config(d.sampling),
            rewards: self.rewards,
            epsilon: self.epsilon.unwrap_or(d.epsilon),
            epsilon_high: self.epsilon_high.or(d.epsilon_high),
            mask_truncated_completions: self.mask_truncated_completions,
            num_iterations: self.num_iterations.unwrap_or(d.num_iterations),
            ..d
        }
    }
}

#[derive(clap::Args)]
#[command(next_help_heading = "Objective")]
pub struct GrpoArgs {
    #[command(flatten)]
    rollouts: RolloutArgs,
    /// TRL 1.16's loss types: dapo (sum over the step's completion tokens / their count across
    /// groups and ranks), grpo (mean per completion, then over completions), bnpo (mean over the
    /// batch's completion tokens), dr_grpo (sum / (completions x --max-new-tokens)), luspo (each
    /// completion's sum, mean over completions), cispo (the ratio capped at --epsilon-high
    /// weighting the log-prob; reduced as dapo), sapo (a sigmoid gate for the clip; reduced as
    /// grpo), vespo (a smooth gamma weight of the completion's ratio for the clip; reduced as
    /// dapo) [default: dapo].
    #[arg(long, value_parser = loss_type)]
    loss_type: Option<GrpoLossType>,
    /// What each group's rewards less their mean are divided by (+ 1e-4): group (its own standard
    /// deviation), batch (that of every reward of the step, all ranks) or none [default: group].
    #[arg(long)]
    scale_rewards: Option<streambp_train::rewards::ScaleRewards>,
    /// sapo's gate temperature where the advantage is positive [default: 1.0, as TRL's].
    #[arg(long, allow_negative_numbers = true)]
    sapo_temperature_pos: Option<f64>,
    /// sapo's gate temperature where the advantage is not positive [default: 1.05, as TRL's].
    #[arg(long, allow_negative_numbers = true)]
    sapo_temperature_neg: Option<f64>,
    /// One importance weight per token, or per completion (the mean of its tokens' log-ratios:
    /// GSPO) [default: token].
    #[arg(long, value_parser = importance_sampling_level)]
    importance_sampling_level: Option<ImportanceSampling>,
    /// vespo's gamma weight's k where the advantage is not negative [default: 2.0, as TRL's].
    #[arg(long, allow_negative_numbers = true)]
    vespo_k_pos: Option<f64>,
    /// vespo's gamma weight's λ where the advantage is not negative [default: 3.0, as TRL's].
    #[arg(long, allow_negative_numbers = true)]
    vespo_lambda_pos: Option<f64>,
    /// vespo's gamma weight's k where the advantage is negative [default: 3.0, as TRL's].
    #[arg(long, allow_negative_numbers = true)]
    vespo_k_neg: Option<f64>,
    /// vespo's gamma weight's λ where the advantage is negative [default: 2.0, as TRL's].
    #[arg(long, allow_negative_numbers = true)]
    vespo_lambda_neg: Option<f64>,
    /// Completions with a negative advantage whose mean log-ratio of the sampling policy to the
    /// current one exceeds this leave the policy term (DeepSeek-V3.2's off-policy sequence mask)
    /// [default: none].
    #[arg(long, allow_negative_numbers = true)]
    off_policy_mask_threshold: Option<f64>,
    /// Subtract this times the completion tokens' mean entropy (of the sampling distribution) from
    /// the loss, whatever the loss type: an exploration bonus (with --use-adaptive-entropy, the
    /// starting coefficient) [default: 0, none].
    #[arg(long, allow_negative_numbers = true)]
    entropy_coef: Option<f64>,
    /// Only the completion tokens in this top quantile by entropy (over every data-parallel rank's
    /// micro-batch) keep their policy term ("Beyond the 80/20 rule": 0.2), in [0, 1] [default: 1,
    /// every token].
    #[arg(long, allow_negative_numbers = true)]
    top_entropy_quantile: Option<f64>,
    /// Move --entropy-coef after each optimizer step (Skywork-OR1's adaptive entropy control, as
    /// TRL's): up by --entropy-coef-delta while the step's mean entropy over the tokens the bonus
    /// acts on is at most --entropy-target, down otherwise; the bonus applies only while it is.
    #[arg(long)]
    use_adaptive_entropy: bool,
    /// The lowest coefficient of adaptive entropy control [default: 0].
    #[arg(long, allow_negative_numbers = true, requires = "use_adaptive_entropy")]
    entropy_coef_min: Option<f64>,
    /// The highest coefficient of adaptive entropy control [default: 1].
    #[arg(long, allow_negative_numbers = true, requires = "use_adaptive_entropy")]
    entropy_coef_max: Option<f64>,
    /// The coefficient's step under adaptive entropy control [default: 0.005].
    #[arg(long, allow_negative_numbers = true, requires = "use_adaptive_entropy")]
    entropy_coef_delta: Option<f64>,
    /// The mean entropy per token, in nats, at or below which adaptive control applies the bonus
    /// (set it near the `entropy` logged early in training) [default: 0.2].
    #[arg(long, allow_negative_numbers = true, requires = "use_adaptive_entropy")]
    entropy_target: Option<f64>,
}

#[derive(clap::Args)]
#[command(next_help_heading = "Objective")]
pub struct RlooArgs {
    #[command(flatten)]
    rollouts: RolloutArgs,
    /// Normalise the advantages over the step's whole batch of completions (all ranks): less
    /// their mean, over their standard deviation + 1e-4 (TRL's normalize_advantages).
    #[arg(long)]
    normalize_advantages: bool,
}

impl RlooArgs {
    /// RLOO's settings: the flags given, the defaults (the built-in task's when `builtin`) for the
    /// rest.
    pub fn into_config(self, builtin: bool) -> GrpoConfig {
        let d = GrpoConfig::rloo_defaults(builtin, self.normalize_advantages);
        self.rollouts.into_config(d)
    }
}

/// Distillation's flags.
#[derive(clap::Args)]
#[command(next_help_heading = "Objective")]
pub struct DistillArgs {
    /// The teacher: a causal LM directory or hub id with the model's vocabulary (any hidden size
    /// or family), run forward only [default on the built-in task: its shipped SFT checkpoint].
    #[arg(long)]
    teacher: Option<String>,
    #[command(flatten)]
    sampling: SamplingArgs,
}

impl DistillArgs {
    /// Distillation's settings: the flags given, the defaults (the built-in task's when `builtin`)
    /// for the rest.
    pub fn into_config(self, builtin: bool) -> GrpoConfig {
        let d = GrpoConfig::distill_defaults(builtin, self.teacher);
        GrpoConfig {
            sampling: self.sampling.into_config(d.sampling),
            ..d
        }
    }
}

impl TrainArgs {
    /// A DPO run's configuration: [`TrainArgs::into_config`] with the loss `dpo` names. Loss types
    /// typed say the whole loss: the built-in task's NLL weight is then not added.
    pub fn into_dpo_config(self, dpo: DpoArgs) -> Result<TrainConfig, TrainError> {
        let whole_loss_typed = !dpo.loss_type.is_empty() && self.sft_weight.is_none();
        let mut cfg = self.into_config(Recipe::Dpo)?;
        cfg.dpo_loss = dpo.into_loss()?;
        if whole_loss_typed {
            cfg.sft_weight = 0.0;
        }
        Ok(cfg)
    }

    /// A KTO run's configuration: [`TrainArgs::into_config`] with the loss `kto` names.
    pub fn into_kto_config(self, kto: KtoArgs) -> Result<TrainConfig, TrainError> {
        let mut cfg = self.into_config(Recipe::Kto)?;
        let weights = (kto.desirable_weight, kto.undesirable_weight);
        cfg.kto_loss = KtoLoss::from_config(kto.loss_type, weights.0, weights.1);
        Ok(cfg)
    }

    /// A CPO run's configuration: [`TrainArgs::into_config`] with the loss `cpo` names.
    pub fn into_cpo_config(self, cpo: CpoArgs) -> Result<TrainConfig, TrainError> {
        let mut cfg = self.into_config(Recipe::Cpo)?;
        cfg.cpo_loss = cpo.into_loss()?;
        Ok(cfg)
    }

    /// The run configuration of `recipe`: the flags given, the recipe's defaults for the rest (those of
    /// the built-in task when neither --model nor --data is given). A flag the recipe does not use is
    /// refused rather than ignored.
    pub fn into_config(self, recipe: Recipe) -> Result<TrainConfig, TrainError> {
        // The flags only some jobs take: the recipe table says which.
        let typed = [
            ("--beta", self.beta.is_some()),
            ("--sft-weight", self.sft_weight.is_some()),
            ("--ref-model", self.ref_model.is_some()),
            ("--dataset-text-field", self.dataset_text_field.is_some()),
            ("--packing", self.packing),
        ];
        let typed: Vec<&str> = typed.iter().filter(|(_, t)| *t).map(|(f, _)| *f).collect();
        recipe.check_job_flags(&typed)?;
        if self.memory_budget.is_some() {
            for (flag, given) in [
                ("--chunk", self.chunk),
                ("--logits-chunk", self.logits_chunk),
            ] {
                if let Some(value) = given {
                    return Err(TrainError::flag(
                        flag,
                        value,
                        "--memory-budget picks the chunks: give one or the other",
                    ));
                }
            }
        }
        if let (Some(_), Some(epochs)) = (self.max_steps, self.epochs) {
            tracing::warn!(
                epochs,
                "--max-steps is given: it sets the run's length, --epochs does not"
            );
        }
        let d = TrainConfig::defaults(recipe, self.model.is_none() && self.data.is_none());
        // --epochs sets the length where --max-steps is not typed, the built-in task's default included.
        let max_steps = match (self.max_steps, self.epochs) {
            (Some(steps), _) => Some(steps),
            (None, Some(_)) => None,
            (None, None) => d.max_steps,
        };
        Ok(TrainConfig {
            model: self.model,
            builtin_model: d.builtin_model,
            data: self.data,
            split: self.split.unwrap_or(d.split),
            data_config: self.data_config,
            text_field: self.dataset_text_field.unwrap_or(d.text_field),
            eval_data: self.eval_data,
            eval_split: self.eval_split,
            output_dir: match self.output_dir {
                Some(dir) => dir,
                None => default_output_dir(&d.output_dir, self.resume.as_deref()),
            },
            overwrite_output_dir: self.overwrite_output_dir,
            max_steps,
            epochs: self.epochs.unwrap_or(d.epochs),
            batch_size: self.batch_size.unwrap_or(d.batch_size),
            grad_accum: self.grad_accum.unwrap_or(d.grad_accum),
            lr: self.lr.unwrap_or(d.lr),
            weight_decay: self.weight_decay.unwrap_or(d.weight_decay),
            warmup_steps: self.warmup_steps.unwrap_or(d.warmup_steps),
            schedule: self.schedule.unwrap_or(d.schedule),
            max_grad_norm: self.max_grad_norm.unwrap_or(d.max_grad_norm),
            seed: self.seed.unwrap_or(d.seed),
            max_length: self.max_length.unwrap_or(d.max_length),
            overflow: self.overflow.unwrap_or(d.overflow),
            packing: self.packing,
            mode: self.mode.unwrap_or(d.mode),
            chunk: self.chunk.unwrap_or(d.chunk),
            logits_chunk: self.logits_chunk.unwrap_or(d.logits_chunk),
            memory_budget: self.memory_budget,
            host_memory_budget: self.host_memory_budget,
            frozen: Default::default(),
            offload_checkpoints: self.offload_checkpoints,
            checkpoint_every: self.checkpoint_every.unwrap_or(d.checkpoint_every),
            checkpoint_dir: self.checkpoint_dir,
            dtype: self.dtype.unwrap_or(d.dtype),
            device: self.device.unwrap_or(d.device),
            save_every: self.save_every.unwrap_or(d.save_every),
            eval_every: self.eval_every.unwrap_or(d.eval_every),
            resume: self.resume,
            beta: self.beta.unwrap_or(d.beta),
            sft_weight: self.sft_weight.unwrap_or(d.sft_weight),
            dpo_loss: d.dpo_loss,
            cpo_loss: d.cpo_loss,
            kto_loss: d.kto_loss,
            center_rewards_coefficient: d.center_rewards_coefficient,
            ref_model: self.ref_model,
            progress: !self.no_progress,
            lora: self.lora.config()?,
            adapter: self.lora.adapter,
            merge: self.merge,
            zero: self.zero.unwrap_or(d.zero),
            sp: self.sp.unwrap_or(d.sp),
        })
    }
}

impl GrpoArgs {
    /// GRPO's settings: the flags given, the defaults (the built-in task's when `builtin`) for the rest.
    pub fn into_config(self, builtin: bool) -> GrpoConfig {
        let d = self.rollouts.into_config(GrpoConfig::defaults(builtin));
        GrpoConfig {
            loss_type: self.loss_type.unwrap_or(d.loss_type),
            scale_rewards: self.scale_rewards.unwrap_or(d.scale_rewards),
            sapo_temperatures: (
                self.sapo_temperature_pos.unwrap_or(d.sapo_temperatures.0),
                self.sapo_temperature_neg.unwrap_or(d.sapo_temperatures.1),
            ),
            importance_sampling: self
                .importance_sampling_level
                .unwrap_or(d.importance_sampling),
            vespo_gamma: VespoGamma {
                positive: (
                    self.vespo_k_pos.unwrap_or(d.vespo_gamma.positive.0),
                    self.vespo_lambda_pos.unwrap_or(d.vespo_gamma.positive.1),
                ),
                negative: (
                    self.vespo_k_neg.unwrap_or(d.vespo_gamma.negative.0),
                    self.vespo_lambda_neg.unwrap_or(d.vespo_gamma.negative.1),
                ),
            },
            off_policy_mask_threshold: self.off_policy_mask_threshold,
            entropy_coef: self.entropy_coef.unwrap_or(d.entropy_coef),
            top_entropy_quantile: self.top_entropy_quantile.unwrap_or(d.top_entropy_quantile),
            adaptive_entropy: self.use_adaptive_entropy.then(|| {
                let a = AdaptiveEntropy::default();
                AdaptiveEntropy {
                    min: self.entropy_coef_min.unwrap_or(a.min),
                    max: self.entropy_coef_max.unwrap_or(a.max),
                    delta: self.entropy_coef_delta.unwrap_or(a.delta),
                    target: self.entropy_target.unwrap_or(a.target),
                }
            }),
            ..d
        }
    }
}

/// `--importance-sampling-level`'s value, or the accepted ones.
fn importance_sampling_level(s: &str) -> Result<ImportanceSampling, String> {
    s.parse()
        .map_err(|_| "expected token or sequence".to_string())
}

/// `--loss-type`'s value, or the accepted ones.
fn loss_type(s: &str) -> Result<GrpoLossType, String> {
    s.parse().map_err(|_| {
        let names: Vec<&str> = GrpoLossType::ALL.iter().map(|t| t.name()).collect();
        let gspo = match s.eq_ignore_ascii_case("gspo") {
            true => " (GSPO is --importance-sampling-level sequence with a clipped loss type)",
            false => "",
        };
        format!("expected one of {}{gspo}", names.join(", "))
    })
}

/// Where a run without `--output-dir` writes: resuming, the checkpoint's run directory (the run goes
/// on where it was); else a new directory per run, `<job_dir>-<UTC date-time>` (`runs/sft-20261207-101530`,
/// as the HF Trainer's `runs/<date-time>`), so the same command can run again.
fn default_output_dir(job_dir: &Path, resume: Option<&Path>) -> PathBuf {
    if let Some(run) = resume.and_then(Path::parent) {
        return match run.as_os_str().is_empty() {
            true => PathBuf::from("."),
            false => run.to_path_buf(),
        };
    }
    let stamp = chrono::Utc::now().format("%Y%m%d-%H%M%S");
    let dated = PathBuf::from(format!("{}-{stamp}", job_dir.display()));
    // Two runs started within a second.
    (1..)
        .map(|n| match n {
            1 => dated.clone(),
            n => PathBuf::from(format!("{}-{n}", dated.display())),
        })
        .find(|dir| !dir.exists())
        .unwrap_or(dated)
}
