//! `--max-t-budget`: the longest T whose measured peak fits a memory budget, per mode and training,
//! found by doubling then bisection.

use streambp_core::Mode;
use streambp_models::Model;

use crate::args::{chunk_policy, options, problem, Args};
use crate::measure::{is_out_of_memory, run, workload};
use crate::report::mib;

/// `--max-t-budget`: the longest T of each mode and training whose peak fits `budget`.
pub(crate) fn print_max_t(
    args: &Args,
    trainings: &[(String, Model)],
    budget: u64,
) -> anyhow::Result<()> {
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

/// The longest T (multiple of `step`) whose whole peak (weights included) fits `budget`, and the
/// peak there, plus the first T tried that did not fit (`None` when `--t-max` stopped the search).
pub(crate) fn max_t(
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
pub(crate) fn longest_fitting(
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
