"""Gradients added into their f32 accumulators in place on the card, as the CPU kernels
(`src/ops/accumulate/mod.rs`) add them: each element widened to f32 and added once, in the order
the host adds.

- `accumulate_add`: `ACC[i] += X[i]` over `n` elements (64-bit), `BLOCK` per program; `X` in f32 or
  bf16 (a bf16 gradient widened on the way, so no f32 copy of it is made).
- `accumulate_add_rows`: `ACC[IDS[i], :] += ROWS[i, :]` for `i` in order, for an accumulator
  `[V, dim]` and `ROWS` `[n_rows, dim]` (contiguous, f32 or bf16): one program per `BLOCK` columns
  walks the rows one after another, so a repeated id's rows are summed in the host's order, with
  no atomics (the result does not depend on scheduling); `n_rows` is 64-bit, so the rows' offsets
  are. An id outside `0..V` is skipped (the caller checks the ids where it can).

Compiled ahead of time by `scripts/compile_triton.py`; tested under the interpreter against float64
by `test_elementwise.py`; launched from Rust by `src/ops/accumulate/cuda.rs`.
"""

import triton
import triton.language as tl


@triton.jit
def accumulate_add(ACC, X, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    acc = tl.load(ACC + offs, mask=inside, other=0.0)
    x = tl.load(X + offs, mask=inside, other=0.0).to(tl.float32)
    tl.store(ACC + offs, acc + x, mask=inside)


@triton.jit
def accumulate_add_rows(ACC, IDS, ROWS, n_rows, vocab, dim, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < dim
    for i in range(0, n_rows):
        row = tl.full([BLOCK], 0, tl.int64) + tl.load(IDS + i)
        keep = inside & (row >= 0) & (row < vocab)
        x = tl.load(ROWS + i * dim + cols, mask=inside, other=0.0).to(tl.float32)
        target = ACC + tl.where(keep, row, 0) * dim + cols
        acc = tl.load(target, mask=keep, other=0.0)
        tl.store(target, acc + x, mask=keep)
