//! The ops the layers and the LM head fuse, each beside the composed tensor ops it replaces: a
//! folder per op with a forward and backward of its own (`mod.rs`: the op, `cpu.rs`: its CPU
//! kernel), a file where the op is one function (docs/architecture.md, "A kernel for an op on a
//! backend").

pub mod accumulate;
pub mod adamw;
pub mod attention;
pub mod cast;
pub mod divergence;
pub(crate) mod gated;
pub mod geglu;
pub mod grad_norm;
pub mod head_softmax;
pub mod linear;
pub mod matmul;
pub mod rms_norm;
pub mod rope;
pub mod swiglu;
