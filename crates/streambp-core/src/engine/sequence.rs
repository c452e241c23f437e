//! Sequence parallelism: every row's positions split over the ranks of a group, so each rank holds
//! about `T / S` positions of every activation.
//!
//! The split is a zigzag: the rows are cut into `2S` near-equal pieces and rank `r` holds pieces `r`
//! and `2S − 1 − r`, so under the causal mask every rank's queries read about as many keys (a
//! contiguous split would give the last rank `2S − 1` times the first's attention work).
//!
//! Everything but attention is token-local and runs on the rank's positions alone. Attention needs
//! the keys and values of every earlier position: each layer's are computed on their ranks and
//! all-gathered (they are `kv_heads × head_dim` wide, a fraction of the hidden size under GQA). In the
//! streamed backward a rank's queries push gradients into the keys and values of other ranks'
//! positions; those are reduce-scattered to their owners once the rank's chunks are done, and each
//! owner backpropagates them through its own key/value projections. The LM head and the objective's
//! per-position terms stay on the rank; a loss that needs every position (DPO, GRPO) reads them
//! all-gathered.
//!
//! [`Shard`] is this rank's spans of the rows and the collectives along the sequence; a whole
//! sequence on one process is the shard of a group of one, whose collectives are the identity.

use std::ops::Range;

use candle_core::{DType, Tensor};
use streambp_dist::Communicator;

use crate::error::{EngineError, Result};

/// This rank's spans of rows of `total` positions (in order; local positions are the spans one after
/// another), and the group that holds the others (none: the whole rows are here).
#[derive(Clone)]
pub(crate) struct Shard<'a> {
    group: Option<&'a dyn Communicator>,
    spans: Vec<Range<usize>>,
    /// Positions held here.
    pub len: usize,
    /// Positions of the whole rows.
    pub total: usize,
}

/// A chunk of a rank's positions: where it sits among them, and the position of its first token in
/// the whole rows (a chunk never crosses from one span to the next).
#[derive(Debug, Clone)]
pub(crate) struct Chunk {
    /// Its range in the rank's local positions.
    pub local: Range<usize>,
    /// Its first position in the whole rows.
    pub start: usize,
}

impl Chunk {
    /// Its range in the whole rows.
    pub fn global(&self) -> Range<usize> {
        self.start..self.start + self.local.len()
    }
}

/// The spans of rows of `total` positions held by each of `ranks` ranks: the rows cut into `2 × ranks`
/// near-equal pieces (the first `total % (2 × ranks)` one longer), rank `r` holding pieces `r` and
/// `2 × ranks − 1 − r` (empty pieces left out; with at least as many positions as ranks, every rank
/// holds one).
pub fn shard_ranges(total: usize, ranks: usize) -> Vec<Vec<Range<usize>>> {
    let ranks = ranks.max(1);
    if ranks == 1 {
        return vec![std::iter::once(0..total).collect()];
    }
    let pieces = 2 * ranks;
    let (base, extra) = (total / pieces, total % pieces);
    let mut start = 0;
    let cut: Vec<Range<usize>> = (0..pieces)
        .map(|p| {
            let len = base + usize::from(p < extra);
            start += len;
            start - len..start
        })
        .collect();
    (0..ranks)
        .map(|r| {
            [cut[r].clone(), cut[pieces - 1 - r].clone()]
                .into_iter()
                .filter(|span| !span.is_empty())
                .collect()
        })
        .collect()
}

impl<'a> Shard<'a> {
    /// Whole rows of `total` positions on this process.
    pub fn whole(total: usize) -> Self {
        Self {
            group: None,
            spans: std::iter::once(0..total).collect(),
            len: total,
            total,
        }
    }

    /// This rank's spans of rows of `total` positions split over `group` (every rank needs at least
    /// one position).
    pub fn of(group: &'a dyn Communicator, total: usize) -> Result<Self> {
        let ranks = group.world_size();
        if total < ranks {
            return Err(EngineError::Shape(format!(
                "rows of {total} positions cannot be split over a sequence group of {ranks} ranks: \
                 each needs at least one position"
            )));
        }
        let spans = shard_ranges(total, ranks).swap_remove(group.rank());
        Ok(Self {
            group: (ranks > 1).then_some(group),
            len: spans.iter().map(Range::len).sum(),
            spans,
            total,
        })
    }

    /// The spans of the whole rows held here, in the order they are stored.
    pub fn spans(&self) -> &[Range<usize>] {
        &self.spans
    }

    /// Whether other ranks hold part of the rows.
    pub fn is_split(&self) -> bool {
        self.group.is_some()
    }

    /// This rank's positions in chunks of at most `size`, in order.
    pub fn chunks(&self, size: usize) -> Vec<Chunk> {
        let mut local = 0;
        let mut out = Vec::new();
        for span in &self.spans {
            let mut start = span.start;
            while start < span.end {
                let end = (start + size.max(1)).min(span.end);
                out.push(Chunk {
                    local: local..local + end - start,
                    start,
                });
                local += end - start;
                start = end;
            }
        }
        out
    }

    /// `x`'s positions along `dim` that this rank holds (`x` is `total` long there).
    pub fn local(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        local_of(&self.spans, x, dim)
    }

    /// Every rank's `local` (its positions along `dim`) as the whole rows, on every rank.
    pub fn gather(&self, local: &Tensor, dim: usize) -> Result<Tensor> {
        let Some(group) = self.group else {
            return Ok(local.clone());
        };
        let all_spans = shard_ranges(self.total, group.world_size());
        let width = widest(&all_spans);
        let padded = pad_to(local, dim, width)?;
        let (wire, dtype) = on_the_wire(&padded)?;
        let mut shape = vec![all_spans.len()];
        shape.extend_from_slice(padded.dims());
        let all = group.all_gather(&wire.flatten_all()?)?.reshape(shape)?;
        // Every rank's pieces, put back in the order of the rows.
        let mut pieces = Vec::new();
        for (r, spans) in all_spans.iter().enumerate() {
            let mut at = 0;
            for span in spans {
                pieces.push((span.start, all.get(r)?.narrow(dim, at, span.len())?));
                at += span.len();
            }
        }
        pieces.sort_by_key(|(start, _)| *start);
        let pieces: Vec<Tensor> = pieces.into_iter().map(|(_, t)| t).collect();
        Ok(Tensor::cat(&pieces, dim)?.to_dtype(dtype)?)
    }

    /// The sum over the group of every rank's `whole` (the whole rows' positions along `dim`), kept at
    /// this rank's positions.
    pub fn reduce_scatter(&self, whole: &Tensor, dim: usize) -> Result<Tensor> {
        let Some(group) = self.group else {
            return Ok(whole.clone());
        };
        let all_spans = shard_ranges(self.total, group.world_size());
        let width = widest(&all_spans);
        let parts = all_spans
            .iter()
            .map(|spans| pad_to(&local_of(spans, whole, dim)?, dim, width))
            .collect::<Result<Vec<_>>>()?;
        let stacked = Tensor::stack(&parts, 0)?;
        let (wire, dtype) = on_the_wire(&stacked)?;
        let mine = group.reduce_scatter_sum(&wire.flatten_all()?)?;
        let mine = mine.reshape(parts[0].dims())?.narrow(dim, 0, self.len)?;
        Ok(mine.to_dtype(dtype)?)
    }

    /// Sets this rank's positions of `whole` (along `dim`) to zero.
    pub fn zero_own(&self, whole: &Tensor, dim: usize) -> Result<()> {
        for span in &self.spans {
            let zeros = whole.narrow(dim, span.start, span.len())?.zeros_like()?;
            whole.slice_set(&zeros, dim, span.start)?;
        }
        Ok(())
    }

    /// The sum of `x` over the group.
    pub fn sum(&self, x: f64) -> Result<f64> {
        match self.group {
            Some(group) => Ok(group.sum(x)?),
            None => Ok(x),
        }
    }
}

/// `x`'s positions in `spans` along `dim`, one span after another.
fn local_of(spans: &[Range<usize>], x: &Tensor, dim: usize) -> Result<Tensor> {
    if let [span] = spans {
        return Ok(x.narrow(dim, span.start, span.len())?);
    }
    let parts = spans
        .iter()
        .map(|span| x.narrow(dim, span.start, span.len()))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::cat(&parts, dim)?)
}

/// The most positions any rank holds.
fn widest(all_spans: &[Vec<Range<usize>>]) -> usize {
    all_spans
        .iter()
        .map(|spans| spans.iter().map(Range::len).sum())
        .max()
        .unwrap_or(0)
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
/// dtype to return to. Only activations, their gradients and log-probs travel (floats).
fn on_the_wire(x: &Tensor) -> Result<(Tensor, DType)> {
    let dtype = x.dtype();
    Ok(match dtype {
        DType::F32 | DType::F64 => (x.contiguous()?, dtype),
        DType::BF16 | DType::F16 => (x.to_dtype(DType::F32)?, dtype),
        other => {
            return Err(EngineError::Shape(format!(
                "sequence exchange of a {other:?} tensor: only floating-point tensors travel"
            )))
        }
    })
}
