//! `--world N` on this rank: the data-parallel steps of [`crate::world`] over the flags' workload,
//! or their longest T under `--max-t-budget`, with JSON lines from rank 0.

use anyhow::bail;
use streambp_models::Model;
use streambp_train::parallel::ZeroStage;

use crate::args::{given_chunks, Args};
use crate::budget::longest_fitting;
use crate::measure::workload;
use crate::report::write_json;
use crate::world;

/// `--world N`: the data-parallel step on this rank (the launcher started the ranks).
pub(crate) fn run_ranks(args: &Args, model: &Model, ranks: usize) -> anyhow::Result<()> {
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
