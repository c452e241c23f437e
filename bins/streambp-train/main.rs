//! `streambp-train`: the command line.

mod args;

use anyhow::Context;
use clap::Parser;
use streambp_core::memory::CountingAllocator;
use streambp_train::config::Recipe;
use streambp_train::dpo::run_dpo;
use streambp_train::grad::run_grad;
use streambp_train::grpo::run_grpo;
use streambp_train::sft::run_sft;
use streambp_train::trainer::Summary;
use streambp_train::TrainError;

use args::{Cli, Command};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// The final summary of a run (rank 0's to print).
fn report(recipe: &str, summary: &Summary) {
    if streambp_dist::world().rank() != 0 {
        return;
    }
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
            } else if name == "reward" {
                println!("training {name} (first -> last rollouts): {before:.3} -> {after:.3}");
            } else {
                println!("held-out {name}: {before:.4} -> {after:.4}");
            }
        }
    }
    if let Some(peak) = streambp_core::memory::process_peak_bytes() {
        println!("peak heap: {:.1} MiB", peak as f64 / (1u64 << 20) as f64);
    }
    println!("checkpoint: {}", summary.output_dir.display());
}

fn main() -> std::process::ExitCode {
    // Ranks sharing a node share its cores (set before any thread pool starts).
    if let Some(threads) = streambp_dist::threads_per_rank() {
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    }
    streambp_core::settle_thread_settings();
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One readable line with the whole cause chain; no backtrace for user errors.
            eprintln!("error: {}", one_line(&e));
            let usage = e.chain().any(|cause| {
                cause
                    .downcast_ref::<TrainError>()
                    .is_some_and(TrainError::is_usage)
            });
            // As clap does for a bad flag: 2 for how the command was called, 1 for what went wrong.
            std::process::ExitCode::from(if usage { 2 } else { 1 })
        }
    }
}

/// The error and its causes joined by ": ", leaving out a cause whose text the line already ends with
/// (errors that print their source themselves).
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !line.ends_with(&text) {
            if !line.is_empty() {
                line.push_str(": ");
            }
            line.push_str(&text);
        }
    }
    line
}

fn run() -> anyhow::Result<()> {
    // Under mpiexec the other ranks log warnings only: rank 0 speaks for the run.
    let level = match streambp_dist::launched_rank() {
        0 => "info",
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level)),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = streambp_train::config_file::expand_config(std::env::args().collect())?;
    // The ranks of a data-parallel run (one process without mpiexec); kept until the end.
    let start = |device: &str| streambp_dist::init(device.starts_with("cuda"));
    match Cli::parse_from(args).command {
        Command::Sft(args) => {
            let cfg = args.into_config(Recipe::Sft)?;
            let _ranks = start(&cfg.device)?;
            report("sft", &run_sft(&cfg).context("sft failed")?);
        }
        Command::Dpo(args) => {
            let cfg = args.into_config(Recipe::Dpo)?;
            let _ranks = start(&cfg.device)?;
            report("dpo", &run_dpo(&cfg).context("dpo failed")?);
        }
        Command::Grpo { train, grpo } => {
            let builtin = train.model.is_none() && train.data.is_none();
            let cfg = train.into_config(Recipe::Grpo)?;
            let g = grpo.into_config(builtin);
            let _ranks = start(&cfg.device)?;
            report("grpo", &run_grpo(&cfg, &g).context("grpo failed")?);
        }
        Command::Grad(args) => {
            if streambp_dist::launched_ranks().is_some_and(|n| n > 1) {
                anyhow::bail!("grad runs in one process: start it without mpiexec");
            }
            let report = run_grad(&args).context("grad failed")?;
            println!("{}", serde_json::to_string(&report)?);
        }
    }
    Ok(())
}
