//! A forward computed by composed tensor ops before the custom op that records it, handed over to
//! that op: how an op with a written backward runs on a backend without its own forward kernel.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;

use candle_core::{CpuStorage, Shape, Storage, Tensor};

type CResult<T> = candle_core::Result<T>;

/// A forward result waiting to be handed to the op that records it (once).
#[derive(Debug)]
pub struct Precomputed(Mutex<Option<Tensor>>);

impl Precomputed {
    /// Holds `out` for the op.
    pub fn new(out: Tensor) -> Self {
        Self(Mutex::new(Some(out)))
    }

    fn take(&self) -> CResult<Tensor> {
        self.0
            .lock()
            .map_err(|_| candle_core::Error::Msg("precomputed op: poisoned lock".into()))?
            .take()
            .ok_or_else(|| candle_core::Error::Msg("precomputed op: forward run twice".into()))
    }

    /// The result's CPU storage (a copy: the op's output must own its storage).
    pub fn cpu(&self) -> CResult<(CpuStorage, Shape)> {
        let out = self.take()?;
        let (storage, layout) = out.storage_and_layout();
        match &*storage {
            Storage::Cpu(s) => Ok((s.try_clone(layout)?, layout.shape().clone())),
            _ => candle_core::bail!("precomputed op: output on another device than its inputs"),
        }
    }

    /// The result's CUDA storage (a copy, as on the CPU).
    #[cfg(feature = "cuda")]
    pub fn cuda(&self) -> CResult<(candle_core::CudaStorage, Shape)> {
        let out = self.take()?;
        let (storage, layout) = out.storage_and_layout();
        match &*storage {
            Storage::Cuda(s) => Ok((s.try_clone(layout)?, layout.shape().clone())),
            _ => candle_core::bail!("precomputed op: output on another device than its inputs"),
        }
    }
}
