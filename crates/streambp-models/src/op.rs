//! Differentiable ops whose forward is computed with ordinary tensor ops beforehand and whose backward
//! is written out: the op's own forward only hands the precomputed result over. That way the op runs on
//! every backend (the forward is candle ops) while autograd records only what its backward needs.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, Shape, Storage, Tensor};

type CResult<T> = candle_core::Result<T>;

/// A forward result waiting to be handed to the op that records it (once).
#[derive(Debug)]
pub(crate) struct Precomputed(Mutex<Option<Tensor>>);

impl Precomputed {
    pub(crate) fn new(out: Tensor) -> Self {
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
    pub(crate) fn cpu(&self) -> CResult<(CpuStorage, Shape)> {
        let out = self.take()?;
        let (storage, layout) = out.storage_and_layout();
        match &*storage {
            Storage::Cpu(s) => Ok((s.try_clone(layout)?, layout.shape().clone())),
            _ => candle_core::bail!("precomputed op: output on another device than its inputs"),
        }
    }

    /// The result's CUDA storage (a copy, as on the CPU).
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda(&self) -> CResult<(candle_core::CudaStorage, Shape)> {
        let out = self.take()?;
        let (storage, layout) = out.storage_and_layout();
        match &*storage {
            Storage::Cuda(s) => Ok((s.try_clone(layout)?, layout.shape().clone())),
            _ => candle_core::bail!("precomputed op: output on another device than its inputs"),
        }
    }
}

/// `x Wᵀ + b` with `W` and `b` frozen: its backward gives `x` its gradient `g W` and computes nothing for
/// the weight. (candle's matmul backward always forms the gradient of both operands, a weight-sized
/// matmul and buffer per call even when the weight is a constant: the cost LoRA must not pay.)
struct FrozenLinear {
    weight: Tensor,
    out: Precomputed,
}

impl candle_core::CustomOp1 for FrozenLinear {
    fn name(&self) -> &'static str {
        "streambp-frozen-linear"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> CResult<(CpuStorage, Shape)> {
        self.out.cpu()
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        self.out.cuda()
    }

    fn bwd(&self, _x: &Tensor, _out: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        Ok(Some(grad.matmul(&self.weight)?))
    }
}

/// `x Wᵀ (+ b)` for `x` `[n, in]` with a frozen `weight` `[out, in]`: differentiable in `x` only. An
/// untracked `x` (no graph) takes the plain path.
pub(crate) fn frozen_linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> CResult<Tensor> {
    let (weight, bias) = (weight.detach(), bias.map(Tensor::detach));
    let plain = |x: &Tensor| -> CResult<Tensor> {
        let y = x.matmul(&weight.t()?)?;
        match &bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    };
    if !x.track_op() {
        return plain(x);
    }
    let out = plain(&x.detach())?;
    x.apply_op1(FrozenLinear {
        weight,
        out: Precomputed::new(out),
    })
}
