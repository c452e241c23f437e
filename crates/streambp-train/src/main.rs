//! `streambp-train`: the command line.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use streambp_core::memory::CountingAllocator;
use streambp_core::Mode;
use streambp_train::data::Overflow;
use streambp_train::dpo::run_dpo;
use streambp_train::grad::{run_grad, GradArgs};
use streambp_train::grpo::{run_grpo, GrpoConfig};
use streambp_train::optim::Schedule;
use streambp_train::recipe::{BuiltinModel, Summary, TrainConfig};
use streambp_train::sampling::SamplingConfig;
use streambp_train::sft::run_sft;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

#[derive(Parser)]
#[command(
    name = "streambp-train",
    version,
    about = "Exact long-sequence training with StreamBP"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Supervised fine-tuning. With no arguments: a tiny Qwen3-shaped model learns two-digit addition
    /// (shipped in the repo) on the CPU in a minute or two, with held-out accuracy before and after.
    Sft(TrainArgs),
    /// Direct preference optimisation (TRL's sigmoid loss) on prompt/chosen/rejected JSONL, against a
    /// frozen reference. With no arguments: the built-in arithmetic pairs (correct vs wrong sums), from
    /// the built-in model (best started from an SFT checkpoint: --model runs/sft/final).
    Dpo(TrainArgs),
    /// GRPO (TRL's loss): sample a group per prompt with a KV cache, reward it, learn from the
    /// group-normalised advantages. With no arguments: the built-in model on the arithmetic prompts,
    /// rewarded for a digits-only answer and for the exact sum.
    Grpo {
        #[command(flatten)]
        train: TrainArgs,
        #[command(flatten)]
        grpo: GrpoArgs,
    },
    /// One backward on a batch file; writes every gradient under its HF name and prints one JSON line
    /// {"loss","mode","peak_bytes","seconds","tokens",...}.
    Grad(GradArgs),
}

#[derive(clap::Args)]
struct TrainArgs {
    /// A TOML file whose keys mirror these flags (max_steps = 100, lr = 1e-5, …); flags typed on the
    /// command line override it.
    #[arg(long, value_name = "FILE.toml")]
    config: Option<PathBuf>,
    /// Model directory (HF format) or hub id [default: the built-in tiny model: random init for sft and
    /// grpo, the shipped SFT checkpoint of the task for dpo].
    #[arg(long)]
    model: Option<String>,
    /// Training data, JSONL in TRL's formats: sft messages, prompt/completion or text; dpo
    /// prompt/chosen/rejected; grpo prompt (other columns go to the rewards) [default: the built-in
    /// arithmetic task].
    #[arg(long)]
    data: Option<PathBuf>,
    /// Prompt/completion JSONL scored by exact-match accuracy of greedy answers before and after.
    #[arg(long)]
    eval_data: Option<PathBuf>,
    /// Where metrics.jsonl and checkpoints go.
    #[arg(long, default_value = "runs/sft")]
    output_dir: PathBuf,
    /// Optimizer steps [default: --epochs over the data; built-in task: 600; dpo: 300].
    #[arg(long)]
    max_steps: Option<usize>,
    #[arg(long, default_value_t = 1.0)]
    epochs: f64,
    /// Sequences per micro-batch [default: 8; built-in task: 64; dpo: 32 pairs].
    #[arg(long)]
    batch_size: Option<usize>,
    /// Micro-batches per optimizer step (the loss is normalised over all their target tokens).
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,
    /// Peak learning rate [default: 2e-5; built-in task: 5e-3; dpo 2e-4; grpo 2e-3].
    #[arg(long)]
    lr: Option<f64>,
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f64,
    /// Warmup steps [default: 0; built-in task: 20].
    #[arg(long)]
    warmup_steps: Option<usize>,
    /// cosine, linear or constant.
    #[arg(long, default_value = "cosine")]
    schedule: Schedule,
    /// Global gradient-norm clip (0: off).
    #[arg(long, default_value_t = 1.0)]
    max_grad_norm: f64,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Longest sequence in tokens [default: 2048; built-in task: 16].
    #[arg(long)]
    max_length: Option<usize>,
    /// What to do with longer examples: truncate or skip (the log says how many).
    #[arg(long, default_value = "truncate")]
    overflow: Overflow,
    /// sft: pack whole examples into rows of up to --max-length tokens, best-fit decreasing; each
    /// example still sees only itself (positions restart, attention stays inside it), with less padding.
    #[arg(long)]
    packing: bool,
    /// stream (StreamBP), checkpoint or full.
    #[arg(long, default_value = "stream")]
    mode: Mode,
    /// Query chunk of the streamed backward [default: 512; built-in task: 8].
    #[arg(long)]
    chunk: Option<usize>,
    /// LM-head chunk [default: 128; built-in task: 8].
    #[arg(long)]
    logits_chunk: Option<usize>,
    /// Pick the largest chunks whose estimated backward peak (weights, gradients, activations; not
    /// the optimizer state) fits this budget, e.g. 8GiB. Overrides --chunk and --logits-chunk.
    #[arg(long, value_parser = streambp_train::device::parse_budget)]
    memory_budget: Option<u64>,
    /// Keep layer checkpoints in host memory during the backward (accelerator memory then no longer
    /// grows with layers x sequence x hidden size).
    #[arg(long)]
    offload_checkpoints: bool,
    /// f32, bf16 or f64.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// cpu, cuda or cuda:N (a build with --features cuda).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Save a checkpoint every N steps (0: only at the end).
    #[arg(long, default_value_t = 0)]
    save_every: usize,
    /// Continue from a checkpoint-N directory of an earlier run (weights, optimizer, schedule, data
    /// position); give the same flags as that run.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// DPO β [default: 0.1]; GRPO's KL weight β [default: 0, as in TRL].
    #[arg(long)]
    beta: Option<f64>,
    /// DPO: add this weight times the chosen completions' mean token NLL to the loss (TRL's
    /// loss_type=["sigmoid", "sft"] with loss_weights=[1, W]; RPO) [default: 0, plain DPO; built-in
    /// task: 1].
    #[arg(long)]
    sft_weight: Option<f64>,
    /// DPO reference model [default: a frozen copy of the initial policy].
    #[arg(long)]
    ref_model: Option<String>,
    /// Hide the progress bar.
    #[arg(long)]
    no_progress: bool,
}

#[derive(clap::Args)]
struct GrpoArgs {
    /// Completions sampled per prompt.
    #[arg(long, default_value_t = 8)]
    group_size: usize,
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    #[arg(long, default_value_t = 256)]
    max_new_tokens: usize,
    /// Reward functions, summed: exact:COLUMN (completion equals the row's COLUMN) or format:REGEX
    /// (the whole completion matches). Repeat the flag for several.
    #[arg(long = "reward")]
    rewards: Vec<String>,
    /// grpo, bnpo or dr_grpo.
    #[arg(long, default_value = "grpo")]
    loss_type: String,
    /// Clipping ε of the probability ratio.
    #[arg(long, default_value_t = 0.2)]
    epsilon: f64,
    /// Optimizer steps per batch of rollouts (old log-probs fixed before the first).
    #[arg(long, default_value_t = 1)]
    num_iterations: usize,
}

impl TrainArgs {
    fn into_config(self) -> TrainConfig {
        let builtin = self.model.is_none() && self.data.is_none();
        let pick = |given: Option<usize>, default: usize, builtin_default: usize| {
            given.unwrap_or(if builtin { builtin_default } else { default })
        };
        TrainConfig {
            builtin_model: BuiltinModel::Random,
            max_steps: self.max_steps.or(builtin.then_some(600)),
            epochs: self.epochs,
            batch_size: pick(self.batch_size, 8, 64),
            grad_accum: self.grad_accum.max(1),
            lr: self.lr.unwrap_or(if builtin { 5e-3 } else { 2e-5 }),
            weight_decay: self.weight_decay,
            warmup_steps: pick(self.warmup_steps, 0, 20),
            schedule: self.schedule,
            max_grad_norm: self.max_grad_norm,
            seed: self.seed,
            max_length: pick(self.max_length, 2048, 16),
            overflow: self.overflow,
            packing: self.packing,
            mode: self.mode,
            chunk: pick(self.chunk, 512, 8),
            logits_chunk: pick(self.logits_chunk, 128, 8),
            memory_budget: self.memory_budget,
            offload_checkpoints: self.offload_checkpoints,
            dtype: self.dtype,
            device: self.device,
            save_every: self.save_every,
            resume: self.resume,
            beta: self.beta.unwrap_or(0.1),
            sft_weight: self.sft_weight.unwrap_or(0.0),
            ref_model: self.ref_model,
            progress: !self.no_progress,
            model: self.model,
            data: self.data,
            eval_data: self.eval_data,
            output_dir: self.output_dir,
        }
    }
}

/// The final summary of a run.
fn report(recipe: &str, summary: &Summary) {
    println!(
        "{recipe}: {} steps in {:.1} s, loss {:.4} -> {:.4}",
        summary.steps, summary.seconds, summary.first_loss, summary.last_loss
    );
    for (name, before) in &summary.before {
        if let Some((_, after)) = summary.after.iter().find(|(n, _)| n == name) {
            if name.contains("accuracy") {
                // Before training the DPO policy is its own reference: every pair ties.
                let ties = if name == "preference_accuracy" && *before == 0.0 {
                    " (ties: the policy starts as its own reference)"
                } else {
                    ""
                };
                println!(
                    "held-out {name}: {:.1}%{ties} -> {:.1}%",
                    100.0 * before,
                    100.0 * after
                );
            } else {
                println!("training {name} (first -> last rollouts): {before:.3} -> {after:.3}");
            }
        }
    }
    println!("checkpoint: {}", summary.output_dir.display());
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One readable line with the whole cause chain; no backtrace for user errors.
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = streambp_train::config_file::expand_config(std::env::args().collect())?;
    match Cli::parse_from(args).command {
        Command::Sft(args) => {
            report("sft", &run_sft(&args.into_config()).context("sft failed")?);
        }
        Command::Dpo(mut args) => {
            if args.output_dir == std::path::Path::new("runs/sft") {
                args.output_dir = "runs/dpo".into();
            }
            // The built-in task: refine the shipped SFT checkpoint (88.5% held-out accuracy) with
            // TRL's sigmoid + SFT loss, which keeps the correct answers likely.
            let builtin = args.model.is_none() && args.data.is_none();
            if builtin {
                args.max_steps = args.max_steps.or(Some(300));
                args.batch_size = args.batch_size.or(Some(32));
                args.lr = args.lr.or(Some(2e-4));
                args.sft_weight = args.sft_weight.or(Some(1.0));
            }
            let mut cfg = args.into_config();
            if builtin {
                cfg.builtin_model = BuiltinModel::Sft;
            }
            report("dpo", &run_dpo(&cfg).context("dpo failed")?);
        }
        Command::Grpo { mut train, grpo } => {
            let builtin = train.model.is_none() && train.data.is_none();
            if train.output_dir == std::path::Path::new("runs/sft") {
                train.output_dir = "runs/grpo".into();
            }
            train.beta = Some(train.beta.unwrap_or(0.0));
            // The built-in task: 8 prompts per step, short answers, a quicker learning rate.
            if builtin {
                train.batch_size = train.batch_size.or(Some(8));
                train.max_steps = train.max_steps.or(Some(60));
                train.lr = train.lr.or(Some(2e-3));
            }
            let g = GrpoConfig {
                group_size: grpo.group_size,
                sampling: SamplingConfig {
                    temperature: grpo.temperature,
                    top_p: grpo.top_p,
                    max_new_tokens: if builtin {
                        grpo.max_new_tokens.min(5)
                    } else {
                        grpo.max_new_tokens
                    },
                },
                rewards: grpo.rewards,
                loss_type: grpo.loss_type,
                epsilon: grpo.epsilon,
                num_iterations: grpo.num_iterations.max(1),
            };
            report(
                "grpo",
                &run_grpo(&train.into_config(), &g).context("grpo failed")?,
            );
        }
        Command::Grad(args) => {
            let report = run_grad(&args).context("grad failed")?;
            println!("{}", serde_json::to_string(&report)?);
        }
    }
    Ok(())
}
