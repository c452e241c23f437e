//! The command line: the clap [`Args`] and what its flags mean for a run (the engine's options, the
//! chunks at each T, the planner's view of a backward, the model's config and device).

use std::path::PathBuf;

use anyhow::bail;
use candle_core::{DType, Device};
use clap::Parser;
use streambp_core::{CheckpointEvery, ChunkPolicy, Chunks, Mode, Options, Problem, Tiers};
use streambp_models::device::{parse_budget, parse_device};
use streambp_models::{LoraConfig, ModelConfig};
use streambp_train::config::LoraArgs;
use streambp_train::parallel::ZeroStage;

#[derive(Parser)]
#[command(about = "StreamBP vs gradient checkpointing vs full backprop: memory and time")]
pub(crate) struct Args {
    /// Model config.json (weights are random; nothing is downloaded).
    #[arg(long)]
    pub(crate) config: PathBuf,
    /// Sequence lengths, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1024,2048")]
    pub(crate) seq_lens: Vec<usize>,
    /// sft (one row of T), dpo (a pair: two rows of T) or grpo (a group of --group rows of T, half prompt).
    #[arg(long, default_value = "sft")]
    pub(crate) objective: String,
    /// GRPO group size.
    #[arg(long, default_value_t = 4)]
    pub(crate) group: usize,
    /// Modes, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "stream,checkpoint,full")]
    pub(crate) modes: Vec<Mode>,
    /// Query chunk of the streamed backward; default T/3 (the paper's timing setting), or with
    /// --max-t-budget the planner's choice for each T and the budget.
    #[arg(long)]
    pub(crate) chunk: Option<usize>,
    /// LM-head chunk (the paper: 100).
    #[arg(long, default_value_t = 100)]
    pub(crate) logits_chunk: usize,
    #[arg(long, default_value = "f32")]
    pub(crate) dtype: String,
    /// cpu, cuda or cuda:N (a build with --features cuda). On CUDA, peaks are the device memory pool's
    /// own high-water marks and every phase ends with a device synchronize.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// Timed repetitions per point (the fastest is reported).
    #[arg(long, default_value_t = 1)]
    pub(crate) repeats: usize,
    /// Instead of the sweep: the longest T (a multiple of --t-step) whose measured peak, weights
    /// included, fits this budget, per mode, by doubling then bisection (e.g. 1GiB).
    #[arg(long, value_parser = parse_budget)]
    pub(crate) max_t_budget: Option<u64>,
    #[arg(long, default_value_t = 256)]
    pub(crate) t_step: usize,
    /// With --max-t-budget: try no T above this; a mode that still fits reports "at least" it (long
    /// runs on a card are bounded by time before memory).
    #[arg(long)]
    pub(crate) t_max: Option<usize>,
    /// Keep only the first N decoder layers: one layer's share of a shape too slow to run whole. A
    /// deeper model adds its layers' weights and gradients, and their checkpoints unless offloaded.
    #[arg(long)]
    pub(crate) layers: Option<usize>,
    /// Write memory.svg and time.svg (peak memory and seconds vs T, one line per mode) into this folder.
    #[arg(long)]
    pub(crate) plot: Option<PathBuf>,
    /// Keep layer checkpoints in host memory (matters on an accelerator; a no-op on the CPU).
    #[arg(long)]
    pub(crate) offload_checkpoints: bool,
    /// Store the input of every K-th layer only and recompute the others' in the backward, a segment
    /// at a time (`sqrt`: K = ⌈√layers⌉): fewer stored checkpoints for one more forward of the layers
    /// between, the same gradients. Applies to stream and checkpoint alike.
    #[arg(long, default_value = "1")]
    pub(crate) checkpoint_every: CheckpointEvery,
    /// Keep the stored checkpoints in a scratch file in this directory (the disk tier); the bytes
    /// written and read per step and their seconds are reported.
    #[arg(long)]
    pub(crate) checkpoint_dir: Option<PathBuf>,
    /// With --max-t-budget on an accelerator: host memory the plan may keep checkpoints in.
    #[arg(long, value_parser = parse_budget)]
    pub(crate) host_memory_budget: Option<u64>,
    /// After each backward, one AdamW step with the trainer's optimizer (f32 moments created for it;
    /// learning rate 0, so the weights stay as they are): its seconds and peak bytes are reported too.
    #[arg(long)]
    pub(crate) optimizer_step: bool,
    /// Print the planner's cost-model estimate of stream's peak per phase at each T (with --chunk,
    /// T/3, or the planner's chunks for --max-t-budget) instead of running: sizes a run on a card
    /// before it is lent. No weights are built.
    #[arg(long)]
    pub(crate) predict: bool,
    /// Time the engine's and the attention op's parts too (each synchronises its device before and
    /// after, so an accelerator's kernels count where they were queued): printed under each point
    /// and written to --json. The synchronisation slows the step: read the parts as shares.
    #[arg(long)]
    pub(crate) op_times: bool,
    /// Write the results as JSON lines here too, each as soon as its point is done.
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
    /// With --lora-r: every point is measured for full fine-tuning and for LoRA (a fresh adapter on the
    /// same weights), side by side.
    #[command(flatten)]
    pub(crate) lora: LoraArgs,
    /// Data-parallel training steps on this many ranks (the bench relaunches itself under `mpiexec`;
    /// a build with `--features mpi`): per-rank peak, optimizer state, gradients and step time for
    /// each --zero stage, stream mode, one sequence of T per rank.
    #[arg(long)]
    pub(crate) world: Option<usize>,
    /// With --world: the ZeRO stages, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "0,1,2")]
    pub(crate) zero: Vec<ZeroStage>,
    /// With --world: split each sequence over this many ranks (sequence parallelism, dividing
    /// --world: each run of S ranks shares one sequence of T, each holding T / S of its positions).
    #[arg(long, default_value_t = 1)]
    pub(crate) sp: usize,
    /// Instead of the sweep: each T's SFT step beside PyTorch + transformers' (without and with
    /// gradient checkpointing) run by this Python (torch and transformers installed), alternating
    /// the two for max(--repeats, 3) rounds and reporting medians and ratios.
    #[arg(long)]
    pub(crate) peer: Option<PathBuf>,
    /// The peer's script [default: scripts/peer_bench.py of this checkout].
    #[arg(long)]
    pub(crate) peer_script: Option<PathBuf>,
    /// With --peer: also write the table into this markdown file (between its marker lines).
    #[arg(long)]
    pub(crate) peer_doc: Option<PathBuf>,
}

/// The sequences in one batch of `objective`: one for SFT, a pair for DPO, `group` for GRPO.
pub(crate) fn rows_of(objective: &str, group: usize) -> usize {
    match objective {
        "dpo" => 2,
        "grpo" => group,
        _ => 1,
    }
}

/// The engine's options of the command line: which checkpoints are stored, and where.
pub(crate) fn options(args: &Args) -> Options {
    Options {
        offload_checkpoints: args.offload_checkpoints,
        checkpoint_every: args.checkpoint_every,
        checkpoint_dir: args.checkpoint_dir.as_deref().map(Into::into),
        ..Default::default()
    }
}

/// How the chunks at `t` tokens are chosen: `--chunk` when given, else the planner's for
/// `--max-t-budget`, else T/3 (the paper's timing setting).
pub(crate) fn chunk_policy(args: &Args, t: usize) -> ChunkPolicy {
    match (args.chunk, args.max_t_budget) {
        (None, Some(budget)) => {
            ChunkPolicy::Budget(budget, Tiers::of(&options(args), args.host_memory_budget))
        }
        _ => ChunkPolicy::Fixed(given_chunks(args, t)),
    }
}

/// The chunks of the command line at `t` tokens: `--chunk` (default T/3, the paper's timing setting)
/// and `--logits-chunk`.
pub(crate) fn given_chunks(args: &Args, t: usize) -> Chunks {
    Chunks {
        chunk: args.chunk.unwrap_or(t.div_ceil(3)),
        logits_chunk: args.logits_chunk,
    }
}

/// The planner's view of one backward of this run at `t` tokens (`lora`: what LoRA trains).
pub(crate) fn problem<'a>(
    config: &'a ModelConfig,
    dtype: DType,
    args: &Args,
    t: usize,
    lora: Option<&'a LoraConfig>,
) -> Problem<'a> {
    Problem {
        lora,
        config,
        batch: rows_of(&args.objective, args.group),
        seq_len: t,
        dtype,
        // Offloading moves the checkpoints off an accelerator; on the CPU they stay where they were.
        offloaded: (args.offload_checkpoints && args.device != "cpu")
            || args.checkpoint_dir.is_some(),
        checkpoint_every: args.checkpoint_every.layers(config.num_layers()),
        host: args.device == "cpu",
        frozen: Default::default(),
        reads_entropy: false,
    }
}

/// `--world N` with `--sp S`: at least one rank, and S dividing N.
pub(crate) fn check_world(args: &Args, ranks: usize) -> anyhow::Result<()> {
    if ranks == 0 {
        bail!("--world 0: the number of ranks is at least 1");
    }
    if args.sp == 0 || !ranks.is_multiple_of(args.sp) {
        bail!("--sp {}: must divide --world ({ranks})", args.sp);
    }
    Ok(())
}

/// The config of `--config`, with only its first `--layers` decoder layers when given.
pub(crate) fn model_config(args: &Args) -> anyhow::Result<ModelConfig> {
    let mut cfg = ModelConfig::from_file(&args.config)?;
    if let Some(n) = args.layers {
        cfg.layers.truncate(n.max(1));
    }
    Ok(cfg)
}

/// The device of `--device`; with `--world`, a GPU is this rank's own on its node.
pub(crate) fn device(args: &Args) -> anyhow::Result<Device> {
    Ok(match (parse_device(&args.device)?, args.world) {
        // One GPU per rank of the node.
        (Device::Cuda(_), Some(_)) => {
            parse_device(&format!("cuda:{}", streambp_dist::local_rank()))?
        }
        (device, _) => device,
    })
}
