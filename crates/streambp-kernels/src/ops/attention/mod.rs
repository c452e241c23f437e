//! The attention's CPU kernels: a chunk of queries against blocks of earlier keys, forward and
//! backward, without materialising the scores ([`kernel`]), and the per-row softmax passes over a
//! score block that the composed path materialises ([`softmax_block`]).

pub mod kernel;
pub mod softmax_block;
