//! `--peer PYTHON`: our SFT step measured at each T beside the peer's (the process and its table
//! are [`crate::peer`]'s), and the table printed and written into `--peer-doc`.

use std::path::PathBuf;

use anyhow::bail;
use streambp_core::Mode;
use streambp_models::Model;

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
