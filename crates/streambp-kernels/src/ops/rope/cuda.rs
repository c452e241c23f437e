//! Rope on the card: the Triton kernel of `triton/rope.py` (compiled into [`super::compiled`] per
//! head dim) over contiguous rows, launched from the ops' `cuda_fwd`, forward and by the transpose.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaStorage;
use candle_core::{Layout, Shape, Tensor};

use super::cpu::Rotation;
use super::cuda_table::{rope_args, HEAD_DIMS};
use crate::triton::launch::{
    self, alloc, compiled_for, contiguous_address, required, storage_address,
};

type CResult<T> = candle_core::Result<T>;

/// Whether there is a compiled kernel for `x`'s card, dtype and head dim.
pub(super) fn takes(x: &Tensor, head_dim: usize) -> CResult<bool> {
    let candle_core::Device::Cuda(device) = x.device() else {
        return Ok(false);
    };
    let found = compiled_for(
        super::compiled::KERNELS,
        device,
        ("rope", x.dtype(), head_dim),
    )?;
    Ok(HEAD_DIMS.contains(&head_dim) && found.is_some())
}

/// The address of a contiguous input of at least `len` elements.
fn input(storage: &CudaStorage, layout: &Layout, len: usize) -> CResult<u64> {
    if layout.shape().elem_count() < len {
        candle_core::bail!(
            "rope on the card: {} values where {len} are needed",
            layout.shape().elem_count()
        );
    }
    contiguous_address(storage, layout)
}

/// `x` rotated by the tables, forward or by the transpose.
pub(super) fn rotate(
    r: &Rotation,
    inverse: bool,
    (xs, xl): (&CudaStorage, &Layout),
    (cs, cl): (&CudaStorage, &Layout),
    (ss, sl): (&CudaStorage, &Layout),
) -> CResult<(CudaStorage, Shape)> {
    let what = ("rope", xs.dtype(), r.head_dim);
    let kernel = required(super::compiled::KERNELS, &xs.device, what)?;
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
