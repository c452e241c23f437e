//! Tensors' host memory as slices: the contiguous CPU data of a tensor (or of a custom op's input)
//! read or written in place, for the passes that make one pass where composed ops make several, and
//! the test of whether a tensor's data can be read so ([`host_float`]).

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
    f(input_data(cpu, layout)?).map(Some)
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

/// Runs `f` on the CPU storage `t` lies in, mutably, with `t`'s layout (which addresses `t`'s elements
/// in it: `t` may be a view). `None` when `t` is not on the CPU in `T`. For kernels that add into
/// several views at once, which candle's in-place ops (one destination each) cannot.
pub fn with_data_mut<T: WithDType, R>(
    t: &Tensor,
    f: impl FnOnce(&mut [T], &candle_core::Layout) -> CResult<R>,
) -> CResult<Option<R>> {
    if !t.device().is_cpu() || t.dtype() != T::DTYPE {
        return Ok(None);
    }
    let op = WithMut {
        f: std::sync::Mutex::new(Some(f)),
        out: std::sync::Mutex::new(None),
        dtype: std::marker::PhantomData::<fn() -> T>,
    };
    t.inplace_op1(&op)?;
    let out = op.out.into_inner().ok().flatten();
    out.ok_or_else(|| candle_core::Error::Msg("CPU pass: storage not reached".into()))?
        .map(Some)
}

/// The in-place op through which [`with_data_mut`] reaches a storage.
struct WithMut<T, F, R> {
    f: std::sync::Mutex<Option<F>>,
    out: std::sync::Mutex<Option<CResult<R>>>,
    dtype: std::marker::PhantomData<fn() -> T>,
}

impl<T: WithDType, F: FnOnce(&mut [T], &candle_core::Layout) -> CResult<R>, R>
    candle_core::InplaceOp1 for WithMut<T, F, R>
{
    fn name(&self) -> &'static str {
        "streambp-with-data-mut"
    }

    fn cpu_fwd(
        &self,
        storage: &mut candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> CResult<()> {
        use std::any::Any;
        let data: Option<&mut Vec<T>> = match storage {
            candle_core::CpuStorage::F32(v) => (v as &mut dyn Any).downcast_mut(),
            candle_core::CpuStorage::F64(v) => (v as &mut dyn Any).downcast_mut(),
            candle_core::CpuStorage::BF16(v) => (v as &mut dyn Any).downcast_mut(),
            _ => None,
        };
        let (Some(data), Ok(mut f)) = (data, self.f.lock()) else {
            candle_core::bail!("CPU pass: not f32, f64 or bf16");
        };
        let Some(f) = f.take() else {
            candle_core::bail!("CPU pass: run twice");
        };
        let result = f(data, layout);
        if let Ok(mut out) = self.out.lock() {
            *out = Some(result);
        }
        Ok(())
    }
}

/// The elements of a contiguous CPU tensor in its storage (from [`Tensor::storage_and_layout`], whose
/// guard the caller keeps while it reads).
pub fn host_slice<'a, T: WithDType>(
    storage: &'a Storage,
    layout: &candle_core::Layout,
) -> CResult<&'a [T]> {
    let Storage::Cpu(cpu) = storage else {
        candle_core::bail!("CPU pass: not on the CPU");
    };
    input_data(cpu, layout)
}

/// The address of the CPU buffer `t` lies in, telling tensors that share storage apart (`None`
/// off the CPU or outside f32/f64/bf16).
pub fn storage_id(t: &Tensor) -> Option<usize> {
    let (storage, _) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(candle_core::CpuStorage::F32(v)) => Some(v.as_ptr() as usize),
        Storage::Cpu(candle_core::CpuStorage::F64(v)) => Some(v.as_ptr() as usize),
        Storage::Cpu(candle_core::CpuStorage::BF16(v)) => Some(v.as_ptr() as usize),
        _ => None,
    }
}

/// Whether `t`'s data is host memory in f32 or f64, as the host's passes read it.
pub fn host_float(t: &Tensor) -> bool {
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
