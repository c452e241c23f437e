//! `streambp-train`: the command line.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use streambp_core::memory::CountingAllocator;
use streambp_core::Mode;
use streambp_train::device::parse_bytes;
use streambp_train::grad::{run_grad, GradArgs};

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
    /// One backward on a batch file; writes every gradient under its HF name and prints one JSON line
    /// {"loss","mode","peak_bytes","seconds","tokens",...}.
    Grad {
        /// Model directory (HF format) or hub id.
        #[arg(long)]
        model: String,
        /// Batch file (JSON; see docs/grad.md).
        #[arg(long)]
        batch: PathBuf,
        /// stream (StreamBP), checkpoint (per-layer gradient checkpointing) or full (plain backprop).
        #[arg(long, default_value = "stream")]
        mode: Mode,
        /// Query chunk of the streamed layer backward, in tokens [default: 512, or from --memory-budget].
        #[arg(long)]
        chunk: Option<usize>,
        /// Positions per LM-head chunk [default: 128, or from --memory-budget].
        #[arg(long)]
        logits_chunk: Option<usize>,
        /// Pick the largest chunks whose estimated peak fits this budget (e.g. 8GiB).
        #[arg(long, value_parser = parse_budget)]
        memory_budget: Option<u64>,
        /// Compute dtype: f64, f32 or bf16.
        #[arg(long, default_value = "f32")]
        dtype: String,
        /// cpu, cuda or cuda:N.
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Output safetensors file.
        #[arg(long)]
        out: PathBuf,
        /// Reference model for DPO / GRPO batches that carry no reference log-probs
        /// [default: the policy itself].
        #[arg(long)]
        ref_model: Option<String>,
    },
}

fn parse_budget(s: &str) -> Result<u64, String> {
    parse_bytes(s).map_err(|e| e.to_string())
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
    match Cli::parse().command {
        Command::Grad {
            model,
            batch,
            mode,
            chunk,
            logits_chunk,
            memory_budget,
            dtype,
            device,
            out,
            ref_model,
        } => {
            let args = GradArgs {
                model,
                batch,
                mode,
                chunk,
                logits_chunk,
                memory_budget,
                dtype,
                device,
                out,
                ref_model,
            };
            let report = run_grad(&args).context("grad failed")?;
            println!("{}", serde_json::to_string(&report)?);
        }
    }
    Ok(())
}
