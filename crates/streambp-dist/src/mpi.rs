//! MPI as the collective engine (rsmpi over the system's MPICH or Open MPI): the launcher of every
//! multi-process run, and the engine of CPU processes. Tensors go through host memory.

use ::mpi::collective::SystemOperation;
use ::mpi::environment::Universe;
use ::mpi::topology::{Color, SimpleCommunicator};
use ::mpi::traits::{Communicator as _, CommunicatorCollectives, Equivalence, Root};
use ::mpi::Threading;
use std::sync::Arc;

use candle_core::{DType, Tensor};

use crate::{check_flat, Communicator, DistError, Result};

/// Whether this process was started by an MPI launcher (hydra's `mpiexec`, Open MPI's `mpirun`).
pub fn launched() -> bool {
    crate::launched_by_mpi()
}

/// MPI's world communicator.
pub struct MpiCommunicator {
    world: SimpleCommunicator,
}

// SAFETY: MPI is initialised with MPI_THREAD_SERIALIZED, and collectives are issued one at a time:
// from the trainer's thread, or from the engine's phase that thread is waiting for (on a rayon
// worker); the handle is an integer id that the library owns.
unsafe impl Send for MpiCommunicator {}
// SAFETY: as for Send: shared, it is still only used by one thread at a time.
unsafe impl Sync for MpiCommunicator {}

impl MpiCommunicator {
    /// Initialises MPI; the universe must live until the end of the program (it finalises MPI).
    pub fn start() -> Result<(Self, Universe)> {
        // Serialized: one thread calls MPI at a time, but not always the same one (sequence
        // parallelism's key exchanges run inside the engine's phases, on a rayon worker).
        let (universe, threading) = ::mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| DistError::Backend("MPI was already initialised".into()))?;
        if threading < Threading::Serialized {
            return Err(DistError::Backend(format!(
                "MPI provides thread level {threading:?}; streambp needs Serialized (calls from one \
                 thread at a time, not always the main one)"
            )));
        }
        Ok((
            Self {
                world: universe.world(),
            },
            universe,
        ))
    }

    /// [`Communicator::split`] as an MPI communicator (NCCL makes its groups' communicators on these).
    pub fn split_mpi(&self, color: usize) -> Result<Self> {
        let color = i32::try_from(color)
            .map_err(|_| DistError::Backend(format!("MPI: group color {color} out of range")))?;
        let group = self
            .world
            .split_by_color(Color::with_value(color))
            .ok_or_else(|| {
                DistError::Backend("MPI: the split left this rank in no group".into())
            })?;
        Ok(Self { world: group })
    }

    fn reduce<T: Equivalence + Copy + Default + candle_core::WithDType>(
        &self,
        x: &Tensor,
        scatter: bool,
    ) -> Result<Tensor> {
        let send: Vec<T> = x.to_vec1::<T>()?;
        let world = self.world_size();
        let len = match scatter {
            true if !send.len().is_multiple_of(world) => {
                return Err(DistError::Uneven {
                    what: "reduce-scatter",
                    len: send.len(),
                    world,
                })
            }
            true => send.len() / world,
            false => send.len(),
        };
        let mut recv = vec![T::default(); len];
        match scatter {
            true => self.world.reduce_scatter_block_into(
                &send[..],
                &mut recv[..],
                SystemOperation::sum(),
            ),
            false => self
                .world
                .all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum()),
        }
        Ok(Tensor::from_vec(recv, len, x.device())?)
    }

    fn gather<T: Equivalence + Copy + Default + candle_core::WithDType>(
        &self,
        x: &Tensor,
    ) -> Result<Tensor> {
        let send: Vec<T> = x.to_vec1::<T>()?;
        let mut recv = vec![T::default(); send.len() * self.world_size()];
        self.world.all_gather_into(&send[..], &mut recv[..]);
        let len = recv.len();
        Ok(Tensor::from_vec(recv, len, x.device())?)
    }
}

impl Communicator for MpiCommunicator {
    fn rank(&self) -> usize {
        self.world.rank() as usize
    }

    fn world_size(&self) -> usize {
        self.world.size() as usize
    }

    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        check_flat(x)?;
        match x.dtype() {
            DType::F64 => self.reduce::<f64>(x, false),
            _ => self.reduce::<f32>(x, false),
        }
    }

    fn reduce_scatter_sum(&self, x: &Tensor) -> Result<Tensor> {
        check_flat(x)?;
        match x.dtype() {
            DType::F64 => self.reduce::<f64>(x, true),
            _ => self.reduce::<f32>(x, true),
        }
    }

    fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        check_flat(x)?;
        match x.dtype() {
            DType::F64 => self.gather::<f64>(x),
            _ => self.gather::<f32>(x),
        }
    }

    fn sum(&self, x: f64) -> Result<f64> {
        let mut out = 0.0;
        self.world
            .all_reduce_into(&x, &mut out, SystemOperation::sum());
        Ok(out)
    }

    fn broadcast(&self, x: u64) -> Result<u64> {
        let mut value = x;
        self.world.process_at_rank(0).broadcast_into(&mut value);
        Ok(value)
    }

    fn barrier(&self) -> Result<()> {
        self.world.barrier();
        Ok(())
    }

    fn name(&self) -> &'static str {
        "MPI"
    }

    fn split(&self, color: usize) -> Result<Arc<dyn Communicator>> {
        Ok(Arc::new(self.split_mpi(color)?))
    }
}
