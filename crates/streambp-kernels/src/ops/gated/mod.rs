//! The ops the gated MLPs' activations share (SwiGLU's and GeGLU's `act(gate) ⊙ up`): the forward
//! and the backward, each one candle op over a [`GatedKernel`] that computes it on host slices
//! (`cpu_fwd`) or names its Triton kernels for the card (`cuda_fwd`, `cuda.rs`), so the backward
//! dispatches by device as the forward does.

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod compiled;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod cuda_table;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor};

use crate::host::storage::input_data;

type CResult<T> = candle_core::Result<T>;

/// One activation's CPU kernel: `act(gate) ⊙ up`, and for the output's gradient `g` the gate's
/// gradient followed by up's (one buffer of twice the elements).
pub(crate) trait GatedKernel: Copy + Send + Sync + 'static {
    /// The forward op's name; the backward's is this with `-backward`.
    const NAME: &'static str;
    /// The backward op's name.
    const BACKWARD_NAME: &'static str;
    /// The forward in f32.
    fn forward_f32(self, gate: &[f32], up: &[f32]) -> Vec<f32>;
    /// The forward in f64.
    fn forward_f64(self, gate: &[f64], up: &[f64]) -> Vec<f64>;
    /// d gate then d up, in f32.
    fn backward_f32(self, gate: &[f32], up: &[f32], g: &[f32]) -> Vec<f32>;
    /// d gate then d up, in f64.
    fn backward_f64(self, gate: &[f64], up: &[f64], g: &[f64]) -> Vec<f64>;
    /// The card's kernels' variant (`triton/gated.py`'s `ACT`) computing what this kernel
    /// computes, where there is one.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn card_variant(self) -> Option<usize>;
}

/// Whether the table has `kernel`'s card kernels for every architecture and dtype.
#[cfg(test)]
pub(crate) fn has_card_kernels<K: GatedKernel>(kernel: K) -> bool {
    kernel.card_variant().is_some_and(|variant| {
        ["gated_forward", "gated_backward"]
            .iter()
            .all(|name| crate::triton::compiled_everywhere(compiled::KERNELS, name, variant))
    })
}

/// `act(gate) ⊙ up` by `kernel` for f32 or f64 CPU tensors of one dtype and shape, differentiable in
/// both.
pub(crate) fn apply<K: GatedKernel>(kernel: K, gate: &Tensor, up: &Tensor) -> CResult<Tensor> {
    gate.contiguous()?
        .apply_op2(&up.contiguous()?, Forward(kernel))
}

/// `act(gate) ⊙ up` by `kernel`'s card kernels for bf16 or f32 CUDA tensors of one dtype and shape,
/// differentiable in both; `None` where they do not apply (another device, dtype or card, or no
/// kernel for this one), and the caller composes.
pub(crate) fn on_card<K: GatedKernel>(
    kernel: K,
    gate: &Tensor,
    up: &Tensor,
) -> CResult<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    {
        let alike = gate.dtype() == up.dtype() && gate.shape() == up.shape();
        if alike && gate.elem_count() > 0 && cuda::takes(kernel, gate)? {
            let aligned = crate::triton::contiguous_for_kernels;
            let (gate, up) = (aligned(gate)?, aligned(up)?);
            return gate.apply_op2(&up, Forward(kernel)).map(Some);
        }
    }
    let _ = (kernel, gate, up);
    Ok(None)
}

/// The forward.
struct Forward<K>(K);

impl<K: GatedKernel> CustomOp2 for Forward<K> {
    fn name(&self) -> &'static str {
        K::NAME
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        us: &CpuStorage,
        ul: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let y = match (gs, us) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => {
                CpuStorage::F32(self.0.forward_f32(input_data(gs, gl)?, input_data(us, ul)?))
            }
            (CpuStorage::F64(_), CpuStorage::F64(_)) => {
                CpuStorage::F64(self.0.forward_f64(input_data(gs, gl)?, input_data(us, ul)?))
            }
            _ => candle_core::bail!("{}: gate and up not both f32 or f64", K::NAME),
        };
        Ok((y, gl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
        us: &candle_core::CudaStorage,
        ul: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        cuda::forward(self.0, (gs, gl), (us, ul))
    }

    /// [`Backward`], on the backend of the forward's inputs.
    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let (gate, up) = (gate.detach(), up.detach());
        let g = crate::triton::contiguous_for_kernels(g)?;
        let both = gate.apply_op3_no_bwd(&up, &g, &Backward(self.0))?;
        // `[2, n]` (the card's: `[2, n']`, each row padded to 16 bytes): d gate, then d up.
        let n = gate.elem_count();
        let grad = |i: usize| both.get(i)?.narrow(0, 0, n)?.reshape(gate.shape());
        Ok((Some(grad(0)?), Some(grad(1)?)))
    }
}

/// The backward of `gate`, `up` and the output's gradient: one output `[2, n]`, d gate then d up.
struct Backward<K>(K);

impl<K: GatedKernel> CustomOp3 for Backward<K> {
    fn name(&self) -> &'static str {
        K::BACKWARD_NAME
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        us: &CpuStorage,
        ul: &Layout,
        dys: &CpuStorage,
        dyl: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let out = match (gs, us, dys) {
            (CpuStorage::F32(_), CpuStorage::F32(_), CpuStorage::F32(_)) => {
                CpuStorage::F32(self.0.backward_f32(
                    input_data(gs, gl)?,
                    input_data(us, ul)?,
                    input_data(dys, dyl)?,
                ))
            }
            (CpuStorage::F64(_), CpuStorage::F64(_), CpuStorage::F64(_)) => {
                CpuStorage::F64(self.0.backward_f64(
                    input_data(gs, gl)?,
                    input_data(us, ul)?,
                    input_data(dys, dyl)?,
                ))
            }
            _ => candle_core::bail!("{}: inputs not all f32 or f64", K::BACKWARD_NAME),
        };
        Ok((out, Shape::from((2, gl.shape().elem_count()))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
        us: &candle_core::CudaStorage,
        ul: &Layout,
        dys: &candle_core::CudaStorage,
        dyl: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        cuda::backward(self.0, (gs, gl), (us, ul), (dys, dyl))
    }
}
