//! The gated activations on the card: the Triton kernels of `triton/gated.py` (compiled into
//! [`super::compiled`]) over contiguous runs of elements, launched from the ops' `cuda_fwd`.

use candle_core::cuda_backend::CudaStorage;
use candle_core::{Layout, Shape, Tensor};

use super::cuda_table::{backward_args, forward_args};
use super::GatedKernel;
use crate::triton::launch::{
    self, alloc, compiled_for, contiguous_address, required, storage_address, ALIGN,
};
use crate::triton::Compiled;

type CResult<T> = candle_core::Result<T>;

/// Whether `k`'s card kernels take `t` (on a card that has them, in their dtype).
pub(super) fn takes<K: GatedKernel>(k: K, t: &Tensor) -> CResult<bool> {
    let (candle_core::Device::Cuda(device), Some(variant)) = (t.device(), k.card_variant()) else {
        return Ok(false);
    };
    let found = |name| {
        compiled_for(super::compiled::KERNELS, device, (name, t.dtype(), variant))
            .map(|k| k.is_some())
    };
    Ok(found("gated_forward")? && found("gated_backward")?)
}

/// The kernel `name` of `k`'s variant for `storage`'s device and dtype.
fn kernel_for<K: GatedKernel>(
    storage: &CudaStorage,
    name: &str,
    k: K,
) -> CResult<&'static Compiled> {
    let dtype = candle_core::backend::BackendStorage::dtype(storage);
    let Some(variant) = k.card_variant() else {
        candle_core::bail!("no card kernel {name} for this activation");
    };
    required(
        super::compiled::KERNELS,
        &storage.device,
        (name, dtype, variant),
    )
}

/// `act(gate) ⊙ up`.
pub(super) fn forward<K: GatedKernel>(
    k: K,
    (gs, gl): (&CudaStorage, &Layout),
    (us, ul): (&CudaStorage, &Layout),
) -> CResult<(CudaStorage, Shape)> {
    let kernel = kernel_for(gs, "gated_forward", k)?;
    let n = gl.shape().elem_count();
    let dtype = candle_core::backend::BackendStorage::dtype(gs);
    let y = alloc(&gs.device, dtype, n)?;
    let y_at = storage_address(&y, &Layout::contiguous(n))?;
    let args = forward_args(
        contiguous_address(gs, gl)?,
        contiguous_address(us, ul)?,
        y_at,
        n,
    );
    launch::launch(&gs.device, kernel, (n.div_ceil(kernel.block_m), 1), &args)?;
    Ok((y, gl.shape().clone()))
}

/// d gate and d up in one `[2, n']` buffer, each row padded to [`ALIGN`] bytes.
pub(super) fn backward<K: GatedKernel>(
    k: K,
    (gs, gl): (&CudaStorage, &Layout),
    (us, ul): (&CudaStorage, &Layout),
    (dys, dyl): (&CudaStorage, &Layout),
) -> CResult<(CudaStorage, Shape)> {
    let kernel = kernel_for(gs, "gated_backward", k)?;
    let n = gl.shape().elem_count();
    let dtype = candle_core::backend::BackendStorage::dtype(gs);
    let row = n.next_multiple_of(ALIGN / dtype.size_in_bytes());
    let out = alloc(&gs.device, dtype, 2 * row)?;
    let base = storage_address(&out, &Layout::contiguous(2 * row))?;
    let inputs = (
        contiguous_address(gs, gl)?,
        contiguous_address(us, ul)?,
        contiguous_address(dys, dyl)?,
    );
    let d_up = base + (row * dtype.size_in_bytes()) as u64;
    let args = backward_args(inputs, (base, d_up), n);
    launch::launch(&gs.device, kernel, (n.div_ceil(kernel.block_m), 1), &args)?;
    Ok((out, Shape::from((2, row))))
}
