//! The attention core as one differentiable op. Composed from tensor ops, autograd would keep the
//! scores, the masked scores, the probabilities (and their f32 copies) in the graph and build a gradient
//! for each: about a dozen `heads × queries × keys` tensors. This op works through the keys in blocks
//! with an online softmax (FlashAttention's scheme, on tensor ops): the forward keeps only the output and
//! each query's softmax normalizer; the backward recomputes each block's probabilities from them. The graph
//! holds q, k, v, the output and the normalizer, and no tensor larger than
//! `heads × queries × key block` exists at any time. Built from candle ops, so it runs on every backend;
//! on the CPU in f32/f64 the same steps run as one kernel with a task per head and block
//! ([`kernel`]; bf16 runs it in f32), the tensor-op path staying CUDA's; where the kernel does not
//! apply, the host runs each block's softmax as one pass ([`softmax_block`]).
//!
//! Shapes (GQA without repeating K/V): q `[b, kv_heads, group·c, hd]` (already scaled), k and v
//! `[b, kv_heads, t, hd]`, output like q ([`attention_over_heads`] takes and gives the layer's
//! layouts instead, regrouping inside the op). A streamed chunk's earlier keys come as [`EarlierKeys`]:
//! read in place and their gradients added in place, so the graph holds no copy of them. Which keys
//! each query may read comes from a [`KeyMask`] one key block at a time, so not even the mask is ever
//! `c × t`.

pub mod kernel;
pub mod softmax_block;

use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Shape, Tensor, WithDType, D};

use crate::backend::Backend;
use crate::host::cast::cast;
use crate::host::half_product::Kernel;
use crate::host::storage::{host_float, host_slice, input_data, storage_id, with_data_mut};
use crate::op_times;
use crate::precomputed::Precomputed;
use kernel::{KernelFloat, Multiply};

thread_local! {
    /// Set by [`with_fused_softmax_blocks`].
    static KERNEL_OFF: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with the attention ops on this thread taking their tensor-op path with the host's fused
/// softmax blocks (what the CPU runs where its kernel does not apply) rather than the CPU kernel,
/// restored however `f` ends: for tests of that path. (The composed path alone, a card's, is
/// [`streambp_kernels::backend::with_composed`]'s.)
pub fn with_fused_softmax_blocks<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            KERNEL_OFF.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(KERNEL_OFF.with(|c| c.replace(true)));
    f()
}

/// Keys per block: the score tensors of a query chunk are at most `heads × c × KEY_BLOCK`. 512 keeps
/// a streamed chunk's block passes near the cache (4 × 128 × 512 f32 scores are 1 MiB) and is as fast as
/// the smaller and larger blocks measured (docs/benchmarks.md, "Figures the kernels' comments
/// held"); larger blocks only add memory.
pub const KEY_BLOCK: usize = 512;

/// Query rows of a task of the CPU kernel's forward at most (the planner sizes its buffers by it).
pub use kernel::MAX_ROW_TILE;

type CResult<T> = candle_core::Result<T>;

/// Which keys the queries of one op may read, asked for one block of keys at a time.
pub trait KeyMask: Send + Sync {
    /// The additive mask `[rows, 1, 1, c, n]` (rows = b or 1) in `dtype` for keys `start..start + n`:
    /// 0 where a query may read the key, the dtype's minimum where not; `None` when every query may
    /// read every key of the block (nothing to add).
    fn bias(&self, start: usize, n: usize, dtype: DType) -> CResult<Option<Tensor>>;
}

/// A mask given whole, as an additive `[rows, 1, 1, c, t]` tensor.
impl KeyMask for Tensor {
    fn bias(&self, start: usize, n: usize, dtype: DType) -> CResult<Option<Tensor>> {
        Ok(Some(self.detach().narrow(4, start, n)?.to_dtype(dtype)?))
    }
}

/// Keys and values the queries read before the op's own, computed outside the graph (for earlier
/// query chunks): the op reads them as constants and, in its backward, adds their gradients in place
/// into `grad_keys` / `grad_values` (`[b, kv_heads, T, hd]`) from index `offset`. No copy of them, nor
/// of their gradients, is made for the graph.
#[derive(Debug, Clone)]
pub struct EarlierKeys {
    /// `[b, kv_heads, n, hd]`: the earlier keys, rope applied.
    pub keys: Tensor,
    /// `[b, kv_heads, n, hd]`: their values.
    pub values: Tensor,
    /// `[b, kv_heads, T, hd]`: the whole sequence's key gradient, added into in place.
    pub grad_keys: Tensor,
    /// `[b, kv_heads, T, hd]`: the whole sequence's value gradient, added into in place.
    pub grad_values: Tensor,
    /// Index in `grad_keys` / `grad_values` of the first earlier key.
    pub offset: usize,
}

/// One block of keys: `n` keys from `start` of the earlier keys or of the op's own, at `index` among
/// all the keys the queries read (earlier first).
#[derive(Debug, Clone, Copy)]
struct KeyRange {
    earlier: bool,
    start: usize,
    n: usize,
    index: usize,
}

/// What the forward and the backward share: the mask, the earlier keys, the grouping and the block size.
struct Blocks {
    mask: Box<dyn KeyMask>,
    earlier: Option<EarlierKeys>,
    group: usize,
    /// The softmax's dtype: f32 (f64 for f64 models), like transformers' eager attention.
    compute: DType,
    key_block: usize,
    products: Products,
    /// The factor on `q·kᵀ`: the op's q comes unscaled.
    scale: f64,
}

impl Blocks {
    /// The blocks of one op, its earlier keys read as constants (detached).
    fn new(
        mask: impl KeyMask + 'static,
        earlier: Option<EarlierKeys>,
        group: usize,
        Blocking {
            compute,
            key_block,
            products,
        }: Blocking,
        scale: f64,
    ) -> Self {
        let earlier = earlier.map(|e| EarlierKeys {
            keys: e.keys.detach(),
            values: e.values.detach(),
            ..e
        });
        Self {
            mask: Box::new(mask),
            earlier,
            group,
            compute,
            key_block: key_block.max(1),
            products,
            scale,
        }
    }

    /// `x · scale` (q before the products, or the gradient of the scaled q): `x` itself at 1.
    fn scaled(&self, x: &Tensor) -> CResult<Tensor> {
        match self.scale {
            1.0 => Ok(x.clone()),
            scale => x.affine(scale, 0.0),
        }
    }

    /// How the kernel multiplies where it takes bf16 products ([`Products::Bf16`]): f32 queries
    /// and the kernel running (see [`Blocks::kernel_applies`]); `None` elsewhere.
    fn bf16_products(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> CResult<Option<Multiply>> {
        let applies = self.products == Products::Bf16
            && q.dtype() == DType::F32
            && self.kernel_applies(q, k, v)?;
        Ok(applies.then(|| Multiply::Bf16 {
            kernel: Kernel::detect(),
            scale: self.scale as f32,
        }))
    }

    /// How the CPU kernel multiplies where it runs the forward of q (unscaled), k and v as they
    /// are ([`Blocks::kernel_applies`]); `None` where it does not.
    fn kernel_multiply(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> CResult<Option<Multiply>> {
        if !self.kernel_applies(q, k, v)? {
            return Ok(None);
        }
        Ok(Some(
            self.bf16_products(q, k, v)?.unwrap_or(Multiply::Exact),
        ))
    }

    /// The key blocks, in order: the earlier keys', then the op's own `own` keys'.
    fn ranges(&self, own: usize) -> CResult<Vec<KeyRange>> {
        let earlier = match &self.earlier {
            Some(e) => e.keys.dim(2)?,
            None => 0,
        };
        let blocks = |len: usize, is_earlier: bool, index: usize| {
            (0..len).step_by(self.key_block).map(move |start| KeyRange {
                earlier: is_earlier,
                start,
                n: self.key_block.min(len - start),
                index: index + start,
            })
        };
        Ok(blocks(earlier, true, 0)
            .chain(blocks(own, false, earlier))
            .collect())
    }

    /// The keys and values of block `r` (`k`, `v`: the op's own).
    fn keys_values(&self, r: KeyRange, k: &Tensor, v: &Tensor) -> CResult<(Tensor, Tensor)> {
        let (k, v) = match (&self.earlier, r.earlier) {
            (Some(e), true) => (&e.keys, &e.values),
            _ => (k, v),
        };
        Ok((k.narrow(2, r.start, r.n)?, v.narrow(2, r.start, r.n)?))
    }

    /// Scores of all queries against the keys `k` of block `r` (`[b, kv_heads, group, c, n]`, in the
    /// compute dtype), and the block's additive mask (`None`: every query reads every key).
    /// Timed in parts ([`op_times`], the forward's and the backward's together): the product, its
    /// cast to the compute dtype and the mask.
    fn scores(&self, q: &Tensor, k: &Tensor, r: KeyRange) -> CResult<(Tensor, Option<Tensor>)> {
        let (b, kv_heads, rows, _) = q.dims4()?;
        let device = q.device();
        let s = op_times::timed("attention.scores.product", device, || q.matmul(&k.t()?))?;
        let s = op_times::timed("attention.scores.cast", device, || {
            s.to_dtype(self.compute)?
                .reshape((b, kv_heads, self.group, rows / self.group, r.n))
        })?;
        let mask = op_times::timed("attention.scores.mask", device, || {
            self.mask.bias(r.index, r.n, self.compute)
        })?;
        Ok((s, mask))
    }

    /// `[b, kv_heads, group, c, n]` in the compute dtype as `[b, kv_heads, group·c, n]` in `dtype`.
    fn flat(&self, x: &Tensor, dtype: DType) -> CResult<Tensor> {
        let (b, kv_heads, group, c, n) = x.dims5()?;
        x.to_dtype(dtype)?.reshape((b, kv_heads, group * c, n))
    }

    /// `[b, kv_heads, group·c, hd]` as `[b, kv_heads, group, c, hd]` in the compute dtype.
    fn grouped(&self, x: &Tensor) -> CResult<Tensor> {
        let (b, kv_heads, rows, hd) = x.dims4()?;
        x.to_dtype(self.compute)?
            .reshape((b, kv_heads, self.group, rows / self.group, hd))
    }

    /// Output (like q) and each query's softmax normalizer, for q unscaled ([`Blocks::scale`]).
    fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> CResult<(Tensor, Normalizer)> {
        if let Some(multiply) = self.bf16_products(q, k, v)? {
            return self.timed_kernel_forward((q, k, v), multiply);
        }
        self.forward_scaled(&self.scaled(q)?, k, v)
    }

    /// [`Blocks::kernel_forward`] for the dtypes of q and the keys, timed.
    fn timed_kernel_forward(
        &self,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        multiply: Multiply,
    ) -> CResult<(Tensor, Normalizer)> {
        op_times::timed("attention.forward.kernel", q.device(), || {
            match (q.dtype(), k.dtype()) {
                (DType::F32, DType::BF16) => {
                    self.kernel_forward::<f32, half::bf16>(q, k, v, multiply)
                }
                (DType::F32, _) => self.kernel_forward::<f32, f32>(q, k, v, multiply),
                _ => self.kernel_forward::<f64, f64>(q, k, v, multiply),
            }
        })
    }

    /// [`Blocks::forward`] for q scaled, with a running maximum so that no block's exponentials
    /// overflow.
    fn forward_scaled(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> CResult<(Tensor, Normalizer)> {
        let device = q.device();
        if self.kernel_applies(q, k, v)? {
            return self.timed_kernel_forward((q, k, v), Multiply::Exact);
        }
        if k.dtype() != q.dtype() {
            let (k, v) = (cast(k, q.dtype())?, cast(v, q.dtype())?);
            return self.forward_scaled(q, &k, &v);
        }
        let dtype = q.dtype();
        // (running max, running sum of exponentials, running weighted sum of values)
        let mut state: Option<(Tensor, Tensor, Tensor)> = None;
        for r in self.ranges(k.dim(2)?)? {
            let (k, v) = self.keys_values(r, k, v)?;
            let (s, mask) =
                op_times::timed("attention.forward.scores", device, || self.scores(q, &k, r))?;
            let before = state.as_ref().map(|(m, _, _)| m);
            let (p, max, sum) = op_times::timed("attention.forward.softmax", device, || {
                if let Some(fused) = softmax_block::forward(&s, mask.as_ref(), before)? {
                    return Ok(fused);
                }
                // The tensor ops of the softmax block, each timed (the suspects on a card).
                let s = op_times::timed("attention.forward.softmax.mask", device, || {
                    masked(&s, mask.as_ref())
                })?;
                let max = op_times::timed("attention.forward.softmax.max", device, || {
                    let block_max = s.max_keepdim(D::Minus1)?;
                    match before {
                        Some(m) => m.maximum(&block_max),
                        None => Ok(block_max),
                    }
                })?;
                let p = op_times::timed("attention.forward.softmax.exp", device, || {
                    s.broadcast_sub(&max)?.exp()
                })?;
                let sum = op_times::timed("attention.forward.softmax.sum", device, || {
                    p.sum_keepdim(D::Minus1)
                })?;
                Ok::<_, candle_core::Error>((p, max, sum))
            })?;
            // Only the probabilities go on: the scores' memory is free for the product.
            drop((s, mask));
            state = Some(op_times::timed("attention.forward.values", device, || {
                let pv = self.grouped(&self.flat(&p, dtype)?.matmul(&v)?)?;
                Ok::<_, candle_core::Error>(match state {
                    None => (max, sum, pv),
                    Some((m, l, acc)) => {
                        let rescale = (m - &max)?.exp()?;
                        let l = ((l * &rescale)? + sum)?;
                        let acc = (acc.broadcast_mul(&rescale)? + pv)?;
                        (max, l, acc)
                    }
                })
            })?);
        }
        let (max, sum, acc) = state.ok_or_else(|| candle_core::Error::Msg("no keys".into()))?;
        let out = self.flat(&acc.broadcast_div(&sum)?, dtype)?.contiguous()?;
        let log_sum = sum.log()?;
        Ok((out, Normalizer { max, log_sum }))
    }

    /// Whether the CPU kernel ([`kernel`]) runs the op: f32/f64 on the CPU with the softmax in the
    /// model's dtype, keys and values shaped like q's heads, and earlier keys' gradients it can add
    /// into (contiguous buffers long enough, sharing no storage with each other or the inputs).
    /// Elsewhere the tensor-op path runs, which reports what does not fit.
    fn kernel_applies(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> CResult<bool> {
        let on_cpu = Backend::of(q) == Backend::Cpu && !KERNEL_OFF.with(|c| c.get());
        if !on_cpu || !host_float(q) || self.compute != q.dtype() {
            return Ok(false);
        }
        let (b, kv_heads, rows, hd) = q.dims4()?;
        // Keys and values in q's dtype, or bf16 ones for an f32 forward without earlier keys
        // (the kernel widens them a block at a time; the backward widens them whole).
        let stored = |t: &Tensor| {
            t.dtype() == q.dtype()
                || (t.dtype(), q.dtype()) == (DType::BF16, DType::F32) && self.earlier.is_none()
        };
        // The sequence length of a `[b, kv_heads, len, hd]` tensor like q's on the CPU.
        let heads_of = |t: &Tensor| match *t.dims() {
            [tb, tk, len, td] if (tb, tk, td) == (b, kv_heads, hd) => {
                (t.device().is_cpu() && stored(t)).then_some(len)
            }
            _ => None,
        };
        let pair = |a: &Tensor, b: &Tensor| {
            heads_of(a).filter(|&n| heads_of(b) == Some(n) && a.dtype() == b.dtype())
        };
        let own = pair(k, v);
        let sizes = rows > 0 && hd > 0 && self.group > 0 && rows % self.group == 0;
        let earlier = match &self.earlier {
            None => Some(0),
            Some(e) => {
                let ids =
                    [&e.grad_keys, &e.grad_values, q, k, v, &e.keys, &e.values].map(storage_id);
                let distinct = ids[0].is_some()
                    && ids[1].is_some()
                    && ids[0] != ids[1]
                    && ids[2..].iter().all(|id| *id != ids[0] && *id != ids[1]);
                let contiguous = e.grad_keys.is_contiguous() && e.grad_values.is_contiguous();
                match (pair(&e.keys, &e.values), pair(&e.grad_keys, &e.grad_values)) {
                    (Some(n), Some(len)) if e.offset + n <= len && distinct && contiguous => {
                        Some(n)
                    }
                    _ => None,
                }
            }
        };
        Ok(match (own, earlier) {
            (Some(t), Some(n)) => sizes && t + n > 0,
            _ => false,
        })
    }

    /// The kernel's sizes for queries `[b, kv_heads, rows, hd]`.
    fn kernel_dims(
        &self,
        (b, kv_heads, rows, hd): (usize, usize, usize, usize),
    ) -> CResult<kernel::Dims> {
        Ok(kernel::Dims {
            items: b * kv_heads,
            kv_heads,
            rows,
            c: rows / self.group,
            hd,
        })
    }

    /// Key block `r` with its mask's data.
    fn kernel_block<T: WithDType>(
        &self,
        dims: kernel::Dims,
        r: KeyRange,
    ) -> CResult<kernel::KeyBlock<T>> {
        let mask = match self.mask.bias(r.index, r.n, self.compute)? {
            // `[1 | b, 1, 1, c, n]`, as the kernel reads it (a mask that only broadcasts to it is
            // expanded; one that does not is an error).
            Some(m) => {
                let per_batch = m.dim(0)? > 1;
                let rows = if per_batch {
                    dims.items / dims.kv_heads
                } else {
                    1
                };
                let m = m.broadcast_as((rows, 1, 1, dims.c, r.n))?;
                Some((m.flatten_all()?.to_vec1::<T>()?, per_batch))
            }
            None => None,
        };
        Ok(kernel::KeyBlock {
            earlier: r.earlier,
            start: r.start,
            n: r.n,
            mask,
        })
    }

    /// [`Blocks::forward`] by the CPU kernel.
    fn kernel_forward<T: KernelFloat, K: WithDType + kernel::Stored<T>>(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        multiply: Multiply,
    ) -> CResult<(Tensor, Normalizer)> {
        let dims = self.kernel_dims(q.dims4()?)?;
        let data = HostKeys::new(q, k, v, self.earlier.as_ref())?;
        let fwd = data.read::<T, K, _>((dims, multiply), |inputs| {
            self.kernel_forward_of(inputs, k.dim(2)?)
        })?;
        let device = q.device();
        let normalizer = self.normalizer_of(&fwd, q.dims4()?, device)?;
        Ok((Tensor::from_vec(fwd.out, q.shape(), device)?, normalizer))
    }

    /// The CPU kernel's forward of `inputs`, with `own` keys of the op's own.
    fn kernel_forward_of<T: KernelFloat, K: kernel::Stored<T>>(
        &self,
        inputs: &kernel::Inputs<'_, T, K>,
        own: usize,
    ) -> CResult<kernel::Forward<T>> {
        let ranges = self.ranges(own)?;
        let fetch = |b: usize| self.kernel_block::<T>(inputs.dims, ranges[b]);
        let blocks = kernel::Blocks {
            count: ranges.len(),
            fetch: &fetch,
        };
        kernel::forward(inputs, blocks)
    }

    /// The normalizer of the kernel's forward `fwd` of queries `[b, kv_heads, rows, hd]`.
    fn normalizer_of<T: WithDType>(
        &self,
        fwd: &kernel::Forward<T>,
        (b, kv_heads, rows, _): (usize, usize, usize, usize),
        device: &candle_core::Device,
    ) -> CResult<Normalizer> {
        let per_query = (b, kv_heads, self.group, rows / self.group, 1);
        Ok(Normalizer {
            max: Tensor::from_slice(&fwd.max, per_query, device)?,
            log_sum: Tensor::from_slice(&fwd.log_sum, per_query, device)?,
        })
    }

    /// The op's backward by the CPU kernel: the gradients of q and of the op's own keys and values;
    /// the earlier keys' are added into their buffers.
    fn kernel_backward<T: KernelFloat>(
        &self,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        (out, normalizer): (&Tensor, &Normalizer),
        grad: &Tensor,
        multiply: Multiply,
    ) -> CResult<(Tensor, Tensor, Tensor)> {
        let dims = self.kernel_dims(q.dims4()?)?;
        let t = k.dim(2)?;
        let ranges = self.ranges(t)?;
        let fetch = |b: usize| self.kernel_block::<T>(dims, ranges[b]);
        let data = HostKeys::new(q, k, v, self.earlier.as_ref())?;
        let per_query = |x: &Tensor| x.flatten_all()?.to_vec1::<T>();
        let (max, log_sum) = (per_query(&normalizer.max)?, per_query(&normalizer.log_sum)?);
        let (out, grad) = (out.contiguous()?, grad.contiguous()?);
        let (out_guard, grad_guard) = (out.storage_and_layout(), grad.storage_and_layout());
        let out_data = host_slice::<T>(&out_guard.0, out_guard.1)?;
        let grad_data = host_slice::<T>(&grad_guard.0, grad_guard.1)?;
        let mut dq = vec![T::zero(); dims.items * dims.rows * dims.hd];
        let (mut dk, mut dv) = (
            vec![T::zero(); dims.items * t * dims.hd],
            vec![T::zero(); dims.items * t * dims.hd],
        );
        let mut run = |earlier: Option<kernel::KeyGrads<'_, T>>| {
            data.read::<T, T, _>((dims, multiply), |inputs| {
                let blocks = kernel::Blocks {
                    count: ranges.len(),
                    fetch: &fetch,
                };
                let grads = kernel::Grads {
                    dq: &mut dq,
                    own: kernel::KeyGrads {
                        keys: &mut dk,
                        values: &mut dv,
                        len: t,
                        offset: 0,
                    },
                    earlier,
                };
                kernel::backward(inputs, blocks, (out_data, &max, &log_sum), grad_data, grads)
            })
        };
        match &self.earlier {
            None => run(None)?,
            Some(e) => {
                let len = e.grad_keys.dim(2)?;
                let offset = e.offset;
                let added = with_data_mut::<T, _>(&e.grad_keys, |gk, gk_layout| {
                    with_data_mut::<T, _>(&e.grad_values, |gv, gv_layout| {
                        run(Some(kernel::KeyGrads {
                            keys: view_mut(gk, gk_layout)?,
                            values: view_mut(gv, gv_layout)?,
                            len,
                            offset,
                        }))
                    })
                })?;
                if added.flatten().is_none() {
                    candle_core::bail!("attention kernel: earlier keys' gradients not on the CPU");
                }
            }
        }
        let device = q.device();
        Ok((
            Tensor::from_vec(dq, q.shape(), device)?,
            Tensor::from_vec(dk, k.shape(), device)?,
            Tensor::from_vec(dv, v.shape(), device)?,
        ))
    }
}

/// The contiguous elements of a tensor's view in its storage (the earlier keys' gradients).
fn view_mut<'a, T>(data: &'a mut [T], layout: &Layout) -> CResult<&'a mut [T]> {
    let (start, end) = layout.contiguous_offsets().ok_or_else(|| {
        candle_core::Error::Msg("attention kernel: gradient not contiguous".into())
    })?;
    Ok(&mut data[start..end])
}

/// The kernel's inputs, read in place: q contiguous, keys and values with each head's rows
/// contiguous (a chunk's keys narrowed from the sequence's are not copied).
struct HostKeys {
    q: Tensor,
    own: (Tensor, Tensor),
    earlier: Option<(Tensor, Tensor)>,
}

/// `t` (`[b, heads, len, hd]`) itself where each head's rows are contiguous, else a contiguous copy.
fn rows_contiguous(t: &Tensor) -> CResult<Tensor> {
    match rows_are_contiguous(t) {
        true => Ok(t.clone()),
        false => t.contiguous(),
    }
}

/// The head rows of `t`'s view in its (read-locked) storage.
fn head_rows<'a, T: WithDType>(
    storage: &'a candle_core::Storage,
    layout: &Layout,
) -> CResult<kernel::HeadRows<'a, T>> {
    let candle_core::Storage::Cpu(cpu) = storage else {
        candle_core::bail!("attention kernel: not on the CPU");
    };
    cpu_head_rows(cpu, layout)
}

/// The head rows of a `[b, heads, len, hd]` view in CPU storage, each head's rows contiguous.
fn cpu_head_rows<'a, T: WithDType>(
    cpu: &'a CpuStorage,
    layout: &Layout,
) -> CResult<kernel::HeadRows<'a, T>> {
    if !rows_contiguous_in(layout.dims(), layout.stride()) {
        candle_core::bail!("attention kernel: head rows not contiguous");
    }
    Ok(kernel::HeadRows {
        data: &cpu.as_slice::<T>()?[layout.start_offset()..],
        batch_stride: layout.stride()[0],
        head_stride: layout.stride()[1],
    })
}

impl HostKeys {
    fn new(q: &Tensor, k: &Tensor, v: &Tensor, earlier: Option<&EarlierKeys>) -> CResult<Self> {
        let earlier = match earlier {
            Some(e) => Some((rows_contiguous(&e.keys)?, rows_contiguous(&e.values)?)),
            None => None,
        };
        Ok(Self {
            q: q.contiguous()?,
            own: (rows_contiguous(k)?, rows_contiguous(v)?),
            earlier,
        })
    }

    /// Runs `f` on the kernel's inputs, the storages read-locked meanwhile.
    fn read<T: KernelFloat, K: WithDType, R>(
        &self,
        (dims, multiply): (kernel::Dims, Multiply),
        f: impl FnOnce(&kernel::Inputs<'_, T, K>) -> CResult<R>,
    ) -> CResult<R> {
        let q = self.q.storage_and_layout();
        let (k, v) = (
            self.own.0.storage_and_layout(),
            self.own.1.storage_and_layout(),
        );
        let own = kernel::KeysValues {
            keys: head_rows::<K>(&k.0, k.1)?,
            values: head_rows::<K>(&v.0, v.1)?,
        };
        let q = host_slice::<T>(&q.0, q.1)?;
        with_earlier(self.earlier.as_ref(), |earlier| {
            let inputs = kernel::Inputs {
                dims,
                q,
                own,
                earlier,
                multiply,
            };
            f(&inputs)
        })
    }
}

/// Runs `f` on the earlier keys and values (`[b, kv_heads, n, hd]`, each head's rows contiguous),
/// their storages read-locked meanwhile.
fn with_earlier<K: WithDType, R>(
    earlier: Option<&(Tensor, Tensor)>,
    f: impl FnOnce(Option<kernel::KeysValues<'_, K>>) -> CResult<R>,
) -> CResult<R> {
    let Some((k, v)) = earlier else {
        return f(None);
    };
    let (k, v) = (k.storage_and_layout(), v.storage_and_layout());
    f(Some(kernel::KeysValues {
        keys: head_rows::<K>(&k.0, k.1)?,
        values: head_rows::<K>(&v.0, v.1)?,
    }))
}

/// Each query's softmax normalizer (`[b, kv_heads, group, c, 1]`): `p = exp((s − max) − log_sum)`.
/// Kept as two terms: for a row whose keys are all masked, `max` is the dtype's minimum, and adding
/// `log_sum` to it would round the sum away.
#[derive(Clone)]
struct Normalizer {
    max: Tensor,
    log_sum: Tensor,
}

/// The op: q, k and v in, the output out, the backward written out ([`Attention::inner_bwd`]).
struct Attention {
    blocks: Blocks,
    forward: Forward,
    /// Whether q and the output are in the layer's layout ([`HeadsLayout`]).
    over_heads: bool,
    /// What the forward leaves for the backward.
    saved: Mutex<Option<Saved>>,
}

/// How the op's forward runs.
enum Forward {
    /// In the op, by the CPU kernel multiplying so, the earlier keys and values read from these
    /// (each head's rows contiguous).
    CpuKernel(Multiply, Option<(Tensor, Tensor)>),
    /// By the composed path before the op was recorded, handed over.
    Composed(Precomputed),
}

/// What the forward leaves for the backward.
#[derive(Clone)]
struct Saved {
    /// To recompute the probabilities.
    normalizer: Normalizer,
    /// Over heads ([`HeadsLayout`]): the output in the inner layout.
    inner_out: Option<Tensor>,
}

/// The op recorded over the layer's layout: q `[b, heads, c, hd]` unscaled, output
/// `[b, c, heads·hd]`; the inner layout (q `[b, kv_heads, group·c, hd]` scaled, output like it) is
/// formed inside the op, so none of its reshapes, transposes and the scaling is a graph node (each
/// would be a zero-filled buffer and a sum in candle's backward).
struct HeadsLayout;

impl HeadsLayout {
    /// q `[b, heads, c, hd]` as the inner layout's `[b, kv_heads, group·c, hd]`.
    fn inner_q(q: &Tensor, kv_heads: usize) -> CResult<Tensor> {
        let (b, heads, c, hd) = q.dims4()?;
        q.contiguous()?
            .reshape((b, kv_heads, heads / kv_heads.max(1) * c, hd))
    }

    /// The data of an output `[b, heads, c, hd]` (the inner layout's `[b, kv_heads, group·c, hd]`)
    /// laid out as `[b, c, heads·hd]`.
    fn outer_data<T: Copy>(inner: &[T], (b, heads, c, hd): (usize, usize, usize, usize)) -> Vec<T> {
        let mut out = Vec::with_capacity(inner.len());
        for batch in 0..b {
            for i in 0..c {
                for h in 0..heads {
                    let at = ((batch * heads + h) * c + i) * hd;
                    out.extend_from_slice(&inner[at..at + hd]);
                }
            }
        }
        out
    }

    /// An output or its gradient `[b, kv_heads, group·c, hd]` as `[b, c, heads·hd]`.
    fn outer(x: &Tensor, heads: usize) -> CResult<Tensor> {
        let (b, kv_heads, rows, hd) = x.dims4()?;
        let c = kv_heads * rows / heads.max(1);
        x.reshape((b, heads, c, hd))?
            .transpose(1, 2)?
            .reshape((b, c, heads * hd))
    }

    /// The gradient of the output `[b, c, heads·hd]` in the inner layout.
    fn inner_grad(grad: &Tensor, kv_heads: usize, hd: usize) -> CResult<Tensor> {
        let (b, c, width) = grad.dims3()?;
        let heads = width / hd.max(1);
        grad.reshape((b, c, heads, hd))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((b, kv_heads, heads / kv_heads.max(1) * c, hd))
    }
}

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "streambp-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        match &self.forward {
            Forward::CpuKernel(multiply, earlier) => {
                let inputs = [(s1, l1), (s2, l2), (s3, l3)];
                let kernel = || self.kernel_fwd(*multiply, earlier.as_ref(), inputs);
                op_times::timed("attention.forward.kernel", &Device::Cpu, kernel)
            }
            Forward::Composed(out) => out.cpu(),
        }
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
        match &self.forward {
            Forward::Composed(out) => out.cuda(),
            Forward::CpuKernel(..) => candle_core::bail!("attention: the CPU kernel on the card"),
        }
    }

    /// Per key block, with `P` recomputed from the normalizer: `dV = Pᵀ g`, `dP = g Vᵀ`,
    /// `dS = P ⊙ (dP − Σ g ⊙ out)` (the softmax's backward; `Σ_keys P ⊙ dP = g · out`), `dQ += dS K`,
    /// `dK = dSᵀ Q`.
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (k, v) = (k.detach(), v.detach());
        let saved = self.saved()?;
        let (dq, dk, dv) = match &saved.inner_out {
            None => self.inner_bwd(&q.detach(), &k, &v, &out.detach(), &grad.detach())?,
            Some(inner_out) => {
                let (kv_heads, hd) = (k.dim(1)?, k.dim(3)?);
                let inner_q = HeadsLayout::inner_q(&q.detach(), kv_heads)?;
                let inner_grad = HeadsLayout::inner_grad(&grad.detach(), kv_heads, hd)?;
                let (dq, dk, dv) = self.inner_bwd(&inner_q, &k, &v, inner_out, &inner_grad)?;
                (dq.reshape(q.dims())?, dk, dv)
            }
        };
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

impl Attention {
    /// The op with its forward computed as `forward` says.
    fn new(blocks: Blocks, forward: Forward, over_heads: bool, saved: Option<Saved>) -> Self {
        Self {
            blocks,
            forward,
            over_heads,
            saved: Mutex::new(saved),
        }
    }

    /// What the forward left (an error before the forward ran).
    fn saved(&self) -> CResult<Saved> {
        let saved = self.saved.lock().map_err(|_| poisoned())?;
        saved
            .clone()
            .ok_or_else(|| candle_core::Error::Msg("attention: backward before forward".into()))
    }

    /// The forward by the CPU kernel on the op's inputs (q contiguous, unscaled, in the layer's
    /// layout where the op is over heads; k and v with each head's rows contiguous): the output,
    /// the normalizer and the inner output left in [`Attention::saved`].
    fn kernel_fwd(
        &self,
        multiply: Multiply,
        earlier: Option<&(Tensor, Tensor)>,
        [q, k, v]: [(&CpuStorage, &Layout); 3],
    ) -> CResult<(CpuStorage, Shape)> {
        match (q.0, k.0) {
            (CpuStorage::F32(_), CpuStorage::BF16(_)) => {
                self.kernel_fwd_as::<f32, half::bf16>(multiply, earlier, [q, k, v])
            }
            (CpuStorage::F32(_), CpuStorage::F32(_)) => {
                self.kernel_fwd_as::<f32, f32>(multiply, earlier, [q, k, v])
            }
            (CpuStorage::F64(_), CpuStorage::F64(_)) => {
                self.kernel_fwd_as::<f64, f64>(multiply, earlier, [q, k, v])
            }
            _ => candle_core::bail!("attention kernel: q and keys in other dtypes"),
        }
    }

    /// [`Attention::kernel_fwd`] for q in `T` and keys in `K`.
    fn kernel_fwd_as<T: KernelFloat, K: WithDType + kernel::Stored<T>>(
        &self,
        multiply: Multiply,
        earlier: Option<&(Tensor, Tensor)>,
        [(qs, ql), (ks, kl), (vs, vl)]: [(&CpuStorage, &Layout); 3],
    ) -> CResult<(CpuStorage, Shape)> {
        let b = &self.blocks;
        let (batch, heads, c, hd) = ql.shape().dims4()?;
        let (_, kv_heads, own, _) = kl.shape().dims4()?;
        let inner = match self.over_heads {
            true => (batch, kv_heads, heads / kv_heads.max(1) * c, hd),
            false => (batch, heads, c, hd),
        };
        let q = input_data::<T>(qs, ql)?;
        // The exact products take q scaled, as candle's `affine` scales it (`x·s + 0`).
        let scaled: Vec<T>;
        let q = match multiply {
            Multiply::Exact if b.scale != 1.0 => {
                let (s, zero) = (T::from_f64(b.scale), T::from_f64(0.0));
                scaled = q.iter().map(|&x| x * s + zero).collect();
                &scaled
            }
            _ => q,
        };
        let own_keys = kernel::KeysValues {
            keys: cpu_head_rows::<K>(ks, kl)?,
            values: cpu_head_rows::<K>(vs, vl)?,
        };
        let dims = b.kernel_dims(inner)?;
        let fwd = with_earlier(earlier, |earlier| {
            let inputs = kernel::Inputs {
                dims,
                q,
                own: own_keys,
                earlier,
                multiply,
            };
            b.kernel_forward_of(&inputs, own)
        })?;
        let normalizer = b.normalizer_of(&fwd, inner, &Device::Cpu)?;
        let (out, shape, inner_out) = match self.over_heads {
            true => {
                let out = HeadsLayout::outer_data(&fwd.out, (batch, heads, c, hd));
                let inner_out = Tensor::from_vec(fwd.out, inner, &Device::Cpu)?;
                (out, Shape::from((batch, c, heads * hd)), Some(inner_out))
            }
            false => (fwd.out, ql.shape().clone(), None),
        };
        let saved = Saved {
            normalizer,
            inner_out,
        };
        *self.saved.lock().map_err(|_| poisoned())? = Some(saved);
        Ok((T::to_cpu_storage_owned(out), shape))
    }

    /// The backward in the inner layout (see [`HeadsLayout`]), q unscaled ([`Blocks::scale`]): the
    /// gradients of q, k and v.
    fn inner_bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Tensor, Tensor, Tensor)> {
        let b = &self.blocks;
        if k.dtype() != q.dtype() {
            // Keys and values stored in bf16 for an f32 forward: their gradients in f32, rounded.
            let (wide_k, wide_v) = (cast(k, q.dtype())?, cast(v, q.dtype())?);
            let (dq, dk, dv) = self.inner_bwd(q, &wide_k, &wide_v, out, grad)?;
            return Ok((dq, cast(&dk, k.dtype())?, cast(&dv, v.dtype())?));
        }
        if let Some(multiply) = b.bf16_products(q, k, v)? {
            return self.timed_kernel_bwd((q, k, v), (out, grad), multiply);
        }
        let (dq, dk, dv) = self.scaled_bwd(&b.scaled(q)?, k, v, out, grad)?;
        Ok((b.scaled(&dq)?, dk, dv))
    }

    /// [`Blocks::kernel_backward`] for q's dtype, timed.
    fn timed_kernel_bwd(
        &self,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        (out, grad): (&Tensor, &Tensor),
        multiply: Multiply,
    ) -> CResult<(Tensor, Tensor, Tensor)> {
        let normalizer = self.saved()?.normalizer;
        let (b, fwd) = (&self.blocks, (out, &normalizer));
        op_times::timed("attention.backward.kernel", q.device(), || {
            match q.dtype() {
                DType::F32 => b.kernel_backward::<f32>((q, k, v), fwd, grad, multiply),
                _ => b.kernel_backward::<f64>((q, k, v), fwd, grad, multiply),
            }
        })
    }

    /// [`Attention::inner_bwd`] for q scaled (the gradient of q is the scaled q's), keys and values
    /// in q's dtype.
    fn scaled_bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Tensor, Tensor, Tensor)> {
        let b = &self.blocks;
        let device = q.device();
        if b.kernel_applies(q, k, v)? {
            return self.timed_kernel_bwd((q, k, v), (out, grad), Multiply::Exact);
        }
        let dtype = q.dtype();
        let saved = self.saved()?;
        let dot = (b.grouped(grad)? * b.grouped(out)?)?.sum_keepdim(D::Minus1)?;
        let mut grad_q: Option<Tensor> = None;
        let (own_grad_k, own_grad_v) = (k.zeros_like()?, v.zeros_like()?);
        for r in b.ranges(k.dim(2)?)? {
            let (k_r, v_r) = b.keys_values(r, k, v)?;
            let (s, mask, grad_p) =
                op_times::timed("attention.backward.scores_and_dp", device, || {
                    let (s, mask) = b.scores(q, &k_r, r)?;
                    let grad_p = grad
                        .matmul(&v_r.t()?)?
                        .to_dtype(b.compute)?
                        .reshape(s.shape())?;
                    Ok::<_, candle_core::Error>((s, mask, grad_p))
                })?;
            let normalizer = (&saved.normalizer.max, &saved.normalizer.log_sum);
            let (p, grad_s) = op_times::timed("attention.backward.softmax", device, || {
                let fused = softmax_block::backward(&s, mask.as_ref(), normalizer, &grad_p, &dot)?;
                if let Some(fused) = fused {
                    return Ok(fused);
                }
                // The tensor ops of the softmax block, each timed (the suspects on a card).
                let p =
                    op_times::timed("attention.backward.softmax.probabilities", device, || {
                        masked(&s, mask.as_ref())?
                            .broadcast_sub(normalizer.0)?
                            .broadcast_sub(normalizer.1)?
                            .exp()
                    })?;
                let grad_s =
                    op_times::timed("attention.backward.softmax.gradient", device, || {
                        &p * grad_p.broadcast_sub(&dot)?
                    })?;
                Ok::<_, candle_core::Error>((p, grad_s))
            })?;
            // Each score-sized buffer is freed as soon as it is used: the scores and dP now, P after
            // its product.
            drop((s, mask, grad_p));
            let (grad_k_r, grad_v_r) =
                op_times::timed("attention.backward.products", device, || {
                    let grad_v_r = b.flat(&p, dtype)?.t()?.matmul(grad)?;
                    drop(p);
                    let grad_s = b.flat(&grad_s, dtype)?;
                    let dq = grad_s.matmul(&k_r)?.to_dtype(b.compute)?;
                    grad_q = Some(match grad_q.take() {
                        Some(acc) => (acc + dq)?,
                        None => dq,
                    });
                    Ok::<_, candle_core::Error>((grad_s.t()?.matmul(q)?, grad_v_r))
                })?;
            // Each block's gradient goes straight where it belongs: no per-block list to concatenate.
            let (grad_keys, grad_values, at) = match (&b.earlier, r.earlier) {
                (Some(e), true) => (&e.grad_keys, &e.grad_values, e.offset + r.start),
                _ => (&own_grad_k, &own_grad_v, r.start),
            };
            op_times::timed("attention.backward.scatter", device, || {
                add_at(grad_keys, &grad_k_r, at)?;
                add_at(grad_values, &grad_v_r, at)
            })?;
        }
        let grad_q = grad_q
            .ok_or_else(|| candle_core::Error::Msg("no keys".into()))?
            .to_dtype(dtype)?;
        Ok((grad_q, own_grad_k, own_grad_v))
    }
}

/// Scores with their mask added (the composed path).
fn masked(s: &Tensor, mask: Option<&Tensor>) -> CResult<Tensor> {
    match mask {
        Some(mask) => s.broadcast_add(mask),
        None => Ok(s.clone()),
    }
}

/// `dst[:, :, at..at + n] += src` (`n` = `src`'s keys), in place.
fn add_at(dst: &Tensor, src: &Tensor, at: usize) -> CResult<()> {
    let n = src.dim(2)?;
    let sum = (dst.narrow(2, at, n)? + src.to_dtype(dst.dtype())?)?;
    dst.slice_set(&sum, 2, at)
}

/// How the op walks the keys: the dtype its softmax is computed in and the keys per block
/// ([`KEY_BLOCK`] in the model; any size gives the same result to rounding).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Blocking {
    /// The softmax's dtype (f32 for half-precision inputs).
    pub compute: DType,
    /// Keys per block.
    pub key_block: usize,
    /// How the products multiply.
    pub products: Products,
}

/// How the op's matrix products multiply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Products {
    /// In the compute dtype.
    #[default]
    Compute,
    /// For f32 inputs holding bf16 values (a bf16 layer computed in f32), on the CPU kernel: as
    /// PyTorch's bf16 attention on the CPU (its `cpu_flash_attention` and backward), each product's
    /// operands in bf16 and its sums in f32, on the bf16 kernel in force
    /// ([`crate::host::half_product::Kernel::detect`]). So the forward's exponentials, and the backward's
    /// probabilities, output gradient and `dS`, are rounded to bf16 for their products, and `q·kᵀ`
    /// is of the unscaled q, its f32 sums scaled (as are `dS·K` and `dSᵀ·Q`). Elsewhere (the
    /// composed path CUDA runs, f64) the products are [`Products::Compute`]'s.
    Bf16,
}

/// `softmax(q kᵀ + bias) v` per key/value head, differentiable in q, k and v (see the module doc for
/// shapes), keys in blocks as `blocking` says.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    earlier: Option<EarlierKeys>,
    mask: impl KeyMask + 'static,
    group: usize,
    blocking: Blocking,
) -> CResult<Tensor> {
    let blocks = Blocks::new(mask, earlier, group, blocking, 1.0);
    record(blocks, (q, k, v), false)
}

/// [`attention`] over the layer's layout: q `[b, heads, c, hd]` before the `scale` on q·k, the
/// output `[b, c, heads·hd]` (the query heads side by side, as the output projection reads them).
/// The same arithmetic; the regrouping and the scaling happen inside the op ([`HeadsLayout`]).
pub fn attention_over_heads(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    earlier: Option<EarlierKeys>,
    mask: impl KeyMask + 'static,
    blocking: Blocking,
    scale: f64,
) -> CResult<Tensor> {
    let (heads, kv_heads) = (q.dim(1)?, k.dim(1)?);
    if kv_heads == 0 || heads % kv_heads != 0 {
        candle_core::bail!("attention: {heads} query heads over {kv_heads} key/value heads");
    }
    let blocks = Blocks::new(mask, earlier, heads / kv_heads, blocking, scale);
    record(blocks, (q, k, v), true)
}

/// The op of `blocks` on q, k and v recorded, its forward by the backend of q: the CPU kernel in
/// the op where it takes the inputs as they are (q contiguous, each head's rows of the keys and
/// values contiguous), else the composed path (which the kernel may still run, on copies: see
/// [`Blocks::forward`]) before the op, handed over.
fn record(
    blocks: Blocks,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    over_heads: bool,
) -> CResult<Tensor> {
    let (heads, kv_heads) = (q.dim(1)?, k.dim(1)?);
    let inner_q = match over_heads {
        true => HeadsLayout::inner_q(&q.detach(), kv_heads)?,
        false => q.detach(),
    };
    let (k0, v0) = (k.detach(), v.detach());
    let as_they_are = q.is_contiguous() && rows_are_contiguous(k) && rows_are_contiguous(v);
    let multiply = match Backend::of(q) {
        Backend::Cpu if as_they_are => blocks.kernel_multiply(&inner_q, &k0, &v0)?,
        // A card's kernel goes here (docs/architecture.md, "A kernel for an op on a backend").
        Backend::Cpu | Backend::Cuda | Backend::Composed => None,
    };
    let op = match multiply {
        Some(multiply) => {
            let earlier = match &blocks.earlier {
                Some(e) => Some((rows_contiguous(&e.keys)?, rows_contiguous(&e.values)?)),
                None => None,
            };
            Attention::new(
                blocks,
                Forward::CpuKernel(multiply, earlier),
                over_heads,
                None,
            )
        }
        None => {
            let (inner_out, normalizer) = blocks.forward(&inner_q, &k0, &v0)?;
            let (out, inner_out) = match over_heads {
                true => (HeadsLayout::outer(&inner_out, heads)?, Some(inner_out)),
                false => (inner_out, None),
            };
            let saved = Saved {
                normalizer,
                inner_out,
            };
            let forward = Forward::Composed(Precomputed::new(out));
            Attention::new(blocks, forward, over_heads, Some(saved))
        }
    };
    q.apply_op3(k, v, op)
}

/// Whether each head's rows of `t` (`[b, heads, len, hd]`) are contiguous.
fn rows_are_contiguous(t: &Tensor) -> bool {
    rows_contiguous_in(t.dims(), t.stride())
}

/// Whether each head's rows of a `[b, heads, len, hd]` view with these strides are contiguous (a
/// dimension of one element may have any stride, as candle lays such views out).
fn rows_contiguous_in(dims: &[usize], stride: &[usize]) -> bool {
    match (dims, stride) {
        (&[_, _, len, hd], &[_, _, row, col]) => (len <= 1 || row == hd) && (hd <= 1 || col == 1),
        _ => false,
    }
}

fn poisoned() -> candle_core::Error {
    candle_core::Error::Msg("attention: poisoned lock".into())
}
