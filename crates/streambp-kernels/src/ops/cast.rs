//! Casts between f32 and the half-precision dtypes, differentiable, and tensors rounded to a
//! dtype's values in place. On the host each is one pass split over the threads (candle's
//! `to_dtype` runs on one); elsewhere `to_dtype` ([`cast`]). [`through_f32`] runs an f32/f64 pass on
//! bf16 tensors.

use candle_core::{DType, Tensor};

use crate::host::cast::{bf16_value, widened_bf16, CAST_PER_TASK};
use crate::host::storage::{input_data, with_data};
use crate::vectorized;

type CResult<T> = candle_core::Result<T>;

/// Runs `op`, a pass written for f32/f64 ([`crate::host::storage::host_float`]), on bf16 CPU tensors: their f32 copies in
/// (inputs already in f32 as they are), the result rounded back to bf16 once (the casts recorded in
/// the graph). Composed in bf16 the same computation makes a buffer and a rounding per step, forward
/// and backward. `None`, with nothing run, unless the first input is bf16 and every input bf16 or
/// f32, all on the CPU.
pub fn through_f32<const N: usize, E: From<candle_core::Error>>(
    inputs: [&Tensor; N],
    op: impl FnOnce([Tensor; N]) -> Result<Tensor, E>,
) -> Result<Option<Tensor>, E> {
    let applies = inputs.first().is_some_and(|t| t.dtype() == DType::BF16)
        && inputs
            .iter()
            .all(|t| t.device().is_cpu() && matches!(t.dtype(), DType::BF16 | DType::F32));
    if !applies {
        return Ok(None);
    }
    let wide: Vec<Tensor> = inputs
        .iter()
        .map(|t| cast(t, DType::F32))
        .collect::<CResult<_>>()?;
    let wide: [Tensor; N] = wide
        .try_into()
        .map_err(|_| candle_core::Error::Msg("through_f32: inputs lost".into()))?;
    Ok(Some(cast(&op(wide)?, DType::BF16)?))
}

/// `t` in `dtype`, differentiable: between bf16 and f32 on the CPU one pass split over rayon's
/// threads (candle's `to_dtype` runs on one), rounding to nearest even as candle does; any other
/// conversion by `to_dtype`.
pub fn cast(t: &Tensor, dtype: DType) -> CResult<Tensor> {
    match (t.dtype(), dtype, t.device().is_cpu()) {
        (DType::BF16, DType::F32, true) | (DType::F32, DType::BF16, true) => {
            t.contiguous()?.apply_op1(Cast(dtype))
        }
        _ => t.to_dtype(dtype),
    }
}

/// The op of [`cast`]: its target dtype.
struct Cast(DType);

impl candle_core::CustomOp1 for Cast {
    fn name(&self) -> &'static str {
        "streambp-cast"
    }

    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> CResult<(candle_core::CpuStorage, candle_core::Shape)> {
        use half::bf16;
        use rayon::prelude::*;
        let out = match (s, self.0) {
            (candle_core::CpuStorage::BF16(_), DType::F32) => {
                candle_core::CpuStorage::F32(widened_bf16(input_data::<bf16>(s, l)?))
            }
            (candle_core::CpuStorage::F32(_), DType::BF16) => {
                let x = input_data::<f32>(s, l)?;
                let mut y = vec![bf16::ZERO; x.len()];
                y.par_chunks_mut(CAST_PER_TASK)
                    .zip(x.par_chunks(CAST_PER_TASK))
                    .for_each(|(y, x)| {
                        vectorized!(|_| {
                            y.iter_mut()
                                .zip(x)
                                .for_each(|(y, &x)| *y = bf16::from_f32(x))
                        })
                    });
                candle_core::CpuStorage::BF16(y)
            }
            (_, to) => candle_core::bail!("cast: not between bf16 and f32 (to {to:?})"),
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        cast(grad, x.dtype()).map(Some)
    }
}

/// The values of a half-precision (bf16, f16) CPU tensor in f32, row-major: exact, f32 holds every
/// one. (For a buffer of one's own: candle's `to_dtype` runs on one thread and a variable made from
/// its result would be a second copy.)
pub fn widened_values(t: &Tensor) -> CResult<Vec<f32>> {
    let values = match t.dtype() {
        DType::BF16 => with_data::<half::bf16, _>(t, |x| Ok(widened_bf16(x)))?,
        DType::F16 => with_data::<half::f16, _>(t, |x| Ok(x.iter().map(|v| v.to_f32()).collect()))?,
        other => candle_core::bail!("widen: a {other:?} tensor, not half precision"),
    };
    values.ok_or_else(|| candle_core::Error::Msg("widen: a tensor off the CPU".into()))
}

/// Rounds `t` (f32, contiguous, on the CPU) in place to the nearest values of `dtype` (bf16 or f16),
/// as a cast there and back would: what a half-precision layer computed in f32 does where the
/// model's own arithmetic rounds (`streambp_models`' `DecoderLayer::computed_in_f32`). It records
/// nothing: callers round only a fresh output of an op whose backward does not read that output.
pub fn round_in_place(t: &Tensor, dtype: DType) -> CResult<()> {
    t.inplace_op1(&RoundTo(dtype))
}

/// The op of [`round_in_place`]: the dtype whose values to round to.
struct RoundTo(DType);

impl candle_core::InplaceOp1 for RoundTo {
    fn name(&self) -> &'static str {
        "streambp-round"
    }

    fn cpu_fwd(&self, s: &mut candle_core::CpuStorage, l: &candle_core::Layout) -> CResult<()> {
        use rayon::prelude::*;
        let (start, end) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("round: tensor not contiguous".into()))?;
        let candle_core::CpuStorage::F32(data) = s else {
            candle_core::bail!("round: not an f32 tensor");
        };
        let tasks = data[start..end].par_chunks_mut(CAST_PER_TASK);
        match self.0 {
            DType::BF16 => {
                tasks.for_each(|x| vectorized!(|_| x.iter_mut().for_each(|x| *x = bf16_value(*x))))
            }
            DType::F16 => tasks.for_each(|x| {
                x.iter_mut()
                    .for_each(|x| *x = half::f16::from_f32(*x).to_f32())
            }),
            other => candle_core::bail!("round: to {other:?}, not a half-precision dtype"),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parallel cast gives candle's `to_dtype` values both ways (rounding to nearest even: ties,
    /// infinities and NaN included, tensors longer than one task), and its backward casts the
    /// gradient back to the input's dtype.
    #[test]
    fn casts_equal_to_dtype_and_differentiate() {
        use half::bf16;
        let step = 2f32.powi(-8);
        let mut values: Vec<f32> = (0..40_000)
            .map(|i| (i as f32 * 0.37).sin() * 300.0)
            .collect();
        values.extend([
            1.0 + step,
            1.0 + 3.0 * step,
            f32::INFINITY,
            f32::MIN,
            -0.0,
            f32::NAN,
        ]);
        let t = Tensor::from_vec(values.clone(), values.len(), &candle_core::Device::Cpu).unwrap();
        let bits = |t: &Tensor| -> Vec<u16> {
            let v = t.to_vec1::<bf16>().unwrap();
            v.iter()
                .map(|x| if x.is_nan() { 0x7fc0 } else { x.to_bits() })
                .collect()
        };
        let narrow = cast(&t, DType::BF16).unwrap();
        assert_eq!(bits(&narrow), bits(&t.to_dtype(DType::BF16).unwrap()));
        let wide = cast(&narrow, DType::F32).unwrap().to_vec1::<f32>().unwrap();
        let want = narrow
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        for (got, want) in wide.iter().zip(&want) {
            assert!(
                got == want || (got.is_nan() && want.is_nan()),
                "{got} vs {want}"
            );
        }

        let x = candle_core::Var::from_tensor(&t.narrow(0, 0, 1000).unwrap()).unwrap();
        let y = cast(&cast(x.as_tensor(), DType::BF16).unwrap(), DType::F32).unwrap();
        let grads = (y * 3.0).unwrap().sum_all().unwrap().backward().unwrap();
        let g = grads.get(x.as_tensor()).unwrap();
        assert_eq!(g.dtype(), DType::F32);
        assert!(g.to_vec1::<f32>().unwrap().iter().all(|&g| g == 3.0));
    }
}
