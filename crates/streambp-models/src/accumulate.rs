//! Gradient accumulators updated in place on the CPU.
//!
//! Summing a gradient over chunks as `acc = acc + g` allocates a fresh parameter-sized buffer per
//! chunk and, for a weight's share `aᵀ·b`, another for the product: at T = 2048 the LM head alone
//! went through 42 buffers of 16 MiB a step, each page-faulted in and zeroed. Here `acc += g` is one
//! pass over `acc`, and `acc += a·b` is one matrix product that adds into `acc` (gemm, the kernel
//! candle's own products run, told to read the destination). Both are exact sums, in a fixed order,
//! so a step's gradients do not depend on the thread count.
//!
//! CPU, f32 and f64, accumulators their owner alone holds (contiguous, sharing no storage): the
//! engine's gradient sink, and a trained projection's backward adding its weight's gradient straight
//! into the sink's accumulator ([`crate::linear::Linear::grad_into`]). Elsewhere the functions answer
//! `false` and the caller keeps the tensor-op sum (which CUDA runs).

use crate::cpu::{fusable, gemm_into, gemm_parallelism, input_data};
use candle_core::{CpuStorage, InplaceOp2, InplaceOp3, Layout, Tensor, WithDType};
use rayon::prelude::*;

type CResult<T> = candle_core::Result<T>;

/// Elements per rayon task of the in-place sum.
const PER_TASK: usize = 1 << 14;

/// Whether `acc` can be added into in place with operands like `operands`.
fn in_place(acc: &Tensor, operands: &[&Tensor]) -> bool {
    fusable(acc)
        && acc.is_contiguous()
        && operands
            .iter()
            .all(|t| t.device().is_cpu() && t.dtype() == acc.dtype())
}

/// `acc += x` in place (same shape); `false`, with nothing done, where that does not apply.
pub fn add(acc: &Tensor, x: &Tensor) -> CResult<bool> {
    if !in_place(acc, &[x]) || acc.shape() != x.shape() {
        return Ok(false);
    }
    acc.inplace_op2(&x.contiguous()?, &AddInto)?;
    Ok(true)
}

/// `acc += a·b` in place for `a` `[m, k]`, `b` `[k, n]` (any strides) and `acc` `[m, n]`; `false`,
/// with nothing done, where that does not apply.
pub fn add_product(acc: &Tensor, a: &Tensor, b: &Tensor) -> CResult<bool> {
    let ((m, k), (k2, n)) = (a.dims2()?, b.dims2()?);
    if !in_place(acc, &[a, b]) || k != k2 || acc.dims() != [m, n] {
        return Ok(false);
    }
    acc.inplace_op3(a, b, &AddProduct)?;
    Ok(true)
}

/// The accumulator's element range in its storage.
fn range(l: &Layout) -> CResult<std::ops::Range<usize>> {
    let (start, end) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("accumulator not contiguous".into()))?;
    Ok(start..end)
}

struct AddInto;

impl AddInto {
    fn add<T: WithDType + std::ops::AddAssign>(acc: &mut [T], x: &[T]) {
        acc.par_chunks_mut(PER_TASK)
            .zip(x.par_chunks(PER_TASK))
            .for_each(|(acc, x)| {
                for (a, &x) in acc.iter_mut().zip(x) {
                    *a += x;
                }
            });
    }
}

impl InplaceOp2 for AddInto {
    fn name(&self) -> &'static str {
        "streambp-add-into"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<()> {
        let r = range(l1)?;
        match s1 {
            CpuStorage::F32(acc) => Self::add(&mut acc[r], input_data::<f32>(s2, l2)?),
            CpuStorage::F64(acc) => Self::add(&mut acc[r], input_data::<f64>(s2, l2)?),
            _ => candle_core::bail!("in-place sum: not f32 or f64"),
        }
        Ok(())
    }
}

struct AddProduct;

/// A matrix operand from its first element, with its row and column strides.
fn strided<'a, T>((data, l): (&'a [T], &Layout)) -> (&'a [T], usize, usize) {
    let s = l.stride();
    (&data[l.start_offset()..], s[0], s[1])
}

impl AddProduct {
    /// `dst[m, n] += a[m, k]·b[k, n]`, strides from the layouts.
    fn run<T: WithDType>(dst: &mut [T], a: (&[T], &Layout), b: (&[T], &Layout)) -> CResult<()> {
        let (m, k) = a.1.shape().dims2()?;
        let n = b.1.shape().dims2()?.1;
        // `dst` holds `m × n` contiguous elements (the caller's shape test), distinct from `a` and
        // `b` (candle's in-place ops refuse aliased sources).
        gemm_into(
            dst,
            (m, n, k),
            true,
            strided(a),
            strided(b),
            gemm_parallelism(),
        );
        Ok(())
    }
}

impl InplaceOp3 for AddProduct {
    fn name(&self) -> &'static str {
        "streambp-add-product"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<()> {
        let r = range(l1)?;
        match s1 {
            CpuStorage::F32(acc) => Self::run(
                &mut acc[r],
                (f32::cpu_storage_as_slice(s2)?, l2),
                (f32::cpu_storage_as_slice(s3)?, l3),
            ),
            CpuStorage::F64(acc) => Self::run(
                &mut acc[r],
                (f64::cpu_storage_as_slice(s2)?, l2),
                (f64::cpu_storage_as_slice(s3)?, l3),
            ),
            _ => candle_core::bail!("in-place product: not f32 or f64"),
        }
    }
}
