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
//!
//! An objective that reads each row's entropy `H = −Σ p log p` as well (GRPO's entropy terms) takes
//! [`entropy_rows`]: the same first pass, with `Σ eᵈ·d` (`d = z − max`) beside the sum, gives
//! `H = log Σ − Σ eᵈ·d / Σ`, and `z` stays as it is; the gradient's pass writes
//! `dz = p·(−g − g_H·(log p + H))`, plus `g` at the target, over it. Composed, the same holds the
//! log-probabilities, their exponentials and the gradient's terms: five more `[n, V]` buffers.

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod compiled;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod cuda_table;

use crate::backend::Backend;
use crate::host::exp::BulkExp;
use crate::host::reduce::row_max;
use crate::host::storage::{host_float, with_data, with_data_mut};
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
    /// `[n]`: each row's entropy, for rows from [`entropy_rows`].
    pub entropy: Option<Tensor>,
    /// The logits chunk: on the host from [`log_softmax_rows`] now holding `exp(z − max)` per row;
    /// from [`entropy_rows`], and on the card, `z` itself.
    chunk: Tensor,
    stats: Stats,
}

/// What the gradient's pass reads beside the chunk.
enum Stats {
    /// The host's, the chunk holding `exp(z − max)`: `1 / Σ exp(z − max)` per row, in the logits'
    /// dtype (held in f64, exactly), and the targets.
    Host {
        inv_sums: Vec<f64>,
        targets: Vec<u32>,
    },
    /// The host's with the entropies, the chunk holding `z`: each row's log-sum-exp and entropy
    /// (values of the logits' dtype, held in f64), and the targets.
    HostEntropy {
        lse: Vec<f64>,
        entropy: Vec<f64>,
        targets: Vec<u32>,
    },
    /// The card's: each row's log-sum-exp (f32), the targets (i64) and, for [`entropy_rows`], the
    /// entropies (f32), on the card.
    #[cfg(feature = "cuda")]
    Card {
        lse: Tensor,
        targets: Tensor,
        entropy: Option<Tensor>,
    },
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

/// The targets of `z`'s rows on the host, each checked within the vocabulary.
fn host_targets(z: &Tensor, targets: &Tensor) -> CResult<Vec<u32>> {
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
    Ok(targets)
}

/// [`log_softmax_rows`] on the host.
fn host_rows(z: &Tensor, targets: &Tensor) -> CResult<Option<HeadRows>> {
    let targets = host_targets(z, targets)?;
    let n = targets.len();
    let rows = match z.dtype() {
        candle_core::DType::F32 => rows_as::<f32>(z, &targets)?,
        _ => rows_as::<f64>(z, &targets)?,
    };
    let Some((logp, inv_sums)) = rows else {
        return Ok(None);
    };
    Ok(Some(HeadRows {
        logp: Tensor::from_vec(logp, n, &Device::Cpu)?.to_dtype(z.dtype())?,
        entropy: None,
        chunk: z.clone(),
        stats: Stats::Host { inv_sums, targets },
    }))
}

/// Each row's target log-prob and, for its objective's gradient, entropy `H = −Σ p log p`, for `z`
/// `[n, V]` and `targets` `[n]` (u32), leaving `z` as it is (the caller hands over a logits chunk
/// nothing else reads: the gradient is written over it). `None` where no kernel applies (another
/// device or dtype).
pub fn entropy_rows(z: &Tensor, targets: &Tensor) -> CResult<Option<HeadRows>> {
    match Backend::of(z) {
        Backend::Cpu if host_float(z) && z.is_contiguous() => host_entropy_rows(z, targets),
        #[cfg(feature = "cuda")]
        Backend::Cuda => cuda::entropy_rows(z, targets),
        _ => Ok(None),
    }
}

/// [`entropy_rows`] on the host.
fn host_entropy_rows(z: &Tensor, targets: &Tensor) -> CResult<Option<HeadRows>> {
    let targets = host_targets(z, targets)?;
    let n = targets.len();
    let rows = match z.dtype() {
        candle_core::DType::F32 => entropy_rows_as::<f32>(z, &targets)?,
        _ => entropy_rows_as::<f64>(z, &targets)?,
    };
    let Some(rows) = rows else {
        return Ok(None);
    };
    let column = |pick: fn(&(f64, f64, f64)) -> f64| -> CResult<Tensor> {
        Tensor::from_vec(rows.iter().map(pick).collect::<Vec<_>>(), n, &Device::Cpu)?
            .to_dtype(z.dtype())
    };
    Ok(Some(HeadRows {
        logp: column(|r| r.0)?,
        entropy: Some(column(|r| r.2)?),
        chunk: z.clone(),
        stats: Stats::HostEntropy {
            lse: rows.iter().map(|r| r.1).collect(),
            entropy: rows.iter().map(|r| r.2).collect(),
            targets,
        },
    }))
}

/// Each row's target log-prob, log-sum-exp and entropy (as f64 of `T`), `z` read only.
fn entropy_rows_as<T: WithDType + BulkExp>(
    z: &Tensor,
    targets: &[u32],
) -> CResult<Option<Vec<(f64, f64, f64)>>> {
    let vocab = z.dims2()?.1.max(1);
    with_data::<T, _>(z, |z| {
        Ok(z.par_chunks(vocab)
            .zip(targets.par_iter())
            .map(|(row, &target)| {
                vectorized!(|_| {
                    let max = row_max(row, T::neg_infinity());
                    let (sum, moment) = T::exp_shifted_moments(row, max);
                    let log_sum = sum.ln();
                    let lse = log_sum + max;
                    let entropy = log_sum - moment / sum;
                    let logp = row[target as usize] - lse;
                    (logp.to_f64(), lse.to_f64(), entropy.to_f64())
                })
            })
            .collect())
    })
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
    /// `dz` (`[n, V]`, in the logits' dtype) for `g` = dLoss/dlogp (`[n]`) and, for rows from
    /// [`entropy_rows`], `g_entropy` = dLoss/dH (`[n]`; `None`: zero): `g·(onehot(target) − p)`,
    /// minus `g_entropy·p·(log p + H)`, written over the chunk.
    pub fn logit_grad(self, g: &Tensor, g_entropy: Option<&Tensor>) -> CResult<Tensor> {
        let n = self.logp.elem_count();
        let column = |t: &Tensor, what: &str| -> CResult<Vec<f64>> {
            let t = t.flatten_all()?.to_dtype(candle_core::DType::F64)?;
            let values = t.to_device(&Device::Cpu)?.to_vec1::<f64>()?;
            if values.len() != n {
                candle_core::bail!("head softmax: {} {what} for {n} rows", values.len());
            }
            Ok(values)
        };
        match &self.stats {
            Stats::Host { inv_sums, targets } => {
                if g_entropy.is_some() {
                    candle_core::bail!(
                        "head softmax: an entropy gradient for rows without entropies"
                    );
                }
                let g = column(g, "gradients")?;
                match self.chunk.dtype() {
                    candle_core::DType::F32 => self.grad_in_place::<f32>(&g, inv_sums, targets)?,
                    _ => self.grad_in_place::<f64>(&g, inv_sums, targets)?,
                }
            }
            Stats::HostEntropy {
                lse,
                entropy,
                targets,
            } => {
                let g = column(g, "gradients")?;
                let g_entropy = match g_entropy {
                    Some(t) => column(t, "entropy gradients")?,
                    None => vec![0.0; n],
                };
                let rows = EntropyGrad {
                    g: &g,
                    g_entropy: &g_entropy,
                    lse,
                    entropy,
                    targets,
                };
                match self.chunk.dtype() {
                    candle_core::DType::F32 => self.entropy_grad_in_place::<f32>(&rows)?,
                    _ => self.entropy_grad_in_place::<f64>(&rows)?,
                }
            }
            #[cfg(feature = "cuda")]
            Stats::Card {
                lse,
                targets,
                entropy,
            } => {
                let stats = (lse, targets, entropy.as_ref());
                cuda::logit_grad(&self.chunk, stats, g, g_entropy)?;
            }
        }
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

    /// `p·(−g − g_H·(log p + H))` over each row of logits (`log p = z − lse`, `p` its
    /// exponential), then `+ g` at the row's target, in place.
    fn entropy_grad_in_place<T: WithDType + BulkExp>(&self, rows: &EntropyGrad) -> CResult<()> {
        let vocab = self.chunk.dims2()?.1.max(1);
        with_rows::<T, _>(&self.chunk, |z| {
            z.par_chunks_mut(vocab).enumerate().for_each(|(i, row)| {
                let [g, g_h, lse, h] = [rows.g, rows.g_entropy, rows.lse, rows.entropy]
                    .map(|column| T::from_f64(column[i]));
                let minus_g = -g;
                T::exp_shifted_map(row, lse, |log_p, p| {
                    // `p = 0` where `log p = −∞`, whose product would be NaN.
                    let term = minus_g - g_h * (log_p + h);
                    if p > T::zero() {
                        p * term
                    } else {
                        T::zero()
                    }
                });
                row[rows.targets[i] as usize] += g;
            });
            Ok(())
        })?;
        Ok(())
    }
}

/// What the entropy rows' gradient pass reads per row.
struct EntropyGrad<'a> {
    g: &'a [f64],
    g_entropy: &'a [f64],
    lse: &'a [f64],
    entropy: &'a [f64],
    targets: &'a [u32],
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
            let dz = rows.logit_grad(&g, None).unwrap();
            assert!(max_diff(&dz, &want_dz) <= bound, "{dtype:?}");
        }
    }

    /// The passes with the entropies against the composed ops (log-probs, entropies and the logits'
    /// gradient with both gradients, and with no entropy gradient), in f64 (≤ 1e-12) and f32, with
    /// a row of equal logits (the largest entropy), one far apart (an entropy near 0) and one with
    /// masked (−∞) logits; the logits are left as they were until the gradient's pass.
    #[test]
    fn entropy_passes_equal_the_composed_ops() {
        let (n, vocab) = (6, 37);
        let mut values = crate::testing::spread(n * vocab, 11, (-10.0, 10.0));
        values[..vocab].iter_mut().for_each(|v| *v = 1.5);
        values[vocab..vocab + 3].copy_from_slice(&[60.0, -60.0, 30.0]);
        (2 * vocab..3 * vocab)
            .step_by(3)
            .for_each(|i| values[i] = f64::NEG_INFINITY);
        let targets: Vec<u32> = vec![0, 36, 1, 17, 36, 2];
        let g: Vec<f64> = (0..n).map(|i| 0.25 * i as f64 - 0.5).collect();
        let g_h: Vec<f64> = (0..n).map(|i| 0.7 - 0.3 * i as f64).collect();
        // `v` as `rows` rows in `dtype`.
        let matrix = |v: &[f64], rows: usize, dtype| {
            Tensor::from_vec(v.to_vec(), (rows, v.len() / rows), &Device::Cpu)
                .and_then(|t| t.to_dtype(dtype))
                .unwrap()
        };
        for (dtype, bound) in [(DType::F64, 1e-12), (DType::F32, 2e-5)] {
            let z = matrix(&values, n, dtype);
            let idx = Tensor::from_vec(targets.clone(), (n, 1), &Device::Cpu).unwrap();
            let (g, g_h) = (matrix(&g, n, dtype), matrix(&g_h, n, dtype));
            let lse = z.log_sum_exp(D::Minus1).unwrap();
            let log_p = z.broadcast_sub(&lse.unsqueeze(D::Minus1).unwrap()).unwrap();
            let p = log_p.exp().unwrap();
            // `p·log p` with `0` where `p = 0` (composed, `0·(−∞)` is NaN).
            let zero = p.zeros_like().unwrap();
            let p_log_p = p
                .gt(&zero)
                .unwrap()
                .where_cond(&(&p * &log_p).unwrap(), &zero);
            let want_h = p_log_p.unwrap().sum(D::Minus1).unwrap().neg().unwrap();
            let want_logp = log_p
                .gather(&idx, D::Minus1)
                .unwrap()
                .squeeze(D::Minus1)
                .unwrap();
            let from_logp = p
                .broadcast_mul(&g.neg().unwrap())
                .and_then(|t| t.scatter_add(&idx, &g, D::Minus1))
                .unwrap();
            let centred = log_p
                .broadcast_add(&want_h.unsqueeze(D::Minus1).unwrap())
                .unwrap();
            let p_centred = p
                .gt(&zero)
                .unwrap()
                .where_cond(&(&p * centred).unwrap(), &zero);
            let from_h = p_centred
                .unwrap()
                .broadcast_mul(&g_h.neg().unwrap())
                .unwrap();
            for with_g_h in [true, false] {
                let z = z.copy().unwrap();
                let rows = entropy_rows(&z, &idx).unwrap().unwrap();
                assert!(max_diff(&rows.logp, &want_logp) <= bound, "{dtype:?}");
                let h = rows.entropy.clone().unwrap();
                assert!(max_diff(&h, &want_h) <= bound, "{dtype:?}");
                let as_f64 = |t: &Tensor| t.flatten_all().and_then(|t| t.to_dtype(DType::F64));
                let unchanged = as_f64(&z).and_then(|t| t.to_vec1::<f64>()).unwrap();
                let given = as_f64(&matrix(&values, n, dtype)).and_then(|t| t.to_vec1::<f64>());
                assert_eq!(
                    unchanged,
                    given.unwrap(),
                    "{dtype:?}: the logits were written"
                );
                let (dz, want) = match with_g_h {
                    true => (
                        rows.logit_grad(&g, Some(&g_h)),
                        (&from_logp + &from_h).unwrap(),
                    ),
                    false => (rows.logit_grad(&g, None), from_logp.clone()),
                };
                assert!(
                    max_diff(&dz.unwrap(), &want) <= bound,
                    "{dtype:?} {with_g_h}"
                );
            }
        }
        // An entropy gradient for rows made without the entropies is refused.
        let z = matrix(&values[..vocab], 1, DType::F64);
        let idx = Tensor::from_vec(vec![3u32], (1, 1), &Device::Cpu).unwrap();
        let g = matrix(&[1.0], 1, DType::F64);
        let rows = log_softmax_rows(&z, &idx).unwrap().unwrap();
        assert!(rows.entropy.is_none());
        assert!(rows.logit_grad(&g, Some(&g)).is_err());
    }

    #[test]
    fn bad_targets_are_refused_and_other_dtypes_keep_the_composed_path() {
        let z = Tensor::zeros((2, 4), DType::F32, &Device::Cpu).unwrap();
        let idx = Tensor::from_vec(vec![0u32, 4], 2, &Device::Cpu).unwrap();
        assert!(log_softmax_rows(&z, &idx).is_err());
        let bf16 = z.to_dtype(DType::BF16).unwrap();
        let ok = Tensor::from_vec(vec![0u32, 3], 2, &Device::Cpu).unwrap();
        assert!(log_softmax_rows(&bf16, &ok).unwrap().is_none());
        assert!(entropy_rows(&z, &idx).is_err());
        assert!(entropy_rows(&bf16, &ok).unwrap().is_none());
    }
}
