//! `streambp-bench`: one backward per (mode, T) on a random model built from a config, reporting peak
//! bytes per phase (host: exact, counting allocator; CUDA: the device memory pool's high-water marks)
//! and seconds, with every mode measured side by side in one process.
//!
//! `cargo run --release -p streambp-bench -- --config benches/configs/qwen3-small.json --seq-lens 1024,2048`

mod cpu;
mod peer;
mod world;

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use streambp_core::memory::{CountingAllocator, Meter};
use streambp_core::{
    backward_with, estimate, Batch, CheckpointEvery, CheckpointPlace, ChunkPolicy, Chunks, Mode,
    Options, Plan, Problem, Tiers,
};
use streambp_kernels::op_times;
use streambp_models::device::{parse_budget, parse_device, parse_dtype};
use streambp_models::{LoraConfig, Model, ModelConfig};
use streambp_objectives::{Dpo, Grpo, GrpoBatch, GrpoLossType, Objective, Sft};
use streambp_train::config::LoraArgs;
use streambp_train::optim::{AdamW, AdamWConfig};
use streambp_train::parallel::ZeroStage;
use streambp_train::plots::{draw, Chart, Series};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

#[derive(Parser)]
#[command(about = "StreamBP vs gradient checkpointing vs full backprop: memory and time")]
struct Args {
    /// Model config.json (weights are random; nothing is downloaded).
    #[arg(long)]
    config: PathBuf,
    /// Sequence lengths, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1024,2048")]
    seq_lens: Vec<usize>,
    /// sft (one row of T), dpo (a pair: two rows of T) or grpo (a group of --group rows of T, half prompt).
    #[arg(long, default_value = "sft")]
    objective: String,
    /// GRPO group size.
    #[arg(long, default_value_t = 4)]
    group: usize,
    /// Modes, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "stream,checkpoint,full")]
    modes: Vec<Mode>,
    /// Query chunk of the streamed backward; default T/3 (the paper's timing setting), or with
    /// --max-t-budget the planner's choice for each T and the budget.
    #[arg(long)]
    chunk: Option<usize>,
    /// LM-head chunk (the paper: 100).
    #[arg(long, default_value_t = 100)]
    logits_chunk: usize,
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// cpu, cuda or cuda:N (a build with --features cuda). On CUDA, peaks are the device memory pool's
    /// own high-water marks and every phase ends with a device synchronize.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Timed repetitions per point (the fastest is reported).
    #[arg(long, default_value_t = 1)]
    repeats: usize,
    /// Instead of the sweep: the longest T (a multiple of --t-step) whose measured peak, weights
    /// included, fits this budget, per mode, by doubling then bisection (e.g. 1GiB).
    #[arg(long, value_parser = parse_budget)]
    max_t_budget: Option<u64>,
    #[arg(long, default_value_t = 256)]
    t_step: usize,
    /// With --max-t-budget: try no T above this; a mode that still fits reports "at least" it (long
    /// runs on a card are bounded by time before memory).
    #[arg(long)]
    t_max: Option<usize>,
    /// Keep only the first N decoder layers: one layer's share of a shape too slow to run whole. A
    /// deeper model adds its layers' weights and gradients, and their checkpoints unless offloaded.
    #[arg(long)]
    layers: Option<usize>,
    /// Write memory.svg and time.svg (peak memory and seconds vs T, one line per mode) into this folder.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Keep layer checkpoints in host memory (matters on an accelerator; a no-op on the CPU).
    #[arg(long)]
    offload_checkpoints: bool,
    /// Store the input of every K-th layer only and recompute the others' in the backward, a segment
    /// at a time (`sqrt`: K = ⌈√layers⌉): fewer stored checkpoints for one more forward of the layers
    /// between, the same gradients. Applies to stream and checkpoint alike.
    #[arg(long, default_value = "1")]
    checkpoint_every: CheckpointEvery,
    /// Keep the stored checkpoints in a scratch file in this directory (the disk tier); the bytes
    /// written and read per step and their seconds are reported.
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// With --max-t-budget on an accelerator: host memory the plan may keep checkpoints in.
    #[arg(long, value_parser = parse_budget)]
    host_memory_budget: Option<u64>,
    /// After each backward, one AdamW step with the trainer's optimizer (f32 moments created for it;
    /// learning rate 0, so the weights stay as they are): its seconds and peak bytes are reported too.
    #[arg(long)]
    optimizer_step: bool,
    /// Print the planner's cost-model estimate of stream's peak per phase at each T (with --chunk,
    /// T/3, or the planner's chunks for --max-t-budget) instead of running: sizes a run on a card
    /// before it is lent. No weights are built.
    #[arg(long)]
    predict: bool,
    /// Time the engine's and the attention op's parts too (each synchronises its device before and
    /// after, so an accelerator's kernels count where they were queued): printed under each point
    /// and written to --json. The synchronisation slows the step: read the parts as shares.
    #[arg(long)]
    op_times: bool,
    /// Write the results as JSON lines here too, each as soon as its point is done.
    #[arg(long)]
    json: Option<PathBuf>,
    /// With --lora-r: every point is measured for full fine-tuning and for LoRA (a fresh adapter on the
    /// same weights), side by side.
    #[command(flatten)]
    lora: LoraArgs,
    /// Data-parallel training steps on this many ranks (the bench relaunches itself under `mpiexec`;
    /// a build with `--features mpi`): per-rank peak, optimizer state, gradients and step time for
    /// each --zero stage, stream mode, one sequence of T per rank.
    #[arg(long)]
    world: Option<usize>,
    /// With --world: the ZeRO stages, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "0,1,2")]
    zero: Vec<ZeroStage>,
    /// With --world: split each sequence over this many ranks (sequence parallelism, dividing
    /// --world: each run of S ranks shares one sequence of T, each holding T / S of its positions).
    #[arg(long, default_value_t = 1)]
    sp: usize,
    /// Instead of the sweep: each T's SFT step beside PyTorch + transformers' (without and with
    /// gradient checkpointing) run by this Python (torch and transformers installed), alternating
    /// the two for max(--repeats, 3) rounds and reporting medians and ratios.
    #[arg(long)]
    peer: Option<PathBuf>,
    /// The peer's script [default: scripts/peer_bench.py of this checkout].
    #[arg(long)]
    peer_script: Option<PathBuf>,
    /// With --peer: also write the table into this markdown file (between its marker lines).
    #[arg(long)]
    peer_doc: Option<PathBuf>,
}

struct Point {
    /// What is trained: `full`, or `LoRA r=N`.
    trained: String,
    mode: Mode,
    t: usize,
    /// Peak bytes above what was live before the backward (the weights).
    peak: usize,
    /// Bytes live before the backward.
    base: usize,
    phases: Vec<(&'static str, usize, f64)>,
    seconds: f64,
    loss: f64,
    /// With --optimizer-step: the step's peak bytes above what was live before it, and its seconds.
    optimizer: Option<(usize, f64)>,
    /// With --checkpoint-dir: the checkpoints' bytes written and read and their seconds.
    checkpoint_io: streambp_core::CheckpointIo,
    /// With --op-times: the parts' calls and seconds in this run.
    op_times: Vec<op_times::OpTime>,
}

fn rows_of(objective: &str, group: usize) -> usize {
    match objective {
        "dpo" => 2,
        "grpo" => group,
        _ => 1,
    }
}

/// A synthetic batch of `rows` sequences of `t` tokens and the objective over it.
fn workload(
    objective: &str,
    vocab: usize,
    t: usize,
    group: usize,
    dev: &Device,
) -> anyhow::Result<(Tensor, Box<dyn Objective>)> {
    if !matches!(objective, "sft" | "dpo" | "grpo") {
        bail!("unknown objective {objective} (sft, dpo or grpo)");
    }
    let rows = rows_of(objective, group);
    let ids: Vec<Vec<i64>> = (0..rows)
        .map(|r| {
            (0..t as u64)
                .map(|i| ((i * 2654435761 + r as u64 * 97) >> 7) as i64 % vocab as i64)
                .collect()
        })
        .collect();
    let objective: Box<dyn Objective> = match objective {
        "sft" => Box::new(Sft::new(&ids, vocab, None, dev)?),
        "dpo" => Box::new(Dpo::new(&ids, &[-1000.0], &[-1000.0], 0.1, vocab, dev)?),
        _ => {
            let completion: Vec<Vec<i64>> = (0..rows)
                .map(|_| (0..t).map(|i| (i >= t / 2) as i64).collect())
                .collect();
            let advantages: Vec<f64> = (0..rows)
                .map(|r| if r % 2 == 0 { 1.0 } else { -1.0 })
                .collect();
            let reference: Vec<Vec<f64>> = vec![vec![-5.0; t]; rows];
            Box::new(Grpo::new(
                &GrpoBatch {
                    input_ids: &ids,
                    completion_mask: &completion,
                    advantages: &advantages,
                    old_logps: None,
                    ref_logps: Some(&reference),
                    beta: 0.04,
                    epsilon_low: 0.2,
                    epsilon_high: 0.2,
                    loss_type: GrpoLossType::Grpo,
                    max_completion_length: None,
                    temperature: 1.0,
                    num_items_in_batch: None,
                    use_bias_correction_kl: true,
                    sapo_temperatures: (1.0, 1.05),
                },
                vocab,
                dev,
            )?)
        }
    };
    let flat: Vec<u32> = ids.iter().flatten().map(|&v| v as u32).collect();
    Ok((Tensor::from_vec(flat, (rows, t), dev)?, objective))
}

/// One AdamW step on `grads` (moments created for it, learning rate 0): peak bytes above what was live
/// before it, and seconds.
fn optimizer_step(model: &Model, grads: &[(String, Tensor)]) -> anyhow::Result<(usize, f64)> {
    let meter = Meter::for_device(model.device());
    let before = meter.current_bytes().unwrap_or(0);
    meter.reset_peak();
    let start = Instant::now();
    let mut adamw = AdamW::new(model.parameters(), AdamWConfig::default())?;
    adamw.apply(grads, 0.0)?;
    model.device().synchronize()?;
    let seconds = start.elapsed().as_secs_f64();
    let peak = meter.peak_bytes().unwrap_or(0).saturating_sub(before);
    Ok((peak, seconds))
}

fn run(
    (trained, model): (&str, &Model),
    work: &(Tensor, Box<dyn Objective>),
    mode: Mode,
    chunks: Chunks,
    repeats: usize,
    options: Options,
    with_optimizer: bool,
) -> anyhow::Result<Point> {
    let (ids, objective) = work;
    let t = ids.dim(1)?;
    let mut best: Option<Point> = None;
    for _ in 0..repeats.max(1) {
        let before = Meter::for_device(model.device())
            .current_bytes()
            .unwrap_or(0);
        // Only this run's parts (empty unless --op-times switched the timing on).
        op_times::take();
        let start = Instant::now();
        let out = backward_with(
            model,
            Batch::new(ids, None),
            objective.as_ref(),
            Plan::new(mode, chunks).with(options.clone()),
        )?;
        let seconds = start.elapsed().as_secs_f64();
        let op_times = op_times::take();
        let optimizer = with_optimizer
            .then(|| optimizer_step(model, &out.grads))
            .transpose()?;
        let phases: Vec<_> = out
            .phases
            .phases
            .iter()
            .map(|p| {
                (
                    p.name,
                    p.peak_bytes.unwrap_or(0).saturating_sub(before),
                    p.seconds,
                )
            })
            .collect();
        let peak = phases.iter().map(|(_, b, _)| *b).max().unwrap_or(0);
        if best.as_ref().is_none_or(|b| seconds < b.seconds) {
            best = Some(Point {
                trained: trained.to_string(),
                mode,
                t,
                peak,
                base: before,
                phases,
                seconds,
                loss: out.loss,
                optimizer,
                checkpoint_io: out.checkpoint_io,
                op_times,
            });
        }
    }
    best.context("no run")
}

fn options(args: &Args) -> Options {
    Options {
        offload_checkpoints: args.offload_checkpoints,
        checkpoint_every: args.checkpoint_every,
        checkpoint_dir: args.checkpoint_dir.as_deref().map(Into::into),
        ..Default::default()
    }
}

/// How the chunks at `t` tokens are chosen: `--chunk` when given, else the planner's for
/// `--max-t-budget`, else T/3 (the paper's timing setting).
fn chunk_policy(args: &Args, t: usize) -> ChunkPolicy {
    match (args.chunk, args.max_t_budget) {
        (None, Some(budget)) => {
            ChunkPolicy::Budget(budget, Tiers::of(&options(args), args.host_memory_budget))
        }
        _ => ChunkPolicy::Fixed(given_chunks(args, t)),
    }
}

/// The chunks of the command line at `t` tokens: `--chunk` (default T/3, the paper's timing setting)
/// and `--logits-chunk`.
fn given_chunks(args: &Args, t: usize) -> Chunks {
    Chunks {
        chunk: args.chunk.unwrap_or(t.div_ceil(3)),
        logits_chunk: args.logits_chunk,
    }
}

/// The planner's view of one backward of this run at `t` tokens (`lora`: what LoRA trains).
fn problem<'a>(
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
    }
}

/// `--predict`: the cost model's view of stream at each T, without building the model.
fn predict(cfg: &ModelConfig, dtype: DType, args: &Args) -> anyhow::Result<()> {
    // GiB for models of a card's size, MiB for the small ones.
    let lora = args.lora.config()?;
    let weights = estimate(
        problem(cfg, dtype, args, 1, lora.as_ref()),
        Chunks {
            chunk: 1,
            logits_chunk: 1,
        },
    )
    .resident;
    let (unit, scale) = match weights >= 1 << 30 {
        true => ("GiB", (1u64 << 30) as f64),
        false => ("MiB", (1u64 << 20) as f64),
    };
    let in_unit = |b: u64| b as f64 / scale;
    println!();
    println!("Cost-model estimate of stream's peak (not a measurement):");
    println!("| T | chunk | logits chunk | layers per checkpoint | weights, rope, gemm slabs ({unit}) | head phase (with its gradients) | layer phase (with all gradients) | embedding phase | peak ({unit}) | stored checkpoints ({unit}) | where |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for &t in &args.seq_lens {
        let p = problem(cfg, dtype, args, t, lora.as_ref());
        let planned = match chunk_policy(args, t).plan_for(p) {
            Ok(planned) => planned,
            Err(e) => {
                println!("| {t} | - | - | - | - | - | - | - | {e} | - | - |");
                continue;
            }
        };
        let chunks = planned.chunks;
        // Where the stored checkpoints are: the plan's choice under a budget, else the flags'.
        let place = planned.place.unwrap_or(match p.offloaded {
            true if args.checkpoint_dir.is_some() => CheckpointPlace::Disk,
            true => CheckpointPlace::Host,
            false => CheckpointPlace::Device,
        });
        let est = estimate(
            Problem {
                checkpoint_every: planned.checkpoint_every,
                offloaded: place != CheckpointPlace::Device,
                ..p
            },
            chunks,
        );
        let place = match place {
            CheckpointPlace::Device => "on the device (in the peak)",
            CheckpointPlace::Host => "host memory",
            CheckpointPlace::Disk => "disk",
        };
        let stored = cfg.num_layers().div_ceil(planned.checkpoint_every)
            * p.batch
            * t
            * cfg.hidden_size
            * dtype.size_in_bytes();
        println!(
            "| {t} | {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {place} |",
            chunks.chunk,
            chunks.logits_chunk,
            planned.checkpoint_every,
            in_unit(est.resident),
            in_unit(est.head_phase),
            in_unit(est.layer_phase),
            in_unit(est.embedding_phase),
            in_unit(est.peak()),
            in_unit(stored as u64)
        );
    }
    Ok(())
}

/// The longest T (multiple of `step`) whose whole peak (weights included) fits `budget`, and the
/// peak there, plus the first T tried that did not fit (`None` when `--t-max` stopped the search).
fn max_t(
    (trained, model): (&str, &Model),
    args: &Args,
    mode: Mode,
    budget: u64,
) -> anyhow::Result<(usize, usize, Option<usize>)> {
    let vocab = model.config.vocab_size;
    // The whole peak at `t` when it fits the budget.
    let fits = |t: usize| -> anyhow::Result<Option<usize>> {
        // Chunks as given, else the planner's for this T and budget (when even its smallest chunks
        // are estimated not to fit, that T does not fit).
        let problem = problem(&model.config, model.dtype(), args, t, model.lora());
        let planned = match chunk_policy(args, t).plan_for(problem) {
            Ok(planned) => planned,
            Err(e) => {
                eprintln!("  {mode} T={t}: {e}");
                return Ok(None);
            }
        };
        let chunks = planned.chunks;
        let work = workload(&args.objective, vocab, t, args.group, model.device())?;
        let p = match run(
            (trained, model),
            &work,
            mode,
            chunks,
            1,
            planned.options(options(args)),
            false,
        ) {
            Ok(p) => p,
            Err(e) if is_out_of_memory(&e) => {
                eprintln!("  {mode} T={t} ({chunks:?}): out of memory");
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        let total = p.peak + p.base;
        let ok = total as u64 <= budget;
        let verdict = if ok { "fits" } else { "over" };
        eprintln!(
            "  {mode} T={t} ({chunks:?}): {:.1} MiB {verdict}",
            mib(total)
        );
        Ok(ok.then_some(total))
    };
    longest_fitting((args.t_step, args.t_max), fits)
}

/// The longest multiple of `step` (up to `t_max`) for which `fits` gives a peak, by doubling then
/// bisection: that T, its peak, and the first T tried that did not fit (`None`: bounded by `t_max`).
fn longest_fitting(
    (step, t_max): (usize, Option<usize>),
    mut fits: impl FnMut(usize) -> anyhow::Result<Option<usize>>,
) -> anyhow::Result<(usize, usize, Option<usize>)> {
    let Some(mut best_peak) = fits(step)? else {
        return Ok((0, 0, Some(step)));
    };
    let (mut lo, mut hi) = (step, 2 * step);
    loop {
        if t_max.is_some_and(|cap| hi > cap) {
            // Bounded by the cap, not by memory.
            return Ok((lo, best_peak, None));
        }
        let Some(peak) = fits(hi)? else {
            break;
        };
        best_peak = peak;
        lo = hi;
        hi *= 2;
    }
    // lo fits, hi does not.
    while hi - lo > step {
        let mid = (lo + hi) / 2 / step * step;
        match fits(mid)? {
            Some(peak) => {
                lo = mid;
                best_peak = peak;
            }
            None => hi = mid,
        }
    }
    Ok((lo, best_peak, Some(hi)))
}

/// With --op-times: each part's calls, seconds and share of the point's step, by name (the
/// `attention.*` parts run inside the `layer.*` ones).
fn print_op_times(p: &Point) {
    if p.op_times.is_empty() {
        return;
    }
    let mut parts = p.op_times.clone();
    parts.sort_by(|a, b| a.name.cmp(b.name));
    println!(
        "T={} {} {}: parts of the step ({:.3} s with every part synchronised; parts in parts \
         count in both)",
        p.t, p.trained, p.mode, p.seconds
    );
    for o in parts {
        println!(
            "  {:<42} {:>7} calls {:>9.3} s {:>6.1}%",
            o.name,
            o.calls,
            o.seconds,
            100.0 * o.seconds / p.seconds
        );
    }
}

/// One JSON line of results.
fn point_json(args: &Args, p: &Point, c: &Chunks) -> serde_json::Value {
    serde_json::json!({
        "objective": args.objective, "trained": p.trained, "t": p.t, "mode": p.mode.to_string(), "chunk": c.chunk,
        "logits_chunk": c.logits_chunk, "peak_bytes": p.peak, "base_bytes": p.base,
        "seconds": p.seconds, "loss": p.loss,
        "optimizer_step": p.optimizer.map(|(b, s)| serde_json::json!({"peak_bytes": b, "seconds": s})),
        "checkpoint_io": args.checkpoint_dir.as_ref().map(|_| serde_json::json!({
            "written_bytes": p.checkpoint_io.written, "read_bytes": p.checkpoint_io.read,
            "seconds": p.checkpoint_io.seconds,
        })),
        "phases": p.phases.iter().map(|(n, b, s)| serde_json::json!({"phase": n, "peak_bytes": b, "seconds": s})).collect::<Vec<_>>(),
        "op_times": p.op_times.iter().map(|o| serde_json::json!({"part": o.name, "calls": o.calls, "seconds": o.seconds})).collect::<Vec<_>>(),
    })
}

/// Appends one JSON line to `--json`'s file, if any, flushed so that a run cut off keeps it.
fn write_json(file: &mut Option<std::fs::File>, line: &serde_json::Value) -> anyhow::Result<()> {
    if let Some(file) = file {
        writeln!(file, "{line}")?;
        file.flush()?;
    }
    Ok(())
}

/// An accelerator that runs out of memory answers with an error, which the bench reports as a result.
fn is_out_of_memory(e: &anyhow::Error) -> bool {
    format!("{e:#}")
        .to_ascii_lowercase()
        .contains("out of memory")
}

fn mib(b: usize) -> f64 {
    b as f64 / (1 << 20) as f64
}

/// `--peer`: our SFT step beside the peer's at each T ([`peer`]).
fn compare_with_peer(args: &Args, model: &Model, python: &std::path::Path) -> anyhow::Result<()> {
    if args.objective != "sft" {
        bail!("--peer times SFT steps (the peer's loss): give --objective sft");
    }
    let script = args
        .peer_script
        .clone()
        .unwrap_or_else(|| PathBuf::from(peer::DEFAULT_SCRIPT));
    let mut runner = peer::Peer::start(python, &script, &args.config, &args.dtype)?;
    let modes: Vec<String> = args.modes.iter().map(|m| m.to_string()).collect();
    let vocab = model.config.vocab_size;
    let rows = peer::compare(
        &mut runner,
        &args.seq_lens,
        &modes,
        args.repeats.max(3),
        |t, mode| {
            let work = workload("sft", vocab, t, 1, model.device())?;
            let mode: Mode = mode.parse().map_err(|e| anyhow::anyhow!("{e}"))?;
            let p = run(
                ("full", model),
                &work,
                mode,
                given_chunks(args, t),
                1,
                options(args),
                false,
            )?;
            Ok(p.seconds)
        },
    )?;
    let info = &runner.info;
    let cpu = cpu::Cpu::this();
    let chunk = args.chunk.map_or("T/3".to_string(), |c| c.to_string());
    let heading = format!(
        "{}, {}, batch 1, SFT forward + backward; streambp chunk {chunk}, logits chunk {}; peer: torch {}, \
         transformers {}, {} threads, {} attention; medians of {} alternated rounds\n\nCPU: {cpu}{}\n\n",
        args.config.display(),
        args.dtype,
        args.logits_chunk,
        info["torch"].as_str().unwrap_or("?"),
        info["transformers"].as_str().unwrap_or("?"),
        info["threads"],
        info["attn"].as_str().unwrap_or("?"),
        args.repeats.max(3),
        match (args.dtype.as_str(), cpu.has_bf16_arithmetic()) {
            ("bf16", true) => ", with bf16 arithmetic",
            ("bf16", false) => ", without bf16 arithmetic (both sides emulate it)",
            _ => "",
        },
    );
    let table = peer::table(&rows);
    println!();
    print!("{heading}{table}");
    if let Some(doc) = &args.peer_doc {
        let key = format!("{} ({}), {}", cpu.name(), cpu.flags.join(" "), args.dtype);
        peer::write_into(doc, &key, &format!("{heading}{table}"))?;
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    // Ranks sharing a node share its cores (set before any thread pool starts).
    if let Some(threads) = streambp_dist::threads_per_rank() {
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    }
    streambp_core::settle_thread_settings();
    streambp_core::memory::keep_freed_memory();
    // The host kernels the STREAMBP_SIMD and STREAMBP_BF16_KERNEL switches name (a value the CPU
    // cannot run is reported and left to the CPU), fixed before the first product.
    {
        use streambp_kernels::host::{choices, half_product::KERNEL_ENV, simd::SIMD_ENV};
        let switch = |name| std::env::var(name).ok();
        let asked = choices::Choices::from_switches(
            switch(SIMD_ENV).as_deref(),
            switch(KERNEL_ENV).as_deref(),
        );
        choices::choose(asked)?;
    }
    let args = Args::parse();
    if let Some(ranks) = args.world {
        if ranks == 0 {
            bail!("--world 0: the number of ranks is at least 1");
        }
        if args.sp == 0 || !ranks.is_multiple_of(args.sp) {
            bail!("--sp {}: must divide --world ({ranks})", args.sp);
        }
        if let Some(status) = world::relaunch(ranks)? {
            std::process::exit(status.code().unwrap_or(1));
        }
    }
    let dtype = parse_dtype(&args.dtype)?;
    let mut cfg = ModelConfig::from_file(&args.config)?;
    if let Some(n) = args.layers {
        cfg.layers.truncate(n.max(1));
    }
    if args.predict {
        return predict(&cfg, dtype, &args);
    }
    op_times::switch(args.op_times);
    let device = match (parse_device(&args.device)?, args.world) {
        // One GPU per rank of the node.
        (Device::Cuda(_), Some(_)) => {
            parse_device(&format!("cuda:{}", streambp_dist::local_rank()))?
        }
        (device, _) => device,
    };
    // Seeded: every rank builds the same weights.
    let model = Model::random(cfg, dtype, &device, 0)?;
    if let Some(ranks) = args.world {
        return run_ranks(&args, &model, ranks);
    }
    if args.sp != 1 {
        bail!("--sp {}: needs --world", args.sp);
    }
    let params: usize = model.parameters().iter().map(|(_, v)| v.elem_count()).sum();
    println!(
        "objective {}, model {} ({:.1}M parameters, {} layers), dtype {dtype:?}, device {}, logits chunk {}",
        args.objective,
        args.config.display(),
        params as f64 / 1e6,
        model.layers.len(),
        args.device,
        args.logits_chunk
    );
    if args.device == "cpu" {
        println!("CPU: {}", cpu::Cpu::this());
    }
    // Warm-up: first-touch costs (thread pools, page faults) out of the timings.
    let warm = Chunks {
        chunk: 64,
        logits_chunk: 64,
    };
    let vocab = model.config.vocab_size;
    if args.lora.adapter.is_some() {
        bail!("--adapter: the bench measures a fresh adapter (--lora-r), not a loaded one");
    }
    // Full fine-tuning, and LoRA on the same weights (a view of them: no second copy).
    let mut trainings = vec![("full".to_string(), model.clone())];
    if let Some(lora) = args.lora.config()? {
        let label = format!("LoRA r={}", lora.r);
        trainings.push((label, model.clone().with_lora(lora, None, 0)?));
    }
    run(
        ("full", &model),
        &workload("sft", vocab, 128, 1, model.device())?,
        Mode::Stream,
        warm,
        1,
        Options::default(),
        false,
    )?;

    if let Some(python) = &args.peer {
        return compare_with_peer(&args, &model, python);
    }

    if let Some(budget) = args.max_t_budget {
        return print_max_t(&args, &trainings, budget);
    }
    let (points, out_of_memory) = sweep(&args, &trainings)?;
    print_table(&args, &model, dtype, &trainings, &points, &out_of_memory);
    print_lora_against_full(&model, params, &points);
    if let Some(dir) = &args.plot {
        plot(&args, &trainings, &points, dir)?;
    }
    Ok(())
}

/// `--world N`: the data-parallel step on this rank (the launcher started the ranks).
fn run_ranks(args: &Args, model: &Model, ranks: usize) -> anyhow::Result<()> {
    let device = model.device();
    let _guard = streambp_dist::init(device.is_cuda())?;
    let world = streambp_dist::world().world_size();
    if world != ranks {
        bail!("--world {ranks}, but the launcher started {world} rank(s)");
    }
    let rank0 = streambp_dist::world().rank() == 0;
    let mut json = args
        .json
        .as_ref()
        .filter(|_| rank0)
        .map(std::fs::File::create)
        .transpose()?;
    let vocab = model.config.vocab_size;
    let workload = |t| {
        let work = workload(&args.objective, vocab, t, args.group, model.device())?;
        Ok((work, given_chunks(args, t)))
    };
    if let Some(budget) = args.max_t_budget {
        let zero = args.zero.first().copied().unwrap_or(ZeroStage::Zero0);
        let search = |fits: &mut dyn FnMut(usize) -> anyhow::Result<Option<usize>>| {
            longest_fitting((args.t_step, args.t_max), fits)
        };
        return world::world_max_t(model, (args.sp, zero), budget, workload, search);
    }
    world::run_world(
        model,
        (&args.seq_lens, args.sp),
        &args.zero,
        workload,
        |line| write_json(&mut json, &line),
    )
}

/// `--max-t-budget`: the longest T of each mode and training whose peak fits `budget`.
fn print_max_t(args: &Args, trainings: &[(String, Model)], budget: u64) -> anyhow::Result<()> {
    println!();
    println!(
        "Longest T whose peak (weights included) fits {:.0} MiB:",
        budget as f64 / (1 << 20) as f64
    );
    println!("| trained | mode | max T | peak there (MiB) | next T tried (over) |");
    println!("|---|---|---|---|---|");
    for (trained, m) in trainings {
        for &mode in &args.modes {
            let (t, peak, over) = max_t((trained, m), args, mode, budget)?;
            let over = over.map_or("none tried (--t-max)".to_string(), |t| t.to_string());
            println!("| {trained} | {mode} | {t} | {:.1} | {over} |", mib(peak));
        }
    }
    Ok(())
}

/// Every T of `--seq-lens`, every training and mode: the measured points, and the runs that ran out
/// of memory.
#[allow(clippy::type_complexity)]
fn sweep(
    args: &Args,
    trainings: &[(String, Model)],
) -> anyhow::Result<(Vec<(Point, Chunks)>, Vec<(usize, String, Mode)>)> {
    let vocab = trainings[0].1.config.vocab_size;
    let device = trainings[0].1.device();
    let mut json = args
        .json
        .as_ref()
        .map(|path| {
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))
        })
        .transpose()?;
    let mut points = Vec::new();
    let mut out_of_memory = Vec::new();
    for &t in &args.seq_lens {
        let chunks = given_chunks(args, t);
        let work = workload(&args.objective, vocab, t, args.group, device)?;
        for (trained, mode) in trainings
            .iter()
            .flat_map(|(k, m)| args.modes.iter().map(move |&mode| ((k.as_str(), m), mode)))
        {
            let p = match run(
                trained,
                &work,
                mode,
                chunks,
                args.repeats,
                options(args),
                args.optimizer_step,
            ) {
                Ok(p) => p,
                Err(e) if is_out_of_memory(&e) => {
                    eprintln!("T={t} {} {mode}: out of memory", trained.0);
                    out_of_memory.push((t, trained.0.to_string(), mode));
                    let line = serde_json::json!({
                        "objective": args.objective, "trained": trained.0, "t": t,
                        "mode": mode.to_string(), "out_of_memory": true,
                    });
                    write_json(&mut json, &line)?;
                    continue;
                }
                Err(e) => return Err(e),
            };
            eprintln!(
                "T={t} {} {mode}: peak {:.1} MiB, {:.3} s",
                p.trained,
                mib(p.peak),
                p.seconds
            );
            if let Some(dir) = &args.checkpoint_dir {
                let io = p.checkpoint_io;
                eprintln!(
                    "T={t} {mode}: checkpoints in {}: {:.1} MiB written, {:.1} MiB read, {:.3} s",
                    dir.display(),
                    mib(io.written as usize),
                    mib(io.read as usize),
                    io.seconds
                );
            }
            print_op_times(&p);
            if let Some((peak, seconds)) = p.optimizer {
                println!(
                    "T={t} {mode}: AdamW step {seconds:.3} s, peak {:.1} MiB above the gradients (f32 moments included)",
                    mib(peak)
                );
            }
            write_json(&mut json, &point_json(args, &p, &chunks))?;
            points.push((p, chunks));
        }
    }

    Ok((points, out_of_memory))
}

/// The sweep's table: each point's peak and time beside the other modes' at the same T, and the
/// planner's estimate error.
fn print_table(
    args: &Args,
    model: &Model,
    dtype: DType,
    trainings: &[(String, Model)],
    points: &[(Point, Chunks)],
    out_of_memory: &[(usize, String, Mode)],
) {
    println!();
    println!("| T | trained | mode | chunk | peak above the weights (MiB) | vs checkpoint | vs full | seconds | vs checkpoint | planner estimate error |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let lora_of = |trained: &str| {
        trainings
            .iter()
            .find(|(k, _)| k == trained)
            .and_then(|(_, m)| m.lora())
    };
    for (p, chunks) in points {
        let same_t = |m: Mode| {
            points
                .iter()
                .map(|(q, _)| q)
                .find(|q| q.t == p.t && q.mode == m && q.trained == p.trained)
        };
        let ratio = |other: Option<&Point>, f: &dyn Fn(&Point) -> f64| {
            other
                .map(|o| format!("{:.3}", f(p) / f(o)))
                .unwrap_or_else(|| "-".into())
        };
        // The planner's cost model of stream's whole peak, against the measured whole peak.
        let estimate_error = if p.mode == Mode::Stream {
            let problem = problem(&model.config, dtype, args, p.t, lora_of(&p.trained));
            let est = estimate(problem, *chunks).peak() as f64;
            let measured = (p.peak + p.base) as f64;
            format!("{:+.1}%", 100.0 * (est - measured) / measured)
        } else {
            "-".into()
        };
        println!(
            "| {} | {} | {} | {} | {:.1} | {} | {} | {:.3} | {} | {} |",
            p.t,
            p.trained,
            p.mode,
            if p.mode == Mode::Stream {
                chunks.chunk.to_string()
            } else {
                "-".into()
            },
            mib(p.peak),
            ratio(same_t(Mode::Checkpoint), &|x| x.peak as f64),
            ratio(same_t(Mode::Full), &|x| x.peak as f64),
            p.seconds,
            ratio(same_t(Mode::Checkpoint), &|x| x.seconds),
            estimate_error,
        );
    }
    for (t, trained, mode) in out_of_memory {
        println!("| {t} | {trained} | {mode} | - | out of memory | - | - | - | - | - |");
    }
}

/// LoRA beside full fine-tuning: what the frozen weights' gradients cost (`params`: the model's
/// parameter count).
fn print_lora_against_full(model: &Model, params: usize, points: &[(Point, Chunks)]) {
    let grads_mib = mib(params * model.dtype().size_in_bytes());
    for (p, _) in points.iter().filter(|(p, _)| p.trained != "full") {
        let full = points
            .iter()
            .map(|(q, _)| q)
            .find(|q| q.t == p.t && q.mode == p.mode && q.trained == "full");
        if let Some(full) = full {
            println!(
                "T={} {}: {} peak {:.1} MiB, full fine-tuning {:.1} MiB: {:.1} MiB less (full gradients {grads_mib:.1} MiB); time {:.3} s vs {:.3} s ({:.2}x)",
                p.t,
                p.mode,
                p.trained,
                mib(p.peak),
                mib(full.peak),
                mib(full.peak) - mib(p.peak),
                p.seconds,
                full.seconds,
                p.seconds / full.seconds
            );
        }
    }
}

/// `--plot DIR`: memory and time against T, one series per mode (and training).
fn plot(
    args: &Args,
    trainings: &[(String, Model)],
    points: &[(Point, Chunks)],
    dir: &std::path::Path,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let series = |value: &dyn Fn(&Point) -> f64| -> Vec<Series> {
        let kinds: Vec<&String> = trainings.iter().map(|(k, _)| k).collect();
        kinds
            .iter()
            .flat_map(|k| {
                [Mode::Stream, Mode::Checkpoint, Mode::Full]
                    .into_iter()
                    .filter(|m| args.modes.contains(m))
                    .map(move |m| (*k, m))
            })
            .map(|(k, m)| Series {
                label: match kinds.len() {
                    1 => m.to_string(),
                    _ => format!("{m} ({k})"),
                },
                points: points
                    .iter()
                    .filter(|(p, _)| p.mode == m && &p.trained == k)
                    .map(|(p, _)| (p.t as f64, value(p)))
                    .collect(),
            })
            .collect()
    };
    let title = format!("{} backward, {}", args.objective, args.config.display());
    let chart = |y_label: &str, value: &dyn Fn(&Point) -> f64| Chart {
        title: title.clone(),
        x_label: "sequence length T".into(),
        y_label: y_label.into(),
        series: series(value),
    };
    draw(
        &dir.join("memory.svg"),
        &[chart("activation peak (MiB)", &|p| mib(p.peak))],
        1,
    )?;
    draw(
        &dir.join("time.svg"),
        &[chart("seconds per backward", &|p| p.seconds)],
        1,
    )?;
    Ok(())
}
