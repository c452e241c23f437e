"""The LM head's softmax over the vocabulary on the card, as the CPU kernel
(`src/ops/head_softmax/mod.rs`) computes it, one program per row of a logits chunk `z` `[n, vocab]`:

- `head_log_softmax`: each row's log-sum-exp (one pass: a running maximum and sum per lane, then
  combined) into `LSE`, and the target's log-prob `z[target] - lse` into `LOGP` (f32); a target
  outside the vocabulary gives NaN, which the loss carries;
- `head_logit_grad`: the logits' gradient `dz = g (onehot(target) - exp(z - lse))` for the row's
  `g = dLoss/dlogp`, written over `z` (the chunk is the caller's to give up).

Statistics in f32 whatever `z`'s dtype. Compiled ahead of time by `scripts/compile_triton.py`; tested
under the interpreter against float64 by `test_elementwise.py`; launched from Rust by
`src/ops/head_softmax/cuda.rs`.
"""

import triton
import triton.language as tl


@triton.jit
def head_log_softmax(Z, TARGETS, LSE, LOGP, stride_z, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(z_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, x)
        # A lane that has read only masked columns keeps m = -inf and s = 0 (no -inf - -inf).
        shift = tl.where(new_m == float("-inf"), 0.0, new_m)
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = new_m
    top = tl.max(m, 0)
    lse = tl.log(tl.sum(s * tl.exp(m - top), 0)) + top
    target = tl.load(TARGETS + row)
    inside = (target >= 0) & (target < vocab)
    picked = tl.load(z_row + tl.where(inside, target, 0)).to(tl.float32)
    tl.store(LSE + row, lse)
    tl.store(LOGP + row, tl.where(inside, picked - lse, float("nan")))


@triton.jit
def head_logit_grad(Z, TARGETS, LSE, G, stride_z, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    lse = tl.load(LSE + row)
    g = tl.load(G + row)
    target = tl.load(TARGETS + row)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(z_row + cols, mask=cols < vocab, other=0.0).to(tl.float32)
        dz = tl.exp(x - lse) * -g + tl.where(cols == target, g, 0.0)
        tl.store(z_row + cols, dz.to(Z.dtype.element_ty), mask=cols < vocab)
