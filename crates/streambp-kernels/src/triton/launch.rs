//! Launching a compiled kernel on candle's context and stream, so it is ordered with candle's own
//! kernels: the module loaded once per context, the arguments checked against the table before
//! every launch, and the device addresses of tensors and storages the launchers pass.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::{DType, Layout, Storage, Tensor};
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute_enum};
use cudarc::driver::{CudaFunction, DevicePtr, LaunchConfig, PushKernelArg};

use super::{arch_for, check, dtype_name, find, Args, Compiled, Value};

type CResult<T> = candle_core::Result<T>;

/// Bytes every buffer the kernels read or write starts on (they were compiled assuming it).
pub(crate) const ALIGN: usize = 16;

/// Launches so far in this process, per kernel name (for tests that a kernel ran).
static LAUNCHES: OnceLock<Mutex<HashMap<&'static str, usize>>> = OnceLock::new();

/// How many of the card's kernels (Triton's, and the library calls counted with them) whose name
/// starts with `prefix` (`""`: all) this process has launched.
pub fn launches(prefix: &str) -> usize {
    LAUNCHES.get().and_then(|m| m.lock().ok()).map_or(0, |m| {
        m.iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(_, n)| n)
            .sum()
    })
}

/// The compiled architecture `device` runs ([`arch_for`]), if any.
pub(crate) fn arch(device: &CudaDevice) -> CResult<Option<u32>> {
    let (major, minor) = device
        .cuda_stream()
        .context()
        .compute_capability()
        .map_err(candle_core::Error::wrap)?;
    Ok(arch_for(major as u32, minor as u32))
}

/// The kernel `name` of `table` compiled for `device`'s architecture, `dtype` and `variant`, if
/// there is one.
pub(crate) fn compiled_for(
    table: &'static [Compiled],
    device: &CudaDevice,
    (name, dtype, variant): (&str, DType, usize),
) -> CResult<Option<&'static Compiled>> {
    Ok(match (arch(device)?, dtype_name(dtype)) {
        (Some(arch), Some(dtype)) => find(table, name, arch, dtype, variant),
        _ => None,
    })
}

/// [`compiled_for`] where the op's dispatch has already found it: an error naming it otherwise.
pub(crate) fn required(
    table: &'static [Compiled],
    device: &CudaDevice,
    (name, dtype, variant): (&str, DType, usize),
) -> CResult<&'static Compiled> {
    compiled_for(table, device, (name, dtype, variant))?.ok_or_else(|| {
        candle_core::Error::Msg(format!("no card kernel {name} for {dtype:?} ({variant})"))
    })
}

/// The address of an input the kernels read as contiguous elements (an error for other layouts).
pub(crate) fn contiguous_address(storage: &CudaStorage, layout: &Layout) -> CResult<u64> {
    if !layout.is_contiguous() {
        candle_core::bail!("a kernel for the card given an input laid out as {layout:?}");
    }
    storage_address(storage, layout)
}

/// The most dynamic shared memory a block may opt into on `device`, bytes.
pub(crate) fn shared_opt_in(device: &CudaDevice) -> CResult<i64> {
    let opt_in = CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN;
    let shared = device
        .cuda_stream()
        .context()
        .attribute(opt_in)
        .map_err(candle_core::Error::wrap)?;
    Ok(shared as i64)
}

/// Launches `kernel` over `grid` (x, y) with `args` on `device`'s stream, once they match what it
/// was compiled for; nothing for an empty grid.
pub(crate) fn launch(
    device: &CudaDevice,
    kernel: &'static Compiled,
    grid: (usize, usize),
    args: &Args,
) -> CResult<()> {
    check(kernel, args).map_err(candle_core::Error::wrap)?;
    if grid.0 == 0 || grid.1 == 0 {
        return Ok(());
    }
    let grid_dim = (
        u32::try_from(grid.0).map_err(candle_core::Error::wrap)?,
        u32::try_from(grid.1).map_err(candle_core::Error::wrap)?,
        1,
    );
    let function = function(device, kernel)?;
    let stream = device.cuda_stream();
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
    // SAFETY: the arguments are the kernel's, in order and of its types (`check`); the launchers
    // pass addresses of live buffers of the extents their counts and strides say, and grids that
    // cover no more than that.
    unsafe { builder.launch(config) }.map_err(candle_core::Error::wrap)?;
    count(kernel.kernel);
    Ok(())
}

/// Counts a launch of the card's kernel `name` ([`launches`]): the Triton kernels' and the library
/// calls the ops make in their place (cuBLAS's products into accumulators).
pub(crate) fn count(name: &'static str) {
    if let Ok(mut m) = LAUNCHES.get_or_init(Default::default).lock() {
        *m.entry(name).or_default() += 1;
    }
}

/// The device address of `t`'s first element (the tensor must outlive the launches that read it).
pub(crate) fn address(t: &Tensor) -> CResult<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(storage) = &*storage else {
        candle_core::bail!("a kernel for the card given a tensor off the card");
    };
    storage_address(storage, layout)
}

/// The device address of the first element of `layout` in `storage`.
pub(crate) fn storage_address(storage: &CudaStorage, layout: &Layout) -> CResult<u64> {
    let stream = storage.device.cuda_stream();
    let base = match storage.dtype() {
        DType::F32 => storage.as_cuda_slice::<f32>()?.device_ptr(&stream).0,
        DType::BF16 => storage.as_cuda_slice::<half::bf16>()?.device_ptr(&stream).0,
        DType::I64 => storage.as_cuda_slice::<i64>()?.device_ptr(&stream).0,
        DType::U8 => storage.as_cuda_slice::<u8>()?.device_ptr(&stream).0,
        other => candle_core::bail!("no kernel for the card reads {other:?}"),
    };
    Ok(base + (layout.start_offset() * storage.dtype().size_in_bytes()) as u64)
}

/// Whether `t` is contiguous from an [`ALIGN`]ed address, as the kernels read their buffers.
pub(crate) fn is_aligned(t: &Tensor) -> bool {
    let offset = t.layout().start_offset() * t.dtype().size_in_bytes();
    t.is_contiguous() && offset.is_multiple_of(ALIGN)
}

/// `t` contiguous from an [`ALIGN`]ed address: itself where it is, else a copy.
pub(crate) fn aligned(t: &Tensor) -> CResult<Tensor> {
    match is_aligned(t) {
        true => Ok(t.clone()),
        false => t.force_contiguous(),
    }
}

/// A new buffer of `len` elements of `dtype` (bf16 or f32) on `device`, uninitialised: every
/// launcher writes each element it returns.
pub(crate) fn alloc(device: &CudaDevice, dtype: DType, len: usize) -> CResult<CudaStorage> {
    let storage = match dtype {
        DType::F32 => {
            // SAFETY: the callers' kernels write every element before anything reads it.
            let slice = unsafe { device.alloc::<f32>(len)? };
            CudaStorage::wrap_cuda_slice(slice, device.clone())
        }
        DType::BF16 => {
            // SAFETY: as above.
            let slice = unsafe { device.alloc::<half::bf16>(len)? };
            CudaStorage::wrap_cuda_slice(slice, device.clone())
        }
        other => candle_core::bail!("no kernel for the card writes {other:?}"),
    };
    Ok(storage)
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
        .map_err(|_| candle_core::Error::Msg("kernels for the card: poisoned lock".into()))?;
    if let Some(f) = loaded.get(&key) {
        return Ok(f.clone());
    }
    tracing::debug!(
        "loading {} for sm_{} (cubin sha256 {})",
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
