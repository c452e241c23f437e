"""AdamW's update on the card, one pass over a parameter: as the composed update
(`streambp-train/src/optim.rs`, torch's AdamW, decoupled decay first) computes it, in f32 with the
moments in f32, the parameter rounded once to its dtype, written in place:

    p <- p * decay                              (decay = 1 - lr * wd; 1 without decay)
    m <- m * beta1 + g * (1 - beta1)
    v <- v * beta2 + g^2 * (1 - beta2)
    p <- p - ((m * (1 / bc1)) / (sqrt(v * (1 / bc2)) + eps)) * lr

- `adamw`: `BLOCK` elements per program of `n` (64-bit); `P` and `G` in the parameter's dtype,
  `M` and `V` f32. The constants come as the composed ops have them: `1 - beta` and `1 / bc`
  formed in f64 and rounded to f32 once (candle divides a tensor by a number as a product by its
  reciprocal); the division by the denominator and the square root in IEEE precision.

Compiled ahead of time by `scripts/compile_triton.py`; tested under the interpreter against float64
by `test_elementwise.py`; launched from Rust by `src/ops/adamw/cuda.rs`.
"""

import triton
import triton.language as tl


@triton.jit
def adamw(P, G, M, V, n, lr, decay, beta1, beta2, rest1, rest2, inv_bc1, inv_bc2, eps,
          BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    p = tl.load(P + offs, mask=inside, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=inside, other=0.0).to(tl.float32)
    m = tl.load(M + offs, mask=inside, other=0.0)
    v = tl.load(V + offs, mask=inside, other=0.0)
    p = p * decay
    m = m * beta1 + g * rest1
    v = v * beta2 + (g * g) * rest2
    denom = tl.math.sqrt_rn(v * inv_bc2) + eps
    p = p - tl.math.div_rn(m * inv_bc1, denom) * lr
    tl.store(P + offs, p.to(P.dtype.element_ty), mask=inside)
    tl.store(M + offs, m, mask=inside)
    tl.store(V + offs, v, mask=inside)
