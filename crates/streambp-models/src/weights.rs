//! Model parts rebuilt with each of their weights mapped: cut from the graph ([`MapWeights::detached`]),
//! widened to f32 ([`crate::layer::DecoderLayer::computed_in_f32`]).

use std::convert::Infallible;

use candle_core::Tensor;

/// A part holding weights (a decoder layer, a projection, a norm, an adapter).
pub trait MapWeights: Sized {
    /// The same part with each weight replaced by `f(weight)`.
    fn map_weights<E>(&self, f: &mut impl FnMut(&Tensor) -> Result<Tensor, E>) -> Result<Self, E>;

    /// The same part with every weight cut from the graph: it runs without recording anything.
    fn detached(&self) -> Self {
        let Ok(part) = self.map_weights(&mut |t: &Tensor| Ok::<_, Infallible>(t.detach()));
        part
    }
}
