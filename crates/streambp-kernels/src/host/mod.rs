//! The host's compute library: what the CPU kernels of [`crate::ops`] are built from.

mod amx_kernel;
mod bf16_kernel;
pub mod cast;
pub mod choices;
pub mod exp;
pub mod gemm_memory;
pub mod half_product;
pub mod products;
pub mod reduce;
pub mod simd;
pub mod skinny;
pub mod storage;
pub mod transpose;
