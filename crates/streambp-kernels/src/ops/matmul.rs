//! Matrix products of constants on every backend: a detached forward's, a backward's own, the LM
//! head's. On the host bf16 operands go to the bf16 kernel in force and f32/f64 ones to the tiled
//! products; elsewhere candle's `matmul`. Also the host products' workspace, for the planner.

use candle_core::{CpuStorage, Layout, Storage, Tensor};
use half::bf16;

use crate::host::half_product::{linear_into, operand, product, Destination, Element};

pub use crate::host::gemm_memory::{thread_slabs, workspace, Product};

type CResult<T> = candle_core::Result<T>;

/// `a·b`: by [`product`] for 2-D bf16 tensors on the CPU (any strides), by
/// [`crate::host::products::tiled_matmul`] for 2-D f32/f64 ones, by candle's `matmul` for any others. The
/// bf16 result records no backward: for products of constants (a detached forward, a backward's
/// own products), never for one a graph must differentiate.
pub fn matmul(a: &Tensor, b: &Tensor) -> CResult<Tensor> {
    let on_host = |t: &Tensor| t.device().is_cpu() && t.dtype() == candle_core::DType::BF16;
    if !(on_host(a) && on_host(b) && a.rank() == 2 && b.rank() == 2) {
        return match crate::host::products::tiled_matmul(a, b)? {
            Some(product) => Ok(product),
            None => a.matmul(b),
        };
    }
    let ((sa, la), (sb, lb)) = (a.storage_and_layout(), b.storage_and_layout());
    let (Storage::Cpu(CpuStorage::BF16(da)), Storage::Cpu(CpuStorage::BF16(db))) = (&*sa, &*sb)
    else {
        candle_core::bail!("bf16 product: operands not in bf16 host storage");
    };
    product_tensor((da, la), (db, lb), a.device(), |d| Destination::Bf16(d))
}

/// `a·b` for 2-D host tensors (any strides): `a` f32 holding bf16 values ([`Element`]), `b` bf16,
/// by [`product`], rounded to bf16: [`matmul`]'s product of `a` cast to bf16, without that copy.
/// Like it, it records no backward. The caller rounds `a` first: a value bf16 does not hold would
/// be truncated by the packing kernels and read whole by the widened one.
pub fn matmul_of_bf16_values(a: &Tensor, b: &Tensor) -> CResult<Tensor> {
    let (sa, la) = a.storage_and_layout();
    let (sb, lb) = b.storage_and_layout();
    let (Storage::Cpu(CpuStorage::F32(da)), Storage::Cpu(CpuStorage::BF16(db))) = (&*sa, &*sb)
    else {
        candle_core::bail!("bf16 product: operands not f32 and bf16 in host storage");
    };
    product_tensor((da, la), (db, lb), a.device(), |d| Destination::Bf16(d))
}

/// `a·b` for 2-D bf16 host tensors (any strides) by [`product`], as f32 with the sums unrounded:
/// the products of a bf16 layer's backward, which goes on in f32. Like [`matmul`], it records no
/// backward.
pub fn matmul_unrounded(a: &Tensor, b: &Tensor) -> CResult<Tensor> {
    let ((sa, la), (sb, lb)) = (a.storage_and_layout(), b.storage_and_layout());
    let (Storage::Cpu(CpuStorage::BF16(da)), Storage::Cpu(CpuStorage::BF16(db))) = (&*sa, &*sb)
    else {
        candle_core::bail!("bf16 product: operands not in bf16 host storage");
    };
    product_tensor((da, la), (db, lb), a.device(), |d| Destination::F32(d))
}

/// `a·b` by [`product`] for 2-D operands `a` (bf16 values) and `b` (bf16) in host data (any other
/// rank an error), into a new tensor of `T` on `device`, written as `destination` says (rounded to
/// bf16, or f32 unrounded).
fn product_tensor<A: Element, T: candle_core::WithDType>(
    (a, la): (&[A], &Layout),
    (b, lb): (&[bf16], &Layout),
    device: &candle_core::Device,
    destination: impl FnOnce(&mut [T]) -> Destination<'_>,
) -> CResult<Tensor> {
    if la.dims().len() != 2 || lb.dims().len() != 2 {
        candle_core::bail!("bf16 product: {:?} by {:?}", la.dims(), lb.dims());
    }
    let ((oa, m, k), (ob, k2, n)) = (operand(a, la)?, operand(b, lb)?);
    if k != k2 {
        candle_core::bail!("bf16 product: [{m}, {k}] by [{k2}, {n}]");
    }
    let mut out = vec![T::zero(); m * n];
    product(destination(&mut out), (m, n, k), oa, ob);
    Tensor::from_vec(out, (m, n), device)
}

/// `x Wᵀ` for bf16 host tensors `x` `[.., in]` and `W` `[out, in]` (any strides) as f32 holding
/// the sums rounded to bf16 (`[.., out]`): [`linear`](crate::host::half_product::linear)'s values, for a computation that goes on
/// in f32 (the LM head's softmax), without the bf16 result and its widened copy. `None` for other
/// dtypes or devices.
pub fn linear_as_bf16_values(x: &Tensor, w: &Tensor) -> CResult<Option<Tensor>> {
    let host_bf16 = |t: &Tensor| t.device().is_cpu() && t.dtype() == candle_core::DType::BF16;
    if !(host_bf16(x) && host_bf16(w)) {
        return Ok(None);
    }
    let x = x.contiguous()?;
    let (sx, xl) = x.storage_and_layout();
    let (sw, wl) = w.storage_and_layout();
    let (Storage::Cpu(CpuStorage::BF16(dx)), Storage::Cpu(CpuStorage::BF16(dw))) = (&*sx, &*sw)
    else {
        return Ok(None);
    };
    let (dst, shape) = linear_into((dx, xl), (dw, wl), |d| Destination::Bf16Values(d))?;
    Tensor::from_vec(dst, shape, x.device()).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::choices::Kernel;
    use crate::testing::bf16_values as values;

    /// The tensor functions agree with their bf16 counterparts, by the route in force (a few rows
    /// by `skinny`, more by the kernel): `x Wᵀ` as values, `a·b` of values.
    #[test]
    fn products_of_bf16_values_agree_with_bf16_products() {
        let dev = candle_core::Device::Cpu;
        let tensor = |len: usize, seed: u32, shape: (usize, usize)| {
            Tensor::from_vec(values(len, seed), shape, &dev).unwrap()
        };
        let f32s = |t: &Tensor| {
            let t = t.to_dtype(candle_core::DType::F32).unwrap();
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        };
        let w = tensor(90 * 300, 8, (90, 300));
        for rows in [3, 40] {
            let x = tensor(rows * 300, 7, (rows, 300));
            let as_values = linear_as_bf16_values(&x, &w).unwrap().unwrap();
            let want = matmul(&x, &w.t().unwrap()).unwrap();
            assert_eq!(as_values.dims(), &[rows, 90]);
            assert!(
                f32s(&as_values) == f32s(&want),
                "{rows} rows: linear as values"
            );
            let a32 = x.to_dtype(candle_core::DType::F32).unwrap();
            let of_values = matmul_of_bf16_values(&a32, &w.t().unwrap()).unwrap();
            let (got, want) = (f32s(&of_values), f32s(&want));
            match Kernel::detect() {
                // gemm's sums may differ in their last bit, and then their rounding by an ulp.
                Kernel::Widened => {
                    for (g, w) in got.iter().zip(&want) {
                        assert!((g - w).abs() <= w.abs() / 128.0, "{rows} rows: {g} vs {w}");
                    }
                }
                _ => assert!(got == want, "{rows} rows: product of values"),
            }
            assert!(linear_as_bf16_values(&a32, &w).unwrap().is_none());
        }
    }
}
