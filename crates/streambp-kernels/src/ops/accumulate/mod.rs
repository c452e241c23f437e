//! Gradient accumulators updated in place.
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
//! into the sink's accumulator (`streambp_models`' `Linear::grad_into`). On the card, [`add`] and
//! [`add_rows`] into f32 accumulators from f32 or bf16 gradients, widened on the way (Triton
//! kernels: `triton/accumulate.py`, `cuda.rs`), so neither a sum's buffer nor an f32 copy of a bf16
//! gradient is made; the rows one after another, as the host adds them, without atomics; and
//! [`add_product`] by cuBLAS's product with β = 1, so a chunk's weight gradient makes no buffer of
//! its own. Elsewhere the functions answer `false` and the caller keeps the tensor-op sum.

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod compiled;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod cuda_table;

use crate::backend::Backend;
use crate::host::half_product::{self, Destination};
use crate::host::products::{product_into, strided};
use crate::host::skinny::SumType;
use crate::host::storage::{host_float, input_data};
use crate::vectorized;
use candle_core::{CpuStorage, DType, InplaceOp2, InplaceOp3, Layout, Tensor, WithDType};
use rayon::prelude::*;

type CResult<T> = candle_core::Result<T>;

/// Elements per rayon task of the in-place sum.
const PER_TASK: usize = 1 << 14;

/// Whether `acc` can be added into in place with operands like `operands`.
fn in_place(acc: &Tensor, operands: &[&Tensor]) -> bool {
    host_float(acc)
        && acc.is_contiguous()
        && operands
            .iter()
            .all(|t| t.device().is_cpu() && t.dtype() == acc.dtype())
}

/// Whether `x` is a half-precision gradient for the f32 accumulator `acc`, widened before it is
/// added.
fn widened(acc: &Tensor, x: &Tensor) -> bool {
    acc.dtype() == DType::F32 && matches!(x.dtype(), DType::BF16 | DType::F16)
}

/// `acc += x` in place (same shape; a half-precision `x` into an f32 `acc` widened); `false`, with
/// nothing done, where that does not apply.
pub fn add(acc: &Tensor, x: &Tensor) -> CResult<bool> {
    if acc.shape() != x.shape() {
        return Ok(false);
    }
    match Backend::of(acc) {
        Backend::Cpu if widened(acc, x) && x.device().is_cpu() && acc.is_contiguous() => {
            add(acc, &crate::ops::cast::cast(x, DType::F32)?)
        }
        Backend::Cpu if in_place(acc, &[x]) => {
            acc.inplace_op2(&x.contiguous()?, &AddInto)?;
            Ok(true)
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda => cuda::add(acc, x),
        _ => Ok(false),
    }
}

/// Whether [`add_product`] adds products of operands like `a` into an accumulator in place on their
/// device (f32/f64, and bf16 into f32, on the host; f32 and bf16 into f32 on the card), so that an
/// accumulator made for it ahead of the first product is used.
pub fn adds_products_in_place(a: &Tensor) -> bool {
    match Backend::of(a) {
        Backend::Cpu => matches!(a.dtype(), DType::F32 | DType::F64 | DType::BF16),
        Backend::Cuda => matches!(a.dtype(), DType::F32 | DType::BF16),
        Backend::Composed => false,
    }
}

/// Whether [`add_rows`] adds rows like `rows` into an accumulator shaped as `table` in place on its
/// device (any float on the host; on the card f32 and bf16 rows a multiple of 16 wide, where the
/// kernel is compiled for it), so that an accumulator made for it is used.
pub fn adds_rows_in_place(table: &Tensor, rows: &Tensor) -> CResult<bool> {
    Ok(match Backend::of(table) {
        Backend::Cpu => rows.dtype().is_float(),
        #[cfg(feature = "cuda")]
        Backend::Cuda => cuda::adds_rows(table, rows)?,
        _ => false,
    })
}

/// `acc += a·b` in place for `a` `[m, k]`, `b` `[k, n]` (any strides) and `acc` `[m, n]`; `false`,
/// with nothing done, where that does not apply. bf16 operands add into an f32 accumulator
/// (summed in f32, unrounded: on the host [`crate::host::half_product`], on the card cuBLAS with
/// β = 1, f32 and bf16 operands whose layout it reads).
pub fn add_product(acc: &Tensor, a: &Tensor, b: &Tensor) -> CResult<bool> {
    let ((m, k), (k2, n)) = (a.dims2()?, b.dims2()?);
    #[cfg(feature = "cuda")]
    if Backend::of(acc) == Backend::Cuda {
        return match k == k2 && acc.dims() == [m, n] {
            true => cuda::add_product(acc, a, b),
            false => Ok(false),
        };
    }
    let half_into_f32 = acc.dtype() == DType::F32
        && acc.is_contiguous()
        && [a, b]
            .iter()
            .all(|t| t.device().is_cpu() && t.dtype() == DType::BF16);
    if !(in_place(acc, &[a, b]) || half_into_f32) || k != k2 || acc.dims() != [m, n] {
        return Ok(false);
    }
    acc.inplace_op3(a, b, &AddProduct)?;
    Ok(true)
}

/// `acc += a·b` in place for `a` `[m, k]` f32 holding bf16 values (see
/// [`half_product::Element`]), `b` `[k, n]` bf16 (any strides) and `acc` `[m, n]` f32 on the host:
/// [`add_product`] of `a` cast to bf16, without that copy (the caller rounds `a` first, as for
/// [`crate::ops::matmul::matmul_of_bf16_values`]); `false`, with nothing done, where that does not apply.
pub fn add_product_of_bf16_values(acc: &Tensor, a: &Tensor, b: &Tensor) -> CResult<bool> {
    let ((m, k), (k2, n)) = (a.dims2()?, b.dims2()?);
    let applies = acc.dtype() == DType::F32
        && acc.is_contiguous()
        && [acc, a, b].iter().all(|t| t.device().is_cpu())
        && (a.dtype(), b.dtype()) == (DType::F32, DType::BF16);
    if !applies || k != k2 || acc.dims() != [m, n] {
        return Ok(false);
    }
    acc.inplace_op3(a, b, &AddProduct)?;
    Ok(true)
}

/// `acc[ids[i]] += rows[i]` in place, row after row in order (as candle's `index_add` sums), for
/// `acc` `[V, d]`, `ids` `[n]` (any integer dtype) and `rows` `[n, d]` (half-precision rows into an
/// f32 `acc` widened); `false`, with nothing done, where that does not apply. On the host an id outside
/// `0..V` is an error; the card skips it (reading the ids back would stop the card).
pub fn add_rows(acc: &Tensor, ids: &Tensor, rows: &Tensor) -> CResult<bool> {
    let ((vocab, d), (n, d2)) = (acc.dims2()?, rows.dims2()?);
    if d != d2 || ids.dims1()? != n {
        return Ok(false);
    }
    match Backend::of(acc) {
        Backend::Cpu if widened(acc, rows) && rows.device().is_cpu() && acc.is_contiguous() => {
            return add_rows(acc, ids, &crate::ops::cast::cast(rows, DType::F32)?);
        }
        Backend::Cpu if in_place(acc, &[rows]) => {}
        #[cfg(feature = "cuda")]
        Backend::Cuda => return cuda::add_rows(acc, ids, rows),
        _ => return Ok(false),
    }
    let ids = ids.to_dtype(candle_core::DType::I64)?.to_vec1::<i64>()?;
    if let Some(bad) = ids.iter().find(|&&id| id < 0 || id as usize >= vocab) {
        candle_core::bail!("embedding gradient: token id {bad} outside the table's {vocab} rows");
    }
    acc.inplace_op2(&rows.contiguous()?, &AddRows { ids })?;
    Ok(true)
}

/// The accumulator's element range in its storage.
fn range(l: &Layout) -> CResult<std::ops::Range<usize>> {
    let (start, end) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("accumulator not contiguous".into()))?;
    Ok(start..end)
}

/// An addition into an accumulator's elements from one operand, in either float type: the in-place
/// ops below differ only in this.
trait AddKernel {
    fn add<T: WithDType + std::ops::AddAssign>(&self, acc: &mut [T], x: &[T]);
}

/// [`InplaceOp2::cpu_fwd`] of an [`AddKernel`] op: the accumulator's elements and the operand's data
/// in their dtype.
fn add_kernel_fwd(
    op: &(impl AddKernel + InplaceOp2),
    s1: &mut CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> CResult<()> {
    let r = range(l1)?;
    match s1 {
        CpuStorage::F32(acc) => op.add(&mut acc[r], input_data::<f32>(s2, l2)?),
        CpuStorage::F64(acc) => op.add(&mut acc[r], input_data::<f64>(s2, l2)?),
        _ => candle_core::bail!("{}: not f32 or f64", op.name()),
    }
    Ok(())
}

struct AddInto;

impl AddKernel for AddInto {
    fn add<T: WithDType + std::ops::AddAssign>(&self, acc: &mut [T], x: &[T]) {
        acc.par_chunks_mut(PER_TASK)
            .zip(x.par_chunks(PER_TASK))
            .for_each(|(acc, x)| {
                vectorized!(|_| acc.iter_mut().zip(x).for_each(|(a, &x)| *a += x))
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
        add_kernel_fwd(self, s1, l1, s2, l2)
    }
}

struct AddRows {
    ids: Vec<i64>,
}

impl AddKernel for AddRows {
    fn add<T: WithDType + std::ops::AddAssign>(&self, acc: &mut [T], rows: &[T]) {
        let d = rows.len() / self.ids.len().max(1);
        for (&id, row) in self.ids.iter().zip(rows.chunks_exact(d.max(1))) {
            let at = id as usize * d;
            for (a, &x) in acc[at..at + d].iter_mut().zip(row) {
                *a += x;
            }
        }
    }
}

impl InplaceOp2 for AddRows {
    fn name(&self) -> &'static str {
        "streambp-add-rows"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<()> {
        add_kernel_fwd(self, s1, l1, s2, l2)
    }
}

struct AddProduct;

impl AddProduct {
    /// `dst[m, n] += a[m, k]·b[k, n]`, strides from the layouts.
    fn run<T: WithDType + SumType>(
        dst: &mut [T],
        a: (&[T], &Layout),
        b: (&[T], &Layout),
    ) -> CResult<()> {
        let (m, k) = a.1.shape().dims2()?;
        let n = b.1.shape().dims2()?.1;
        // `dst` holds `m × n` contiguous elements (the caller's shape test), distinct from `a` and
        // `b` (candle's in-place ops refuse aliased sources).
        product_into(dst, (m, n, k), true, strided(a), strided(b));
        Ok(())
    }

    /// `dst[m, n] += a[m, k]·b[k, n]` for bf16 values `a` and bf16 `b`, summed in f32
    /// ([`half_product::product`]).
    fn half<A: half_product::Element>(
        dst: &mut [f32],
        (a, la): (&[A], &Layout),
        (b, lb): (&[half::bf16], &Layout),
    ) -> CResult<()> {
        let ((a, m, k), (b, _, n)) = (half_product::operand(a, la)?, half_product::operand(b, lb)?);
        half_product::product(Destination::AddF32(dst), (m, n, k), a, b);
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
        match (s1, s2, s3) {
            (CpuStorage::F32(acc), CpuStorage::BF16(a), CpuStorage::BF16(b)) => {
                Self::half(&mut acc[r], (a, l2), (b, l3))
            }
            // f32 holding bf16 values by bf16: only `add_product_of_bf16_values` passes these.
            (CpuStorage::F32(acc), CpuStorage::F32(a), CpuStorage::BF16(b)) => {
                Self::half(&mut acc[r], (a, l2), (b, l3))
            }
            (CpuStorage::F32(acc), _, _) => Self::run(
                &mut acc[r],
                (f32::cpu_storage_as_slice(s2)?, l2),
                (f32::cpu_storage_as_slice(s3)?, l3),
            ),
            (CpuStorage::F64(acc), _, _) => Self::run(
                &mut acc[r],
                (f64::cpu_storage_as_slice(s2)?, l2),
                (f64::cpu_storage_as_slice(s3)?, l3),
            ),
            _ => candle_core::bail!("in-place product: not f32 or f64"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// A product of f32 holding bf16 values added in place equals the product of those bf16 (bit
    /// for bit on a kernel that packs bf16; within f32's rounding on the widened one, which reads
    /// the f32 in place), `aᵀ` strided as the LM head's `dzᵀ` is; other dtypes are declined.
    #[test]
    fn products_of_bf16_values_add_as_their_bf16() {
        let dev = Device::Cpu;
        let (m, n, k) = (37, 21, 300);
        let values = |len: usize, seed: usize| -> Vec<f32> {
            let v = (0..len).map(|i| ((i * 7 + seed) as f32 * 0.37).sin() * 2.0);
            v.map(|x| half::bf16::from_f32(x).to_f32()).collect()
        };
        let a_t = Tensor::from_vec(values(k * m, 1), (k, m), &dev).unwrap();
        let a = a_t.t().unwrap();
        let b = Tensor::from_vec(values(k * n, 2), (k, n), &dev)
            .and_then(|t| t.to_dtype(DType::BF16))
            .unwrap();
        let held = Tensor::from_vec(values(m * n, 3), (m, n), &dev).unwrap();
        let (want, got) = (held.copy().unwrap(), held.copy().unwrap());
        let a16 = a.to_dtype(DType::BF16).unwrap();
        assert!(add_product(&want, &a16, &b).unwrap());
        assert!(add_product_of_bf16_values(&got, &a, &b).unwrap());
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (want, got) = (flat(&want), flat(&got));
        if half_product::Kernel::detect() == half_product::Kernel::Widened {
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "{g} vs {w}");
            }
        } else {
            assert!(got == want, "not the bf16 product's bits");
        }
        assert!(!add_product_of_bf16_values(&held, &a16, &b).unwrap());
        let acc64 = held.to_dtype(DType::F64).unwrap();
        assert!(!add_product_of_bf16_values(&acc64, &a, &b).unwrap());
    }

    /// Rows added in place equal candle's `index_add` onto what the accumulator held, repeated ids
    /// included; an id past the table is an error that changes nothing; half precision is declined.
    #[test]
    fn rows_added_in_place_equal_index_add() {
        let dev = Device::Cpu;
        let held: Vec<f64> = (0..12).map(|i| 0.5 * i as f64 - 2.0).collect();
        let acc = Tensor::from_vec(held.clone(), (4, 3), &dev).unwrap();
        let rows = Tensor::from_vec(
            (0..15).map(|i| 1.0 / (1.0 + i as f64)).collect(),
            (5, 3),
            &dev,
        )
        .unwrap();
        let ids = Tensor::from_vec(vec![2u32, 0, 2, 3, 2], 5, &dev).unwrap();
        let want = acc.index_add(&ids, &rows, 0).unwrap();
        assert!(add_rows(&acc, &ids, &rows).unwrap());
        let (got, want) = (
            acc.to_vec2::<f64>().unwrap(),
            want.to_vec2::<f64>().unwrap(),
        );
        assert_eq!(got, want);

        let before = acc.to_vec2::<f64>().unwrap();
        let bad = Tensor::from_vec(vec![0u32, 1, 4, 0, 0], 5, &dev).unwrap();
        let err = add_rows(&acc, &bad, &rows).unwrap_err().to_string();
        assert!(err.contains("token id 4"), "{err}");
        assert_eq!(acc.to_vec2::<f64>().unwrap(), before);

        let half = acc.to_dtype(DType::BF16).unwrap();
        let half_rows = rows.to_dtype(DType::BF16).unwrap();
        assert!(!add_rows(&half, &ids, &half_rows).unwrap());
    }

    /// Half-precision gradients into an f32 accumulator are widened and added: the sums of their
    /// f32 values, bit for bit, whole tensors and rows (an id repeated).
    #[test]
    fn half_precision_gradients_add_widened() {
        let dev = Device::Cpu;
        let values = |len: usize, seed: usize| -> Vec<f32> {
            (0..len)
                .map(|i| ((i * 13 + seed) as f32 * 0.41).sin() * 3.0)
                .collect()
        };
        let held = Tensor::from_vec(values(12, 1), (4, 3), &dev).unwrap();
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for half in [DType::BF16, DType::F16] {
            let x = Tensor::from_vec(values(12, 2), (4, 3), &dev)
                .and_then(|t| t.to_dtype(half))
                .unwrap();
            let want = (&held + x.to_dtype(DType::F32).unwrap()).unwrap();
            let acc = held.copy().unwrap();
            assert!(add(&acc, &x).unwrap());
            assert_eq!(flat(&acc), flat(&want), "{half:?}");

            let rows = Tensor::from_vec(values(9, 3), (3, 3), &dev)
                .and_then(|t| t.to_dtype(half))
                .unwrap();
            let ids = Tensor::from_vec(vec![1u32, 3, 1], 3, &dev).unwrap();
            let want = held
                .index_add(&ids, &rows.to_dtype(DType::F32).unwrap(), 0)
                .unwrap();
            let acc = held.copy().unwrap();
            assert!(add_rows(&acc, &ids, &rows).unwrap());
            assert_eq!(flat(&acc), flat(&want), "{half:?} rows");
        }
    }
}
