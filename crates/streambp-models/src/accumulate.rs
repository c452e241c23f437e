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

use crate::cpu::{fusable, input_data};
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

impl AddProduct {
    /// `dst[m, n] += a[m, k]·b[k, n]`, strides from the layouts.
    fn run<T: WithDType>(dst: &mut [T], a: (&[T], &Layout), b: (&[T], &Layout)) -> CResult<()> {
        let (m, k) = a.1.shape().dims2()?;
        let n = b.1.shape().dims2()?.1;
        let (a_rs, a_cs) = (a.1.stride()[0] as isize, a.1.stride()[1] as isize);
        let (b_rs, b_cs) = (b.1.stride()[0] as isize, b.1.stride()[1] as isize);
        let (a_data, b_data) = (&a.0[a.1.start_offset()..], &b.0[b.1.start_offset()..]);
        let threads = rayon::current_num_threads();
        let parallelism = match threads > 1 {
            true => gemm::Parallelism::Rayon(threads),
            false => gemm::Parallelism::None,
        };
        // SAFETY: `dst` holds `m × n` contiguous elements (checked by the caller's shape test);
        // `a` and `b` are read within their layouts' extents, and candle gave `dst` as a distinct
        // mutable storage (in-place ops refuse aliased sources).
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dst.as_mut_ptr(),
                1,
                n as isize,
                true,
                a_data.as_ptr(),
                a_cs,
                a_rs,
                b_data.as_ptr(),
                b_cs,
                b_rs,
                T::from_f64(1.0),
                T::from_f64(1.0),
                false,
                false,
                false,
                parallelism,
            );
        }
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
