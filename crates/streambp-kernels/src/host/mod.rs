//! The host's compute library: what the CPU kernels of [`crate::ops`] are built from.

pub(crate) mod amx_kernel;
pub(crate) mod bf16_kernel;
pub mod cast;
pub mod exp;
pub mod gemm_memory;
pub mod half_product;
pub mod products;
pub mod reduce;
pub mod simd;
pub mod skinny;
pub mod storage;
pub mod transpose;
