//! The accumulators on the card: the Triton kernels of `triton/accumulate.py` (compiled into
//! [`super::compiled`]), launched on candle's stream, writing the accumulator in place.

use candle_core::{DType, Device, Tensor};

use super::cuda_table::{add_args, add_rows_args, gemm_args, Layout2, ADD_BLOCK, ROWS_BLOCK};
use crate::triton::launch::{self, address, aligned, compiled_for, is_aligned};
use crate::triton::{check, Args, Compiled};

type CResult<T> = candle_core::Result<T>;

/// The kernel `name` (`variant`) for a gradient `x` into the f32 accumulator `acc` on the same
/// card, laid out as the kernels write it; `None` otherwise.
fn kernel(
    acc: &Tensor,
    x: &Tensor,
    (name, variant): (&str, usize),
) -> CResult<Option<&'static Compiled>> {
    let Device::Cuda(device) = acc.device() else {
        return Ok(None);
    };
    let fits = acc.dtype() == DType::F32
        && x.device().same_device(acc.device())
        && is_aligned(acc)
        && acc.elem_count() > 0;
    match fits {
        true => compiled_for(super::compiled::KERNELS, device, (name, x.dtype(), variant)),
        false => Ok(None),
    }
}

/// Launches `kernel` over `programs` if `args` fit its compiled list; `false` otherwise.
fn run(acc: &Tensor, kernel: &'static Compiled, programs: usize, args: &Args) -> CResult<bool> {
    if check(kernel, args).is_err() {
        return Ok(false);
    }
    launch::launch(acc.device().as_cuda_device()?, kernel, (programs, 1), args)?;
    Ok(true)
}

/// [`super::add`] on the card.
pub(super) fn add(acc: &Tensor, x: &Tensor) -> CResult<bool> {
    let Some(kernel) = kernel(acc, x, ("accumulate_add", ADD_BLOCK))? else {
        return Ok(false);
    };
    let x = aligned(x)?;
    let n = acc.elem_count();
    run(
        acc,
        kernel,
        n.div_ceil(ADD_BLOCK),
        &add_args(address(acc)?, address(&x)?, n),
    )
}

/// [`super::adds_rows_in_place`] on the card: the kernel compiled for this card and the rows'
/// dtype, rows a multiple of 16 wide (as the kernel assumes of `dim`).
pub(super) fn adds_rows(table: &Tensor, rows: &Tensor) -> CResult<bool> {
    let Device::Cuda(device) = table.device() else {
        return Ok(false);
    };
    let what = ("accumulate_add_rows", rows.dtype(), ROWS_BLOCK);
    let compiled = compiled_for(super::compiled::KERNELS, device, what)?.is_some();
    Ok(compiled && table.dims2()?.1.is_multiple_of(16))
}

/// [`super::add_rows`] on the card.
pub(super) fn add_rows(acc: &Tensor, ids: &Tensor, rows: &Tensor) -> CResult<bool> {
    let Some(kernel) = kernel(acc, rows, ("accumulate_add_rows", ROWS_BLOCK))? else {
        return Ok(false);
    };
    let ((vocab, dim), n) = (acc.dims2()?, rows.dims2()?.0);
    if n == 0 {
        return Ok(true);
    }
    let ids = aligned(&ids.to_dtype(DType::I64)?.to_device(acc.device())?)?;
    let rows = aligned(rows)?;
    let buffers = (address(acc)?, address(&ids)?, address(&rows)?);
    let args = add_rows_args(buffers, n, (vocab, dim));
    run(acc, kernel, dim.div_ceil(ROWS_BLOCK), &args)
}

/// [`super::add_product`] on the card: cuBLAS's product with β = 1 into the f32 accumulator, from
/// f32 or bf16 operands (products summed in f32, the sum never rounded to bf16), so a chunk's
/// share makes no weight-sized buffer; `false` for other dtypes or layouts.
pub(super) fn add_product(acc: &Tensor, a: &Tensor, b: &Tensor) -> CResult<bool> {
    use cudarc::cublas::sys::{
        cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
    };
    let Device::Cuda(device) = acc.device() else {
        return Ok(false);
    };
    let data_type = match a.dtype() {
        DType::F32 => cudaDataType_t::CUDA_R_32F,
        DType::BF16 => cudaDataType_t::CUDA_R_16BF,
        _ => return Ok(false),
    };
    let on_card = [a, b].iter().all(|t| t.device().same_device(acc.device()));
    if acc.dtype() != DType::F32 || b.dtype() != a.dtype() || !acc.is_contiguous() || !on_card {
        return Ok(false);
    }
    let layout = |t: &Tensor| -> CResult<Layout2> {
        let strides = t.stride();
        Ok((t.dims2()?, (strides[0], strides[1])))
    };
    let Some(g) = gemm_args(layout(a)?, layout(b)?) else {
        return Ok(false);
    };
    if g.m == 0 || g.n == 0 || g.k == 0 {
        return Ok(true);
    }
    let op = |transposed| match transposed {
        true => cublasOperation_t::CUBLAS_OP_T,
        false => cublasOperation_t::CUBLAS_OP_N,
    };
    let (alpha, beta) = (1f32, 1f32);
    let blas = device.cublas_handle();
    // SAFETY: the three addresses are of live tensors on this card (`acc`, `a`, `b` outlive the
    // call, and candle's stream, which the handle is bound to, orders the product after the
    // kernels that wrote them); the sizes and leading dimensions are those `gemm_args` derived
    // from their shapes and strides, within i32, and `acc` is contiguous f32 `[m, n]`.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            op(g.op_b),
            op(g.op_a),
            g.m as i32,
            g.n as i32,
            g.k as i32,
            &alpha as *const f32 as *const _,
            address(b)? as *const _,
            data_type,
            g.ld_b as i32,
            address(a)? as *const _,
            data_type,
            g.ld_a as i32,
            &beta as *const f32 as *const _,
            address(acc)? as *mut _,
            cudaDataType_t::CUDA_R_32F,
            g.ld_c as i32,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
        )
    }
    .map_err(candle_core::Error::wrap)?;
    launch::count("accumulate_add_product");
    Ok(true)
}
