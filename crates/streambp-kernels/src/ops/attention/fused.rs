//! The attention on the card by the fused Triton kernels (`triton/attention.py`, compiled into
//! cubins by `scripts/compile_triton.py`), launched on candle's stream so they are ordered with its
//! own kernels. The forward leaves each row's log-sum-exp; the backward recomputes every score block
//! from it in on-chip memory, so no `heads × rows × keys` tensor exists at any point. Where the
//! kernels do not apply (another architecture, dtype or head dim, a card with less shared memory than
//! a kernel needs, a mask not of the chunk's form, views the compiled kernels were not specialised
//! for, more batch rows × heads than a grid holds), [`Fused::new`] answers `None` and the op takes the
//! composed path, with one warning per reason. A row that reads no key (only left padding gives one)
//! gets output 0, where the composed path averages every value; the loss never reads such rows.

use std::sync::{Mutex, OnceLock};

use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device, Tensor};

use super::cuda_table::{
    delta_args, find, forward_args, keys_args, queries_args, Chunk, Grads, KeySegment, Reads, Row,
    View,
};
use super::{Blocks, EarlierKeys};
use crate::triton::launch::{self, address};
use crate::triton::{check, dtype_name, Args, Compiled};

type CResult<T> = candle_core::Result<T>;

/// The four kernels of one architecture, dtype and head dim, with the chunk they run on.
pub(super) struct Fused {
    forward: &'static Compiled,
    delta: &'static Compiled,
    queries: &'static Compiled,
    keys: &'static Compiled,
    device: CudaDevice,
    chunk: Chunk,
    /// The mask's per-token tables (document starts as i64, key validity as u8) on the card.
    tables: [Option<Tensor>; 2],
    /// Whether q and the output are in the layer's layout (`[b, heads, c, hd]` and `[b, c, heads·hd]`).
    over_heads: bool,
}

/// The most blocks a grid's second dimension holds (CUDA's limit).
const GRID_Y: usize = 65_535;

/// How many fused attention kernels this process has launched (for tests that the fused path ran).
pub fn launches() -> usize {
    launch::launches("attention_")
}

/// Logs `reason` once per process: why the fused kernels did not take a chunk.
fn composed_because(reason: String) -> Option<Fused> {
    static SEEN: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    let seen = SEEN.get_or_init(|| Mutex::new(Vec::new()));
    if let Ok(mut seen) = seen.lock() {
        if !seen.contains(&reason) {
            tracing::warn!("attention on the card: {reason}; the composed tensor ops run instead");
            seen.push(reason);
        }
    }
    None
}

impl Fused {
    /// The kernels for `blocks` on q (`[b, heads, c, hd]` over heads, else the inner layout), k and v
    /// (`[b, kv_heads, n, hd]`), or `None` where they do not apply (logged once).
    pub(super) fn new(
        blocks: &Blocks,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        over_heads: bool,
    ) -> CResult<Option<Self>> {
        let Device::Cuda(device) = q.device() else {
            return Ok(None);
        };
        let (b, kv_heads, own, hd) = k.dims4()?;
        let heads = kv_heads * blocks.group;
        let rows = match over_heads {
            true => q.dim(2)?,
            false => q.dim(2)? / blocks.group.max(1),
        };
        let Some(dtype) = dtype_name(q.dtype()) else {
            return Ok(composed_because(format!("no kernel for {:?}", q.dtype())));
        };
        let mut tensors = vec![k.dtype()];
        if let Some(e) = &blocks.earlier {
            tensors.extend([e.keys.dtype(), e.values.dtype(), e.grad_keys.dtype()]);
            tensors.push(e.grad_values.dtype());
        }
        if tensors.iter().any(|&d| d != q.dtype()) {
            return Ok(composed_because(
                "queries, keys and their gradients in different dtypes".into(),
            ));
        }
        let Some(arch) = launch::arch(device)? else {
            return Ok(composed_because(
                "no kernels compiled for this card's compute capability".into(),
            ));
        };
        let find = |kernel| find(kernel, arch, dtype, hd);
        let (Some(forward), Some(delta), Some(queries), Some(keys)) = (
            find("attention_forward"),
            find("attention_backward_delta"),
            find("attention_backward_queries"),
            find("attention_backward_keys"),
        ) else {
            return Ok(composed_because(format!("no kernels for head dim {hd}")));
        };
        let shared = launch::shared_opt_in(device)?;
        let most = [forward, delta, queries, keys]
            .map(|k| k.shared)
            .into_iter()
            .max();
        if most.is_some_and(|m| m as i64 > shared) {
            return Ok(composed_because(format!(
                "{dtype} head dim {hd} needs {} B of shared memory per block, this card has {shared}",
                most.unwrap_or(0)
            )));
        }
        if b * heads > GRID_Y {
            return Ok(composed_because(format!(
                "{b} rows × {heads} heads: more than a grid's {GRID_Y} blocks"
            )));
        }
        let Some(mask) = blocks.mask.structure() else {
            return Ok(composed_because("a mask not of a chunk's form".into()));
        };
        let earlier = blocks.earlier.as_ref().map_or(Ok(0), |e| e.keys.dim(2))?;
        let chunk = Chunk {
            heads,
            group: blocks.group,
            rows,
            earlier,
            own,
            q_start: mask.q_start,
            k_start: mask.k_start,
            window: mask.window.unwrap_or(0),
            scale: blocks.scale as f32,
        };
        let on_card = |t: &Option<Tensor>, dtype: DType| -> CResult<Option<Tensor>> {
            t.as_ref()
                .map(|t| t.to_dtype(dtype)?.to_device(q.device())?.contiguous())
                .transpose()
        };
        let tables = [
            on_card(&mask.doc_start, DType::I64)?,
            on_card(&mask.key_valid, DType::U8)?,
        ];
        let fused = Self {
            forward,
            delta,
            queries,
            keys,
            device: device.clone(),
            chunk,
            tables,
            over_heads,
        };
        // The inputs as the kernels would read them: laid out and aligned as they were compiled for.
        let fits = fused
            .reads(q, k, v, blocks.earlier.as_ref())
            .map_err(|e| e.to_string())
            .and_then(|r| {
                let args = forward_args(&r, r.q, r.q.ptr, &fused.chunk);
                check(forward, &args).map_err(|e| e.to_string())
            });
        match fits {
            Ok(()) => Ok(Some(fused)),
            Err(why) => Ok(composed_because(format!(
                "inputs the kernels do not take ({why})"
            ))),
        }
    }

    /// The output (shaped as the op's: `[b, c, heads·hd]` over heads, else like q) and each row's
    /// log-sum-exp `[b, heads, c]` f32.
    pub(super) fn forward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        earlier: Option<&EarlierKeys>,
    ) -> CResult<(Tensor, Tensor)> {
        let c = &self.chunk;
        let b = k.dim(0)?;
        let out = match self.over_heads {
            true => Tensor::zeros((b, c.rows, c.heads * k.dim(3)?), q.dtype(), q.device())?,
            false => Tensor::zeros(q.shape(), q.dtype(), q.device())?,
        };
        let lse = Tensor::zeros((b, c.heads, c.rows), DType::F32, q.device())?;
        let reads = self.reads(q, k, v, earlier)?;
        let args = forward_args(&reads, self.rows_view(&out)?, address(&lse)?, c);
        self.launch(self.forward, self.row_grid(self.forward, b), &args)?;
        Ok((out, lse))
    }

    /// q's gradient (like q) and the chunk's own keys' and values' (like k); the earlier keys'
    /// gradients are added into their buffers.
    pub(super) fn backward(
        &self,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        (out, grad, lse): (&Tensor, &Tensor, &Tensor),
        earlier: Option<&EarlierKeys>,
    ) -> CResult<(Tensor, Tensor, Tensor)> {
        let c = &self.chunk;
        let b = k.dim(0)?;
        let delta = Tensor::zeros((b, c.heads, c.rows), DType::F32, q.device())?;
        let o_view = self.rows_view(out)?;
        // The gradient as it comes where the kernels take it so (the layer's is), else a copy.
        let takes = |g: &Tensor| -> CResult<Option<View>> {
            let Ok(view) = self.rows_view(g) else {
                return Ok(None);
            };
            let args = delta_args(o_view, view, address(&delta)?, c);
            Ok(check(self.delta, &args).is_ok().then_some(view))
        };
        // (The copy must live while the kernels that read it are queued.)
        let (_grad_read, do_view) = match takes(grad)? {
            Some(view) => (grad.clone(), view),
            None => {
                let copy = grad.contiguous()?;
                let view = self.rows_view(&copy)?;
                (copy, view)
            }
        };
        let args = delta_args(o_view, do_view, address(&delta)?, c);
        self.launch(self.delta, self.row_grid(self.delta, b), &args)?;
        let grads = Grads {
            d_o: do_view,
            lse: address(lse)?,
            delta: address(&delta)?,
        };
        let reads = self.reads(q, k, v, earlier)?;
        let dq = Tensor::zeros(q.shape(), q.dtype(), q.device())?;
        let args = queries_args(&reads, &grads, self.rows_view(&dq)?, c);
        self.launch(self.queries, self.row_grid(self.queries, b), &args)?;
        let dk = Tensor::zeros(k.shape(), k.dtype(), k.device())?;
        let dv = Tensor::zeros(v.shape(), v.dtype(), v.device())?;
        let own = KeySegment {
            k: reads.k2,
            v: reads.v2,
            dk: keys_view(&dk)?,
            dv: keys_view(&dv)?,
            keys: c.own,
            first: c.k_start + c.earlier,
            accumulate: false,
        };
        let mut segments = vec![own];
        if let Some(e) = earlier.filter(|_| c.earlier > 0) {
            let bytes = e.grad_keys.dtype().size_in_bytes();
            segments.push(KeySegment {
                k: reads.k1,
                v: reads.v1,
                dk: at_key(keys_view(&e.grad_keys)?, e.offset, bytes),
                dv: at_key(keys_view(&e.grad_values)?, e.offset, bytes),
                keys: c.earlier,
                first: c.k_start,
                accumulate: true,
            });
        }
        for s in segments.iter().filter(|s| s.keys > 0) {
            let args = keys_args(reads.q, s, &grads, reads.doc, reads.valid, c);
            let grid = (
                s.keys.div_ceil(self.keys.block_n.max(1)),
                b * c.heads / c.group,
            );
            self.launch(self.keys, grid, &args)?;
        }
        Ok((dq, dk, dv))
    }

    /// The tensors the forward and the queries' backward read.
    fn reads(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        earlier: Option<&EarlierKeys>,
    ) -> CResult<Reads> {
        let [doc, valid] = &self.tables;
        let (k2, v2) = (keys_view(k)?, keys_view(v)?);
        let (k1, v1) = match earlier {
            Some(e) => (keys_view(&e.keys)?, keys_view(&e.values)?),
            // No earlier keys: n1 = 0, so nothing reads these.
            None => (k2, v2),
        };
        let row = |t: &Option<Tensor>| -> CResult<Row> {
            t.as_ref()
                .map(|t| Ok((address(t)?, t.dim(1)? as i64)))
                .transpose()
        };
        Ok(Reads {
            q: self.rows_view(q)?,
            k1,
            v1,
            k2,
            v2,
            doc: row(doc)?,
            valid: row(valid)?,
        })
    }

    /// A tensor of the chunk's rows as `[b, heads, c, hd]`: the layer's q `[b, heads, c, hd]` or
    /// output `[b, c, heads·hd]` over heads, else the inner layout `[b, kv_heads, group·c, hd]`.
    fn rows_view(&self, t: &Tensor) -> CResult<View> {
        let c = &self.chunk;
        let s = t.stride();
        let ptr = address(t)?;
        let strides = match (t.rank(), self.over_heads) {
            (4, true) if s[3] == 1 => [s[0], s[1], s[2]],
            (3, true) if s[2] == 1 => [s[0], t.dim(2)? / c.heads.max(1), s[1]],
            // Head kv·group + g, row i at kv·s1 + (g·c + i)·s2: one head stride where s1 = group·c·s2.
            (4, false) if s[3] == 1 && s[1] == c.group * c.rows * s[2] => {
                [s[0], c.rows * s[2], s[2]]
            }
            _ => candle_core::bail!("attention on the card: rows laid out as {:?}", t.layout()),
        };
        Ok(View {
            ptr,
            strides: strides.map(|x| x as i64),
        })
    }

    /// A grid over the chunk's rows: blocks of `kernel.block_m` rows, one per batch row and head.
    fn row_grid(&self, kernel: &Compiled, b: usize) -> (usize, usize) {
        (
            self.chunk.rows.div_ceil(kernel.block_m.max(1)),
            b * self.chunk.heads,
        )
    }

    /// Launches `kernel` over `grid` with `args` on candle's stream.
    fn launch(&self, kernel: &'static Compiled, grid: (usize, usize), args: &Args) -> CResult<()> {
        launch::launch(&self.device, kernel, grid, args)
    }
}

/// `[b, kv_heads, n, hd]` keys, values or their gradients as a kernel reads them.
fn keys_view(t: &Tensor) -> CResult<View> {
    let s = t.stride();
    if t.rank() != 4 || s[3] != 1 {
        candle_core::bail!("attention on the card: keys laid out as {:?}", t.layout());
    }
    Ok(View {
        ptr: address(t)?,
        strides: [s[0] as i64, s[1] as i64, s[2] as i64],
    })
}

/// `view` (of elements of `bytes` bytes) from key `index` on.
fn at_key(view: View, index: usize, bytes: usize) -> View {
    View {
        ptr: view.ptr + (index as i64 * view.strides[2]) as u64 * bytes as u64,
        ..view
    }
}
