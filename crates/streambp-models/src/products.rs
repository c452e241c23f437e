//! Batched matrix products on the CPU with one batch item per task.
//!
//! The attention op multiplies per key/value head: `[b, kv_heads, rows, k] · [b, kv_heads, k, n]`
//! with rows, k and n in the tens to hundreds. candle's product runs the items one after the other,
//! each split over every core, into a zero-filled output: on these sizes the split costs more than
//! it gains (70-90 GFLOP/s on 2 cores, against 170-185 with one item per core, measured on the
//! attention's block shapes). Here, where there are at least as many items as rayon threads, each
//! item is one single-threaded gemm call (the kernel candle's products run) on its own task, writing
//! an output that is never zero-filled, and `acc += a·b` adds into its destination in place.
//! Elsewhere (fewer items than threads, other devices or dtypes) candle's own ops run.

use crate::cpu::fusable;
use candle_core::{CpuStorage, CustomOp2, InplaceOp3, Layout, Shape, Tensor, WithDType};
use rayon::prelude::*;

type CResult<T> = candle_core::Result<T>;

/// One operand or destination: its data and where each batch item's matrix lies in it.
#[derive(Clone, Copy)]
struct Matrices {
    /// Offset of item `i`'s first element, for `i` over the batch in row-major order.
    batch: BatchOffsets,
    rows: usize,
    cols: usize,
    row_stride: isize,
    col_stride: isize,
}

/// Offsets of the batch items of a strided layout (every dimension but the last two).
#[derive(Clone, Copy)]
struct BatchOffsets {
    start: usize,
    /// Up to two batch dimensions (the attention's `[b, kv_heads]`): sizes and strides.
    dims: [usize; 2],
    strides: [usize; 2],
}

impl BatchOffsets {
    fn count(&self) -> usize {
        self.dims[0] * self.dims[1]
    }

    fn offset(&self, item: usize) -> usize {
        let (i, j) = (item / self.dims[1], item % self.dims[1]);
        self.start + i * self.strides[0] + j * self.strides[1]
    }
}

impl Matrices {
    /// The matrices of a layout of rank 2 to 4 (`None` above that).
    fn of(layout: &Layout) -> Option<Self> {
        let (dims, strides) = (layout.dims(), layout.stride());
        let rank = dims.len();
        if !(2..=4).contains(&rank) {
            return None;
        }
        let mut batch = BatchOffsets {
            start: layout.start_offset(),
            dims: [1, 1],
            strides: [0, 0],
        };
        for (slot, d) in (0..rank - 2).rev().zip((0..2).rev()) {
            batch.dims[d] = dims[slot];
            batch.strides[d] = strides[slot];
        }
        Some(Self {
            batch,
            rows: dims[rank - 2],
            cols: dims[rank - 1],
            row_stride: strides[rank - 2] as isize,
            col_stride: strides[rank - 1] as isize,
        })
    }
}

/// Whether `a · b` (and a destination like `dst`) takes the per-item path.
fn per_item(a: &Tensor, b: &Tensor, dst: Option<&Tensor>) -> bool {
    let rank = a.rank();
    let items: usize = a.dims().iter().take(rank.saturating_sub(2)).product();
    fusable(a)
        && b.device().is_cpu()
        && b.dtype() == a.dtype()
        && dst.is_none_or(|d| {
            // Items written in parallel must not share elements: no broadcast dimension.
            let distinct = d
                .dims()
                .iter()
                .zip(d.stride())
                .all(|(&n, &s)| n < 2 || s > 0);
            d.device().is_cpu() && d.dtype() == a.dtype() && distinct
        })
        && (3..=4).contains(&rank)
        && b.rank() == rank
        && a.dims()[..rank - 2] == b.dims()[..rank - 2]
        && a.dims()[rank - 1] == b.dims()[rank - 2]
        && a.elem_count() > 0
        && b.elem_count() > 0
        && items >= rayon::current_num_threads()
}

/// `a · b` over the batch dimensions (as [`Tensor::matmul`], without a backward: for ops that form
/// their gradients themselves).
pub fn matmul(a: &Tensor, b: &Tensor) -> CResult<Tensor> {
    if per_item(a, b, None) {
        a.apply_op2_no_bwd(b, &Product)
    } else {
        a.matmul(b)
    }
}

/// `acc += a · b` in place over the batch dimensions, where `acc` may be a view (a gradient
/// narrowed to a block of keys); `false`, with nothing done, where the per-item path does not apply.
pub fn add_matmul(acc: &Tensor, a: &Tensor, b: &Tensor) -> CResult<bool> {
    if !per_item(a, b, Some(acc)) {
        return Ok(false);
    }
    acc.inplace_op3(a, b, &AddProduct)?;
    Ok(true)
}

/// `dst[i] (=|+=) a[i] · b[i]` for every batch item `i`, one single-threaded gemm per task (which
/// writes every element of its item's matrix when not accumulating).
///
/// # Safety
/// `dst` must hold every element its matrices `d` address, the items must not overlap, and `a`
/// and `b` must lie within their slices.
unsafe fn run<T: WithDType>(
    dst: *mut T,
    d: Matrices,
    a: (&[T], Matrices),
    b: (&[T], Matrices),
    accumulate: bool,
) {
    let (a_data, a) = a;
    let (b_data, b) = b;
    // Raw pointers are not Send; each task gets the address and rebuilds its own.
    let dst = dst as usize;
    (0..a.batch.count()).into_par_iter().for_each(|item| {
        let out = (dst as *mut T).wrapping_add(d.batch.offset(item));
        // SAFETY: per the function's contract; a and b are read within their slices' layouts.
        unsafe {
            gemm::gemm(
                a.rows,
                b.cols,
                a.cols,
                out,
                d.col_stride,
                d.row_stride,
                accumulate,
                a_data.as_ptr().add(a.batch.offset(item)),
                a.col_stride,
                a.row_stride,
                b_data.as_ptr().add(b.batch.offset(item)),
                b.col_stride,
                b.row_stride,
                T::from_f64(1.0),
                T::from_f64(1.0),
                false,
                false,
                false,
                gemm::Parallelism::None,
            )
        }
    });
}

/// The matrices of a layout over `len` elements of storage, checked to lie within it.
fn within(layout: &Layout, len: usize) -> CResult<Matrices> {
    let last = layout
        .dims()
        .iter()
        .zip(layout.stride())
        .map(|(&n, &s)| n.saturating_sub(1) * s)
        .sum::<usize>();
    let empty = layout.shape().elem_count() == 0;
    match Matrices::of(layout) {
        Some(m) if !empty && layout.start_offset() + last < len => Ok(m),
        _ => candle_core::bail!(
            "batched product: layout {:?} outside its storage",
            layout.dims()
        ),
    }
}

/// `a · b` into a fresh contiguous output.
struct Product;

impl Product {
    fn product<T: WithDType>(a: (&[T], &Layout), b: (&[T], &Layout)) -> CResult<(Vec<T>, Shape)> {
        let (ma, mb) = (within(a.1, a.0.len())?, within(b.1, b.0.len())?);
        let mut dims = a.1.dims().to_vec();
        let rank = dims.len();
        dims[rank - 1] = mb.cols;
        let shape = Shape::from(dims);
        let mut out: Vec<T> = Vec::with_capacity(shape.elem_count());
        let out_layout = Layout::contiguous(&shape);
        let d = within(&out_layout, shape.elem_count())?;
        // SAFETY: the output's capacity holds the contiguous layout's elements, items are disjoint,
        // and gemm writes every element when not accumulating, so the length can then be set.
        unsafe {
            run(out.as_mut_ptr(), d, (a.0, ma), (b.0, mb), false);
            out.set_len(shape.elem_count());
        }
        Ok((out, shape))
    }
}

impl CustomOp2 for Product {
    fn name(&self) -> &'static str {
        "streambp-batched-product"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        match (s1, s2) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => {
                let (out, shape) = Self::product((a, l1), (b, l2))?;
                Ok((CpuStorage::F32(out), shape))
            }
            (CpuStorage::F64(a), CpuStorage::F64(b)) => {
                let (out, shape) = Self::product((a, l1), (b, l2))?;
                Ok((CpuStorage::F64(out), shape))
            }
            _ => candle_core::bail!("batched product: not f32 or f64"),
        }
    }
}

/// `acc += a · b` in place.
struct AddProduct;

impl AddProduct {
    fn add<T: WithDType>(
        acc: (&mut [T], &Layout),
        a: (&[T], &Layout),
        b: (&[T], &Layout),
    ) -> CResult<()> {
        let (ma, mb) = (within(a.1, a.0.len())?, within(b.1, b.0.len())?);
        let d = within(acc.1, acc.0.len())?;
        if d.batch.count() != ma.batch.count() || d.rows != ma.rows || d.cols != mb.cols {
            candle_core::bail!("batched product: destination {:?}", acc.1.dims());
        }
        // SAFETY: every layout was checked to lie within its storage; the destination's items are
        // disjoint (no broadcast dimension, checked by `per_item`).
        unsafe { run(acc.0.as_mut_ptr(), d, (a.0, ma), (b.0, mb), true) };
        Ok(())
    }
}

impl InplaceOp3 for AddProduct {
    fn name(&self) -> &'static str {
        "streambp-batched-add-product"
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
        match (s1, s2, s3) {
            (CpuStorage::F32(acc), CpuStorage::F32(a), CpuStorage::F32(b)) => {
                Self::add((acc, l1), (a, l2), (b, l3))
            }
            (CpuStorage::F64(acc), CpuStorage::F64(a), CpuStorage::F64(b)) => {
                Self::add((acc, l1), (a, l2), (b, l3))
            }
            _ => candle_core::bail!("batched product: not f32 or f64"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::max_diff;
    use candle_core::{DType, Device, IndexOp};

    fn random(dims: &[usize], seed: u64) -> Tensor {
        let n: usize = dims.iter().product();
        // A fixed pseudo-random sequence (the test must not depend on candle's generator).
        let mut x = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let data: Vec<f64> = (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (x >> 11) as f64 / (1u64 << 53) as f64 - 0.5
            })
            .collect();
        Tensor::from_vec(data, dims, &Device::Cpu).unwrap()
    }

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
    }

    /// Strided operands as the attention op passes them: keys transposed, views narrowed from a
    /// longer sequence, rank 3 and 4; per item against candle's product.
    #[test]
    fn per_item_products_match_candle() {
        pool(2).install(|| {
            let q = random(&[2, 3, 10, 8], 1);
            let keys = random(&[2, 3, 40, 8], 2);
            let k = keys.narrow(2, 7, 21).unwrap();
            assert!(per_item(&q, &k.t().unwrap(), None));
            let s = matmul(&q, &k.t().unwrap()).unwrap();
            assert_eq!(s.dims(), [2, 3, 10, 21]);
            assert!(max_diff(&s, &q.matmul(&k.t().unwrap()).unwrap()) < 1e-13);

            let p = random(&[6, 21, 10], 3).transpose(1, 2).unwrap();
            let v = keys.reshape((6, 40, 8)).unwrap().narrow(1, 7, 21).unwrap();
            let pv = matmul(&p, &v).unwrap();
            assert!(max_diff(&pv, &p.matmul(&v).unwrap()) < 1e-13);
        });
    }

    /// `acc += a·b` into a view of a longer gradient: the view gets the product, nothing else moves.
    #[test]
    fn add_into_a_view_leaves_the_rest() {
        pool(2).install(|| {
            let grad = random(&[1, 2, 30, 4], 4);
            let before = grad.copy().unwrap();
            let a = random(&[1, 2, 6, 5], 5);
            let b = random(&[1, 2, 5, 4], 6);
            let view = grad.narrow(2, 11, 6).unwrap();
            assert!(add_matmul(&view, &a, &b).unwrap());
            let expected = (before.narrow(2, 11, 6).unwrap() + a.matmul(&b).unwrap()).unwrap();
            assert!(max_diff(&grad.narrow(2, 11, 6).unwrap(), &expected) < 1e-13);
            for range in [0..11, 17..30] {
                let n = range.len();
                let (now, then) = (
                    grad.narrow(2, range.start, n).unwrap(),
                    before.narrow(2, range.start, n).unwrap(),
                );
                assert_eq!(max_diff(&now, &then), 0.0);
            }
        });
    }

    /// Fewer items than threads, a broadcast destination, f16, rank 2: candle's product, and
    /// `add_matmul` declines.
    #[test]
    fn declines_where_it_does_not_apply() {
        let a = random(&[1, 2, 3, 4], 7);
        let b = random(&[1, 2, 4, 5], 8);
        pool(4).install(|| {
            assert!(!per_item(&a, &b, None));
            let acc = Tensor::zeros((1, 2, 3, 5), DType::F64, &Device::Cpu).unwrap();
            assert!(!add_matmul(&acc, &a, &b).unwrap());
            assert_eq!(
                max_diff(&matmul(&a, &b).unwrap(), &a.matmul(&b).unwrap()),
                0.0
            );
        });
        pool(1).install(|| {
            let broadcast = Tensor::zeros((1, 1, 3, 5), DType::F64, &Device::Cpu)
                .unwrap()
                .broadcast_as((1, 2, 3, 5))
                .unwrap();
            assert!(!add_matmul(&broadcast, &a, &b).unwrap());
            let half = a.to_dtype(DType::F16).unwrap();
            assert!(!per_item(&half, &b.to_dtype(DType::F16).unwrap(), None));
            assert!(!per_item(
                &a.i((0, 0)).unwrap(),
                &b.i((0, 0)).unwrap(),
                None
            ));
        });
    }
}
