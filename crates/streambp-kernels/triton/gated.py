"""The gated MLPs' activations on the card, `act(gate)·up` forward and backward, as the CPU kernels
(`src/ops/swiglu/cpu.rs`, `src/ops/geglu/cpu.rs`) compute them: in f32, each output rounded once to
the inputs' dtype; GeGLU in bf16 also rounds the activation before the product, as bf16 arithmetic
(and the CPU's bf16 path) does.

- `gated_forward` and `gated_backward`, compiled once per activation (`ACT`): `SILU` (SwiGLU,
  `silu(x) = x / (1 + exp(−x))`, `silu'(x) = σ(x)·(1 − silu(x)) + silu(x)`), `GELU_TANH`
  (transformers' `gelu_pytorch_tanh`) and `GELU_ERF` (transformers' `gelu`).

The backward writes d gate and d up (`d up = g·act(gate)`, `d gate = g·up·act'(gate)`). The tensors
are contiguous runs of `n` elements (64-bit); the compiler is told the pointers are 16-byte aligned,
which the launcher checks. Compiled ahead of time by `scripts/compile_triton.py`; tested under the
interpreter against float64 by `test_elementwise.py`; launched from Rust by `src/ops/gated/cuda.rs`.
"""

import triton
import triton.language as tl

SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
CUBIC = tl.constexpr(0.044715)
FRAC_1_SQRT_2 = tl.constexpr(0.7071067811865476)
# 1 / sqrt(2 pi): the normal density's constant.
DENSITY = tl.constexpr(0.3989422804014327)

SILU = tl.constexpr(0)
GELU_TANH = tl.constexpr(1)
GELU_ERF = tl.constexpr(2)


@triton.jit
def _tanh(z):
    """tanh(z) and 1 - tanh(z)^2 through one exponential of -2|z| (libdevice's tanh is not in
    Triton's interpreter), which neither overflows nor cancels: t = sign(z)(1 - e)/(1 + e),
    1 - t^2 = 4e/(1 + e)^2. (Here and below the module's constants multiply from the right, where
    the interpreter keeps a tensor.)"""
    e = tl.exp(tl.abs(z) * -2.0)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(z < 0, -t, t), (e * 4.0) / ((1.0 + e) * (1.0 + e))


@triton.jit
def _activation(x, ACT: tl.constexpr):
    """`act(x)` and `act'(x)` in f32."""
    if ACT == SILU:
        e = tl.exp(-x)
        s = x / (1.0 + e)
        return s, (1.0 / (1.0 + e)) * (1.0 - s) + s
    elif ACT == GELU_TANH:
        t, sech2 = _tanh((x + x * x * x * CUBIC) * SQRT_2_OVER_PI)
        slope = (x * x * (3.0 * CUBIC) + 1.0) * SQRT_2_OVER_PI
        return 0.5 * x * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * x * sech2 * slope
    else:
        e = tl.math.erf(x * FRAC_1_SQRT_2)
        return 0.5 * x * (1.0 + e), 0.5 * (1.0 + e) + x * tl.exp(x * x * -0.5) * DENSITY


@triton.jit
def _stored(a, ACT: tl.constexpr, dtype: tl.constexpr):
    """The activation as the product reads it: GeGLU's rounded to a bf16 input's values."""
    if ACT != SILU and dtype == tl.bfloat16:
        return a.to(tl.bfloat16).to(tl.float32)
    else:
        return a


@triton.jit
def gated_forward(GATE, UP, Y, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(GATE + offs, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(UP + offs, mask=inside, other=0.0).to(tl.float32)
    a, _ = _activation(x, ACT)
    y = _stored(a, ACT, GATE.dtype.element_ty) * u
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=inside)


@triton.jit
def gated_backward(GATE, UP, G, DGATE, DUP, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(GATE + offs, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(UP + offs, mask=inside, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=inside, other=0.0).to(tl.float32)
    a, slope = _activation(x, ACT)
    tl.store(DUP + offs, (g * _stored(a, ACT, GATE.dtype.element_ty)).to(DUP.dtype.element_ty),
             mask=inside)
    tl.store(DGATE + offs, ((g * u) * slope).to(DGATE.dtype.element_ty), mask=inside)
