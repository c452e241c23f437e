//! `--device`, `--dtype` and byte-size parsing, shared by the trainer's and the bench's command lines.

use candle_core::{DType, Device};

use crate::error::{ModelError, Result};

/// `cpu`, `cuda` or `cuda:N` (the latter only in a build with `--features cuda`).
pub fn parse_device(spec: &str) -> Result<Device> {
    match spec {
        "cpu" => Ok(Device::Cpu),
        s if s == "cuda" || s.starts_with("cuda:") => {
            let ordinal = s
                .strip_prefix("cuda:")
                .map(|n| {
                    n.parse::<usize>()
                        .map_err(|_| ModelError::Input(format!("bad device ordinal in {s:?}")))
                })
                .transpose()?
                .unwrap_or(0);
            if !candle_core::utils::cuda_is_available() {
                return Err(ModelError::Input(
                    "--device cuda needs a build with `--features cuda` and a GPU".into(),
                ));
            }
            let device = Device::new_cuda(ordinal)?;
            #[cfg(feature = "cuda")]
            keep_freed_memory(&device);
            Ok(device)
        }
        other => Err(ModelError::Input(format!(
            "unknown device {other:?} (expected cpu, cuda or cuda:N)"
        ))),
    }
}

/// Lets the device's memory pool keep what a step frees instead of returning it to the driver.
///
/// Candle allocates stream-ordered (`cuMemAllocAsync`) from the device's current pool, whose release
/// threshold is 0 by default: every synchronisation (each phase's end, every value read back) hands
/// the pool's free memory back, and the next allocations map it again, page by page. A training
/// process reuses the same sizes every step, so it keeps them, as PyTorch's caching allocator does.
/// The peaks the bench reports count bytes in use, not bytes kept. Best effort: a pool that cannot
/// be set is left as it is.
#[cfg(feature = "cuda")]
fn keep_freed_memory(device: &Device) {
    use candle_core::cuda_backend::cudarc::driver::{result, sys::CUmemPool_attribute};
    let Device::Cuda(cuda) = device else { return };
    let context = cuda.cuda_stream().context().clone();
    if !context.has_async_alloc() || context.bind_to_thread().is_err() {
        return;
    }
    let mut keep_all = u64::MAX;
    // SAFETY: the pool comes from a live, bound context, and the release threshold is a u64.
    let set = unsafe {
        result::device::get_mem_pool(context.cu_device()).and_then(|pool| {
            result::mem_pool::set_attribute(
                pool,
                CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut keep_all as *mut u64 as *mut std::ffi::c_void,
            )
        })
    };
    if let Err(e) = set {
        tracing::warn!("the CUDA memory pool keeps releasing freed memory: {e}");
    }
}

/// `f64`, `f32` or `bf16`.
pub fn parse_dtype(spec: &str) -> Result<DType> {
    match spec {
        "f64" => Ok(DType::F64),
        "f32" => Ok(DType::F32),
        "bf16" => Ok(DType::BF16),
        other => Err(ModelError::Input(format!(
            "unknown dtype {other:?} (expected f64, f32 or bf16)"
        ))),
    }
}

/// The units [`parse_bytes`] reads (case-insensitive), with their sizes.
const UNITS: [(&str, f64); 14] = [
    ("", 1.0),
    ("b", 1.0),
    ("kb", 1e3),
    ("mb", 1e6),
    ("gb", 1e9),
    ("tb", 1e12),
    ("kib", 1024.0),
    ("mib", 1048576.0),
    ("gib", 1073741824.0),
    ("tib", 1099511627776.0),
    ("k", 1024.0),
    ("m", 1048576.0),
    ("g", 1073741824.0),
    ("t", 1099511627776.0),
];

/// Byte sizes such as `512MiB`, `8GiB`, `1.5GB`, `1TiB` or a plain number of bytes (`K`, `M`, `G`, `T`
/// alone are binary units).
pub fn parse_bytes(spec: &str) -> Result<u64> {
    let s = spec.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let value: f64 = num.parse().map_err(|_| {
        ModelError::Input(format!(
            "bad size {spec:?}: expected a number and a unit, like 8GiB"
        ))
    })?;
    let unit = unit.trim().to_ascii_lowercase();
    let (_, scale) = UNITS
        .iter()
        .find(|(name, _)| *name == unit)
        .ok_or_else(|| {
            ModelError::Input(format!(
                "unknown size unit {unit:?} in {spec:?} (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
            ))
        })?;
    let bytes = value * scale;
    if bytes.is_nan() || bytes < 1.0 {
        return Err(ModelError::Input(format!("size {spec:?} is below 1 byte")));
    }
    if bytes >= u64::MAX as f64 {
        return Err(ModelError::Input(format!(
            "size {spec:?} is too large (at most 16 EiB, 2^64 bytes)"
        )));
    }
    Ok(bytes as u64)
}

/// `parse_bytes` for clap.
pub fn parse_budget(s: &str) -> std::result::Result<u64, String> {
    parse_bytes(s).map_err(|e| e.to_string())
}
