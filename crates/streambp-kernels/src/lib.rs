//! The fused ops of streambp's layers and LM head, and the host's compute library they run on.
//!
//! - [`ops`]: every op the layers, the LM head and the optimizer run, one home each: RMSNorm
//!   ([`ops::rms_norm`]), rope ([`ops::rope`]), SwiGLU ([`ops::swiglu`]) and GeGLU ([`ops::geglu`]),
//!   the projections with LoRA's ([`ops::linear`]), products of constants and their workspace
//!   ([`ops::matmul`]), the attention ([`ops::attention`]), the LM head's softmax and log-probs
//!   ([`ops::head_softmax`]), gradients added into their accumulators in place
//!   ([`ops::accumulate`]), casts and rounding ([`ops::cast`]) and the gradients' norm
//!   ([`ops::grad_norm`]). Each has its public function, the composed tensor ops it is held to
//!   (every device's path without a kernel), and its CPU kernel, chosen by [`Backend`]. This is
//!   what the other crates call.
//! - [`choices`]: which host kernels a process runs where the CPU can run several (instruction set,
//!   bf16 kernel), chosen once by the program.
//! - [`host`]: the CPU's compute library the ops' kernels are built from, a module per concern:
//!   tensors' host memory ([`host::storage`]), the SIMD layer that compiles a pass per instruction
//!   set and picks one at run time ([`host::simd`], [`vectorized!`]), exponentials ([`host::exp`]),
//!   row reductions ([`host::reduce`]), bf16 element conversions ([`host::cast`]), and matrix
//!   products: tiled over the threads ([`host::products`], their workspace [`host::gemm_memory`]),
//!   of a few rows ([`host::skinny`]), transposed operands copied into rows ([`host::transpose`])
//!   and bf16 operands ([`host::half_product`], on the widened, dot-product or AMX kernel). Public
//!   for this crate's tests, examples and the kernels' benchmarks, not for the other crates.
//! - `triton`: the card's Triton kernels as their launchers see them (the compiled tables each op
//!   keeps in its `compiled.rs`, the argument checks) and, under the `cuda` feature, their launch on
//!   candle's stream.
//! - [`op_times`]: where a step's time goes, op part by op part; [`precomputed`]: a composed
//!   forward handed to the op that records its written backward.
//!
//! A kernel of the host's library answers `None` (or `false`) where it does not apply (another
//! device or dtype), and its caller keeps the composed tensor ops.

#![warn(missing_docs)]

pub mod backend;
pub mod choices;
pub mod host;
pub mod op_times;
pub mod ops;
pub mod precomputed;
#[cfg(test)]
mod testing;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod triton;

pub use backend::Backend;
#[cfg(feature = "cuda")]
pub use triton::launch::launches as card_launches;
