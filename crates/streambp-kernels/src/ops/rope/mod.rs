//! Rotary position embeddings applied to queries or keys (the `rotate_half` convention of
//! transformers), for tables of any positions, so a chunk of queries or keys (or a packed row's
//! documents) can be rotated on its own.
//!
//! [`apply_rope`] picks the implementation by [`Backend`]: on the CPU the rotation and its
//! transpose (the backward) are each one op of one pass ([`cpu`]); half precision on the CPU runs
//! them in f32. On the card (bf16, f32; head dims 64, 128, 256) each is one Triton kernel computing
//! what the CPU's does (`triton/rope.py`, `cuda.rs`). [`composed`] (seven tensor ops, each with a
//! buffer, and their backward) is the reference and every other device's path.

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod compiled;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod cuda_table;

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor, D};

use crate::backend::Backend;
use crate::host::storage::input_data;
use crate::ops::cast::through_f32;

type CResult<T> = candle_core::Result<T>;

/// `x` of shape `[batch, heads, len, head_dim]` rotated by tables `cos`, `sin` of shape
/// `[len, head_dim]` (or `[batch, 1, len, head_dim]`, one table per row):
/// `x·cos + rotate_half(x)·sin`. Differentiable in `x` (candle's fused rope records no backward).
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> CResult<Tensor> {
    let (_, heads, len, head_dim) = x.dims4()?;
    let rotation = cpu::Rotation {
        head_dim,
        rows_per_batch: heads * len,
        len,
        per_batch: cos.rank() == 4,
    };
    match Backend::of(x) {
        Backend::Cpu => {
            let tables_like_x = cos.dtype() == x.dtype() && sin.dtype() == x.dtype();
            if matches!(x.dtype(), DType::F32 | DType::F64) && head_dim > 0 && tables_like_x {
                let (cos, sin) = (cos.detach().contiguous()?, sin.detach().contiguous()?);
                return x.contiguous()?.apply_op3(&cos, &sin, Forward(rotation));
            }
            let in_f32 = |[x, cos, sin]: [Tensor; 3]| apply_rope(&x, &cos, &sin);
            match through_f32([x, &cos.detach(), &sin.detach()], in_f32)? {
                Some(out) => Ok(out),
                None => composed(x, cos, sin),
            }
        }
        Backend::Cuda => match on_card(x, cos, sin, rotation)? {
            Some(out) => Ok(out),
            None => composed(x, cos, sin),
        },
        Backend::Composed => composed(x, cos, sin),
    }
}

/// [`apply_rope`] by the card's kernel, or `None` where it does not apply (another device, dtype,
/// card or head dim, tables in another dtype).
fn on_card(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    rotation: cpu::Rotation,
) -> CResult<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    {
        // The tables as the kernel reads them: one row per position (per batch row when packed).
        let (b, len, hd) = (x.dim(0)?, rotation.len, rotation.head_dim);
        let rows = match rotation.per_batch {
            true => vec![b, 1, len, hd],
            false => vec![len, hd],
        };
        let tables = [cos, sin]
            .iter()
            .all(|t| t.dtype() == x.dtype() && t.dims() == rows.as_slice());
        if tables && x.elem_count() > 0 && cuda::takes(x, rotation.head_dim)? {
            let aligned = crate::triton::contiguous_for_kernels;
            let (cos, sin) = (aligned(&cos.detach())?, aligned(&sin.detach())?);
            return aligned(x)?
                .apply_op3(&cos, &sin, Forward(rotation))
                .map(Some);
        }
    }
    let _ = (x, cos, sin, rotation);
    Ok(None)
}

/// [`apply_rope`] from tensor ops (every device and dtype; autograd differentiates it).
pub fn composed(x: &Tensor, cos: &Tensor, sin: &Tensor) -> CResult<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?
}

/// [`cpu::Rotation::rotate`] of the first input by the tables (the other two), forward or by
/// the transpose, in the inputs' dtype.
fn rotate_storage(
    rotation: &cpu::Rotation,
    inverse: bool,
    (xs, xl): (&CpuStorage, &Layout),
    (cs, cl): (&CpuStorage, &Layout),
    (ss, sl): (&CpuStorage, &Layout),
) -> CResult<(CpuStorage, Shape)> {
    let y = match (xs, cs, ss) {
        (CpuStorage::F32(_), CpuStorage::F32(_), CpuStorage::F32(_)) => {
            let tables = (input_data(cs, cl)?, input_data(ss, sl)?);
            CpuStorage::F32(rotation.rotate::<f32>(input_data(xs, xl)?, tables, inverse)?)
        }
        (CpuStorage::F64(_), CpuStorage::F64(_), CpuStorage::F64(_)) => {
            let tables = (input_data(cs, cl)?, input_data(ss, sl)?);
            CpuStorage::F64(rotation.rotate::<f64>(input_data(xs, xl)?, tables, inverse)?)
        }
        _ => candle_core::bail!("rope: x and tables not all f32 or f64"),
    };
    Ok((y, xl.shape().clone()))
}

/// The rotation of `x` by the tables `cos`, `sin`.
struct Forward(cpu::Rotation);

impl CustomOp3 for Forward {
    fn name(&self) -> &'static str {
        "streambp-rope"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        cs: &CpuStorage,
        cl: &Layout,
        ss: &CpuStorage,
        sl: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        rotate_storage(&self.0, false, (xs, xl), (cs, cl), (ss, sl))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        cs: &candle_core::CudaStorage,
        cl: &Layout,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        cuda::rotate(&self.0, false, (xs, xl), (cs, cl), (ss, sl))
    }

    /// [`Backward`], on the backend of the forward's inputs; the tables are constants.
    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = crate::triton::contiguous_for_kernels(g)?;
        let dx = g.apply_op3_no_bwd(cos, sin, &Backward(self.0))?;
        Ok((Some(dx), None, None))
    }
}

/// The transpose of the rotation, applied to the output's gradient: the gradient of `x`.
struct Backward(cpu::Rotation);

impl CustomOp3 for Backward {
    fn name(&self) -> &'static str {
        "streambp-rope-backward"
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        cs: &CpuStorage,
        cl: &Layout,
        ss: &CpuStorage,
        sl: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        rotate_storage(&self.0, true, (gs, gl), (cs, cl), (ss, sl))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
        cs: &candle_core::CudaStorage,
        cl: &Layout,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        cuda::rotate(&self.0, true, (gs, gl), (cs, cl), (ss, sl))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use streambp_testkit::{grads, max_diff};

    /// `(cos, sin)` `[n, hd]` of `positions` at transformers' default frequencies.
    fn tables(positions: &[f64], hd: usize) -> (Tensor, Tensor) {
        let angles: Vec<f64> = positions
            .iter()
            .flat_map(|&p| {
                (0..hd).map(move |i| {
                    let f = 1.0 / 10_000f64.powf((2 * (i % (hd / 2))) as f64 / hd as f64);
                    p * f
                })
            })
            .collect();
        let table = |f: fn(f64) -> f64| {
            let values = angles.iter().map(|&a| f(a)).collect::<Vec<_>>();
            Tensor::from_vec(values, (positions.len(), hd), &Device::Cpu).unwrap()
        };
        (table(f64::cos), table(f64::sin))
    }

    /// The CPU ops and the composed ones: equal outputs and input gradients in f64, with one table
    /// for all rows and with one table per batch row (packing), on a strided input.
    #[test]
    fn the_cpu_rope_matches_the_composed_one_in_f64() {
        let dev = Device::Cpu;
        let (b, heads, len, hd) = (2, 3, 5, 8);
        let shared = tables(&(0..len).map(|p| p as f64).collect::<Vec<_>>(), hd);
        let positions: Vec<f64> = (0..b * len).map(|i| ((i * 7) % 11) as f64).collect();
        let (cos, sin) = tables(&positions, hd);
        let per_row = (
            cos.reshape((b, 1, len, hd)).unwrap(),
            sin.reshape((b, 1, len, hd)).unwrap(),
        );
        for (cos, sin) in [shared, per_row] {
            let x = Var::from_tensor(
                &Tensor::randn(0f64, 1.0, (b, len, heads, hd), &dev)
                    .unwrap()
                    .transpose(1, 2)
                    .unwrap(),
            )
            .unwrap();
            let g = Tensor::randn(0f64, 1.0, (b, heads, len, hd), &dev).unwrap();
            let on_cpu = apply_rope(x.as_tensor(), &cos, &sin).unwrap();
            let reference = composed(x.as_tensor(), &cos, &sin).unwrap();
            assert!(max_diff(&on_cpu, &reference) < 1e-12, "rank {}", cos.rank());
            let (cpu_dx, composed_dx) = (grads(&on_cpu, &g, &[&x]), grads(&reference, &g, &[&x]));
            assert!(
                max_diff(&cpu_dx[0], &composed_dx[0]) < 1e-12,
                "rank {}",
                cos.rank()
            );
        }
    }
}
