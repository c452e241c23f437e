"""RMSNorm over the last dimension on the card, forward and backward, as the CPU kernel
(`src/ops/rms_norm/cpu.rs`) computes it: statistics and every product in f32, each output rounded
once to the inputs' dtype.

With `r = 1 / sqrt(mean(x²) + eps)`, `n = x·r` and the scale `s = w` (or `1 + w`, Gemma's, where
`one_plus` is 1):

- `rms_norm_forward`: `y = n·s`, one program per row;
- `rms_norm_backward`: `dx = r·(g·s − n·mean(g·s·n))` per row, and each row's `r` into `R` (f32)
  for the weight's kernel;
- `rms_norm_backward_weight`: `dw = Σ_rows g·n` as one f32 partial sum per group of `group_rows`
  rows and block of columns, into `PARTIAL` (`[groups, dim]`);
- `rms_norm_weight_sum`: the groups' partial sums added in order into `DW` in its dtype, so the
  result does not depend on scheduling.

Rows are `stride_*` apart (64-bit) with contiguous columns; the compiler is told the pointers, the
row strides and `dim` are multiples of 16 (vectorised loads), which the launcher checks.
Compiled ahead of time by `scripts/compile_triton.py`; tested under the interpreter against float64 by
`test_elementwise.py`; launched from Rust by `src/ops/rms_norm/cuda.rs`.
"""

import triton
import triton.language as tl


@triton.jit
def _inv_rms(x_row, dim, eps, BLOCK: tl.constexpr):
    """`1 / sqrt(Σx² / dim + eps)` of one row, in f32 with IEEE square root and division."""
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, dim, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < dim, other=0.0).to(tl.float32)
        acc += x * x
    mean = tl.sum(acc, 0) * (1.0 / dim.to(tl.float32))
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(mean + eps))


@triton.jit
def _scale(W, cols, dim, one_plus):
    w = tl.load(W + cols, mask=cols < dim, other=0.0).to(tl.float32)
    return w + one_plus.to(tl.float32)


@triton.jit
def rms_norm_forward(X, W, Y, stride_x, stride_y, dim, eps, one_plus, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    r = _inv_rms(x_row, dim, eps, BLOCK)
    for start in range(0, dim, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < dim, other=0.0).to(tl.float32)
        y = (x * r) * _scale(W, cols, dim, one_plus)
        tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=cols < dim)


@triton.jit
def rms_norm_backward(X, W, G, DX, R, stride_x, stride_g, stride_dx, dim, eps, one_plus,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    g_row = G + row * stride_g
    r = _inv_rms(x_row, dim, eps, BLOCK)
    tl.store(R + row, r)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, dim, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < dim, other=0.0).to(tl.float32)
        g = tl.load(g_row + cols, mask=cols < dim, other=0.0).to(tl.float32)
        acc += (g * _scale(W, cols, dim, one_plus)) * (x * r)
    mean = tl.sum(acc, 0) * (1.0 / dim.to(tl.float32))
    for start in range(0, dim, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < dim, other=0.0).to(tl.float32)
        g = tl.load(g_row + cols, mask=cols < dim, other=0.0).to(tl.float32)
        dx = r * (g * _scale(W, cols, dim, one_plus) - (x * r) * mean)
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=cols < dim)


@triton.jit
def rms_norm_backward_weight(X, G, R, PARTIAL, stride_x, stride_g, rows, dim, group_rows,
                             BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    group = tl.program_id(1).to(tl.int64)
    first = group * group_rows
    last = tl.minimum(first + group_rows, rows)
    acc = tl.zeros([BLOCK], tl.float32)
    for row in range(first, last):
        x = tl.load(X + row * stride_x + cols, mask=cols < dim, other=0.0).to(tl.float32)
        g = tl.load(G + row * stride_g + cols, mask=cols < dim, other=0.0).to(tl.float32)
        acc += g * (x * tl.load(R + row))
    tl.store(PARTIAL + group * dim + cols, acc, mask=cols < dim)


@triton.jit
def rms_norm_weight_sum(PARTIAL, DW, groups, dim, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for group in range(0, groups):
        acc += tl.load(PARTIAL + group * dim + cols, mask=cols < dim, other=0.0)
    tl.store(DW + cols, acc.to(DW.dtype.element_ty), mask=cols < dim)
