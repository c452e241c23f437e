//! The ops the gated MLPs' activations share (SwiGLU's and GeGLU's `act(gate) ⊙ up`): the forward
//! and the backward, each one candle op over a [`GatedKernel`] that computes it on host slices, so
//! the backward dispatches by device as the forward does.

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
}

/// `act(gate) ⊙ up` by `kernel` for f32 or f64 CPU tensors of one dtype and shape, differentiable in
/// both.
pub(crate) fn apply<K: GatedKernel>(kernel: K, gate: &Tensor, up: &Tensor) -> CResult<Tensor> {
    gate.contiguous()?
        .apply_op2(&up.contiguous()?, Forward(kernel))
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

    /// [`Backward`], on the backend of the forward's inputs.
    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let (gate, up, g) = (gate.detach(), up.detach(), g.contiguous()?);
        let both = gate.apply_op3_no_bwd(&up, &g, &Backward(self.0))?;
        // `[2, n]`: d gate, then d up.
        let grad = |i: usize| both.get(i)?.reshape(gate.shape());
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
}
