//! `streambp-train`: the command line.

mod args;

use anyhow::Context;
use streambp_core::memory::CountingAllocator;
use streambp_train::config::Recipe;
use streambp_train::cpo::run_cpo;
use streambp_train::dpo::run_dpo;
use streambp_train::grad::run_grad;
use streambp_train::grpo::run_grpo;
use streambp_train::kto::run_kto;
use streambp_train::orpo::run_orpo;
use streambp_train::reward::run_reward;
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

/// The host kernels the `STREAMBP_SIMD` and `STREAMBP_BF16_KERNEL` switches name, fixed before the
/// first product (a value the CPU cannot run is reported and left to the CPU).
fn choose_host_kernels() {
    use streambp_kernels::choices::{self, KERNEL_ENV, SIMD_ENV};
    let switch = |name| std::env::var(name).ok();
    let asked =
        choices::Choices::from_switches(switch(SIMD_ENV).as_deref(), switch(KERNEL_ENV).as_deref());
    if let Err(e) = choices::choose(asked) {
        tracing::warn!("host kernels: {e}");
    }
}

fn main() -> std::process::ExitCode {
    // Ranks sharing a node share its cores (set before any thread pool starts).
    if let Some(threads) = streambp_dist::threads_per_rank() {
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    }
    streambp_core::settle_thread_settings();
    streambp_core::memory::keep_freed_memory();
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

/// The command line parsed, a negative number after a flag taken as its value (`--lr -1e-5` is then
/// refused by the flag's own check, which names its range, rather than read as an unknown flag `-1`);
/// on an error about a flag the config file set, the message says so. Exits as clap does on errors
/// and `--help`.
fn parse_cli(expanded: &streambp_train::config_file::Expanded) -> Cli {
    use clap::Parser;
    let parsed = Cli::try_parse_from(negative_values_attached(&expanded.args));
    match parsed {
        Ok(cli) => cli,
        Err(e) => {
            let flag = match e.get(clap::error::ContextKind::InvalidArg) {
                Some(clap::error::ContextValue::String(arg)) => {
                    arg.split([' ', '=']).next().unwrap_or_default().to_string()
                }
                _ => String::new(),
            };
            let origin = expanded.origin(&flag);
            if origin.is_empty() {
                e.exit();
            }
            let _ = e.print();
            eprintln!("note: {flag}{origin}");
            std::process::exit(e.exit_code());
        }
    }
}

/// The flags of `subcommand`, each with whether it is a switch (takes no value, as `--packing`),
/// which a config file sets with a boolean only.
fn flags_of(subcommand: &str) -> Vec<(String, bool)> {
    use clap::CommandFactory;
    let cli = Cli::command();
    let Some(command) = cli.find_subcommand(subcommand) else {
        return Vec::new();
    };
    command
        .get_arguments()
        .filter_map(|a| {
            let switch = !a.get_action().takes_values();
            a.get_long().map(|long| (format!("--{long}"), switch))
        })
        .collect()
}

/// `args` with `--flag -N` written `--flag=-N` wherever `-N` is a number (no flag starts with a
/// digit or a dot), which clap would otherwise read as a flag when it has an exponent (`-1e-5`).
fn negative_values_attached(args: &[String]) -> Vec<String> {
    let negative_number = |a: &str| {
        a.strip_prefix('-')
            .and_then(|rest| rest.chars().next())
            .is_some_and(|c| c.is_ascii_digit() || c == '.')
    };
    let mut out: Vec<String> = Vec::with_capacity(args.len());
    for arg in args {
        match out.last_mut() {
            Some(flag) if flag.starts_with("--") && !flag.contains('=') && negative_number(arg) => {
                flag.push('=');
                flag.push_str(arg);
            }
            _ => out.push(arg.clone()),
        }
    }
    out
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
    choose_host_kernels();
    let args: Vec<String> = std::env::args().collect();
    let flags = flags_of(args.get(1).map_or("", String::as_str));
    let is_switch = |flag: &str| {
        flags
            .iter()
            .find(|(name, _)| name == flag)
            .map(|(_, switch)| *switch)
    };
    let expanded = streambp_train::config_file::expand_config(args, &is_switch)?;
    let cli = parse_cli(&expanded);
    // A flag's error names the config file when the value came from there.
    let located = |e: TrainError| -> anyhow::Error {
        let place = match &e {
            TrainError::Flag { flag, .. } => format!("{flag}{}", expanded.origin(flag)),
            _ => String::new(),
        };
        match place.contains(" (set in ") {
            true => anyhow::Error::new(e).context(place),
            false => e.into(),
        }
    };
    // The ranks of a data-parallel run (one process without mpiexec); kept until the end.
    let start = |device: &str| streambp_dist::init(device.starts_with("cuda"));
    match cli.command {
        Command::Sft(args) => {
            let cfg = args.into_config(Recipe::Sft).map_err(located)?;
            let _ranks = start(&cfg.device)?;
            report(
                "sft",
                &run_sft(&cfg).map_err(located).context("sft failed")?,
            );
        }
        Command::Dpo { train, dpo } => {
            let cfg = train.into_dpo_config(dpo).map_err(located)?;
            let _ranks = start(&cfg.device)?;
            report(
                "dpo",
                &run_dpo(&cfg).map_err(located).context("dpo failed")?,
            );
        }
        Command::Orpo(args) => {
            let cfg = args.into_config(Recipe::Orpo).map_err(located)?;
            let _ranks = start(&cfg.device)?;
            report(
                "orpo",
                &run_orpo(&cfg).map_err(located).context("orpo failed")?,
            );
        }
        Command::Cpo { train, cpo } => {
            let cfg = train.into_cpo_config(cpo).map_err(located)?;
            let _ranks = start(&cfg.device)?;
            report(
                "cpo",
                &run_cpo(&cfg).map_err(located).context("cpo failed")?,
            );
        }
        Command::Kto { train, kto } => {
            let cfg = train.into_kto_config(kto).map_err(located)?;
            let _ranks = start(&cfg.device)?;
            report(
                "kto",
                &run_kto(&cfg).map_err(located).context("kto failed")?,
            );
        }
        Command::Reward {
            train,
            center_rewards_coefficient,
        } => {
            let mut cfg = train.into_config(Recipe::Reward).map_err(located)?;
            cfg.center_rewards_coefficient = center_rewards_coefficient;
            let _ranks = start(&cfg.device)?;
            report(
                "reward",
                &run_reward(&cfg).map_err(located).context("reward failed")?,
            );
        }
        Command::Grpo { train, grpo } => {
            let builtin = train.model.is_none() && train.data.is_none();
            let cfg = train.into_config(Recipe::Grpo).map_err(located)?;
            let g = grpo.into_config(builtin);
            let _ranks = start(&cfg.device)?;
            report(
                "grpo",
                &run_grpo(&cfg, &g).map_err(located).context("grpo failed")?,
            );
        }
        Command::Rloo { train, rloo } => {
            let builtin = train.model.is_none() && train.data.is_none();
            let cfg = train.into_config(Recipe::Rloo).map_err(located)?;
            let g = rloo.into_config(builtin);
            let _ranks = start(&cfg.device)?;
            report(
                "rloo",
                &run_grpo(&cfg, &g).map_err(located).context("rloo failed")?,
            );
        }
        Command::Distill { train, distill } => {
            let builtin = train.model.is_none() && train.data.is_none();
            let cfg = train.into_config(Recipe::Distill).map_err(located)?;
            let g = distill.into_config(builtin);
            let _ranks = start(&cfg.device)?;
            report(
                "distill",
                &run_grpo(&cfg, &g)
                    .map_err(located)
                    .context("distill failed")?,
            );
        }
        Command::Grad(args) => {
            if streambp_dist::launched_ranks().is_some_and(|n| n > 1) {
                anyhow::bail!("grad runs in one process: start it without mpiexec");
            }
            let report = run_grad(&args).map_err(located).context("grad failed")?;
            println!("{}", serde_json::to_string(&report)?);
        }
    }
    Ok(())
}
