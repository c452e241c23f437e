//! Hand-written CPU passes over tensors' data: read a tensor's contiguous host memory in place, for
//! kernels that make one pass where composed ops make several (`softmax_block`, the engine's LM head).

use candle_core::{DType, Storage, Tensor, WithDType};

type CResult<T> = candle_core::Result<T>;

/// Runs `f` on the contiguous CPU data of `t` (`None` when `t` is not on the CPU).
pub fn with_data<T: WithDType, R>(
    t: &Tensor,
    f: impl FnOnce(&[T]) -> CResult<R>,
) -> CResult<Option<R>> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        return Ok(None);
    };
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("CPU pass: not contiguous".into()))?;
    f(&cpu.as_slice::<T>()?[start..end]).map(Some)
}

/// Runs `f` on the data of an optional tensor (an empty slice for none).
pub fn with_optional<T: WithDType, R>(
    t: Option<&Tensor>,
    f: impl FnOnce(&[T]) -> CResult<R>,
) -> CResult<Option<R>> {
    match t {
        Some(t) => with_data(t, f),
        None => f(&[]).map(Some),
    }
}

/// Whether a hand-written pass applies to `t`: on the CPU, in f32 or f64.
pub fn fusable(t: &Tensor) -> bool {
    t.device().is_cpu() && matches!(t.dtype(), DType::F32 | DType::F64)
}

/// The data of a custom op's CPU input (which the caller made contiguous).
pub fn input_data<'a, T: WithDType>(
    storage: &'a candle_core::CpuStorage,
    layout: &candle_core::Layout,
) -> CResult<&'a [T]> {
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("CPU op: input not contiguous".into()))?;
    Ok(&storage.as_slice::<T>()?[start..end])
}

/// A CPU tensor of `shape` holding `data`, on `like`'s device.
pub fn tensor_from<T: WithDType>(data: Vec<T>, like: &Tensor) -> CResult<Tensor> {
    Tensor::from_vec(data, like.shape(), like.device())
}
