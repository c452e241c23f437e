//! The gradients' global norm and their scaling, for clipping: a tensor's `Σ x²` in f64 and a
//! tensor times a scalar. On the host each is one pass split over the threads, in an order that
//! does not depend on their number; elsewhere the composed tensor ops.

use candle_core::{DType, Tensor, WithDType};

use crate::host::cast::{widen, CAST_PER_TASK};
use crate::host::reduce::LANES;
use crate::host::storage::with_data;
use crate::vectorized;

type CResult<T> = candle_core::Result<T>;

/// Elements per rayon task of [`sum_of_squares`]: fixed, so the sum's order is too.
const SQUARES_PER_TASK: usize = 1 << 16;

/// `Σ x²` over a float tensor on the CPU, in f64 (a square of a bf16, f16 or f32 value is exact
/// there), in [`LANES`] interleaved partial sums per task of [`SQUARES_PER_TASK`] elements added in
/// order: the same bits whatever the thread count (candle's `to_dtype(F64)` widens a whole
/// half-precision tensor on one thread first). Off the CPU the composed ops in f64; an error for
/// an integer tensor.
pub fn sum_of_squares(t: &Tensor) -> CResult<f64> {
    if let Some(sum) = on_host(t)? {
        return Ok(sum);
    }
    if !t.dtype().is_float() {
        candle_core::bail!("sum of squares: a {:?} tensor, not a float one", t.dtype());
    }
    t.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>()
}

/// [`sum_of_squares`] on the host; `None` off the CPU or for an integer tensor.
fn on_host(t: &Tensor) -> CResult<Option<f64>> {
    fn sum<T: WithDType>(t: &Tensor, to_f64: impl Fn(T) -> f64 + Sync) -> CResult<Option<f64>> {
        use rayon::prelude::*;
        with_data::<T, _>(t, |xs| {
            let tasks: Vec<f64> = xs
                .par_chunks(SQUARES_PER_TASK)
                .map(|xs| {
                    vectorized!(|_| {
                        let mut lanes = [0f64; LANES];
                        let chunks = xs.chunks_exact(LANES);
                        let rest = chunks.remainder();
                        for chunk in chunks {
                            for (s, &x) in lanes.iter_mut().zip(chunk) {
                                let x = to_f64(x);
                                *s += x * x;
                            }
                        }
                        let s: f64 = lanes.iter().sum();
                        rest.iter()
                            .map(|&x| to_f64(x) * to_f64(x))
                            .fold(s, |s, x| s + x)
                    })
                })
                .collect();
            Ok(tasks.iter().sum())
        })
    }
    match t.dtype() {
        DType::F64 => sum::<f64>(t, |x| x),
        DType::F32 => sum::<f32>(t, f64::from),
        DType::BF16 => sum::<half::bf16>(t, |x| f64::from(widen(x))),
        DType::F16 => sum::<half::f16>(t, |x| x.to_f64()),
        _ => Ok(None),
    }
}

/// `t · by`: for half precision on the CPU one pass over rayon's threads, each product formed in
/// f32 (`by` rounded to f32, not to the tensor's dtype) and rounded once, as PyTorch multiplies a
/// bf16 tensor by an f32 scalar tensor (gradient clipping); candle's `affine` (any other tensor)
/// would round `by` to bf16 and run on one thread.
pub fn scaled(t: &Tensor, by: f64) -> CResult<Tensor> {
    use rayon::prelude::*;
    let by32 = by as f32;
    let out = match t.dtype() {
        DType::BF16 => with_data::<half::bf16, _>(t, |xs| {
            let mut ys = vec![half::bf16::ZERO; xs.len()];
            ys.par_chunks_mut(CAST_PER_TASK)
                .zip(xs.par_chunks(CAST_PER_TASK))
                .for_each(|(ys, xs)| {
                    vectorized!(|_| ys
                        .iter_mut()
                        .zip(xs)
                        .for_each(|(y, &x)| *y = half::bf16::from_f32(widen(x) * by32)))
                });
            Tensor::from_vec(ys, t.shape(), t.device())
        })?,
        DType::F16 => with_data::<half::f16, _>(t, |xs| {
            let ys: Vec<half::f16> = xs
                .par_iter()
                .map(|&x| half::f16::from_f32(x.to_f32() * by32))
                .collect();
            Tensor::from_vec(ys, t.shape(), t.device())
        })?,
        _ => None,
    };
    match out {
        Some(out) => Ok(out),
        None => t.affine(by, 0.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Σ x²` in every float dtype and at lengths around the lanes and the tasks (empty, one lane,
    /// a remainder, several tasks), against candle's f64 sum of the widened values: within f64's
    /// rounding of the sum; an integer tensor is an error.
    #[test]
    fn sums_of_squares_equal_candles() {
        let dev = candle_core::Device::Cpu;
        for len in [0, 1, 7, 8, 9, 3 * SQUARES_PER_TASK + 5] {
            let values: Vec<f64> = (0..len).map(|i| ((i as f64) * 0.37).sin() * 3.0).collect();
            for dtype in [DType::F64, DType::F32, DType::BF16, DType::F16] {
                let t = Tensor::from_vec(values.clone(), len, &dev).unwrap();
                let t = t.to_dtype(dtype).unwrap();
                let want = t
                    .to_dtype(DType::F64)
                    .unwrap()
                    .sqr()
                    .unwrap()
                    .sum_all()
                    .unwrap();
                let want = want.to_scalar::<f64>().unwrap();
                let got = sum_of_squares(&t).unwrap();
                let tol = 1e-15 * want.abs() * (len as f64).sqrt().max(1.0);
                assert!(
                    (got - want).abs() <= tol,
                    "{dtype:?} {len}: {got} against {want}"
                );
            }
        }
        let ids = Tensor::new(&[1u32, 2], &dev).unwrap();
        assert!(sum_of_squares(&ids).is_err());
    }

    /// Half precision scaled in f32 and rounded once (what PyTorch's `g * coef` gives for an f32
    /// scalar tensor `coef`), over several tasks; f32 and f64 exactly as candle scales them.
    #[test]
    fn scaling_rounds_once() {
        let dev = candle_core::Device::Cpu;
        let len = 2 * CAST_PER_TASK + 3;
        let values: Vec<f32> = (0..len).map(|i| ((i as f32) * 0.37).sin() * 3.0).collect();
        let by = 0.123_456_789_f64;
        for dtype in [DType::BF16, DType::F16] {
            let t = Tensor::new(values.as_slice(), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let got = scaled(&t, by).unwrap();
            assert_eq!(got.dtype(), dtype);
            let wide = t.to_dtype(DType::F32).unwrap();
            let want = (wide * f64::from(by as f32))
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let (got, want) = (
                got.to_dtype(DType::F32).unwrap(),
                want.to_dtype(DType::F32).unwrap(),
            );
            let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0, "{dtype:?}");
        }
        for dtype in [DType::F32, DType::F64] {
            let t = Tensor::new(values.as_slice(), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let diff = (scaled(&t, by).unwrap() - (&t * by).unwrap()).unwrap();
            let diff = diff
                .abs()
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .max_all()
                .unwrap();
            assert_eq!(diff.to_scalar::<f64>().unwrap(), 0.0, "{dtype:?}");
        }
    }
}
