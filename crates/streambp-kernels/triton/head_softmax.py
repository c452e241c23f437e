"""The LM head's softmax over the vocabulary on the card, as the CPU kernel
(`src/ops/head_softmax/mod.rs`) computes it, one program per row of a logits chunk `z` `[n, vocab]`:

- `head_log_softmax`: each row's log-sum-exp (one pass: a running maximum and sum per lane, then
  combined) into `LSE`, and the target's log-prob `z[target] - lse` into `LOGP` (f32); a target
  outside the vocabulary gives NaN, which the loss carries;
- `head_logit_grad`: the logits' gradient `dz = g (onehot(target) - exp(z - lse))` for the row's
  `g = dLoss/dlogp`, written over `z` (the chunk is the caller's to give up);
- `head_log_softmax_entropy` and `head_logit_grad_entropy`: the same for an objective that reads
  each row's entropy `H = -sum p log p` too: the first pass also keeps `sum e^d d` (`d = z - max`) per
  lane, giving `H = log sum - sum e^d d / sum` into `ENTROPY`; the second writes
  `dz = g onehot(target) - p (g + g_H (log p + H))` for the row's `g_H = dLoss/dH`.

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


@triton.jit
def head_log_softmax_entropy(Z, TARGETS, LSE, LOGP, ENTROPY, stride_z, vocab, BLOCK: tl.constexpr):
    # Per lane, relative to its running maximum m: s = Σ eᵈ and t = Σ eᵈ·d, d = z − m.
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    t = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(z_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, x)
        shift = tl.where(new_m == float("-inf"), 0.0, new_m)
        # Moving the lane's sums to the new maximum: t' = e^(m − m')·(t + (m − m')·s); a lane that
        # has read only masked columns (m = −∞, s = t = 0) moves by 0.
        moved = tl.where(m == float("-inf"), 0.0, m - shift)
        scale = tl.exp(moved)
        d = tl.where(x == float("-inf"), 0.0, x - shift)
        e = tl.exp(x - shift)
        t = scale * (t + moved * s) + e * d
        s = s * scale + e
        m = new_m
    top = tl.max(m, 0)
    moved = tl.where(m == float("-inf"), 0.0, m - top)
    scale = tl.exp(moved)
    total = tl.sum(s * scale, 0)
    moment = tl.sum(scale * (t + moved * s), 0)
    log_total = tl.log(total)
    lse = log_total + top
    target = tl.load(TARGETS + row)
    inside = (target >= 0) & (target < vocab)
    picked = tl.load(z_row + tl.where(inside, target, 0)).to(tl.float32)
    tl.store(LSE + row, lse)
    tl.store(ENTROPY + row, log_total - moment / total)
    tl.store(LOGP + row, tl.where(inside, picked - lse, float("nan")))


@triton.jit
def head_logit_grad_entropy(Z, TARGETS, LSE, ENTROPY, G, G_ENTROPY, stride_z, vocab,
                            BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    lse = tl.load(LSE + row)
    h = tl.load(ENTROPY + row)
    g = tl.load(G + row)
    g_h = tl.load(G_ENTROPY + row)
    target = tl.load(TARGETS + row)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(z_row + cols, mask=cols < vocab, other=0.0).to(tl.float32)
        log_p = x - lse
        p = tl.exp(log_p)
        # p = 0 where log p = −∞, whose product would be NaN.
        dz = tl.where(p > 0.0, p * (-g - g_h * (log_p + h)), 0.0) + tl.where(cols == target, g, 0.0)
        tl.store(z_row + cols, dz.to(Z.dtype.element_ty), mask=cols < vocab)
