//! AdamW on the card: the Triton kernel of `triton/adamw.py` (compiled into [`super::compiled`]),
//! launched on candle's stream over the parameter's and the moments' buffers, which it writes in
//! place (as `Var::set` would, without the copies).

use candle_core::{DType, Device, Tensor};

use super::cuda_table::{adamw_args, variant};
use super::AdamWStep;
use crate::triton::launch::{self, address, compiled_for, is_aligned};

type CResult<T> = candle_core::Result<T>;

/// Whether `t` is laid out as the kernel reads it, with `n` elements.
fn laid_out(t: &Tensor, n: usize) -> bool {
    is_aligned(t) && t.elem_count() == n
}

/// The update, or `false` where the kernel does not take these tensors.
pub(super) fn update(
    p: &Tensor,
    g: &Tensor,
    (m, v): (&Tensor, &Tensor),
    step: &AdamWStep,
) -> CResult<bool> {
    let Device::Cuda(device) = p.device() else {
        return Ok(false);
    };
    let n = p.elem_count();
    let grad_f32 = g.dtype() == DType::F32;
    let dtypes =
        (g.dtype() == p.dtype() || grad_f32) && m.dtype() == DType::F32 && v.dtype() == DType::F32;
    let on_card = [g, m, v].iter().all(|t| t.device().same_device(p.device()));
    if !dtypes || !on_card || ![p, g, m, v].iter().all(|t| laid_out(t, n)) {
        return Ok(false);
    }
    let what = ("adamw", p.dtype(), variant(grad_f32));
    let Some(kernel) = compiled_for(super::compiled::KERNELS, device, what)? else {
        return Ok(false);
    };
    let buffers = (address(p)?, address(g)?, address(m)?, address(v)?);
    let args = adamw_args(buffers, n, step);
    launch::launch(device, kernel, (n.div_ceil(kernel.block_m), 1), &args)?;
    Ok(true)
}
