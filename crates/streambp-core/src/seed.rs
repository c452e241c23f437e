//! The root of a backward that hands a tensor a gradient it already has.
//!
//! Each backward the engine runs starts from `Σ y ⊙ g`, where `g` is the gradient the output `y`
//! already has (a chunk's output, its keys and values, the final norm's output). Composed, that is a
//! product and a sum over `y` in the forward, and in candle's backward the sum's gradient broadcast
//! into a zero-filled buffer (a strided sum) and multiplied by `g`: passes over `y` that give back
//! `g`. [`seed`] is the same term as one op: its forward computes nothing (its value, 0, is never
//! read) and its backward hands `y` the gradient `g` itself (which candle then adds into `y`'s own
//! zero-filled slot, as for any node: that one sum stays).

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};

use crate::error::{EngineError, Result};

type CResult<T> = candle_core::Result<T>;

/// A scalar whose gradient with respect to `y` is `grad` (`y`'s shape and dtype): `Σ y ⊙ grad` as
/// far as a backward from it can tell, its value 0.
pub fn seed(y: &Tensor, grad: &Tensor) -> Result<Tensor> {
    if y.shape() != grad.shape() || y.dtype() != grad.dtype() {
        return Err(EngineError::Shape(format!(
            "backward seed: gradient {:?} {:?} for a tensor {:?} {:?}",
            grad.dims(),
            grad.dtype(),
            y.dims(),
            y.dtype()
        )));
    }
    Ok(y.apply_op1(Seed {
        grad: grad.detach(),
    })?)
}

struct Seed {
    grad: Tensor,
}

impl CustomOp1 for Seed {
    fn name(&self) -> &'static str {
        "streambp-seed"
    }

    fn cpu_fwd(&self, s: &CpuStorage, _: &Layout) -> CResult<(CpuStorage, Shape)> {
        let shape = Shape::from(());
        Ok((s.device().zeros_impl(&shape, s.dtype())?, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        let shape = Shape::from(());
        Ok((s.device().zeros_impl(&shape, s.dtype())?, shape))
    }

    /// `grad` times the scalar gradient reaching the seed: 1 from a backward's root (through sums
    /// of seeds), which hands `grad` over as it is.
    fn bwd(&self, _: &Tensor, _: &Tensor, scalar: &Tensor) -> CResult<Option<Tensor>> {
        let factor = scalar.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        Ok(Some(match factor == 1.0 {
            true => self.grad.clone(),
            false => self.grad.affine(factor, 0.0)?,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// A seed's gradient is the given one, scaled by whatever multiplies the seed, summed with other
    /// seeds' as `Σ y ⊙ g` would be; mismatched shapes are refused.
    #[test]
    fn seeds_hand_their_gradients_back() {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::arange(0f64, 6.0, &dev).unwrap()).unwrap();
        let y = (x.as_tensor() * 2.0).unwrap();
        let g = Tensor::from_vec(vec![1.0f64, -2.0, 0.5, 4.0, 0.25, -1.0], 6, &dev).unwrap();
        let h = Tensor::from_vec(vec![3.0f64; 6], 6, &dev).unwrap();
        let root =
            ((seed(&y, &g).unwrap() * 3.0).unwrap() + seed(x.as_tensor(), &h).unwrap()).unwrap();
        let store = root.backward().unwrap();
        let got = store.get(x.as_tensor()).unwrap().to_vec1::<f64>().unwrap();
        let want: Vec<f64> = [1.0, -2.0, 0.5, 4.0, 0.25, -1.0]
            .iter()
            .map(|g| 2.0 * 3.0 * g + 3.0)
            .collect();
        assert_eq!(got, want);
        assert_eq!(root.to_scalar::<f64>().unwrap(), 0.0);
        assert!(seed(&y, &g.narrow(0, 0, 5).unwrap()).is_err());
    }
}
