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

// The card's kernels' table and argument lists: in the CPU build for their tests alone.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod compiled;
mod composed;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod cuda_table;
#[cfg(feature = "cuda")]
mod fused;
mod host;
pub mod kernel;
pub mod memory;
mod op;
pub mod softmax_block;

use candle_core::{DType, Tensor};

use crate::ops::cast::through_f32;

use op::record;

#[cfg(feature = "cuda")]
pub use fused::launches as fused_launches;

thread_local! {
    /// Set by [`with_fused_softmax_blocks`].
    static KERNEL_OFF: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with the attention ops on this thread taking their tensor-op path with the host's fused
/// softmax blocks (what the CPU runs where its kernel does not apply) rather than the CPU kernel,
/// restored however `f` ends: for tests of that path. (The composed path alone, a card's, is
/// [`crate::backend::with_composed`]'s.)
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

    /// The mask in the form the card's fused kernels take it, where it is of that form; `None`
    /// (the default) where it is not, and the composed path runs.
    fn structure(&self) -> Option<MaskStructure> {
        None
    }
}

/// A chunk's mask by rule rather than by tensor: query `q_start + i` reads key `k_start + j` (indices
/// in the sequence; the earlier keys first) when `j ≤ i`, within the sliding window if any
/// (`key > query − window`), in the query's document (`key ≥ doc_start[row, query]`) and not padding
/// (`key_valid[row, key] ≠ 0`).
#[derive(Debug, Clone)]
pub struct MaskStructure {
    /// Sequence index of the first query.
    pub q_start: usize,
    /// Sequence index of the first key.
    pub k_start: usize,
    /// The sliding window's width.
    pub window: Option<usize>,
    /// `[b, T]` integers: the first index of each token's document, for packed rows.
    pub doc_start: Option<Tensor>,
    /// `[b, T]`: nonzero for real tokens, for padded rows.
    pub key_valid: Option<Tensor>,
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
}

/// What the forward leaves for the backward to recompute the probabilities from.
#[derive(Clone)]
enum Stats {
    /// The block path's normalizer (the CPU kernel, the composed tensor ops).
    Blocks(Normalizer),
    /// The card's fused kernels, and each row's log-sum-exp `[b, heads, c]` f32.
    #[cfg(feature = "cuda")]
    Fused(std::sync::Arc<fused::Fused>, Tensor),
}

impl Stats {
    /// The block path's normalizer (an error for the fused kernels' statistics).
    fn normalizer(&self) -> CResult<&Normalizer> {
        match self {
            Stats::Blocks(n) => Ok(n),
            #[cfg(feature = "cuda")]
            Stats::Fused(..) => {
                candle_core::bail!("attention: the fused forward's statistics in a block backward")
            }
        }
    }
}

/// Each query's softmax normalizer (`[b, kv_heads, group, c, 1]`): `p = exp((s − max) − log_sum)`.
/// Kept as two terms: for a row whose keys are all masked, `max` is the dtype's minimum, and adding
/// `log_sum` to it would round the sum away.
#[derive(Clone)]
struct Normalizer {
    max: Tensor,
    log_sum: Tensor,
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
/// The same arithmetic; the regrouping and the scaling happen inside the op (`op::HeadsLayout`).
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

/// [`attention_over_heads`] for a layer's tensors in any dtype, keys in [`KEY_BLOCK`]s, the softmax
/// in f32 (f64 for f64 inputs). On the host, bf16 runs the f32 kernel: bf16 q, k and v are widened
/// and the output rounded back once, except that keys and values without earlier ones are read
/// in bf16 as they are (a decoding step's whole cache would otherwise be widened at every step);
/// earlier keys, if any, must then be f32 for the widening to apply.
pub fn attention_in_layer(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    earlier: Option<EarlierKeys>,
    mask: impl KeyMask + 'static,
    products: Products,
    scale: f64,
) -> CResult<Tensor> {
    let earlier_f32 = earlier.as_ref().is_none_or(|e| {
        [&e.keys, &e.values, &e.grad_keys, &e.grad_values]
            .iter()
            .all(|t| t.dtype() == DType::F32)
    });
    let bf16_keys = k.dtype() == DType::BF16 && v.dtype() == DType::BF16;
    let mut mask = Some(mask);
    let mut in_f32 = |q: &Tensor, k: &Tensor, v: &Tensor| {
        let mask = mask
            .take()
            .ok_or_else(|| candle_core::Error::Msg("attention: the mask used twice".into()))?;
        attention_in_layer(q, k, v, earlier.clone(), mask, products, scale)
    };
    if earlier.is_none() && bf16_keys {
        if let Some(out) = through_f32([q], |[q]| in_f32(&q, k, v))? {
            return Ok(out);
        }
    }
    if earlier_f32 {
        if let Some(out) = through_f32([q, k, v], |[q, k, v]| in_f32(&q, &k, &v))? {
            return Ok(out);
        }
    }
    let Some(mask) = mask else {
        candle_core::bail!("attention: the mask used twice");
    };
    let compute = match q.dtype() {
        DType::F64 => DType::F64,
        _ => DType::F32,
    };
    let blocking = Blocking {
        compute,
        key_block: KEY_BLOCK,
        products,
    };
    attention_over_heads(q, k, v, earlier, mask, blocking, scale)
}
