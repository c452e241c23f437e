//! The head's softmax on the card: the Triton kernels of `triton/head_softmax.py` (compiled into
//! [`super::compiled`]), launched on candle's stream; the gradient is written over the chunk.

use candle_core::{DType, Device, Tensor};

use super::cuda_table::{log_softmax_args, logit_grad_args, Chunk, BLOCK};
use super::{HeadRows, Stats};
use crate::triton::launch::{self, address, aligned, compiled_for, is_aligned, required};
use crate::triton::{check, Compiled};

type CResult<T> = candle_core::Result<T>;

/// The kernel `name` for `z`'s card and dtype, if compiled.
fn kernel(z: &Tensor, name: &str) -> CResult<Option<&'static Compiled>> {
    let Device::Cuda(device) = z.device() else {
        return Ok(None);
    };
    compiled_for(super::compiled::KERNELS, device, (name, z.dtype(), BLOCK))
}

/// `[n]` values of `t` in `dtype` on `z`'s card, contiguous and aligned.
fn column(t: &Tensor, dtype: DType, z: &Tensor, n: usize, what: &str) -> CResult<Tensor> {
    let t = t.flatten_all()?;
    if t.elem_count() != n {
        candle_core::bail!("head softmax: {} {what} for {n} rows", t.elem_count());
    }
    aligned(&t.to_dtype(dtype)?.to_device(z.device())?)
}

/// The first pass, or `None` where the kernels do not take `z` (another card or dtype, no rows,
/// rows not contiguous from an aligned address or not a multiple of 16 wide). Unlike the host's, it
/// does not read the targets back to check them (that would stop the card each chunk): a target
/// outside the vocabulary gives a NaN log-prob, which the loss carries.
pub(super) fn rows(z: &Tensor, targets: &Tensor) -> CResult<Option<HeadRows>> {
    let (Some(first), Some(_)) = (
        kernel(z, "head_log_softmax")?,
        kernel(z, "head_logit_grad")?,
    ) else {
        return Ok(None);
    };
    if !is_aligned(z) || z.elem_count() == 0 {
        return Ok(None);
    }
    let (n, vocab) = z.dims2()?;
    let targets = column(targets, DType::I64, z, n, "targets")?;
    let lse = Tensor::zeros(n, DType::F32, z.device())?;
    let logp = Tensor::zeros(n, DType::F32, z.device())?;
    let c = Chunk {
        z: address(z)?,
        targets: address(&targets)?,
        lse: address(&lse)?,
        vocab,
    };
    let args = log_softmax_args(&c, address(&logp)?);
    if check(first, &args).is_err() {
        return Ok(None);
    }
    launch::launch(z.device().as_cuda_device()?, first, (n, 1), &args)?;
    Ok(Some(HeadRows {
        logp: logp.to_dtype(z.dtype())?,
        chunk: z.clone(),
        stats: Stats::Card { lse, targets },
    }))
}

/// The second pass: `dz = g·(onehot(target) − p)` over the chunk `z`.
pub(super) fn logit_grad(
    z: &Tensor,
    (lse, targets): (&Tensor, &Tensor),
    g: &Tensor,
) -> CResult<()> {
    let device = z.device().as_cuda_device()?;
    let what = ("head_logit_grad", z.dtype(), BLOCK);
    let kernel = required(super::compiled::KERNELS, device, what)?;
    let (n, vocab) = z.dims2()?;
    let g = column(g, DType::F32, z, n, "gradients")?;
    let c = Chunk {
        z: address(z)?,
        targets: address(targets)?,
        lse: address(lse)?,
        vocab,
    };
    let args = logit_grad_args(&c, address(&g)?);
    launch::launch(device, kernel, (n, 1), &args)
}
