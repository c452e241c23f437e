//! The sweep: every T of `--seq-lens`, every training and mode measured, each point reported as it
//! is done (progress lines, op times, the optimizer step, a JSON line).

use anyhow::Context;
use streambp_core::{Chunks, Mode};
use streambp_models::Model;

use crate::args::{given_chunks, options, Args};
use crate::measure::{is_out_of_memory, run, workload, Point};
use crate::report::{mib, point_json, print_op_times, write_json};

/// Every T of `--seq-lens`, every training and mode: the measured points, and the runs that ran out
/// of memory.
#[allow(clippy::type_complexity)]
pub(crate) fn sweep(
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
