//! `--peer PYTHON`: our SFT step measured at each T beside the peer's (the process and its table
//! are [`crate::peer`]'s), and the tables printed and written into `--peer-doc`; with `--plot`, the
//! heap peaks of both sides too, drawn against T.

use std::path::PathBuf;

use anyhow::bail;
use streambp_core::Mode;
use streambp_models::Model;

use streambp_train::plots::{draw, Chart, Series};

use crate::args::{given_chunks, options, Args};
use crate::measure::{run, workload};
use crate::{cpu, peer};

/// `--peer`: our SFT step beside the peer's at each T ([`peer`]).
pub(crate) fn compare_with_peer(
    args: &Args,
    model: &Model,
    python: &std::path::Path,
) -> anyhow::Result<()> {
    if args.objective != "sft" {
        bail!("--peer times SFT steps (the peer's loss): give --objective sft");
    }
    let script = args
        .peer_script
        .clone()
        .unwrap_or_else(|| PathBuf::from(peer::DEFAULT_SCRIPT));
    // Peaks are of host memory: measured on the CPU, for the plot.
    let memory = args.plot.is_some() && model.device().is_cpu();
    let mut runner = peer::Peer::start(python, &script, (&args.config, &args.dtype), memory)?;
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
            Ok(peer::Step {
                seconds: p.seconds,
                peak: memory.then_some(p.peak as f64),
            })
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
    let table = peer::table(&rows) + &with_heading(&peer::memory_table(&rows));
    println!();
    print!("{heading}{table}");
    if let Some(dir) = &args.plot {
        let name = args
            .config
            .file_stem()
            .unwrap_or_default()
            .to_string_lossy();
        let title = format!("SFT step, {name}, {}, {}", args.dtype, cpu.name());
        plot_against_peer(&rows, &title, dir)?;
    }
    if let Some(doc) = &args.peer_doc {
        let key = format!("{} ({}), {}", cpu.name(), cpu.flags.join(" "), args.dtype);
        peer::write_into(doc, &key, &format!("{heading}{table}"))?;
    }
    Ok(())
}

/// The memory table's lead-in, where there is one.
fn with_heading(memory: &str) -> String {
    match memory.is_empty() {
        true => String::new(),
        false => format!(
            "\nHeap peak above the weights (ours: the counting allocator; the peer's: \
             scripts/heap_peak.c preloaded; medians of the rounds):\n\n{memory}"
        ),
    }
}

/// `--plot DIR` with `--peer`: memory.svg (where the peaks were measured) and time.svg against T,
/// a line per mode of ours and per setting of the peer's.
fn plot_against_peer(rows: &[peer::Row], title: &str, dir: &std::path::Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let modes: Vec<String> = rows
        .first()
        .map(|r| r.ours.iter().map(|(m, _)| m.clone()).collect())
        .unwrap_or_default();
    // Series: the peer's two settings, then ours; `value(row, k)` the k-th's value at a row.
    let series = |value: &dyn Fn(&peer::Row, usize) -> Option<f64>| -> Vec<Series> {
        let labels = peer::PEER_MODES
            .iter()
            .map(|(_, name)| name.to_string())
            .chain(modes.iter().map(|m| format!("streambp {m}")));
        labels
            .enumerate()
            .map(|(k, label)| Series {
                label,
                points: rows
                    .iter()
                    .filter_map(|r| value(r, k).map(|v| (r.t as f64, v)))
                    .collect(),
            })
            .collect()
    };
    let chart =
        |y_label: &str, log_y: bool, value: &dyn Fn(&peer::Row, usize) -> Option<f64>| Chart {
            title: title.to_string(),
            x_label: "sequence length T".into(),
            y_label: y_label.into(),
            series: series(value),
            log_y,
        };
    let seconds = |r: &peer::Row, k: usize| match k {
        0 | 1 => Some(r.peer[k]),
        _ => r.ours.get(k - 2).map(|(_, s)| *s),
    };
    draw(
        &dir.join("time.svg"),
        &[chart("seconds per step", false, &seconds)],
        1,
    )?;
    if rows.iter().any(|r| r.peaks.is_some()) {
        let mib = |r: &peer::Row, k: usize| {
            let (peer, ours) = r.peaks.as_ref()?;
            let bytes = match k {
                0 | 1 => peer[k],
                _ => *ours.get(k - 2)?,
            };
            Some(bytes / (1u64 << 20) as f64)
        };
        draw(
            &dir.join("memory.svg"),
            &[chart("heap peak above the weights (MiB)", true, &mib)],
            1,
        )?;
    }
    Ok(())
}
