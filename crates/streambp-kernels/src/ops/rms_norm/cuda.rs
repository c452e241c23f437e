//! RMSNorm on the card: the Triton kernels of `triton/rms_norm.py` (compiled into
//! [`super::compiled`]) over contiguous rows, launched from the ops' `cuda_fwd`. The weight's
//! gradient is summed per group of rows, then over the groups in order, so it does not depend on
//! scheduling.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::{DType, Layout, Shape, Tensor};

use super::cpu::Norm;
use super::cuda_table::{backward_args, block, forward_args, groups, sum_args, weight_args, Rows};
use crate::triton::launch::{
    self, alloc, compiled_for, contiguous_address, required, storage_address,
};
use crate::triton::Compiled;

type CResult<T> = candle_core::Result<T>;

/// The compiled kernel `name` for `device`, `dtype` and rows `dim` wide, if any.
fn kernel(
    device: &CudaDevice,
    name: &str,
    dtype: DType,
    dim: usize,
) -> CResult<Option<&'static Compiled>> {
    compiled_for(super::compiled::KERNELS, device, (name, dtype, block(dim)))
}

fn kernel_for(storage: &CudaStorage, name: &str, dim: usize) -> CResult<&'static Compiled> {
    let what = (name, storage.dtype(), block(dim));
    required(super::compiled::KERNELS, &storage.device, what)
}

/// Whether the card's kernels take `x` normed by `weight`: a card that has them, their dtype, and
/// rows a multiple of 16 wide (the compiler assumed it).
pub(super) fn takes(x: &Tensor, weight: &Tensor) -> CResult<bool> {
    let candle_core::Device::Cuda(device) = x.device() else {
        return Ok(false);
    };
    let dim = weight.elem_count();
    let shapes = x.elem_count() > 0 && x.dims().last() == Some(&dim);
    if !shapes || !dim.is_multiple_of(16) {
        return Ok(false);
    }
    Ok(kernel(device, "rms_norm_forward", x.dtype(), dim)?.is_some())
}

fn address(storage: &CudaStorage, len: usize) -> CResult<u64> {
    storage_address(storage, &Layout::contiguous(len))
}

fn rows(norm: Norm, xl: &Layout, dim: usize) -> Rows {
    Rows {
        rows: xl.shape().elem_count() / dim,
        dim,
        eps: norm.eps as f32,
        one_plus: norm.one_plus,
    }
}

/// `y = x / rms(x) ⊙ s`.
pub(super) fn forward(
    norm: Norm,
    (xs, xl): (&CudaStorage, &Layout),
    (ws, wl): (&CudaStorage, &Layout),
) -> CResult<(CudaStorage, Shape)> {
    let r = rows(norm, xl, wl.shape().elem_count());
    let kernel = kernel_for(xs, "rms_norm_forward", r.dim)?;
    let n = r.rows * r.dim;
    let y = alloc(&xs.device, xs.dtype(), n)?;
    let args = forward_args(
        &r,
        contiguous_address(xs, xl)?,
        contiguous_address(ws, wl)?,
        address(&y, n)?,
    );
    launch::launch(&xs.device, kernel, (r.rows, 1), &args)?;
    Ok((y, xl.shape().clone()))
}

/// dx's rows, then dw, in one `[rows + 1, dim]` buffer.
pub(super) fn backward(
    norm: Norm,
    (xs, xl): (&CudaStorage, &Layout),
    (ws, wl): (&CudaStorage, &Layout),
    (gs, gl): (&CudaStorage, &Layout),
) -> CResult<(CudaStorage, Shape)> {
    let r = rows(norm, xl, wl.shape().elem_count());
    let device = &xs.device;
    let rows_kernel = kernel_for(xs, "rms_norm_backward", r.dim)?;
    let weight_kernel = kernel_for(xs, "rms_norm_backward_weight", r.dim)?;
    let sum_kernel = kernel_for(xs, "rms_norm_weight_sum", r.dim)?;
    let len = (r.rows + 1) * r.dim;
    let out = alloc(device, xs.dtype(), len)?;
    let dx = address(&out, len)?;
    let inv_rms = alloc(device, DType::F32, r.rows.max(1))?;
    let inv_rms_at = address(&inv_rms, r.rows.max(1))?;
    let (x, g) = (contiguous_address(xs, xl)?, contiguous_address(gs, gl)?);
    let args = backward_args(&r, (x, contiguous_address(ws, wl)?, g), dx, inv_rms_at);
    launch::launch(device, rows_kernel, (r.rows, 1), &args)?;
    let groups = groups(r.rows).1;
    let partial = alloc(device, DType::F32, groups * r.dim)?;
    let partial_at = address(&partial, groups * r.dim)?;
    let column_blocks = r.dim.div_ceil(weight_kernel.block_m);
    let args = weight_args(&r, (x, g, inv_rms_at), partial_at);
    launch::launch(device, weight_kernel, (column_blocks, groups), &args)?;
    let dw = dx + (r.rows * r.dim * xs.dtype().size_in_bytes()) as u64;
    let args = sum_args(&r, partial_at, dw);
    launch::launch(device, sum_kernel, (column_blocks, 1), &args)?;
    Ok((out, Shape::from((r.rows + 1, r.dim))))
}
