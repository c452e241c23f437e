//! What the bench prints and writes of its points: the heading, the sweep's table, LoRA beside full
//! fine-tuning, op times, JSON lines and the `--plot` charts.

use std::io::Write;

use candle_core::DType;
use streambp_core::{estimate, Chunks, Mode};
use streambp_models::Model;
use streambp_train::plots::{draw, Chart, Series};

use crate::args::{problem, Args};
use crate::cpu;
use crate::measure::Point;

/// The run's heading: objective, model (`params`: its parameter count), dtype, device and logits
/// chunk, and on the CPU, which CPU.
pub(crate) fn print_heading(args: &Args, model: &Model, dtype: DType, params: usize) {
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
}

/// With --op-times: each part's calls, seconds and share of the point's step, by name (the
/// `attention.*` parts run inside the `layer.*` ones).
pub(crate) fn print_op_times(p: &Point) {
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
pub(crate) fn point_json(args: &Args, p: &Point, c: &Chunks) -> serde_json::Value {
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
pub(crate) fn write_json(
    file: &mut Option<std::fs::File>,
    line: &serde_json::Value,
) -> anyhow::Result<()> {
    if let Some(file) = file {
        writeln!(file, "{line}")?;
        file.flush()?;
    }
    Ok(())
}

pub(crate) fn mib(b: usize) -> f64 {
    b as f64 / (1 << 20) as f64
}

/// The sweep's table: each point's peak and time beside the other modes' at the same T, and the
/// planner's estimate error.
pub(crate) fn print_table(
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
pub(crate) fn print_lora_against_full(model: &Model, params: usize, points: &[(Point, Chunks)]) {
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
pub(crate) fn plot(
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
    let chart = |y_label: &str, log_y: bool, value: &dyn Fn(&Point) -> f64| Chart {
        title: title.clone(),
        x_label: "sequence length T".into(),
        y_label: y_label.into(),
        series: series(value),
        log_y,
    };
    draw(
        &dir.join("memory.svg"),
        &[chart("activation peak (MiB)", true, &|p| mib(p.peak))],
        1,
    )?;
    draw(
        &dir.join("time.svg"),
        &[chart("seconds per backward", false, &|p| p.seconds)],
        1,
    )?;
    Ok(())
}
