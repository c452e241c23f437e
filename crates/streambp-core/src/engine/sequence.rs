//! Sequence parallelism: every row's positions split over the ranks of a group, one contiguous shard
//! each, so each rank holds `T / S` positions of every activation.
//!
//! Everything but attention is token-local and runs on the shard alone. Attention needs the keys and
//! values of every earlier position: each layer's are computed on their shards and all-gathered (they
//! are `kv_heads × head_dim` wide, a fraction of the hidden size under GQA). In the streamed
//! backward a rank's queries push gradients into the keys and values of earlier shards; those are
//! reduce-scattered to their owners once the rank's chunks are done, and each owner backpropagates
//! them through its own key/value projections. The LM head and the objective's per-position terms
//! stay on the shard; a loss that needs every position (DPO, GRPO) reads them all-gathered.
//!
//! [`Shard`] is this rank's span of the rows and the collectives along the sequence; a whole
//! sequence on one process is the shard of a group of one, whose collectives are the identity.

use std::ops::Range;

use candle_core::{DType, Tensor};
use streambp_dist::Communicator;

use crate::error::{EngineError, Result};

/// This rank's contiguous span `start..start + len` of rows of `total` positions, and the group that
/// holds the other spans (none: the whole rows are here).
#[derive(Clone, Copy)]
pub(crate) struct Shard<'a> {
    group: Option<&'a dyn Communicator>,
    /// Index of the span's first position in the whole rows.
    pub start: usize,
    /// Positions in the span.
    pub len: usize,
    /// Positions of the whole rows.
    pub total: usize,
}

/// The spans of rows of `total` positions over `ranks` ranks: contiguous, in rank order, lengths
/// differing by at most one (the first `total % ranks` one longer).
pub fn shard_ranges(total: usize, ranks: usize) -> Vec<Range<usize>> {
    let (base, extra) = (total / ranks.max(1), total % ranks.max(1));
    let mut start = 0;
    (0..ranks)
        .map(|r| {
            let len = base + usize::from(r < extra);
            start += len;
            start - len..start
        })
        .collect()
}

impl<'a> Shard<'a> {
    /// Whole rows of `total` positions on this process.
    pub fn whole(total: usize) -> Self {
        Self {
            group: None,
            start: 0,
            len: total,
            total,
        }
    }

    /// This rank's span of rows of `total` positions split over `group` (every rank needs at least
    /// one position).
    pub fn of(group: &'a dyn Communicator, total: usize) -> Result<Self> {
        let ranks = group.world_size();
        if total < ranks {
            return Err(EngineError::Shape(format!(
                "rows of {total} positions cannot be split over a sequence group of {ranks} ranks: \
                 each needs at least one position"
            )));
        }
        let span = shard_ranges(total, ranks)[group.rank()].clone();
        Ok(Self {
            group: (ranks > 1).then_some(group),
            start: span.start,
            len: span.len(),
            total,
        })
    }

    /// Whether other ranks hold part of the rows.
    pub fn is_split(&self) -> bool {
        self.group.is_some()
    }

    /// Whether a span after this one exists (its queries read this span's keys).
    pub fn has_later(&self) -> bool {
        self.start + self.len < self.total
    }

    /// `x` narrowed along `dim` to this span (`x` is `total` long there).
    pub fn local(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        Ok(x.narrow(dim, self.start, self.len)?)
    }

    /// Every rank's `local` (this span's positions along `dim`) as the whole rows, on every rank.
    pub fn gather(&self, local: &Tensor, dim: usize) -> Result<Tensor> {
        let Some(group) = self.group else {
            return Ok(local.clone());
        };
        let spans = shard_ranges(self.total, group.world_size());
        let width = spans[0].len();
        let padded = pad_to(local, dim, width)?;
        let (wire, dtype) = on_the_wire(&padded)?;
        let mut shape = vec![spans.len()];
        shape.extend_from_slice(padded.dims());
        let all = group.all_gather(&wire.flatten_all()?)?.reshape(shape)?;
        let parts = spans
            .iter()
            .enumerate()
            .map(|(r, span)| Ok(all.get(r)?.narrow(dim, 0, span.len())?))
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&parts, dim)?.to_dtype(dtype)?)
    }

    /// The sum over the group of every rank's `whole` (the whole rows' positions along `dim`), kept at
    /// this span's positions.
    pub fn reduce_scatter(&self, whole: &Tensor, dim: usize) -> Result<Tensor> {
        let Some(group) = self.group else {
            return Ok(whole.clone());
        };
        let spans = shard_ranges(self.total, group.world_size());
        let width = spans[0].len();
        let parts = spans
            .iter()
            .map(|span| pad_to(&whole.narrow(dim, span.start, span.len())?, dim, width))
            .collect::<Result<Vec<_>>>()?;
        let stacked = Tensor::stack(&parts, 0)?;
        let (wire, dtype) = on_the_wire(&stacked)?;
        let mine = group.reduce_scatter_sum(&wire.flatten_all()?)?;
        let mine = mine.reshape(parts[0].dims())?.narrow(dim, 0, self.len)?;
        Ok(mine.to_dtype(dtype)?)
    }

    /// The sum of `x` over the group.
    pub fn sum(&self, x: f64) -> Result<f64> {
        match self.group {
            Some(group) => Ok(group.sum(x)?),
            None => Ok(x),
        }
    }
}

/// `x` zero-padded along `dim` to `width` positions.
fn pad_to(x: &Tensor, dim: usize, width: usize) -> Result<Tensor> {
    let n = x.dim(dim)?;
    if n == width {
        return Ok(x.clone());
    }
    let mut shape = x.dims().to_vec();
    shape[dim] = width - n;
    let zeros = Tensor::zeros(shape, x.dtype(), x.device())?;
    Ok(Tensor::cat(&[x, &zeros], dim)?)
}

/// `x` in a dtype the collectives carry (f32, f64; half precision travels as f32, exactly), and the
/// dtype to return to.
fn on_the_wire(x: &Tensor) -> Result<(Tensor, DType)> {
    let dtype = x.dtype();
    Ok(match dtype {
        DType::F32 | DType::F64 => (x.contiguous()?, dtype),
        _ => (x.to_dtype(DType::F32)?, dtype),
    })
}
