//! Helpers the crate's unit tests share.

use candle_core::{DType, Tensor, Var};

/// The largest absolute element-wise difference of `a` and `b` (any float dtype), as f64.
pub(crate) fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// The gradients of `Σ y ⊙ g` with respect to each of `wrt`, in order.
pub(crate) fn grads(y: &Tensor, g: &Tensor, wrt: &[&Var]) -> Vec<Tensor> {
    let store = (y * g).unwrap().sum_all().unwrap().backward().unwrap();
    wrt.iter()
        .map(|v| store.get(v.as_tensor()).unwrap().clone())
        .collect()
}
