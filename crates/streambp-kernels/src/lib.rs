//! The fused ops of streambp's layers and LM head, and the host's compute library they run on.
//!
//! - [`host`]: the CPU's compute library, a module per concern: tensors' host memory
//!   ([`host::storage`]), the SIMD layer that compiles a pass per instruction set and picks one at
//!   run time ([`host::simd`], [`vectorized!`]), exponentials ([`host::exp`]), reductions
//!   ([`host::reduce`]), casts and rounding ([`host::cast`]), and matrix products: tiled over the
//!   threads ([`host::products`], their workspace [`host::gemm_memory`]), of a few rows
//!   ([`host::skinny`]), transposed operands copied into rows ([`host::transpose`]) and bf16
//!   operands ([`host::half_product`], on the widened, dot-product or AMX kernel, as chosen in
//!   [`host::choices`]).
//! - [`ops`]: the kernels of the ops the engine fuses: the attention's forward and backward
//!   ([`ops::attention`]), the LM head's softmax and log-probs ([`ops::head_softmax`]) and gradients
//!   added into their accumulators in place ([`ops::accumulate`]).
//!
//! A kernel answers `None` (or `false`) where it does not apply (another device or dtype), and its
//! caller keeps the composed tensor ops: the path of every other device, and the reference the tests
//! hold each kernel to.

#![warn(missing_docs)]

pub mod backend;
pub mod host;
pub mod op_times;
pub mod ops;
pub mod precomputed;
#[cfg(test)]
mod testing;

pub use backend::Backend;
