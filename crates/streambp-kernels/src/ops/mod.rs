//! The kernels of the ops the engine fuses, each beside the composed tensor ops it replaces.

pub mod accumulate;
pub mod attention;
pub mod head_softmax;
pub mod linear;
pub mod rms_norm;
pub mod rope;
pub mod swiglu;
