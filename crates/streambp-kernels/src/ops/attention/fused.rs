//! The attention on the card by the fused Triton kernels (`triton/attention.py`, compiled into
//! cubins by `scripts/compile_triton.py`), launched on candle's stream so they are ordered with its
//! own kernels. The forward leaves each row's log-sum-exp; the backward recomputes every score block
//! from it in on-chip memory, so no `heads × rows × keys` tensor exists at any point. Where the
//! kernels do not apply (another architecture, dtype or head dim, a card with less shared memory than
//! a kernel needs, a mask not of the chunk's form, views the compiled kernels were not specialised
//! for, more batch rows × heads than a grid holds), [`Fused::new`] answers `None` and the op takes the
//! composed path, with one warning per reason. A row that reads no key (only left padding gives one)
//! gets output 0, where the composed path averages every value; the loss never reads such rows.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::{DType, Device, Storage, Tensor};
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute_enum};
use cudarc::driver::{CudaFunction, DevicePtr, LaunchConfig, PushKernelArg};

use super::cuda_table::{
    arch_for, check, delta_args, find, forward_args, keys_args, queries_args, Args, Chunk,
    Compiled, Grads, KeySegment, Reads, Row, Value, View,
};
use super::{Blocks, EarlierKeys};

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

/// Kernel launches so far in this process (for tests that the fused path ran).
static LAUNCHES: AtomicUsize = AtomicUsize::new(0);

/// How many fused attention kernels this process has launched.
pub fn launches() -> usize {
    LAUNCHES.load(Ordering::Relaxed)
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

fn dtype_name(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::BF16 => Some("bf16"),
        DType::F32 => Some("fp32"),
        _ => None,
    }
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
        let (major, minor) = device
            .cuda_stream()
            .context()
            .compute_capability()
            .map_err(candle_core::Error::wrap)?;
        let Some(arch) = arch_for(major as u32, minor as u32) else {
            return Ok(composed_because(format!(
                "no kernels compiled for compute capability {major}.{minor}"
            )));
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
        let context = device.cuda_stream().context().clone();
        let opt_in = CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN;
        let shared = context
            .attribute(opt_in)
            .map_err(candle_core::Error::wrap)?;
        let most = [forward, delta, queries, keys]
            .map(|k| k.shared)
            .into_iter()
            .max();
        if most.is_some_and(|m| m as i64 > shared as i64) {
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

    /// Launches `kernel` over `grid` with `args` on candle's stream, once they match what it was
    /// compiled for.
    fn launch(&self, kernel: &'static Compiled, grid: (usize, usize), args: &Args) -> CResult<()> {
        check(kernel, args).map_err(candle_core::Error::wrap)?;
        if grid.0 == 0 || grid.1 == 0 {
            return Ok(());
        }
        let grid_dim = (
            u32::try_from(grid.0).map_err(candle_core::Error::wrap)?,
            u32::try_from(grid.1).map_err(candle_core::Error::wrap)?,
            1,
        );
        let function = function(&self.device, kernel)?;
        let stream = self.device.cuda_stream();
        let mut builder = stream.launch_builder(&function);
        for (_, value) in args {
            match value {
                Value::Pointer(p) => builder.arg(p),
                Value::I32(x) => builder.arg(x),
                Value::I64(x) => builder.arg(x),
                Value::F32(x) => builder.arg(x),
            };
        }
        // Triton's global and profile scratch pointers, which these kernels do not use (the script
        // refuses kernels that need them).
        let no_scratch = 0u64;
        builder.arg(&no_scratch).arg(&no_scratch);
        let config = LaunchConfig {
            grid_dim,
            block_dim: (32 * kernel.warps, 1, 1),
            shared_mem_bytes: kernel.shared,
        };
        // SAFETY: the arguments are the kernel's, in order and of its types (`check`), every pointer
        // addresses a live tensor of the extent the shapes say, and the grid covers what they say.
        unsafe { builder.launch(config) }.map_err(candle_core::Error::wrap)?;
        LAUNCHES.fetch_add(1, Ordering::Relaxed);
        Ok(())
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

/// The device address of `t`'s first element (the tensor must outlive the launches that read it).
fn address(t: &Tensor) -> CResult<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(storage) = &*storage else {
        candle_core::bail!("attention on the card: a tensor off the card");
    };
    let base = base_address(storage)?;
    Ok(base + (layout.start_offset() * t.dtype().size_in_bytes()) as u64)
}

fn base_address(storage: &CudaStorage) -> CResult<u64> {
    let stream = storage.device.cuda_stream();
    Ok(match storage.dtype() {
        DType::F32 => storage.as_cuda_slice::<f32>()?.device_ptr(&stream).0,
        DType::BF16 => storage.as_cuda_slice::<half::bf16>()?.device_ptr(&stream).0,
        DType::I64 => storage.as_cuda_slice::<i64>()?.device_ptr(&stream).0,
        DType::U8 => storage.as_cuda_slice::<u8>()?.device_ptr(&stream).0,
        other => candle_core::bail!("attention on the card: no kernel reads {other:?}"),
    })
}

/// `kernel`'s function on `device`'s context, its module loaded once per context.
fn function(device: &CudaDevice, kernel: &'static Compiled) -> CResult<CudaFunction> {
    type Loaded = HashMap<(usize, usize), CudaFunction>;
    static LOADED: OnceLock<Mutex<Loaded>> = OnceLock::new();
    let context = device.cuda_stream().context().clone();
    let key = (
        Arc::as_ptr(&context) as usize,
        kernel as *const Compiled as usize,
    );
    let loaded = LOADED.get_or_init(|| Mutex::new(HashMap::new()));
    let mut loaded = loaded
        .lock()
        .map_err(|_| candle_core::Error::Msg("attention on the card: poisoned lock".into()))?;
    if let Some(f) = loaded.get(&key) {
        return Ok(f.clone());
    }
    tracing::debug!(
        "attention on the card: loading {} for sm_{} (cubin sha256 {})",
        kernel.symbol,
        kernel.arch,
        kernel.sha256
    );
    let image = cudarc::nvrtc::Ptx::from_binary(kernel.cubin.to_vec());
    let module = context
        .load_module(image)
        .map_err(candle_core::Error::wrap)?;
    let f = module
        .load_function(kernel.symbol)
        .map_err(candle_core::Error::wrap)?;
    if kernel.shared > 48 * 1024 {
        let max = CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        f.set_attribute(max, kernel.shared as i32)
            .map_err(candle_core::Error::wrap)?;
    }
    loaded.insert(key, f.clone());
    Ok(f)
}
