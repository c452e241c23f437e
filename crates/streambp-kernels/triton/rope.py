"""Rotary position embeddings on the card, as the CPU kernel (`src/ops/rope/cpu.rs`) computes them:
each row of `x` (one head of one token, halves `x = [x1, x2]`) rotated by its table row as
`y = [x1 c1 - x2 s1, x2 c2 + x1 s2]` (transformers' `x cos + rotate_half(x) sin`), or by the
transpose, `dx = [g1 c1 + g2 s2, g2 c2 - g1 s1]` (the gradient, `inverse` 1); in f32, rounded once
to the inputs' dtype.

- `rope`: `BLOCK_ROWS` rows per program of `x` `[b, heads, len, HEAD_DIM]` (contiguous); row r
  reads table row `(r // rows_per_batch if per_batch else 0) * length + r % length` of `cos`/`sin`
  (`[len, HEAD_DIM]`, or one table per batch row for packed rows).

Compiled ahead of time by `scripts/compile_triton.py` per head dim; tested under the interpreter
against float64 by `test_elementwise.py`; launched from Rust by `src/ops/rope/cuda.rs`.
"""

import triton
import triton.language as tl


@triton.jit
def rope(X, COS, SIN, Y, rows, rows_per_batch, length, per_batch, inverse, HEAD_DIM: tl.constexpr,
         BLOCK_ROWS: tl.constexpr):
    HALF: tl.constexpr = HEAD_DIM // 2
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    inside = (r < rows)[:, None]
    batch = tl.where(per_batch != 0, r // rows_per_batch, 0)
    t = (batch * length + r % length)[:, None] * HEAD_DIM
    i = tl.arange(0, HALF)[None, :]
    at = r[:, None] * HEAD_DIM + i
    x1 = tl.load(X + at, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(X + at + HALF, mask=inside, other=0.0).to(tl.float32)
    c1 = tl.load(COS + t + i, mask=inside, other=0.0).to(tl.float32)
    c2 = tl.load(COS + t + i + HALF, mask=inside, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + t + i, mask=inside, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + t + i + HALF, mask=inside, other=0.0).to(tl.float32)
    if inverse != 0:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(Y + at, y1.to(Y.dtype.element_ty), mask=inside)
    tl.store(Y + at + HALF, y2.to(Y.dtype.element_ty), mask=inside)
