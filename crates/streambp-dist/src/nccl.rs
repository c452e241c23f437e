//! NCCL as the collective engine on CUDA devices (cudarc's `nccl` module, the cudarc candle uses). MPI
//! launches the ranks and carries NCCL's unique id from rank 0 to the others; numbers (token counts,
//! losses) and barriers stay on MPI. Each rank's tensors live on its own GPU (`cuda:<local rank>`); the
//! NCCL communicator is made on the stream of the device of the first tensor it reduces, so that its
//! results are tensors of that same candle device.

use std::sync::OnceLock;

use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Device, Storage, Tensor};
use cudarc::nccl::safe::{Comm, Id, ReduceOp};

use crate::mpi::MpiCommunicator;
use crate::{check_flat, Communicator, DistError, Result};

/// An element type NCCL reduces and candle keeps in CUDA memory (f32, f64).
trait Element:
    cudarc::nccl::NcclType
    + candle_core::cuda_backend::CudaDType
    + cudarc::driver::DeviceRepr
    + cudarc::driver::ValidAsZeroBits
{
}

impl<T> Element for T where
    T: cudarc::nccl::NcclType
        + candle_core::cuda_backend::CudaDType
        + cudarc::driver::DeviceRepr
        + cudarc::driver::ValidAsZeroBits
{
}

/// NCCL for tensors, MPI for the rest.
pub struct NcclCommunicator {
    mpi: MpiCommunicator,
    id: Id,
    comm: OnceLock<Comm>,
}

// SAFETY: as for MPI, collectives are issued by one thread at a time (on CUDA devices the engine's
// phases run on the trainer's thread itself); the NCCL handle is only stored in the communicators.
unsafe impl Send for NcclCommunicator {}
// SAFETY: as for Send: shared, it is still only used by one thread at a time.
unsafe impl Sync for NcclCommunicator {}

fn backend(e: impl std::fmt::Debug) -> DistError {
    DistError::Backend(format!("NCCL: {e:?}"))
}

impl NcclCommunicator {
    /// Rank 0 makes NCCL's unique id and MPI broadcasts it.
    pub fn start(mpi: MpiCommunicator) -> Result<Self> {
        let mut bytes = [0u8; 128];
        if mpi.rank() == 0 {
            let id = Id::new().map_err(backend)?;
            for (b, c) in bytes.iter_mut().zip(id.internal()) {
                *b = *c as u8;
            }
        }
        // 128 bytes as 16 words, through the one broadcast the trait has.
        for word in bytes.chunks_mut(8) {
            let value = mpi.broadcast(u64::from_le_bytes(word.try_into().unwrap_or([0; 8])))?;
            word.copy_from_slice(&value.to_le_bytes());
        }
        let mut internal = [0 as std::ffi::c_char; 128];
        for (c, b) in internal.iter_mut().zip(bytes) {
            *c = b as std::ffi::c_char;
        }
        Ok(Self {
            mpi,
            id: Id::uninit(internal),
            comm: OnceLock::new(),
        })
    }

    /// The NCCL communicator on `device`'s stream (made by the first collective, on every rank at once).
    fn comm(&self, device: &candle_core::CudaDevice) -> Result<&Comm> {
        if let Some(comm) = self.comm.get() {
            return Ok(comm);
        }
        let comm = Comm::from_rank(
            device.cuda_stream(),
            self.mpi.rank(),
            self.mpi.world_size(),
            self.id,
        )
        .map_err(backend)?;
        Ok(self.comm.get_or_init(|| comm))
    }

    /// Runs `op` on `x`'s device memory into a new buffer of `len` elements, as a tensor of `x`'s device.
    fn collective<T: Element>(
        &self,
        x: &Tensor,
        len: usize,
        op: impl FnOnce(
            &Comm,
            &cudarc::driver::CudaView<T>,
            &mut cudarc::driver::CudaSlice<T>,
        ) -> Result<()>,
    ) -> Result<Tensor> {
        let x = x.contiguous()?;
        let Device::Cuda(device) = x.device() else {
            return Err(DistError::Backend(
                "NCCL reduces tensors on a CUDA device".into(),
            ));
        };
        let comm = self.comm(device)?;
        let (storage, layout) = x.storage_and_layout();
        let Storage::Cuda(cuda) = &*storage else {
            return Err(DistError::Backend("NCCL reduces CUDA tensors".into()));
        };
        let start = layout.start_offset();
        let src = cuda.as_cuda_slice::<T>()?;
        let src = src.slice(start..start + x.elem_count());
        let stream = device.cuda_stream();
        let mut dst = stream.alloc_zeros::<T>(len).map_err(backend)?;
        op(comm, &src, &mut dst)?;
        drop(storage);
        let out = CudaStorage::wrap_cuda_slice(dst, device.clone());
        Ok(Tensor::from_storage(
            Storage::Cuda(out),
            len,
            BackpropOp::none(),
            false,
        ))
    }

    fn typed<T: Element>(&self, x: &Tensor, kind: Kind) -> Result<Tensor> {
        let world = self.world_size();
        let n = x.elem_count();
        let len = match kind {
            Kind::AllReduce => n,
            Kind::ReduceScatter if !n.is_multiple_of(world) => {
                return Err(DistError::Uneven {
                    what: "reduce-scatter",
                    len: n,
                    world,
                })
            }
            Kind::ReduceScatter => n / world,
            Kind::AllGather => n * world,
        };
        self.collective::<T>(x, len, |comm, src, dst| {
            match kind {
                Kind::AllReduce => comm.all_reduce(src, dst, &ReduceOp::Sum),
                Kind::ReduceScatter => comm.reduce_scatter(src, dst, &ReduceOp::Sum),
                Kind::AllGather => comm.all_gather(src, dst),
            }
            .map(|_| ())
            .map_err(backend)
        })
    }

    fn run(&self, x: &Tensor, kind: Kind) -> Result<Tensor> {
        check_flat(x)?;
        match x.dtype() {
            DType::F64 => self.typed::<f64>(x, kind),
            _ => self.typed::<f32>(x, kind),
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    AllReduce,
    ReduceScatter,
    AllGather,
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.mpi.rank()
    }
    fn world_size(&self) -> usize {
        self.mpi.world_size()
    }
    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        self.run(x, Kind::AllReduce)
    }
    fn reduce_scatter_sum(&self, x: &Tensor) -> Result<Tensor> {
        self.run(x, Kind::ReduceScatter)
    }
    fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        self.run(x, Kind::AllGather)
    }
    fn sum(&self, x: f64) -> Result<f64> {
        self.mpi.sum(x)
    }
    fn broadcast(&self, x: u64) -> Result<u64> {
        self.mpi.broadcast(x)
    }
    fn barrier(&self) -> Result<()> {
        self.mpi.barrier()
    }
    fn name(&self) -> &'static str {
        "NCCL (MPI for launch and numbers)"
    }

    /// The group's MPI communicator, then an NCCL communicator of its own over the group's ranks.
    fn split(&self, color: usize) -> Result<std::sync::Arc<dyn Communicator>> {
        Ok(std::sync::Arc::new(Self::start(
            self.mpi.split_mpi(color)?,
        )?))
    }
}
