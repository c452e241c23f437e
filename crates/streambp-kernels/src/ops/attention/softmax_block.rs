//! The attention op's element-wise work on one block of scores, as one pass per row on the CPU.
//!
//! Composed from tensor ops, a block's softmax reads and writes the `heads × c × keys` scores once per
//! op: add the mask, take the maximum, subtract it, exponentiate, sum (forward); add the mask,
//! subtract the maximum and the log-sum, exponentiate, subtract `Σ g ⊙ out`, multiply (backward). Here
//! each row of scores is read once and its results written once, the row staying in cache between the
//! steps, rows in parallel on rayon's pool. The arithmetic is the composed ops', in their order, so
//! the results agree with them (to the last bit for the element-wise steps; sums may round apart).
//!
//! CPU only, f32 and f64: on another device or dtype the functions answer `None` and the op keeps its
//! composed path (which is also the CUDA path until these have kernels of their own).
//!
//! Shapes: scores `s` and `dp` are `[b, kv_heads, group, c, n]`, the mask `[rows, 1, 1, c, n]` (rows =
//! b or 1), the per-query values (`max`, `log_sum`, `dot`) `[b, kv_heads, group, c, 1]`.

use candle_core::{DType, Tensor, WithDType};
use num_traits::Float;
use rayon::prelude::*;

use crate::backend::Backend;
use crate::host::exp::BulkExp;
use crate::host::storage::{host_float, with_data, with_optional};
use crate::vectorized;

type CResult<T> = candle_core::Result<T>;

/// The scores as rows (`[b, kv_heads, group, c]` flattened, `n` keys each) and where each finds its
/// mask row.
#[derive(Clone, Copy)]
struct RowMap {
    /// Rows of scores.
    rows: usize,
    /// Keys per row.
    n: usize,
    /// `kv_heads × group × c`: rows per batch row.
    per_batch: usize,
    c: usize,
    /// Whether the mask has a row per batch row (else one for all).
    mask_per_batch: bool,
}

impl RowMap {
    fn new(s: &Tensor, mask: Option<&Tensor>) -> CResult<Self> {
        let (b, kv_heads, group, c, n) = s.dims5()?;
        Ok(Self {
            rows: b * kv_heads * group * c,
            n,
            per_batch: kv_heads * group * c,
            c,
            mask_per_batch: mask.is_some_and(|m| m.dim(0).is_ok_and(|rows| rows > 1)),
        })
    }

    /// The mask row of score row `r`.
    fn mask_row(&self, r: usize) -> usize {
        let batch = if self.mask_per_batch {
            r / self.per_batch
        } else {
            0
        };
        batch * self.c + r % self.c
    }

    /// Row `r` of the scores `s` plus its mask row (none for an empty `mask`) into `out`.
    fn masked_row<T: WithDType + Float>(&self, out: &mut [T], s: &[T], mask: &[T], r: usize) {
        let n = out.len();
        let row = &s[r * n..(r + 1) * n];
        if mask.is_empty() {
            out.copy_from_slice(row);
            return;
        }
        let bias = &mask[self.mask_row(r) * n..][..n];
        for ((o, &x), &b) in out.iter_mut().zip(row).zip(bias) {
            *o = x + b;
        }
    }
}

/// A block's forward softmax: with `v = s + mask`, each query's `max = max(prev_max, maxⱼ vⱼ)`,
/// `p = exp(v − max)` and `sum = Σⱼ pⱼ`. Returns `(p, max, sum)`, or `None` off the CPU.
pub fn forward(
    s: &Tensor,
    mask: Option<&Tensor>,
    prev_max: Option<&Tensor>,
) -> CResult<Option<(Tensor, Tensor, Tensor)>> {
    if Backend::of(s) != Backend::Cpu || !host_float(s) {
        return Ok(None);
    }
    match s.dtype() {
        DType::F32 => forward_as::<f32>(s, mask, prev_max),
        _ => forward_as::<f64>(s, mask, prev_max),
    }
}

fn forward_as<T: WithDType + BulkExp>(
    s: &Tensor,
    mask: Option<&Tensor>,
    prev_max: Option<&Tensor>,
) -> CResult<Option<(Tensor, Tensor, Tensor)>> {
    let map = RowMap::new(s, mask)?;
    let (dims, n, rows) = (s.dims().to_vec(), map.n, map.rows);
    let (mut p, mut max, mut sum) = (
        vec![T::zero(); rows * n],
        vec![T::zero(); rows],
        vec![T::zero(); rows],
    );
    let done = with_data::<T, _>(s, |s| {
        with_optional::<T, _>(mask, |mask| {
            with_optional::<T, _>(prev_max, |prev| {
                p.par_chunks_mut(n.max(1))
                    .zip(max.par_iter_mut())
                    .zip(sum.par_iter_mut())
                    .enumerate()
                    .for_each(|(r, ((p, max), sum))| {
                        // The masked scores, then their maximum, then the exponentials, in place.
                        vectorized!(|_| {
                            map.masked_row(p, s, mask, r);
                            let mut m = prev.get(r).copied().unwrap_or(T::neg_infinity());
                            for &v in p.iter() {
                                if v > m {
                                    m = v;
                                }
                            }
                            for out in p.iter_mut() {
                                *out -= m;
                            }
                            T::exp_in_place(p);
                            let total = p.iter().fold(T::zero(), |acc, &v| acc + v);
                            *max = m;
                            *sum = total;
                        })
                    });
                Ok(())
            })
        })
    })?;
    if done.flatten().flatten().is_none() {
        return Ok(None);
    }
    let mut per_query = dims.clone();
    per_query[4] = 1;
    let device = s.device();
    Ok(Some((
        Tensor::from_vec(p, dims, device)?,
        Tensor::from_vec(max, per_query.clone(), device)?,
        Tensor::from_vec(sum, per_query, device)?,
    )))
}

/// A block's backward: `p = exp(((s + mask) − max) − log_sum)` and `dS = p ⊙ (dp − dot)`. Returns
/// `(p, dS)`, or `None` off the CPU.
pub fn backward(
    s: &Tensor,
    mask: Option<&Tensor>,
    (max, log_sum): (&Tensor, &Tensor),
    dp: &Tensor,
    dot: &Tensor,
) -> CResult<Option<(Tensor, Tensor)>> {
    if Backend::of(s) != Backend::Cpu || !host_float(s) {
        return Ok(None);
    }
    match s.dtype() {
        DType::F32 => backward_as::<f32>(s, mask, (max, log_sum), dp, dot),
        _ => backward_as::<f64>(s, mask, (max, log_sum), dp, dot),
    }
}

fn backward_as<T: WithDType + BulkExp>(
    s: &Tensor,
    mask: Option<&Tensor>,
    (max, log_sum): (&Tensor, &Tensor),
    dp: &Tensor,
    dot: &Tensor,
) -> CResult<Option<(Tensor, Tensor)>> {
    let map = RowMap::new(s, mask)?;
    let (dims, n, rows) = (s.dims().to_vec(), map.n, map.rows);
    // Per-query values: small, copied out.
    let per_query = |t: &Tensor| t.flatten_all()?.to_dtype(s.dtype())?.to_vec1::<T>();
    let (max, log_sum, dot) = (per_query(max)?, per_query(log_sum)?, per_query(dot)?);
    let (mut p, mut ds) = (vec![T::zero(); rows * n], vec![T::zero(); rows * n]);
    let done = with_data::<T, _>(s, |s| {
        with_data::<T, _>(dp, |dp| {
            with_optional::<T, _>(mask, |mask| {
                p.par_chunks_mut(n.max(1))
                    .zip(ds.par_chunks_mut(n.max(1)))
                    .enumerate()
                    .for_each(|(r, (p, ds))| {
                        let grad = &dp[r * n..(r + 1) * n];
                        // The masked scores into `p`, then probabilities and dS in one sweep.
                        vectorized!(|_| {
                            map.masked_row(p, s, mask, r);
                            let (m, l, d) = (max[r], log_sum[r], dot[r]);
                            for prob in p.iter_mut() {
                                *prob = (*prob - m) - l;
                            }
                            T::exp_in_place(p);
                            for ((ds, &prob), &g) in ds.iter_mut().zip(p.iter()).zip(grad) {
                                *ds = prob * (g - d);
                            }
                        })
                    });
                Ok(())
            })
        })
    })?;
    if done.flatten().flatten().is_none() {
        return Ok(None);
    }
    let device = s.device();
    Ok(Some((
        Tensor::from_vec(p, dims.clone(), device)?,
        Tensor::from_vec(ds, dims, device)?,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, D};
    use streambp_testkit::max_diff;

    /// Seeded values in [-3, 3) of `shape`.
    fn values(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
        let v = crate::testing::spread(shape.iter().product(), seed, (-3.0, 3.0));
        Tensor::from_vec(v, shape, &Device::Cpu)
            .and_then(|t| t.to_dtype(dtype))
            .unwrap()
    }

    /// The dtype's minimum, the masks' "no" (as the model's masks make it).
    fn lowest(dtype: DType) -> f64 {
        match dtype {
            DType::F32 => f32::MIN as f64,
            _ => f64::MIN,
        }
    }

    /// A causal-like mask `[rows, 1, 1, c, n]`: 0 or the dtype's minimum.
    fn mask(rows: usize, c: usize, n: usize, dtype: DType) -> Tensor {
        let v: Vec<f64> = (0..rows * c * n)
            .map(|i| {
                let (row, key) = ((i / n) % c, i % n);
                if key <= row + (i / (c * n)) {
                    0.0
                } else {
                    lowest(dtype)
                }
            })
            .collect();
        Tensor::from_vec(v, (rows, 1, 1, c, n), &Device::Cpu)
            .and_then(|t| t.to_dtype(dtype))
            .unwrap()
    }

    /// The fused passes against the composed ops they replace, in f64 (≤ 1e-12) and f32, with and
    /// without a mask (one for all rows, one per batch row, rows wholly masked included) and a
    /// running maximum.
    #[test]
    fn fused_passes_equal_the_composed_ops() {
        let (b, kv_heads, group, c, n) = (2, 2, 3, 5, 7);
        let shape = [b, kv_heads, group, c, n];
        for (dtype, bound) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
            let s = values(&shape, 1, dtype);
            let dp = values(&shape, 2, dtype);
            let dot = values(&[b, kv_heads, group, c, 1], 3, dtype);
            let prev = values(&[b, kv_heads, group, c, 1], 4, dtype);
            let mut masks = vec![None, Some(mask(1, c, n, dtype)), Some(mask(b, c, n, dtype))];
            // A mask that hides every key from query 0.
            let all = mask(1, c, n, dtype)
                .slice_assign(
                    &[0..1, 0..1, 0..1, 0..1, 0..n],
                    &Tensor::full(lowest(dtype), (1, 1, 1, 1, n), &Device::Cpu)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap(),
                )
                .unwrap();
            masks.push(Some(all));
            for mask in &masks {
                let v = match mask {
                    Some(m) => s.broadcast_add(m).unwrap(),
                    None => s.clone(),
                };
                for before in [None, Some(&prev)] {
                    let (p, max, sum) = forward(&s, mask.as_ref(), before).unwrap().unwrap();
                    let block_max = v.max_keepdim(D::Minus1).unwrap();
                    let want_max = match before {
                        Some(m) => m.maximum(&block_max).unwrap(),
                        None => block_max,
                    };
                    let want_p = v.broadcast_sub(&want_max).unwrap().exp().unwrap();
                    let want_sum = want_p.sum_keepdim(D::Minus1).unwrap();
                    assert_eq!(max_diff(&max, &want_max), 0.0, "{dtype:?}");
                    assert!(max_diff(&p, &want_p) <= bound, "{dtype:?}");
                    assert!(max_diff(&sum, &want_sum) <= bound * n as f64, "{dtype:?}");
                }
                let log_sum = values(&[b, kv_heads, group, c, 1], 5, dtype);
                let max = v.max_keepdim(D::Minus1).unwrap();
                let (p, ds) = backward(&s, mask.as_ref(), (&max, &log_sum), &dp, &dot)
                    .unwrap()
                    .unwrap();
                let want_p = v
                    .broadcast_sub(&max)
                    .unwrap()
                    .broadcast_sub(&log_sum)
                    .unwrap()
                    .exp()
                    .unwrap();
                let want_ds = (&want_p * dp.broadcast_sub(&dot).unwrap()).unwrap();
                assert!(max_diff(&p, &want_p) <= bound, "{dtype:?}");
                assert!(max_diff(&ds, &want_ds) <= bound, "{dtype:?}");
            }
        }
    }

    #[test]
    fn other_dtypes_keep_the_composed_path() {
        let s = values(&[1, 1, 1, 2, 3], 1, DType::BF16);
        assert!(forward(&s, None, None).unwrap().is_none());
    }
}
