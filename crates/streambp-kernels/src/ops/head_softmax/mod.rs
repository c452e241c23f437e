//! The LM head's softmax over the vocabulary in two passes per row on the CPU, in the logits' buffer.
//!
//! Composed from tensor ops, a logits chunk `z` (`[n, V]`) is read and written by a dozen ops: the
//! log-sum-exp (maximum, subtract, exponentiate, sum, log), then the probabilities for the backward
//! (subtract, exponentiate), `−g·p` and the scatter of `g` onto the targets. Here
//! [`log_softmax_rows`] makes one pass per row for its maximum and one for the exponentials and their
//! sum, written over `z` itself, and [`HeadRows::logit_grad`] one more turning them into
//! `dz = g·(onehot(target) − p)`, again in place: in f32/f64 without a soft-cap the chunk's only
//! `[n, V]` buffer is `z`'s (a soft-cap adds its slope and the scaled gradient; half precision the raw
//! logits and the rounded gradient), and each exponential is computed once.
//!
//! The arithmetic follows the composed ops (`lse = log Σ exp(z − max) + max`, `dz = p·(−g)`, plus `g`
//! at the target) but for `p`, `exp(z − max) / Σ` here and `exp(z − lse)` there: equal to rounding. On
//! the CPU f32 and f64; on the card (f32 and bf16 logits, rows a multiple of 16 wide) two Triton
//! kernels (`triton/head_softmax.py`, `cuda.rs`): the first leaves `z` as it is and keeps each row's
//! log-sum-exp, the second writes `dz` over `z`. Elsewhere [`log_softmax_rows`] answers `None` and
//! the head keeps its composed path.

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod compiled;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod cuda_table;

use crate::backend::Backend;
use crate::host::exp::BulkExp;
use crate::host::reduce::row_max;
use crate::host::storage::{host_float, with_data_mut};
use crate::vectorized;
use candle_core::{Device, Tensor, WithDType};
use num_traits::Float;
use rayon::prelude::*;

type CResult<T> = candle_core::Result<T>;

/// One logits chunk after [`log_softmax_rows`]: each row's target log-prob, and the chunk's buffer
/// waiting to become the logits' gradient.
pub struct HeadRows {
    /// `[n]`: `log softmax(z)[target]` per row.
    pub logp: Tensor,
    /// The logits chunk: on the host now holding `exp(z − max)` per row, on the card `z` itself.
    chunk: Tensor,
    stats: Stats,
}

/// What the gradient's pass reads beside the chunk.
enum Stats {
    /// The host's: `1 / Σ exp(z − max)` per row, in the logits' dtype (held in f64, exactly), and
    /// the targets.
    Host {
        inv_sums: Vec<f64>,
        targets: Vec<u32>,
    },
    /// The card's: each row's log-sum-exp (f32) and the targets (i64), on the card.
    #[cfg(feature = "cuda")]
    Card { lse: Tensor, targets: Tensor },
}

/// `log softmax(z)` at each row's target, for `z` `[n, V]` and `targets` `[n]` (u32), leaving
/// `exp(z − max)` in `z`'s buffer on the host: the caller hands over a logits chunk nothing else
/// reads. `None` where no kernel applies (another device or dtype; `z` untouched).
pub fn log_softmax_rows(z: &Tensor, targets: &Tensor) -> CResult<Option<HeadRows>> {
    match Backend::of(z) {
        Backend::Cpu if host_float(z) && z.is_contiguous() => host_rows(z, targets),
        #[cfg(feature = "cuda")]
        Backend::Cuda => cuda::rows(z, targets),
        _ => Ok(None),
    }
}

/// [`log_softmax_rows`] on the host.
fn host_rows(z: &Tensor, targets: &Tensor) -> CResult<Option<HeadRows>> {
    let targets = targets
        .flatten_all()?
        .to_dtype(candle_core::DType::U32)?
        .to_vec1::<u32>()?;
    let (n, vocab) = z.dims2()?;
    if targets.len() != n || targets.iter().any(|&t| t as usize >= vocab) {
        candle_core::bail!(
            "head softmax: {} targets for {n} rows of {vocab}",
            targets.len()
        );
    }
    let rows = match z.dtype() {
        candle_core::DType::F32 => rows_as::<f32>(z, &targets)?,
        _ => rows_as::<f64>(z, &targets)?,
    };
    let Some((logp, inv_sums)) = rows else {
        return Ok(None);
    };
    Ok(Some(HeadRows {
        logp: Tensor::from_vec(logp, n, &Device::Cpu)?.to_dtype(z.dtype())?,
        chunk: z.clone(),
        stats: Stats::Host { inv_sums, targets },
    }))
}

/// The rows of `z` (contiguous) in its storage, mutably, for `f`.
fn with_rows<T: WithDType, R>(
    z: &Tensor,
    f: impl FnOnce(&mut [T]) -> CResult<R>,
) -> CResult<Option<R>> {
    with_data_mut::<T, _>(z, |data, layout| match layout.contiguous_offsets() {
        Some((start, end)) => f(&mut data[start..end]),
        None => candle_core::bail!("head softmax: logits not contiguous"),
    })
}

/// Each row's target log-prob (as f64 of `T`) and `1 / Σ`, the row left as `exp(z − max)`.
fn rows_as<T: WithDType + BulkExp>(
    z: &Tensor,
    targets: &[u32],
) -> CResult<Option<(Vec<f64>, Vec<f64>)>> {
    let vocab = z.dims2()?.1.max(1);
    with_rows::<T, _>(z, |z| {
        Ok(z.par_chunks_mut(vocab)
            .zip(targets.par_iter())
            .map(|(row, &target)| {
                vectorized!(|_| {
                    let max = row_max(row, T::neg_infinity());
                    let target_logit = row[target as usize];
                    let sum = T::exp_shifted_sum(row, max);
                    let lse = sum.ln() + max;
                    ((target_logit - lse).to_f64(), (T::one() / sum).to_f64())
                })
            })
            .unzip())
    })
}

impl HeadRows {
    /// `dz = g·(onehot(target) − p)` (`[n, V]`, in the logits' dtype) for `g` = dLoss/dlogp (`[n]`),
    /// written over the exponentials (the probabilities `exp(z − max)·(1/Σ)` formed on the way).
    pub fn logit_grad(self, g: &Tensor) -> CResult<Tensor> {
        let (inv_sums, targets) = match &self.stats {
            Stats::Host { inv_sums, targets } => (inv_sums, targets),
            #[cfg(feature = "cuda")]
            Stats::Card { lse, targets } => {
                cuda::logit_grad(&self.chunk, (lse, targets), g)?;
                return Ok(self.chunk);
            }
        };
        let g = g.flatten_all()?.to_dtype(candle_core::DType::F64)?;
        let g = g.to_device(&Device::Cpu)?.to_vec1::<f64>()?;
        if g.len() != targets.len() {
            candle_core::bail!(
                "head softmax: {} gradients for {} rows",
                g.len(),
                targets.len()
            );
        }
        match self.chunk.dtype() {
            candle_core::DType::F32 => self.grad_in_place::<f32>(&g, inv_sums, targets)?,
            _ => self.grad_in_place::<f64>(&g, inv_sums, targets)?,
        };
        Ok(self.chunk)
    }

    /// `p·(−g)` per row, then `+ g` at the row's target, in place.
    fn grad_in_place<T: WithDType + Float + std::ops::AddAssign>(
        &self,
        g: &[f64],
        inv_sums: &[f64],
        targets: &[u32],
    ) -> CResult<()> {
        let vocab = self.chunk.dims2()?.1.max(1);
        with_rows::<T, _>(&self.chunk, |p| {
            p.par_chunks_mut(vocab)
                .zip(g.par_iter())
                .zip(inv_sums.par_iter().zip(targets.par_iter()))
                .for_each(|((row, &g), (&inv, &target))| {
                    let (g, inv) = (T::from_f64(g), T::from_f64(inv));
                    let minus_g = -g;
                    vectorized!(|_| row.iter_mut().for_each(|x| *x = *x * inv * minus_g));
                    row[target as usize] += g;
                });
            Ok(())
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, D};
    use streambp_testkit::max_diff;

    /// The two passes against the composed head ops, in f64 (≤ 1e-12) and f32, with a row whose
    /// logits are all equal and targets at both ends of the vocabulary.
    #[test]
    fn head_passes_equal_the_composed_ops() {
        let (n, vocab) = (6, 37);
        let mut values = crate::testing::spread(n * vocab, 7, (-10.0, 10.0));
        values[..vocab].iter_mut().for_each(|v| *v = 1.5);
        let targets: Vec<u32> = vec![0, 36, 5, 17, 36, 2];
        let g: Vec<f64> = (0..n).map(|i| 0.25 * i as f64 - 0.5).collect();
        for (dtype, bound) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
            let z = Tensor::from_vec(values.clone(), (n, vocab), &Device::Cpu)
                .and_then(|t| t.to_dtype(dtype))
                .unwrap();
            let idx = Tensor::from_vec(targets.clone(), (n, 1), &Device::Cpu).unwrap();
            let g = Tensor::from_vec(g.clone(), (n, 1), &Device::Cpu)
                .and_then(|t| t.to_dtype(dtype))
                .unwrap();
            let lse = z.log_sum_exp(D::Minus1).unwrap();
            let want_logp = (z
                .gather(&idx, D::Minus1)
                .unwrap()
                .squeeze(D::Minus1)
                .unwrap()
                - &lse)
                .unwrap();
            let p = z
                .broadcast_sub(&lse.unsqueeze(D::Minus1).unwrap())
                .and_then(|t| t.exp())
                .unwrap();
            let want_dz = p
                .broadcast_mul(&g.neg().unwrap())
                .and_then(|t| t.scatter_add(&idx, &g, D::Minus1))
                .unwrap();
            let rows = log_softmax_rows(&z, &idx).unwrap().unwrap();
            assert!(max_diff(&rows.logp, &want_logp) <= bound, "{dtype:?}");
            let dz = rows.logit_grad(&g).unwrap();
            assert!(max_diff(&dz, &want_dz) <= bound, "{dtype:?}");
        }
    }

    #[test]
    fn bad_targets_are_refused_and_other_dtypes_keep_the_composed_path() {
        let z = Tensor::zeros((2, 4), DType::F32, &Device::Cpu).unwrap();
        let idx = Tensor::from_vec(vec![0u32, 4], 2, &Device::Cpu).unwrap();
        assert!(log_softmax_rows(&z, &idx).is_err());
        let bf16 = z.to_dtype(DType::BF16).unwrap();
        let ok = Tensor::from_vec(vec![0u32, 3], 2, &Device::Cpu).unwrap();
        assert!(log_softmax_rows(&bf16, &ok).unwrap().is_none());
    }
}
