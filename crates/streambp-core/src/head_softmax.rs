//! The LM head's softmax over the vocabulary in two passes per row on the CPU.
//!
//! Composed from tensor ops, a logits chunk `z` (`[n, V]`) is read and written by a dozen ops: the
//! log-sum-exp (maximum, subtract, exponentiate, sum, log), then the probabilities for the backward
//! (subtract, exponentiate), `−g·p` and the scatter of `g` onto the targets. Here
//! [`log_softmax_rows`] makes one pass per row for its maximum and one for the exponentials (kept, and
//! divided by their sum, as the probabilities), and [`HeadRows::logit_grad`] turns them into `dz = g·(onehot(target) − p)` in
//! place: the `[n, V]` buffers are `z` and one more, and each exponential is computed once.
//!
//! The arithmetic follows the composed ops (`lse = log Σ exp(z − max) + max`, `dz = p·(−g)`, plus `g`
//! at the target) but for `p`, `exp(z − max) / Σ` here and `exp(z − lse)` there: equal to rounding. CPU only, f32 and f64; elsewhere [`log_softmax_rows`]
//! answers `None` and the head keeps its composed path (which CUDA runs).

use candle_core::{Device, Tensor, WithDType};
use num_traits::Float;
use rayon::prelude::*;
use streambp_models::cpu::{fusable, row_max, row_sum, with_data, BulkExp};

type CResult<T> = candle_core::Result<T>;

/// The exponentials of a logits chunk, in its dtype.
enum Probs {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

/// One logits chunk after [`log_softmax_rows`]: each row's target log-prob, and its probabilities
/// waiting to become the logits' gradient.
pub(crate) struct HeadRows {
    /// `[n]`: `log softmax(z)[target]` per row.
    pub logp: Tensor,
    probs: Probs,
    targets: Vec<u32>,
    vocab: usize,
    device: Device,
}

/// `log softmax(z)` at each row's target and the probabilities `exp(z − lse)`, for `z` `[n, V]` and
/// `targets` `[n]` (u32); `None` off the CPU or for other dtypes.
pub(crate) fn log_softmax_rows(z: &Tensor, targets: &Tensor) -> CResult<Option<HeadRows>> {
    if !fusable(z) {
        return Ok(None);
    }
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
        candle_core::DType::F32 => rows_as::<f32>(z, &targets)?.map(|(p, l)| (Probs::F32(p), l)),
        _ => rows_as::<f64>(z, &targets)?.map(|(p, l)| (Probs::F64(p), l)),
    };
    let Some((probs, logp)) = rows else {
        return Ok(None);
    };
    Ok(Some(HeadRows {
        logp: logp.to_device(z.device())?,
        probs,
        targets,
        vocab,
        device: z.device().clone(),
    }))
}

fn rows_as<T: WithDType + BulkExp + std::ops::MulAssign>(
    z: &Tensor,
    targets: &[u32],
) -> CResult<Option<(Vec<T>, Tensor)>> {
    let (n, vocab) = z.dims2()?;
    let mut probs = vec![T::zero(); n * vocab];
    let mut logp = vec![T::zero(); n];
    let done = with_data::<T, _>(z, |z| {
        probs
            .par_chunks_mut(vocab.max(1))
            .zip(logp.par_iter_mut())
            .enumerate()
            .for_each(|(r, (p, logp))| {
                let row = &z[r * vocab..(r + 1) * vocab];
                let max = row_max(row, T::neg_infinity());
                for (e, &x) in p.iter_mut().zip(row) {
                    *e = x - max;
                }
                T::exp_in_place(p);
                let sum = row_sum(p);
                let lse = sum.ln() + max;
                // The probabilities from the same exponentials (exp(z − lse) to rounding): each
                // exponential is computed once.
                let inv = T::one() / sum;
                for e in p.iter_mut() {
                    *e *= inv;
                }
                *logp = row[targets[r] as usize] - lse;
            });
        Ok(())
    })?;
    if done.is_none() {
        return Ok(None);
    }
    Ok(Some((probs, Tensor::from_vec(logp, n, &Device::Cpu)?)))
}

impl HeadRows {
    /// `dz = g·(onehot(target) − p)` (`[n, V]`, in the logits' dtype) for `g` = dLoss/dlogp (`[n]`),
    /// written over the probabilities.
    pub(crate) fn logit_grad(self, g: &Tensor) -> CResult<Tensor> {
        let dz = match self.probs {
            Probs::F32(p) => grad_over(p, g, &self.targets, self.vocab)?,
            Probs::F64(p) => grad_over(p, g, &self.targets, self.vocab)?,
        };
        dz.to_device(&self.device)
    }
}

/// [`into_grad`] of `p` with `g` read in `p`'s dtype, as a `[n, V]` tensor.
fn grad_over<T: WithDType + Float + std::ops::AddAssign + std::ops::MulAssign>(
    p: Vec<T>,
    g: &Tensor,
    targets: &[u32],
    vocab: usize,
) -> CResult<Tensor> {
    let g = g
        .flatten_all()?
        .to_dtype(T::DTYPE)?
        .to_device(&Device::Cpu)?
        .to_vec1::<T>()?;
    let shape = (targets.len(), vocab);
    Tensor::from_vec(into_grad(p, &g, targets, vocab), shape, &Device::Cpu)
}

/// `p·(−g)` per row, then `+ g` at the row's target, in place.
fn into_grad<T: WithDType + Float + std::ops::AddAssign + std::ops::MulAssign>(
    mut p: Vec<T>,
    g: &[T],
    targets: &[u32],
    vocab: usize,
) -> Vec<T> {
    p.par_chunks_mut(vocab.max(1))
        .enumerate()
        .for_each(|(r, row)| {
            let minus_g = -g[r];
            for x in row.iter_mut() {
                *x *= minus_g;
            }
            row[targets[r] as usize] += g[r];
        });
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, D};

    fn diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b)
            .and_then(|d| d.abs())
            .and_then(|d| d.flatten_all())
            .and_then(|d| d.to_dtype(DType::F64))
            .and_then(|d| d.max(0))
            .and_then(|d| d.to_scalar::<f64>())
            .unwrap()
    }

    /// The two passes against the composed head ops, in f64 (≤ 1e-12) and f32, with a row whose
    /// logits are all equal and targets at both ends of the vocabulary.
    #[test]
    fn head_passes_equal_the_composed_ops() {
        let (n, vocab) = (6, 37);
        let mut rng = streambp_models::init::NormalRng::new(7);
        let mut values: Vec<f64> = (0..n * vocab)
            .map(|_| 20.0 * rng.uniform() - 10.0)
            .collect();
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
            assert!(diff(&rows.logp, &want_logp) <= bound, "{dtype:?}");
            let dz = rows.logit_grad(&g).unwrap();
            assert!(diff(&dz, &want_dz) <= bound, "{dtype:?}");
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
