//! Rope on the card: the Triton kernel of `triton/rope.py` (compiled into [`super::compiled`] per
//! head dim) over contiguous rows, launched from the ops' `cuda_fwd`, forward and by the transpose.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaStorage;
use candle_core::{Layout, Shape, Tensor};

use super::cpu::Rotation;
use super::cuda_table::{rope_args, HEAD_DIMS};
use crate::triton::launch::{self, alloc, storage_address};
use crate::triton::{dtype_name, find, Compiled};

type CResult<T> = candle_core::Result<T>;

/// The compiled kernel for `x`'s card, dtype and head dim, if any.
pub(super) fn takes(x: &Tensor, head_dim: usize) -> CResult<bool> {
    let candle_core::Device::Cuda(device) = x.device() else {
        return Ok(false);
    };
    if !HEAD_DIMS.contains(&head_dim) {
        return Ok(false);
    }
    let (Some(arch), Some(dtype)) = (launch::arch(device)?, dtype_name(x.dtype())) else {
        return Ok(false);
    };
    Ok(find(super::compiled::KERNELS, "rope", arch, dtype, head_dim).is_some())
}

fn kernel(storage: &CudaStorage, head_dim: usize) -> CResult<&'static Compiled> {
    let dtype = storage.dtype();
    let found = match (launch::arch(&storage.device)?, dtype_name(dtype)) {
        (Some(arch), Some(name)) => find(super::compiled::KERNELS, "rope", arch, name, head_dim),
        _ => None,
    };
    found
        .ok_or_else(|| candle_core::Error::Msg(format!("no card rope for {dtype:?} hd {head_dim}")))
}

/// The address of a contiguous input of at least `len` elements.
fn input(storage: &CudaStorage, layout: &Layout, len: usize) -> CResult<u64> {
    if !layout.is_contiguous() || layout.shape().elem_count() < len {
        candle_core::bail!(
            "rope on the card: an input laid out as {layout:?}, {len} values needed"
        );
    }
    storage_address(storage, layout)
}

/// `x` rotated by the tables, forward or by the transpose.
pub(super) fn rotate(
    r: &Rotation,
    inverse: bool,
    (xs, xl): (&CudaStorage, &Layout),
    (cs, cl): (&CudaStorage, &Layout),
    (ss, sl): (&CudaStorage, &Layout),
) -> CResult<(CudaStorage, Shape)> {
    let kernel = kernel(xs, r.head_dim)?;
    let n = xl.shape().elem_count();
    let rows = n / r.head_dim.max(1);
    let batches = match r.per_batch {
        true => rows.div_ceil(r.rows_per_batch.max(1)),
        false => 1,
    };
    let table = batches * r.len * r.head_dim;
    let inputs = (
        input(xs, xl, n)?,
        input(cs, cl, table)?,
        input(ss, sl, table)?,
    );
    let y = alloc(&xs.device, xs.dtype(), n)?;
    let y_at = storage_address(&y, &Layout::contiguous(n))?;
    let args = rope_args(r, rows, inputs, y_at, inverse);
    launch::launch(
        &xs.device,
        kernel,
        (rows.div_ceil(kernel.block_m), 1),
        &args,
    )?;
    Ok((y, xl.shape().clone()))
}
