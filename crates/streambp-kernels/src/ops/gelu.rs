//! GELU activations, composed from tensor ops on every backend: candle's fused `gelu` has a backward
//! with 6-digit constants (relative error ~1e-6), which breaks exact gradients. (No kernel of their
//! own yet: a gated MLP with GELU multiplies the activation into the up projection with a tensor op.)

use candle_core::Tensor;

type CResult<T> = candle_core::Result<T>;

/// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` (transformers' `gelu_pytorch_tanh`).
pub fn gelu_tanh(x: &Tensor) -> CResult<Tensor> {
    let inner =
        ((x + (x.sqr()? * x)?.affine(0.044715, 0.0)?)? * (2.0 / std::f64::consts::PI).sqrt())?;
    ((inner.tanh()? + 1.0)? * x)?.affine(0.5, 0.0)
}

/// `0.5·x·(1 + erf(x/√2))` (transformers' `gelu`).
pub fn gelu_erf(x: &Tensor) -> CResult<Tensor> {
    let e = (x / std::f64::consts::SQRT_2)?.erf()?;
    ((e + 1.0)? * x)?.affine(0.5, 0.0)
}
