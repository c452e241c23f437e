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
//! - [`ops`]: every op the layers and the LM head fuse, one home each: RMSNorm
//!   ([`ops::rms_norm`]), rope ([`ops::rope`]), SwiGLU ([`ops::swiglu`]), the projections with
//!   LoRA's ([`ops::linear`]), the attention ([`ops::attention`]), the LM head's softmax and
//!   log-probs ([`ops::head_softmax`]) and gradients added into their accumulators in place
//!   ([`ops::accumulate`]). Each has its public function, the composed tensor ops it is held to
//!   (every device's path without a kernel), and its CPU kernel, chosen by [`Backend`].
//! - [`op_times`]: where a step's time goes, op part by op part; [`precomputed`]: a composed
//!   forward handed to the op that records its written backward.
//!
//! A kernel of the host's library answers `None` (or `false`) where it does not apply (another
//! device or dtype), and its caller keeps the composed tensor ops.

#![warn(missing_docs)]

pub mod backend;
pub mod host;
pub mod op_times;
pub mod ops;
pub mod precomputed;
#[cfg(test)]
mod testing;

pub use backend::Backend;
