//! The projections as differentiable ops: `x Wᵀ` with a frozen weight (differentiable in `x` only),
//! with a trained one (its gradient formed in the weight's own layout, or added in place into an
//! accumulator), and a LoRA projection as one op; each with its backward written out, so the graph
//! holds what that backward needs and nothing more. On the host the products run on the host's
//! kernels (f32/f64 tiles, bf16 weights' products on the bf16 kernel in force); elsewhere the
//! forward is composed before the op and handed over ([`Precomputed`]).

use candle_core::{CpuStorage, Layout, Shape, Storage, Tensor};

use crate::host::gemm_memory::{self, Product};
use crate::host::half_product;
use crate::host::products::product_into;
use crate::host::storage::host_float;
use crate::ops::accumulate;
use crate::ops::matmul;
use crate::precomputed::Precomputed;
use crate::Backend;

type CResult<T> = candle_core::Result<T>;

/// A projection's weight as its ops read it: the tensor autograd differentiates and, in a bf16 layer
/// computed in f32, the bf16 weight that tensor was widened from, from which the forward's products
/// run on the CPU's bf16 arithmetic ([`half_product::linear_of_bf16_values`]).
#[derive(Clone, Copy)]
pub struct Weight<'a> {
    /// `[out, in]`.
    pub tensor: &'a Tensor,
    /// The same values in bf16, where the layer keeps them.
    pub bf16: Option<&'a Tensor>,
}

/// `x Wᵀ` from `bf16`, the weight of shape `weight_dims` in bf16, by
/// [`half_product::linear_of_bf16_values`] for f32 host data `x`; `None` where that does not take
/// it. A bf16 weight of another shape than the weight's is an error (it cannot be its copy).
fn of_bf16_values(
    x: (&[f32], &Layout),
    (bf16, weight_dims): (Option<&Tensor>, &[usize]),
) -> CResult<Option<(Vec<f32>, Shape)>> {
    let Some(w) = bf16.filter(|w| w.dtype() == candle_core::DType::BF16) else {
        return Ok(None);
    };
    if w.dims() != weight_dims {
        candle_core::bail!("linear: bf16 weight {:?}, weight {weight_dims:?}", w.dims());
    }
    let (storage, wl) = w.storage_and_layout();
    match &*storage {
        Storage::Cpu(CpuStorage::BF16(w)) => half_product::linear_of_bf16_values(x, (w, wl)),
        _ => Ok(None),
    }
}

/// `x Wᵀ` of constants (a frozen base's forward): from the bf16 weight where
/// [`of_bf16_values`] takes it, else by [`matmul::matmul`].
fn constant_linear(x: &Tensor, weight: Weight) -> CResult<Tensor> {
    // (`of_bf16_values` declines other layouts; without a bf16 weight no storage is locked.)
    if weight.bf16.is_some() {
        let (storage, layout) = x.storage_and_layout();
        if let Storage::Cpu(CpuStorage::F32(data)) = &*storage {
            let bf16 = (weight.bf16, weight.tensor.dims());
            if let Some((out, shape)) = of_bf16_values((data, layout), bf16)? {
                return Tensor::from_vec(out, shape, x.device());
            }
        }
    }
    matmul::matmul(x, &weight.tensor.detach().t()?)
}

/// The gradient a projection's backward products take ([`product_gradient`]).
enum Gradient<'w> {
    /// In bf16, with the bf16 weight: for the kernels that pack bf16 operands.
    Bf16(Tensor, &'w Tensor),
    /// In the gradient's own dtype, with the weight itself: the gradient as it is, or on the
    /// widened kernel its values rounded to bf16 (a product of bf16 values is f32's product of
    /// them, so f32's products of the f32 weight take it, with nothing widened, as the forward's
    /// products there: [`half_product::linear_of_bf16_values`]).
    InDtype(Tensor),
}

/// The gradient `g` the backward's products take. In a bf16 layer computed in f32 (a bf16 weight
/// at hand, `g` f32 on the host), `g` rounded to bf16: the products then take the gradient as bf16
/// autograd holds it (PyTorch's bf16 backward multiplies bf16 gradients), on the bf16 kernel in
/// force, their sums unrounded and the gradient flowing on in f32. Elsewhere `g` itself.
///
/// The rounding costs no accuracy that shows: the bf16 gradients' distance from exact arithmetic
/// (`tests/half_accuracy.rs`) stays 1.08e-1, set by the forward's roundings; the products run on
/// the CPU's bf16 arithmetic (AMX's tiles, AVX512-BF16's dot products) rather than f32's.
fn product_gradient<'w>(grad: &Tensor, bf16: Option<&'w Tensor>) -> CResult<Gradient<'w>> {
    let as_is = || Ok(Gradient::InDtype(grad.clone()));
    let Some(w16) = bf16.filter(|w| w.dtype() == candle_core::DType::BF16) else {
        return as_is();
    };
    if !(grad.device().is_cpu() && grad.dtype() == candle_core::DType::F32) {
        return as_is();
    }
    if half_product::Kernel::detect() == half_product::Kernel::Widened {
        let values = grad.contiguous()?.copy()?;
        crate::ops::cast::round_in_place(&values, candle_core::DType::BF16)?;
        return Ok(Gradient::InDtype(values));
    }
    let g16 = crate::ops::cast::cast(grad, candle_core::DType::BF16)?;
    Ok(Gradient::Bf16(g16, w16))
}

/// `g W` for a projection's `weight` (`[out, in]`, and its bf16 copy where the layer keeps one),
/// from the gradient [`product_gradient`] gives.
fn input_gradient(grad: &Tensor, weight: &Tensor, bf16: Option<&Tensor>) -> CResult<Tensor> {
    match product_gradient(grad, bf16)? {
        Gradient::Bf16(g16, w16) => matmul::matmul_unrounded(&g16, w16),
        Gradient::InDtype(g) => matmul::matmul(&g, weight),
    }
}

/// `x` (f32 on the host) narrowed to a bf16 tensor where every value is one bf16 holds.
fn narrowed_exactly(x: &Tensor) -> CResult<Option<Tensor>> {
    let x = x.contiguous()?;
    let (storage, layout) = x.storage_and_layout();
    let Storage::Cpu(CpuStorage::F32(data)) = &*storage else {
        return Ok(None);
    };
    let start = layout.start_offset();
    match data
        .get(start..start + x.elem_count())
        .and_then(crate::host::cast::narrowed_exactly)
    {
        Some(narrowed) => Tensor::from_vec(narrowed, x.shape(), x.device()).map(Some),
        None => Ok(None),
    }
}

/// `x Wᵀ + b` with `W` and `b` frozen: its backward gives `x` its gradient `g W` and computes nothing for
/// the weight. (candle's matmul backward always forms the gradient of both operands, a weight-sized
/// matmul and buffer per call even when the weight is a constant: the cost LoRA must not pay.)
struct FrozenLinear {
    weight: Tensor,
    /// The weight in bf16, where the layer keeps it ([`Weight::bf16`]).
    bf16_weight: Option<Tensor>,
    out: Precomputed,
}

impl candle_core::CustomOp1 for FrozenLinear {
    fn name(&self) -> &'static str {
        "streambp-frozen-linear"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> CResult<(CpuStorage, Shape)> {
        self.out.cpu()
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        self.out.cuda()
    }

    fn bwd(&self, _x: &Tensor, _out: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let bf16 = self.bf16_weight.as_ref();
        Ok(Some(input_gradient(grad, &self.weight, bf16)?))
    }
}

/// `x Wᵀ (+ b)` for `x` `[n, in]` with a frozen `weight` `[out, in]`: differentiable in `x` only. An
/// untracked `x` (no graph) takes the plain path.
pub fn frozen_linear(x: &Tensor, weight: Weight, bias: Option<&Tensor>) -> CResult<Tensor> {
    let bias = bias.map(Tensor::detach);
    let plain = |x: &Tensor| -> CResult<Tensor> {
        let y = constant_linear(x, weight)?;
        match &bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    };
    if !x.track_op() {
        return plain(x);
    }
    let out = plain(&x.detach())?;
    x.apply_op1(FrozenLinear {
        weight: weight.tensor.detach(),
        bf16_weight: weight.bf16.map(Tensor::detach),
        out: Precomputed::new(out),
    })
}

/// `x Wᵀ` with a trained `W`: its backward forms `dx = g W` and the weight's gradient `dW = gᵀ x`
/// directly in `W`'s layout. Composed as `x.matmul(W.t())`, autograd forms `xᵀ g` (`[in, out]`), sums it
/// into a zero-filled gradient of the transpose node, then transposes that and sums it again, strided,
/// into a second zero-filled `[out, in]` buffer: two weight-sized fills and adds per chunk and projection.
struct TrainedLinear {
    /// The forward's result computed by candle's ops, off the host; on the host in f32/f64 the op
    /// computes it itself ([`host_product`]): no zero-filled output, no copy handed over.
    out: Option<Precomputed>,
    /// Where `dW` is added in place instead of being returned (a trained projection's gradient accumulator).
    grad_into: Option<Tensor>,
    /// The weight in bf16, where the forward's product may run from it ([`Weight::bf16`]).
    bf16_weight: Option<Tensor>,
}

impl candle_core::CustomOp2 for TrainedLinear {
    fn name(&self) -> &'static str {
        "streambp-linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        match (&self.out, s1, s2) {
            (Some(out), _, _) => out.cpu(),
            (None, CpuStorage::F32(x), CpuStorage::F32(w)) => {
                let bf16 = (self.bf16_weight.as_ref(), l2.dims());
                let (out, shape) = match of_bf16_values((x, l1), bf16)? {
                    Some(product) => product,
                    None => host_product((x, l1), (w, l2))?,
                };
                Ok((CpuStorage::F32(out), shape))
            }
            (None, CpuStorage::F64(x), CpuStorage::F64(w)) => {
                let (out, shape) = host_product((x, l1), (w, l2))?;
                Ok((CpuStorage::F64(out), shape))
            }
            (None, CpuStorage::BF16(x), CpuStorage::BF16(w)) => {
                let (out, shape) = half_product::linear((x, l1), (w, l2))?;
                Ok((CpuStorage::BF16(out), shape))
            }
            _ => candle_core::bail!("linear: not f32, f64 or bf16"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        match &self.out {
            Some(out) => out.cuda(),
            None => candle_core::bail!("linear: host product on a CUDA tensor"),
        }
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        // `x` and `grad` as `[n, in]` and `[n, out]` (the op takes any leading dimensions).
        let rows = |t: &Tensor| -> CResult<Tensor> {
            let inner = t.dim(candle_core::D::Minus1)?;
            t.reshape((t.elem_count() / inner.max(1), inner))
        };
        let (grad2, x2) = (rows(grad)?, rows(&x.detach())?);
        // `g W`, and `gᵀ` and `x` for `gᵀ x` with the product that takes them; in a bf16 layer
        // computed in f32 from the rounded gradient, `gᵀ x` on the bf16 kernel where `x` holds
        // bf16 values (as such a layer's inputs do), else in f32.
        type Product = fn(&Tensor, &Tensor) -> CResult<Tensor>;
        let (grad_x, grad_t, x2, product): (_, _, _, Product) =
            match product_gradient(&grad2, self.bf16_weight.as_ref())? {
                Gradient::InDtype(g) => {
                    let grad_x = matmul::matmul(&g, &weight.detach())?;
                    (grad_x, g.t()?, x2, matmul::matmul)
                }
                Gradient::Bf16(g16, w16) => {
                    let grad_x = matmul::matmul_unrounded(&g16, w16)?;
                    match narrowed_exactly(&x2)? {
                        Some(x16) => (grad_x, g16.t()?, x16, matmul::matmul_unrounded),
                        None => {
                            let g = crate::ops::cast::cast(&g16, candle_core::DType::F32)?;
                            (grad_x, g.t()?, x2, matmul::matmul)
                        }
                    }
                }
            };
        let grad_w = match &self.grad_into {
            Some(acc) if accumulate::add_product(acc, &grad_t, &x2)? => None,
            _ => Some(product(&grad_t, &x2)?),
        };
        Ok((Some(grad_x.reshape(x.shape())?), grad_w))
    }
}

/// Whether the host computes `x Wᵀ` ([`host_product`], or [`half_product::linear`] in bf16): both
/// on the CPU in the same f32/f64/bf16, `x` contiguous `[.., in]` (rank 2 or more), `W` `[out, in]`,
/// no size zero.
fn on_host(x: &Tensor, weight: &Tensor) -> bool {
    let sizes = match (x.dims(), weight.dims()) {
        (&[_, .., k], &[out, k2]) => k == k2 && x.elem_count() * out > 0,
        _ => false,
    };
    Backend::of(x) == Backend::Cpu
        && (host_float(x) || x.dtype() == candle_core::DType::BF16)
        && weight.device().is_cpu()
        && weight.dtype() == x.dtype()
        && x.is_contiguous()
        && sizes
}

/// `x Wᵀ` for contiguous `x` `[.., in]` and `W` `[out, in]` (any strides), by gemm's kernel (the
/// one candle's products run) in tiles of the output (`[.., out]`), or for a few rows of `x` by
/// [`crate::host::skinny`]'s dot products ([`product_into`]).
fn host_product<T: candle_core::WithDType + crate::host::skinny::SumType>(
    (x, xl): (&[T], &Layout),
    (w, wl): (&[T], &Layout),
) -> CResult<(Vec<T>, Shape)> {
    let Some((&k, lead)) = xl.dims().split_last() else {
        candle_core::bail!("linear: a scalar input");
    };
    let (n, (out, k2)) = (lead.iter().product::<usize>(), wl.shape().dims2()?);
    let (ws0, ws1) = (wl.stride()[0], wl.stride()[1]);
    let x = x.get(xl.start_offset()..xl.start_offset() + n * k);
    let w = w.get(wl.start_offset()..);
    let (Some(x), Some(w)) = (x, w) else {
        candle_core::bail!("linear: operand outside its storage");
    };
    if k != k2
        || !xl.is_contiguous()
        || n * k * out == 0
        || (out - 1) * ws0 + (k - 1) * ws1 >= w.len()
    {
        candle_core::bail!("linear: x {:?}, weight {:?}", xl.dims(), wl.dims());
    }
    let mut dst = vec![T::zero(); n * out];
    product_into(&mut dst, (n, out, k), false, (x, k, 1), (w, ws1, ws0));
    Ok((dst, Shape::from([lead, &[out]].concat())))
}

/// `x Wᵀ` for `x` `[.., in]` and a trained `weight` `[out, in]`, differentiable in both (see
/// [`TrainedLinear`]); with `grad_into`, the weight's gradient is added there (where that can be done
/// in place) rather than handed to autograd. Untracked operands take the plain product.
///
/// On the host the op takes `x` with its leading dimensions: reshaping it to `[n, in]` and the
/// result back would put two more nodes in the graph, each a zero-filled buffer and a sum in the
/// backward.
pub fn trained_linear(
    x: &Tensor,
    Weight {
        tensor: weight,
        bf16,
    }: Weight,
    grad_into: Option<&Tensor>,
) -> CResult<Tensor> {
    let tracked = x.track_op() || weight.track_op();
    // The op on `x` as it is (any leading dimensions), where its product runs on the host.
    let on_host_op = |x: &Tensor| {
        let op = TrainedLinear {
            out: None,
            grad_into: grad_into.cloned(),
            bf16_weight: bf16.map(Tensor::detach),
        };
        match tracked {
            true => x.apply_op2(weight, op),
            false => x.apply_op2_no_bwd(weight, &op),
        }
    };
    if on_host(x, weight) {
        return on_host_op(x);
    }
    let Some((&inner, lead)) = x.dims().split_last() else {
        candle_core::bail!("linear: a scalar input");
    };
    let mut out_shape = lead.to_vec();
    out_shape.push(weight.dim(0)?);
    let x2 = x.reshape((x.elem_count() / inner.max(1), inner))?;
    let y = match (on_host(&x2, weight), tracked) {
        (true, _) => on_host_op(&x2)?,
        (false, true) => {
            let out = matmul::matmul(&x2.detach(), &weight.detach().t()?)?;
            let op = TrainedLinear {
                out: Some(Precomputed::new(out)),
                grad_into: grad_into.cloned(),
                bf16_weight: None,
            };
            x2.apply_op2(weight, op)?
        }
        (false, false) => matmul::matmul(&x2, &weight.t()?)?,
    };
    y.reshape(out_shape)
}

/// `x Wᵀ + b + s·(u Bᵀ)` with `W`, `b` frozen and `u = dropout(x) Aᵀ` the adapter's down-projection:
/// one LoRA projection as one op. Its backward gives `x` its gradient through the frozen weight,
/// `g W`, and `u` and `B` theirs, `s·g B` and `s·gᵀ u`; the graph holds its output only (not the
/// `[n, out]` adapter term, its scaled copy and the sum that composing it would keep).
struct LoraLinear {
    weight: Tensor,
    /// The weight in bf16, where the layer keeps it ([`Weight::bf16`]).
    bf16_weight: Option<Tensor>,
    scale: f64,
    out: Precomputed,
}

impl candle_core::CustomOp3 for LoraLinear {
    fn name(&self) -> &'static str {
        "streambp-lora-linear"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        self.out.cpu()
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        self.out.cuda()
    }

    fn bwd(
        &self,
        _x: &Tensor,
        u: &Tensor,
        b: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let scaled = (grad * self.scale)?;
        let grad_x = input_gradient(grad, &self.weight, self.bf16_weight.as_ref())?;
        let grad_u = matmul::matmul(&scaled, &b.detach())?;
        let grad_b = matmul::matmul(&scaled.t()?, &u.detach())?;
        Ok((Some(grad_x), Some(grad_u), Some(grad_b)))
    }
}

/// `x Wᵀ (+ b) + s·(u Bᵀ)` for `x` `[n, in]`, the frozen `weight` `[out, in]` (and `bias`), the
/// adapter's `u` `[n, r]` and `lora_b` `[out, r]` and its scale `s`: differentiable in `x`, `u` and
/// `lora_b`, the sum formed as PEFT forms it (`base + (u Bᵀ)·s`), the base first rounded to
/// `round_base_to` where given (f32 `x` only: a bf16 base layer computed in f32 rounds its output as bf16 arithmetic does).
pub fn lora_linear(
    x: &Tensor,
    (weight, bias): (Weight, Option<&Tensor>),
    (u, lora_b, scale): (&Tensor, &Tensor, f64),
    round_base_to: Option<candle_core::DType>,
) -> CResult<Tensor> {
    let out = {
        let base = constant_linear(&x.detach(), weight)?;
        let base = match bias {
            Some(b) => base.broadcast_add(&b.detach())?,
            None => base,
        };
        if let Some(dtype) = round_base_to {
            // A fresh product (or sum) that nothing else holds.
            crate::ops::cast::round_in_place(&base, dtype)?;
        }
        (base + (matmul::matmul(&u.detach(), &lora_b.detach().t()?)? * scale)?)?
    };
    if !(x.track_op() || u.track_op() || lora_b.track_op()) {
        return Ok(out);
    }
    x.apply_op3(
        u,
        lora_b,
        LoraLinear {
            weight: weight.tensor.detach(),
            bf16_weight: weight.bf16.map(Tensor::detach),
            scale,
            out: Precomputed::new(out),
        },
    )
}

/// The largest packing workspace, in bytes, of the host's products for `rows` rows through
/// projections of shapes `(out, in)`: the forward's (`x Wᵀ`), the input gradient's (`g W`) and, for
/// `trained` weights, the weight gradient's (`gᵀ x`), in elements of `elem` bytes, as gemm blocks
/// them on the running CPU ([`gemm_memory`]): for the planner.
pub fn host_workspace(rows: usize, shapes: &[(usize, usize)], trained: bool, elem: usize) -> u64 {
    shapes
        .iter()
        .flat_map(|&(out, inner)| {
            let mut products = vec![
                Product::by_transposed(rows, out, inner),
                Product::by_plain(rows, out, inner),
            ];
            if trained {
                products.push(Product::transposed_by(out, inner, rows));
            }
            products
        })
        .map(|p| gemm_memory::workspace(p, elem, true))
        .max()
        .unwrap_or(0)
}
