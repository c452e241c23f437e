//! The accumulators on the card: the Triton kernels of `triton/accumulate.py` (compiled into
//! [`super::compiled`]), launched on candle's stream, writing the accumulator in place.

use candle_core::{DType, Device, Tensor};

use super::cuda_table::{add_args, add_rows_args, ADD_BLOCK, ROWS_BLOCK};
use crate::triton::launch::{self, address, aligned, compiled_for, is_aligned};
use crate::triton::{check, Args, Compiled};

type CResult<T> = candle_core::Result<T>;

/// The kernel `name` (`variant`) for a gradient `x` into the f32 accumulator `acc` on the same
/// card, laid out as the kernels write it; `None` otherwise.
fn kernel(
    acc: &Tensor,
    x: &Tensor,
    (name, variant): (&str, usize),
) -> CResult<Option<&'static Compiled>> {
    let Device::Cuda(device) = acc.device() else {
        return Ok(None);
    };
    let fits = acc.dtype() == DType::F32
        && x.device().same_device(acc.device())
        && is_aligned(acc)
        && acc.elem_count() > 0;
    match fits {
        true => compiled_for(super::compiled::KERNELS, device, (name, x.dtype(), variant)),
        false => Ok(None),
    }
}

/// Launches `kernel` over `programs` if `args` fit its compiled list; `false` otherwise.
fn run(acc: &Tensor, kernel: &'static Compiled, programs: usize, args: &Args) -> CResult<bool> {
    if check(kernel, args).is_err() {
        return Ok(false);
    }
    launch::launch(acc.device().as_cuda_device()?, kernel, (programs, 1), args)?;
    Ok(true)
}

/// [`super::add`] on the card.
pub(super) fn add(acc: &Tensor, x: &Tensor) -> CResult<bool> {
    let Some(kernel) = kernel(acc, x, ("accumulate_add", ADD_BLOCK))? else {
        return Ok(false);
    };
    let x = aligned(x)?;
    let n = acc.elem_count();
    run(
        acc,
        kernel,
        n.div_ceil(ADD_BLOCK),
        &add_args(address(acc)?, address(&x)?, n),
    )
}

/// [`super::add_rows`] on the card.
pub(super) fn add_rows(acc: &Tensor, ids: &Tensor, rows: &Tensor) -> CResult<bool> {
    let Some(kernel) = kernel(acc, rows, ("accumulate_add_rows", ROWS_BLOCK))? else {
        return Ok(false);
    };
    let ((vocab, dim), n) = (acc.dims2()?, rows.dims2()?.0);
    if n == 0 {
        return Ok(true);
    }
    let ids = aligned(&ids.to_dtype(DType::I64)?.to_device(acc.device())?)?;
    let rows = aligned(rows)?;
    let buffers = (address(acc)?, address(&ids)?, address(&rows)?);
    let args = add_rows_args(buffers, n, (vocab, dim));
    run(acc, kernel, dim.div_ceil(ROWS_BLOCK), &args)
}
