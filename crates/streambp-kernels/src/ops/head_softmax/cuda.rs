//! The head's softmax on the card: the Triton kernels of `triton/head_softmax.py` (compiled into
//! [`super::compiled`]), launched on candle's stream; the gradient is written over the chunk.

use candle_core::{DType, Device, Tensor};

use super::cuda_table::{
    log_softmax_args, log_softmax_entropy_args, logit_grad_args, logit_grad_entropy_args, Chunk,
    BLOCK,
};
use super::{HeadRows, Stats};
use crate::triton::launch::{self, address, aligned, compiled_for, is_aligned, required};
use crate::triton::{check, Args, Compiled};

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

/// A row's statistic the first pass writes (f32), a buffer it fills whole.
fn per_row(z: &Tensor, n: usize) -> CResult<Tensor> {
    Tensor::zeros(n, DType::F32, z.device())
}

/// The first pass (`first`, whose gradient's pass `second` must be compiled too), or `None` where
/// the kernels do not take `z` (another card or dtype, no rows, rows not contiguous from an aligned
/// address or not a multiple of 16 wide). With `with_entropy` the rows' entropies too. Unlike the
/// host's, it does not read the targets back to check them (that would stop the card each chunk):
/// a target outside the vocabulary gives a NaN log-prob, which the loss carries.
fn first_pass(z: &Tensor, targets: &Tensor, with_entropy: bool) -> CResult<Option<HeadRows>> {
    let (first, second) = match with_entropy {
        false => ("head_log_softmax", "head_logit_grad"),
        true => ("head_log_softmax_entropy", "head_logit_grad_entropy"),
    };
    let (Some(first), Some(_)) = (kernel(z, first)?, kernel(z, second)?) else {
        return Ok(None);
    };
    if !is_aligned(z) || z.elem_count() == 0 {
        return Ok(None);
    }
    let (n, vocab) = z.dims2()?;
    let targets = column(targets, DType::I64, z, n, "targets")?;
    let (lse, logp) = (per_row(z, n)?, per_row(z, n)?);
    let entropy = with_entropy.then(|| per_row(z, n)).transpose()?;
    let c = Chunk {
        z: address(z)?,
        targets: address(&targets)?,
        lse: address(&lse)?,
        vocab,
    };
    let args = match &entropy {
        Some(h) => log_softmax_entropy_args(&c, address(&logp)?, address(h)?),
        None => log_softmax_args(&c, address(&logp)?),
    };
    if check(first, &args).is_err() {
        return Ok(None);
    }
    launch::launch(z.device().as_cuda_device()?, first, (n, 1), &args)?;
    Ok(Some(HeadRows {
        logp: logp.to_dtype(z.dtype())?,
        entropy: entropy
            .as_ref()
            .map(|h| h.to_dtype(z.dtype()))
            .transpose()?,
        chunk: z.clone(),
        stats: Stats::Card {
            lse,
            targets,
            entropy,
        },
    }))
}

/// [`super::log_softmax_rows`] on the card.
pub(super) fn rows(z: &Tensor, targets: &Tensor) -> CResult<Option<HeadRows>> {
    first_pass(z, targets, false)
}

/// [`super::entropy_rows`] on the card.
pub(super) fn entropy_rows(z: &Tensor, targets: &Tensor) -> CResult<Option<HeadRows>> {
    first_pass(z, targets, true)
}

/// The second pass: `dz = g·(onehot(target) − p)`, less `g_entropy·p·(log p + H)` for rows with
/// entropies (`g_entropy` `None`: zero), over the chunk `z`.
pub(super) fn logit_grad(
    z: &Tensor,
    (lse, targets, entropy): (&Tensor, &Tensor, Option<&Tensor>),
    g: &Tensor,
    g_entropy: Option<&Tensor>,
) -> CResult<()> {
    let device = z.device().as_cuda_device()?;
    let (n, vocab) = z.dims2()?;
    let g = column(g, DType::F32, z, n, "gradients")?;
    let c = Chunk {
        z: address(z)?,
        targets: address(targets)?,
        lse: address(lse)?,
        vocab,
    };
    let launch_as = |name: &str, args: &Args| -> CResult<()> {
        let kernel = required(super::compiled::KERNELS, device, (name, z.dtype(), BLOCK))?;
        launch::launch(device, kernel, (n, 1), args)
    };
    match (entropy, g_entropy) {
        (None, Some(_)) => {
            candle_core::bail!("head softmax: an entropy gradient for rows without entropies")
        }
        (None, None) => launch_as("head_logit_grad", &logit_grad_args(&c, address(&g)?)),
        (Some(h), g_entropy) => {
            let g_entropy = match g_entropy {
                Some(t) => column(t, DType::F32, z, n, "entropy gradients")?,
                None => per_row(z, n)?,
            };
            let columns = (address(&g)?, address(&g_entropy)?);
            let args = logit_grad_entropy_args(&c, address(h)?, columns);
            launch_as("head_logit_grad_entropy", &args)
        }
    }
}
