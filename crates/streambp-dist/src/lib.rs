//! Data-parallel collectives for streambp, behind one [`Communicator`] trait with three engines:
//! - [`SingleProcess`]: the default; every collective is the identity, and no library is needed;
//! - `mpi::MpiCommunicator` (feature `mpi`): rsmpi over the system's MPI, for CPU processes, and the
//!   launcher for every multi-process run (`mpiexec -n N streambp-train …`);
//! - `nccl::NcclCommunicator` (feature `nccl`): NCCL through cudarc on each rank's GPU, its unique id
//!   broadcast over MPI.
//!
//! [`local::LocalGroup`] runs ranks as threads of one process (tests, examples:
//! `cargo run --release -p streambp-train --example data_parallel`); a backend of one's own implements
//! [`Communicator`] as it does.
//!
//! Collectives take and return 1-D tensors (f32 or f64: gradients are summed in full precision). The
//! process's communicator is set up once by [`init`] (which `main` keeps alive until the end, so that
//! MPI is finalised) and read anywhere with [`world`].

#![warn(missing_docs)]

use std::sync::{Arc, OnceLock};

use candle_core::{DType, Device, Tensor};

pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;

/// What can go wrong in a collective.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// A tensor the collectives do not carry (they sum f32 and f64 only, 1-D).
    #[error("collective on a {dtype:?} tensor of shape {shape:?}: only 1-D f32 or f64 tensors are reduced")]
    Unsupported {
        /// The tensor's dtype.
        dtype: DType,
        /// The tensor's shape.
        shape: Vec<usize>,
    },
    /// A length that does not divide over the ranks.
    #[error("{what}: {len} elements do not divide over {world} ranks")]
    Uneven {
        /// The collective.
        what: &'static str,
        /// The tensor's length.
        len: usize,
        /// The number of ranks.
        world: usize,
    },
    /// The collective library failed or could not start.
    #[error("{0}")]
    Backend(String),
    /// A tensor operation around a collective failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// `Result` with [`DistError`].
pub type Result<T> = std::result::Result<T, DistError>;

/// The collectives a data-parallel trainer needs, on 1-D f32/f64 tensors.
pub trait Communicator: Send + Sync {
    /// This process's rank, `0..world_size()`.
    fn rank(&self) -> usize;
    /// The number of processes.
    fn world_size(&self) -> usize;
    /// The element-wise sum of every rank's `x`, on every rank.
    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor>;
    /// `x` holds `world_size · k` elements on every rank; rank `r` gets the sum over ranks of elements
    /// `r·k .. (r+1)·k`.
    fn reduce_scatter_sum(&self, x: &Tensor) -> Result<Tensor>;
    /// Every rank's `x` (all of one length) concatenated in rank order, on every rank.
    fn all_gather(&self, x: &Tensor) -> Result<Tensor>;
    /// The sum over ranks of a number (token counts, losses, metrics).
    fn sum(&self, x: f64) -> Result<f64>;
    /// Rank 0's `x`, on every rank.
    fn broadcast(&self, x: u64) -> Result<u64>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;
    /// The collective engine's name (for logs).
    fn name(&self) -> &'static str;
    /// The ranks that pass the same `color` as a communicator of their own, ranked in this one's
    /// order (sequence groups and the data-parallel groups across them). Every rank calls it, in
    /// the same order as its other collectives. An engine that cannot form groups says so.
    fn split(&self, color: usize) -> Result<std::sync::Arc<dyn Communicator>> {
        let _ = color;
        Err(DistError::Backend(format!(
            "{} cannot form groups of its ranks",
            self.name()
        )))
    }
}

/// One process: every collective is the identity.
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleProcess;

impl Communicator for SingleProcess {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.clone())
    }
    fn reduce_scatter_sum(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.clone())
    }
    fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.clone())
    }
    fn sum(&self, x: f64) -> Result<f64> {
        Ok(x)
    }
    fn broadcast(&self, x: u64) -> Result<u64> {
        Ok(x)
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
    fn name(&self) -> &'static str {
        "single process"
    }
    fn split(&self, _color: usize) -> Result<Arc<dyn Communicator>> {
        Ok(Arc::new(SingleProcess))
    }
}

static WORLD: OnceLock<Arc<dyn Communicator>> = OnceLock::new();

/// The process's communicator: what [`init`] set up, else a single process.
pub fn world() -> Arc<dyn Communicator> {
    WORLD.get_or_init(|| Arc::new(SingleProcess)).clone()
}

/// Keeps the collective engine alive; dropping it finalises MPI (keep it in `main` until the end).
pub struct Guard {
    #[cfg(feature = "mpi")]
    _universe: Option<::mpi::environment::Universe>,
}

/// Sets up the process's communicator: under an MPI launcher (a build with `mpi`), MPI's world (with
/// NCCL between the GPUs when `cuda` and the build has `nccl`); otherwise a single process. Call
/// once, before [`world`].
pub fn init(cuda: bool) -> Result<Guard> {
    #[cfg(feature = "mpi")]
    {
        if mpi::launched() {
            let (comm, universe) = mpi::MpiCommunicator::start()?;
            log_processes(&comm)?;
            let comm: Arc<dyn Communicator> = match cuda {
                #[cfg(feature = "nccl")]
                true => Arc::new(nccl::NcclCommunicator::start(comm)?),
                _ => Arc::new(comm),
            };
            tracing::info!(
                rank = comm.rank(),
                world = comm.world_size(),
                engine = comm.name(),
                "data parallel"
            );
            set(comm)?;
            return Ok(Guard {
                _universe: Some(universe),
            });
        }
        let _ = cuda;
        Ok(Guard { _universe: None })
    }
    #[cfg(not(feature = "mpi"))]
    {
        let _ = cuda;
        // Several ranks that cannot talk would each train alone and silently differ.
        match launched_ranks() {
            Some(n) if n > 1 => Err(DistError::Backend(format!(
                "launched as {n} ranks, but this build has no MPI: build with `--features mpi`"
            ))),
            _ => Ok(Guard {}),
        }
    }
}

/// Logs (on rank 0) every rank's process id: the launcher names a process that dies by its pid.
#[cfg(feature = "mpi")]
fn log_processes(comm: &dyn Communicator) -> Result<()> {
    let own = Tensor::new(&[f64::from(std::process::id())], &candle_core::Device::Cpu)?;
    let pids = comm.all_gather(&own)?.to_vec1::<f64>()?;
    if comm.rank() == 0 {
        let list: Vec<String> = pids
            .iter()
            .enumerate()
            .map(|(rank, pid)| format!("rank {rank}: pid {pid}"))
            .collect();
        tracing::info!("processes: {}", list.join(", "));
    }
    Ok(())
}

/// Makes `comm` the process's communicator (tests and library users with their own engine).
pub fn set(comm: Arc<dyn Communicator>) -> Result<()> {
    WORLD
        .set(comm)
        .map_err(|_| DistError::Backend("the communicator is already set up".into()))
}

/// Whether this process runs under an MPI launcher (`mpiexec`).
pub fn launched_by_mpi() -> bool {
    [
        "PMI_RANK",
        "OMPI_COMM_WORLD_RANK",
        "PMIX_RANK",
        "MPI_LOCALRANKID",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some())
}

/// This process's rank as the MPI launcher's environment says, before MPI starts (0 without one).
pub fn launched_rank() -> usize {
    ["PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
        .unwrap_or(0)
}

/// How many ranks the MPI launcher started, as its environment says (MPICH's hydra, Open MPI).
pub fn launched_ranks() -> Option<usize> {
    ["PMI_SIZE", "OMPI_COMM_WORLD_SIZE"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
}

/// How many compute threads each rank should use when the launcher put several ranks on this node
/// and `RAYON_NUM_THREADS` is not set: the node's cores over its ranks. Candle's kernels and rayon
/// otherwise each take every core in every rank, and the oversubscribed ranks run several times
/// slower (docs/distributed.md).
pub fn threads_per_rank() -> Option<usize> {
    if std::env::var_os("RAYON_NUM_THREADS").is_some() {
        return None;
    }
    let local_ranks: usize = [
        "MPI_LOCALNRANKS",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "PMIX_LOCAL_SIZE",
    ]
    .iter()
    .find_map(|v| std::env::var(v).ok()?.parse().ok())?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (local_ranks > 1).then(|| (cores / local_ranks).max(1))
}

/// This rank's index among the ranks of its node (its GPU): the launcher's local rank (MPICH, Open
/// MPI), else its rank.
pub fn local_rank() -> usize {
    [
        "MPI_LOCALRANKID",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "PMIX_LOCAL_RANK",
    ]
    .iter()
    .find_map(|v| std::env::var(v).ok()?.parse().ok())
    .unwrap_or_else(|| world().rank())
}

/// The 1-D f32/f64 tensor `x`, checked.
pub fn check_flat(x: &Tensor) -> Result<()> {
    match (x.dtype(), x.rank()) {
        (DType::F32 | DType::F64, 1) => Ok(()),
        _ => Err(DistError::Unsupported {
            dtype: x.dtype(),
            shape: x.dims().to_vec(),
        }),
    }
}

/// Every rank's `local` numbers, of any length, concatenated in rank order, on every rank: the
/// lengths are gathered first and each rank's numbers padded to the longest, as the collectives
/// carry tensors of one length. The tensors live on `device` (the card's, for NCCL).
pub fn gather_numbers(comm: &dyn Communicator, local: &[f64], device: &Device) -> Result<Vec<f64>> {
    let length = Tensor::new(&[local.len() as f64], device)?;
    let lengths: Vec<usize> = comm
        .all_gather(&length)?
        .to_vec1::<f64>()?
        .into_iter()
        .map(|n| n as usize)
        .collect();
    let longest = lengths.iter().copied().max().unwrap_or(0);
    if longest == 0 {
        return Ok(Vec::new());
    }
    let mut padded = local.to_vec();
    padded.resize(longest, 0.0);
    let all = comm
        .all_gather(&Tensor::from_vec(padded, longest, device)?)?
        .to_vec1::<f64>()?;
    Ok(all
        .chunks(longest)
        .zip(&lengths)
        .flat_map(|(numbers, &n)| &numbers[..n])
        .copied()
        .collect())
}
