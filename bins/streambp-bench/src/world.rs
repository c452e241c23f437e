//! `--world N`: data-parallel training steps on N ranks (the bench relaunches itself under
//! `mpiexec -n N`), one per ZeRO stage and T: each rank's peak memory over the step, the optimizer
//! state and gradients it holds (counted by the allocator, and as tensor sizes), the bytes its
//! collectives carried, and the step's time. Every rank streams its own sequence of T tokens, as it
//! would with a global batch of N sequences; with `--sp S` each run of S ranks splits one sequence
//! of T instead.

use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use candle_core::{Device, Tensor};
use streambp_core::memory::Meter;
use streambp_core::{Batch, Chunks, Mode, Plan};
use streambp_dist::Communicator;
use streambp_models::Model;
use streambp_objectives::Objective;
use streambp_train::optim::AdamWConfig;
use streambp_train::parallel::{DataParallel, ZeroStage};

/// Runs this command again as `ranks` processes under `mpiexec` (when not already launched by it) and
/// returns its exit status; `None` when this process is one of the ranks.
pub fn relaunch(ranks: usize) -> anyhow::Result<Option<std::process::ExitStatus>> {
    if streambp_dist::launched_by_mpi() {
        return Ok(None);
    }
    if !cfg!(feature = "mpi") {
        bail!("--world: this build has no MPI (cargo build --release -p streambp-bench --features mpi)");
    }
    let exe = std::env::current_exe().context("finding the bench's executable")?;
    let status = Command::new("mpiexec")
        .args(["-n", &ranks.to_string()])
        .arg(exe)
        .args(std::env::args_os().skip(1))
        .status()
        .context("running mpiexec (install MPICH or Open MPI)")?;
    Ok(Some(status))
}

/// A communicator that counts the bytes of the tensors its collectives are given (what this rank
/// contributes; an all-gather returns world times as many).
struct Counted {
    inner: Arc<dyn Communicator>,
    /// Shared with the groups split from it.
    bytes: Arc<AtomicU64>,
}

impl Counted {
    fn add(&self, x: &Tensor) {
        let bytes = (x.elem_count() * x.dtype().size_in_bytes()) as u64;
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// The bytes counted since the last call.
    fn take(&self) -> u64 {
        self.bytes.swap(0, Ordering::Relaxed)
    }
}

impl Communicator for Counted {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce_sum(&self, x: &Tensor) -> streambp_dist::Result<Tensor> {
        self.add(x);
        self.inner.all_reduce_sum(x)
    }
    fn reduce_scatter_sum(&self, x: &Tensor) -> streambp_dist::Result<Tensor> {
        self.add(x);
        self.inner.reduce_scatter_sum(x)
    }
    fn all_gather(&self, x: &Tensor) -> streambp_dist::Result<Tensor> {
        self.add(x);
        self.inner.all_gather(x)
    }
    fn sum(&self, x: f64) -> streambp_dist::Result<f64> {
        self.inner.sum(x)
    }
    fn broadcast(&self, x: u64) -> streambp_dist::Result<u64> {
        self.inner.broadcast(x)
    }
    fn barrier(&self) -> streambp_dist::Result<()> {
        self.inner.barrier()
    }
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn split(&self, color: usize) -> streambp_dist::Result<Arc<dyn Communicator>> {
        Ok(Arc::new(Counted {
            inner: self.inner.split(color)?,
            bytes: self.bytes.clone(),
        }))
    }
}

/// One rank's measurements of one step.
struct StepPoint {
    /// Bytes held before the step's optimizer is made (the weights, the batch).
    base: usize,
    /// Peak bytes during the step (backward, reduction, update) above the weights.
    peak: usize,
    /// Allocator bytes the optimizer's state takes (its moments, allocated when it is created).
    optimizer: usize,
    /// Allocator bytes held after the backward: the gradients (whole, or this rank's shards).
    gradients: usize,
    /// The same two as tensor sizes ([`DataParallel::held_bytes`]).
    held: (usize, usize),
    /// Bytes this rank handed to collectives during the step.
    sent: u64,
    seconds: f64,
}

/// Two steps of `zero` on this rank (the first warms up); the second is measured.
fn measure(
    (comm, sequence): (&Arc<Counted>, &Option<Arc<dyn Communicator>>),
    model: &Model,
    work: &(Tensor, Box<dyn Objective>),
    zero: ZeroStage,
    chunks: Chunks,
) -> anyhow::Result<StepPoint> {
    let meter = Meter::for_device(model.device());
    let weights = meter.current_bytes().unwrap_or(0);
    let groups = (comm.clone() as Arc<dyn Communicator>, sequence.clone());
    let mut parallel = DataParallel::new(model, groups, zero, AdamWConfig::default())?;
    let optimizer = meter.current_bytes().unwrap_or(0).saturating_sub(weights);
    let (ids, objective) = work;
    let mut point = None;
    for _ in 0..2 {
        comm.barrier()?;
        comm.take();
        let before = meter.current_bytes().unwrap_or(0);
        meter.reset_peak();
        let start = Instant::now();
        let batch = Batch::new(ids, None);
        let plan = Plan::new(Mode::Stream, chunks);
        // The engine resets the meter's peak at each of its phases: its own log keeps their peaks.
        let out = parallel.backward(model, batch, objective.as_ref(), plan, 1.0)?;
        let backward_peak = out.phases.overall_peak().unwrap_or(0);
        let gradients = meter.current_bytes().unwrap_or(0).saturating_sub(before);
        let held = parallel.held_bytes();
        // Learning rate 0: the moments move, the weights stay.
        parallel.step(0.0, 0.0)?;
        model.device().synchronize()?;
        point = Some(StepPoint {
            base: weights,
            peak: meter
                .peak_bytes()
                .unwrap_or(0)
                .max(backward_peak)
                .saturating_sub(weights),
            optimizer,
            gradients,
            held: (held.optimizer, held.gradients),
            sent: comm.take(),
            seconds: start.elapsed().as_secs_f64(),
        });
    }
    point.context("no step")
}

/// Every rank's value of `x`, in rank order.
fn gathered(comm: &Counted, x: f64) -> anyhow::Result<Vec<f64>> {
    let own = Tensor::new(&[x], &Device::Cpu)?;
    Ok(comm.all_gather(&own)?.to_vec1::<f64>()?)
}

fn mib(b: f64) -> f64 {
    b / (1 << 20) as f64
}

/// The `--world` table: for each T and ZeRO stage, the largest per-rank figure over the ranks.
pub fn run_world(
    model: &Model,
    (seq_lens, sp): (&[usize], usize),
    stages: &[ZeroStage],
    workload: impl Fn(usize) -> anyhow::Result<((Tensor, Box<dyn Objective>), Chunks)>,
    mut json: impl FnMut(serde_json::Value) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let comm = Arc::new(Counted {
        inner: streambp_dist::world(),
        bytes: Arc::new(AtomicU64::new(0)),
    });
    let sequence = streambp_train::parallel::parallel_groups(comm.clone(), sp)?.sequence;
    let (rank, world) = (comm.rank(), comm.world_size());
    let params: usize = model.parameters().iter().map(|(_, v)| v.elem_count()).sum();
    if rank == 0 {
        let sequences = match sp {
            1 => "one sequence per rank".to_string(),
            sp => format!("one sequence per {sp} ranks (--sp {sp})"),
        };
        println!(
            "{world} ranks ({}), {:.1}M trainable parameters, {sequences}",
            comm.name(),
            params as f64 / 1e6
        );
        println!();
        println!("| T | ZeRO | peak per rank (MiB) | optimizer state per rank (MiB) | gradients per rank (MiB) | sent per rank (MiB) | step seconds |");
        println!("|---|---|---|---|---|---|---|");
    }
    for &t in seq_lens {
        let (work, chunks) = workload(t)?;
        for &zero in stages {
            let p = measure((&comm, &sequence), model, &work, zero, chunks)?;
            let max = |x: f64| -> anyhow::Result<f64> {
                Ok(gathered(&comm, x)?.into_iter().fold(0.0, f64::max))
            };
            let peak = max(p.peak as f64)?;
            let optimizer = max(p.optimizer as f64)?;
            let gradients = max(p.gradients as f64)?;
            let held = (max(p.held.0 as f64)?, max(p.held.1 as f64)?);
            let seconds = max(p.seconds)?;
            let sent = max(p.sent as f64)?;
            if rank == 0 {
                println!(
                    "| {t} | {zero} | {:.1} | {:.2} | {:.2} | {:.2} | {seconds:.3} |",
                    mib(peak),
                    mib(optimizer),
                    mib(gradients),
                    mib(sent)
                );
                json(serde_json::json!({
                    "world": world, "sp": sp, "t": t,
                    "zero": zero.to_string(), "chunk": chunks.chunk, "sent_bytes": sent,
                    "peak_bytes": peak, "optimizer_bytes": optimizer, "gradient_bytes": gradients,
                    "optimizer_tensor_bytes": held.0, "gradient_tensor_bytes": held.1,
                    "seconds": seconds,
                }))?;
            }
        }
    }
    Ok(())
}

/// `--world N --max-t-budget B`: the longest T whose per-rank peak (the most of any rank, weights
/// included) over a whole step at `zero` fits B, found by `search` (doubling, then bisection), every
/// rank measuring each T together.
pub fn world_max_t(
    model: &Model,
    (sp, zero): (usize, ZeroStage),
    budget: u64,
    workload: impl Fn(usize) -> anyhow::Result<((Tensor, Box<dyn Objective>), Chunks)>,
    search: impl FnOnce(
        &mut dyn FnMut(usize) -> anyhow::Result<Option<usize>>,
    ) -> anyhow::Result<(usize, usize, Option<usize>)>,
) -> anyhow::Result<()> {
    let comm = Arc::new(Counted {
        inner: streambp_dist::world(),
        bytes: Arc::new(AtomicU64::new(0)),
    });
    let sequence = streambp_train::parallel::parallel_groups(comm.clone(), sp)?.sequence;
    let rank0 = comm.rank() == 0;
    let mut fits = |t: usize| -> anyhow::Result<Option<usize>> {
        let (work, chunks) = workload(t)?;
        let p = measure((&comm, &sequence), model, &work, zero, chunks)?;
        let total = gathered(&comm, (p.peak + p.base) as f64)?
            .into_iter()
            .fold(0.0, f64::max) as usize;
        let ok = total as u64 <= budget;
        if rank0 {
            let verdict = if ok { "fits" } else { "over" };
            eprintln!(
                "  T={t} ({chunks:?}): {:.1} MiB per rank, {verdict}",
                mib(total as f64)
            );
        }
        Ok(ok.then_some(total))
    };
    let (t, peak, over) = search(&mut fits)?;
    if rank0 {
        println!(
            "Longest T whose per-rank peak (weights included) fits {:.0} MiB, {} ranks, --sp {sp}, ZeRO {zero}:",
            mib(budget as f64),
            comm.world_size()
        );
        println!("| ranks | sp | ZeRO | max T | peak per rank there (MiB) | next T tried (over) |");
        println!("|---|---|---|---|---|---|");
        let over = over.map_or("none tried (--t-max)".to_string(), |t| t.to_string());
        println!(
            "| {} | {sp} | {zero} | {t} | {:.1} | {over} |",
            comm.world_size(),
            mib(peak as f64)
        );
    }
    Ok(())
}
