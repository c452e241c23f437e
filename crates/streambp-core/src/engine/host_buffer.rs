//! The disk tier's bytes on their way between the scratch file and the tensors.
//!
//! For a CUDA card they sit in page-locked (pinned) host memory: the card copies to and from it by
//! DMA at the bus's rate, where pageable memory goes through the driver's own staging copy, and the
//! file is read straight into it. One buffer serves a whole step, taken in turn by the forward's
//! writes and by the backward's read-ahead, so the tier holds one checkpoint's bytes on the host, as
//! before. Elsewhere the bytes are a plain vector, reused the same way.
//!
//! Each copy between the buffer and the card is waited for on the calling thread before the buffer
//! is used again: candle runs one stream per thread, where cudarc records no events for pinned
//! memory, so nothing else would order the host's next use of the buffer after the card's copy.
//! The wait costs the card nothing measurable: the backward's copy back is a few milliseconds
//! against a layer's seconds, and the forward's bytes are needed on the host at once anyway.

use std::fs::File;
use std::os::unix::fs::FileExt;

use candle_core::{DType, Device, Shape, Tensor};

use crate::error::{EngineError, Result};

/// One checkpoint's bytes on the host.
pub(super) enum HostBuffer {
    Plain(Vec<u8>),
    #[cfg(feature = "cuda")]
    Pinned(pinned::PinnedBuffer),
}

impl HostBuffer {
    /// An empty buffer for tensors on `device`: pinned for a CUDA card, plain otherwise.
    pub(super) fn for_device(device: &Device) -> Self {
        match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(card) => Self::Pinned(pinned::PinnedBuffer::new(card.clone())),
            _ => Self::Plain(Vec::new()),
        }
    }

    /// Holds `t`'s elements (little-endian, in order) and returns them, ready to be written.
    pub(super) fn fill_from(&mut self, t: &Tensor) -> Result<&[u8]> {
        match self {
            Self::Plain(bytes) => {
                to_bytes(t, bytes)?;
                Ok(bytes)
            }
            #[cfg(feature = "cuda")]
            Self::Pinned(buffer) => buffer.download(t),
        }
    }

    /// Holds the `bytes` bytes of `file` from `offset` (here, or on the read-ahead's thread).
    pub(super) fn read_from(
        &mut self,
        file: &File,
        offset: u64,
        bytes: usize,
    ) -> std::io::Result<()> {
        let target = match self {
            Self::Plain(buf) => {
                buf.resize(bytes, 0);
                buf.as_mut_slice()
            }
            #[cfg(feature = "cuda")]
            Self::Pinned(buffer) => buffer.writable(bytes)?,
        };
        file.read_exact_at(target, offset)
    }

    /// A tensor of `dtype` and `shape` on `device` made from the bytes held.
    pub(super) fn to_tensor(&self, dtype: DType, shape: &Shape, device: &Device) -> Result<Tensor> {
        match (self, device) {
            (Self::Plain(bytes), _) => {
                Ok(Tensor::from_raw_buffer(bytes, dtype, shape.dims(), device)?)
            }
            #[cfg(feature = "cuda")]
            (Self::Pinned(buffer), Device::Cuda(card)) => buffer.upload(dtype, shape, card),
            #[cfg(feature = "cuda")]
            (Self::Pinned(buffer), _) => Ok(Tensor::from_raw_buffer(
                buffer.readable()?,
                dtype,
                shape.dims(),
                device,
            )?),
        }
    }
}

/// `t`'s elements as little-endian bytes (the layout `Tensor::from_raw_buffer` reads), in `out`.
fn to_bytes(t: &Tensor, out: &mut Vec<u8>) -> Result<()> {
    let t = t.flatten_all()?.to_device(&Device::Cpu)?;
    fn bytes_of<T: candle_core::WithDType, const N: usize>(
        t: &Tensor,
        le: impl Fn(T) -> [u8; N],
        out: &mut Vec<u8>,
    ) -> Result<()> {
        out.clear();
        out.extend(t.to_vec1::<T>()?.into_iter().flat_map(le));
        Ok(())
    }
    match t.dtype() {
        DType::F32 => bytes_of(&t, f32::to_le_bytes, out),
        DType::F64 => bytes_of(&t, f64::to_le_bytes, out),
        DType::BF16 => bytes_of(&t, half::bf16::to_le_bytes, out),
        DType::F16 => bytes_of(&t, half::f16::to_le_bytes, out),
        other => Err(unsupported(other)),
    }
}

fn unsupported(dtype: DType) -> EngineError {
    EngineError::CheckpointIo(format!("checkpoints in {dtype:?} cannot go to disk"))
}

#[cfg(feature = "cuda")]
mod pinned {
    //! Page-locked bytes and the card's copies to and from them, on candle's stream (so they are
    //! ordered after the kernels that made the tensor and before those that use it).

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
    use candle_core::op::BackpropOp;
    use candle_core::{DType, Shape, Storage, Tensor};
    use cudarc::driver::{DeviceRepr, PinnedHostSlice};

    use super::unsupported;
    use crate::error::{EngineError, Result};

    pub(in crate::engine) struct PinnedBuffer {
        card: CudaDevice,
        bytes: Option<PinnedHostSlice<u8>>,
    }

    impl PinnedBuffer {
        pub(super) fn new(card: CudaDevice) -> Self {
            Self { card, bytes: None }
        }

        /// The buffer, exactly `len` bytes long (a step's checkpoints share one size, so it is
        /// allocated once). Its contents are unset until a copy or a read fills all of it.
        fn sized(&mut self, len: usize) -> std::io::Result<&mut PinnedHostSlice<u8>> {
            if self.bytes.as_ref().map(|b| b.len()) != Some(len) {
                self.bytes = None;
                let context = self.card.cuda_stream().context().clone();
                // Not write-combined: the host reads these bytes too (to write them to the file).
                // SAFETY: nothing reads the new buffer before a copy or a file read fills it.
                let pinned =
                    unsafe { context.alloc_pinned_with_flags::<u8>(len, 0) }.map_err(|e| {
                        std::io::Error::other(format!("pinned host memory of {len} bytes: {e}"))
                    })?;
                self.bytes = Some(pinned);
            }
            self.bytes
                .as_mut()
                .ok_or_else(|| std::io::Error::other("no pinned buffer"))
        }

        /// `len` writable bytes (every copy that read them is done: `upload` waits for its own).
        pub(super) fn writable(&mut self, len: usize) -> std::io::Result<&mut [u8]> {
            self.sized(len)?
                .as_mut_slice()
                .map_err(|e| std::io::Error::other(format!("waiting for the card's copy: {e}")))
        }

        /// The bytes held (every copy into them is done: `download` waits for its own).
        pub(super) fn readable(&self) -> Result<&[u8]> {
            let bytes = self
                .bytes
                .as_ref()
                .ok_or_else(|| io_error("an empty pinned buffer"))?;
            bytes
                .as_slice()
                .map_err(|e| io_error(&format!("waiting for the card's copy: {e}")))
        }

        /// Copies `t` (on this card) into the buffer and returns its bytes.
        pub(super) fn download(&mut self, t: &Tensor) -> Result<&[u8]> {
            let t = t.contiguous()?;
            let len = t.elem_count() * t.dtype().size_in_bytes();
            let card = self.card.clone();
            let target = self.sized(len).map_err(|e| io_error(&e.to_string()))?;
            {
                let (storage, layout) = t.storage_and_layout();
                let Storage::Cuda(storage) = &*storage else {
                    return Err(io_error("a checkpoint off the card in a card's store"));
                };
                let (start, end) = layout
                    .contiguous_offsets()
                    .ok_or_else(|| io_error("a checkpoint not contiguous"))?;
                fn copy<T: CudaDType + DeviceRepr>(
                    card: &CudaDevice,
                    storage: &CudaStorage,
                    (start, end): (usize, usize),
                    target: &mut PinnedHostSlice<u8>,
                ) -> Result<()> {
                    let elements = storage.as_cuda_slice::<T>()?.slice(start..end);
                    // SAFETY: any bytes are valid `u8`s; the view covers exactly the elements.
                    let bytes = unsafe { elements.transmute::<u8>(target.len()) }
                        .ok_or_else(|| io_error("a checkpoint shorter than its bytes"))?;
                    Ok(card.memcpy_dtoh(&bytes, target)?)
                }
                let range = (start, end);
                match storage.dtype() {
                    DType::F32 => copy::<f32>(&card, storage, range, target)?,
                    DType::F64 => copy::<f64>(&card, storage, range, target)?,
                    DType::BF16 => copy::<half::bf16>(&card, storage, range, target)?,
                    DType::F16 => copy::<half::f16>(&card, storage, range, target)?,
                    other => return Err(unsupported(other)),
                }
            }
            wait_for(&card)?;
            self.readable()
        }

        /// A new tensor on `card` holding the buffer's bytes, once the card has copied them (the
        /// buffer is then free for the next read).
        pub(super) fn upload(
            &self,
            dtype: DType,
            shape: &Shape,
            card: &CudaDevice,
        ) -> Result<Tensor> {
            let source = self
                .bytes
                .as_ref()
                .ok_or_else(|| io_error("an empty pinned buffer"))?;
            let elements = shape.elem_count();
            if elements * dtype.size_in_bytes() != source.len() {
                return Err(io_error("a checkpoint's bytes do not match its shape"));
            }
            fn copy<T: CudaDType + DeviceRepr>(
                card: &CudaDevice,
                source: &PinnedHostSlice<u8>,
                elements: usize,
            ) -> Result<CudaStorage> {
                // SAFETY: the copy below fills every element before anything reads them.
                let mut target = unsafe { card.alloc::<T>(elements) }?;
                {
                    // SAFETY: any bytes written are a valid `T` (a float dtype).
                    let mut bytes = unsafe { target.transmute_mut::<u8>(source.len()) }
                        .ok_or_else(|| io_error("a device buffer shorter than its bytes"))?;
                    card.memcpy_htod(source, &mut bytes)?;
                }
                Ok(CudaStorage::wrap_cuda_slice(target, card.clone()))
            }
            let storage = match dtype {
                DType::F32 => copy::<f32>(card, source, elements)?,
                DType::F64 => copy::<f64>(card, source, elements)?,
                DType::BF16 => copy::<half::bf16>(card, source, elements)?,
                DType::F16 => copy::<half::f16>(card, source, elements)?,
                other => return Err(unsupported(other)),
            };
            wait_for(card)?;
            Ok(Tensor::from_storage(
                Storage::Cuda(storage),
                shape.clone(),
                BackpropOp::none(),
                false,
            ))
        }
    }

    /// Blocks until the work queued on this thread's stream of `card` (the copies above) is done.
    fn wait_for(card: &CudaDevice) -> Result<()> {
        card.cuda_stream()
            .synchronize()
            .map_err(|e| io_error(&format!("waiting for the card's copy: {e}")))
    }

    fn io_error(what: &str) -> EngineError {
        EngineError::CheckpointIo(what.to_string())
    }
}
