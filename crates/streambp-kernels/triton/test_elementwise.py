"""The element-wise kernels (`rms_norm.py`, `gated.py`, `rope.py`, `adamw.py`, `head_softmax.py`,
`accumulate.py`) under Triton's interpreter (on the CPU, no GPU,
no torch) against a float64 reference: RMSNorm in both weight styles with rows longer than a block,
dims that are not multiples of it, one row, strided rows and a row count the weight's groups do not
divide; the gated activations on runs not a multiple of the block, one element, and gates far enough
out that an exponential overflows; rope forward and by its transpose, one table or one per batch row
(packing), rows not a multiple of the block, every head dim; f32 and bf16. Each case also checks
that the comparison would see a kernel computing the neighbouring formula (the other weight style;
gate and up swapped; the table's halves swapped; AdamW's bias corrections swapped). AdamW: runs not a
multiple of the block, with and without decay, a first and a later step, bf16 and f32 parameters.
The head's softmax: one row, a vocabulary not a multiple of the block and smaller than it, a row
of equal logits, logits far apart, targets at both ends (the neighbour: the target one column off);
with the entropies the same cases and a row with masked (-inf) logits. The accumulators: runs not a
multiple of the block, one element; rows into a table with an id repeated and one outside it (the
neighbour: `x` one element over, each row one id over).

Run: `TRITON_INTERPRET=1 python crates/streambp-kernels/triton/test_elementwise.py` (the variable is
set here if absent). Needs `triton` and `numpy` only.
"""

import math
import os
import sys
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")
# The gates chosen to overflow an exponential do, in numpy as on the card (to inf, which the
# formulas absorb); numpy's warning about it is expected.
warnings.filterwarnings("ignore", "overflow encountered in exp")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import interpret  # noqa: E402
import accumulate  # noqa: E402
import adamw  # noqa: E402
import gated  # noqa: E402
import head_softmax  # noqa: E402
import rms_norm  # noqa: E402
import rope  # noqa: E402
from test_attention import BF16, F32, stored, values  # noqa: E402

# The largest error allowed, relative to the largest reference value: f32's rounding of sums over a
# few thousand terms, and one bf16 rounding of the output (2^-8) with room for the inputs'.
BOUND = {F32: 2e-6, BF16: 1.6e-2}


def relative(got, want):
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def norm_reference(x, w, g, eps, one_plus):
    r = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    s = w + (1.0 if one_plus else 0.0)
    n = x * r
    dn = g * s
    dx = r * (dn - n * (dn * n).mean(-1, keepdims=True))
    return n * s, dx, (g * n).sum(0)


def check_norm(rows, dim, block, one_plus, dtype, pad, rng, group_rows=4):
    """One RMSNorm case: returns the worst error over y, dx and dw, and how far the other style's
    reference is from the kernel's output (what a wrong style would be caught by)."""
    x64 = rng.normal(0, 2.0, (rows, dim + pad))
    x_arr, x = stored(x64, dtype)
    w_arr, w = stored(rng.normal(0, 0.5, dim), dtype)
    g_arr, g = stored(rng.normal(0, 1.0, (rows, dim)), dtype)
    x = x[:, :dim]
    eps = 1e-6
    y_arr = np.zeros((rows, dim), x_arr.dtype)
    dx_arr = np.zeros((rows, dim), x_arr.dtype)
    r_arr = np.zeros(rows, np.float32)
    groups = -(-rows // group_rows)
    partial_arr = np.zeros((groups, dim), np.float32)
    dw_arr = np.zeros(dim, x_arr.dtype)
    p = interpret.pointer
    rms_norm.rms_norm_forward[(rows,)](p(x_arr, dtype), p(w_arr, dtype), p(y_arr, dtype), dim + pad,
                                       dim, dim, eps, int(one_plus), BLOCK=block)
    rms_norm.rms_norm_backward[(rows,)](p(x_arr, dtype), p(w_arr, dtype), p(g_arr, dtype),
                                        p(dx_arr, dtype), p(r_arr, F32), dim + pad, dim, dim, dim, eps,
                                        int(one_plus), BLOCK=block)
    rms_norm.rms_norm_backward_weight[(-(-dim // block), groups)](
        p(x_arr, dtype), p(g_arr, dtype), p(r_arr, F32), p(partial_arr, F32), dim + pad, dim, rows, dim,
        group_rows, BLOCK=block)
    rms_norm.rms_norm_weight_sum[(-(-dim // block),)](p(partial_arr, F32), p(dw_arr, dtype), groups, dim,
                                                      BLOCK=block)
    want = norm_reference(x, w, g, eps, one_plus)
    got = tuple(values(arr, dtype) for arr in (y_arr, dx_arr, dw_arr))
    errors = {name: relative(a, b) for name, a, b in zip(("y", "dx", "dw"), got, want)}
    other = norm_reference(x, w, g, eps, not one_plus)
    return errors, relative(got[0], other[0])


def gelu_tanh(x):
    t = np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))
    slope = math.sqrt(2 / math.pi) * (1 + 3 * 0.044715 * x * x)
    return 0.5 * x * (1 + t), 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * slope


def gelu_erf(x):
    e = np.vectorize(math.erf)(x / math.sqrt(2))
    return 0.5 * x * (1 + e), 0.5 * (1 + e) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def silu(x):
    s = 1 / (1 + np.exp(-x))
    return x * s, s * (1 - x * s) + x * s


ACTIVATIONS = {"swiglu": silu, "geglu_tanh": gelu_tanh, "geglu_erf": gelu_erf}
# Each activation's `ACT` in gated.py.
ACT = {"swiglu": gated.SILU, "geglu_tanh": gated.GELU_TANH, "geglu_erf": gated.GELU_ERF}


def check_gated(name, n, block, dtype, rng):
    """One gated case: the worst error over y, d gate and d up, and how far the reference with gate
    and up swapped is from the kernel's output."""
    gate64 = rng.normal(0, 3.0, n)
    gate64[: min(n, 4)] = [-100.0, 100.0, -20.0, 20.0][: min(n, 4)]
    gate_arr, x = stored(gate64, dtype)
    up_arr, u = stored(rng.normal(0, 1.0, n), dtype)
    g_arr, g = stored(rng.normal(0, 1.0, n), dtype)
    y_arr, dgate_arr, dup_arr = (np.zeros(n, gate_arr.dtype) for _ in range(3))
    p = interpret.pointer
    grid = (-(-n // block),)
    gated.gated_forward[grid](p(gate_arr, dtype), p(up_arr, dtype), p(y_arr, dtype), n, ACT=ACT[name],
                              BLOCK=block)
    gated.gated_backward[grid](p(gate_arr, dtype), p(up_arr, dtype), p(g_arr, dtype), p(dgate_arr, dtype),
                               p(dup_arr, dtype), n, ACT=ACT[name], BLOCK=block)
    a, slope = ACTIVATIONS[name](x)
    if dtype == BF16 and name != "swiglu":
        a = values(stored(a, dtype)[0], dtype)
    want = (a * u, g * u * slope, g * a)
    got = tuple(values(arr, dtype) for arr in (y_arr, dgate_arr, dup_arr))
    errors = {k: relative(b, c) for k, b, c in zip(("y", "d gate", "d up"), got, want)}
    swapped = ACTIVATIONS[name](u)[0] * x
    usual = slice(4, None) if n > 4 else slice(None)  # the overflowing gates aside, which dominate
    return errors, relative(got[0][usual], swapped[usual])


def rope_reference(x, cos, sin, inverse):
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    c1, c2, s1, s2 = cos[..., :h], cos[..., h:], sin[..., :h], sin[..., h:]
    if inverse:
        return np.concatenate([x1 * c1 + x2 * s2, x2 * c2 - x1 * s1], -1)
    return np.concatenate([x1 * c1 - x2 * s1, x2 * c2 + x1 * s2], -1)


def check_rope(b, heads, length, hd, per_batch, inverse, dtype, rng, block_rows=16):
    """One rope case: the error of `y` (or `dx`), and how far the reference with the sine table's
    halves swapped is from the kernel's output."""
    x_arr, x = stored(rng.normal(0, 1.0, (b, heads, length, hd)), dtype)
    tables = (b, 1, length, hd) if per_batch else (length, hd)
    angle = rng.uniform(0, 6.3, tables)
    cos_arr, cos = stored(np.cos(angle), dtype)
    sin_arr, sin = stored(np.sin(angle), dtype)
    y_arr = np.zeros_like(x_arr)
    rows = b * heads * length
    p = interpret.pointer
    rope.rope[(-(-rows // block_rows),)](p(x_arr, dtype), p(cos_arr, dtype), p(sin_arr, dtype),
                                          p(y_arr, dtype), rows, heads * length, length, int(per_batch),
                                          int(inverse), HEAD_DIM=hd, BLOCK_ROWS=block_rows)
    got = values(y_arr, dtype)
    want = rope_reference(x, cos, sin, inverse)
    swapped = np.concatenate([sin[..., hd // 2:], sin[..., :hd // 2]], -1)
    return {"dx" if inverse else "y": relative(got, want)}, relative(got, rope_reference(x, cos, swapped, inverse))


def adamw_reference(p, g, m, v, h):
    p = p * h["decay"]
    m = m * h["beta1"] + g * (1 - h["beta1"])
    v = v * h["beta2"] + g * g * (1 - h["beta2"])
    return p - (m / h["bc1"]) / (np.sqrt(v / h["bc2"]) + h["eps"]) * h["lr"], m, v


def check_adamw(n, step, wd, dtype, rng, block=256):
    """One AdamW case: the errors of p, m and v after the update, and how far the reference with
    the bias corrections swapped is from the kernel's parameter."""
    lr, beta1, beta2, eps = 1e-3, 0.9, 0.999, 1e-8
    h = dict(lr=lr, decay=1 - lr * wd, beta1=beta1, beta2=beta2, eps=eps,
             bc1=1 - beta1 ** step, bc2=1 - beta2 ** step)
    # Parameters as large as a step, so the f32 error of the step is not below p's own rounding.
    p_arr, p = stored(rng.normal(0, 2e-3, n), dtype)
    g_arr, g = stored(rng.normal(0, 1e-2, n), dtype)
    first = step == 1
    m_arr, m = stored(np.zeros(n) if first else rng.normal(0, 1e-3, n), F32)
    v_arr, v = stored(np.zeros(n) if first else rng.uniform(0, 1e-4, n), F32)
    ptr = interpret.pointer
    adamw.adamw[(-(-n // block),)](ptr(p_arr, dtype), ptr(g_arr, dtype), ptr(m_arr, F32), ptr(v_arr, F32), n,
                                   lr, h["decay"], beta1, beta2, 1 - beta1, 1 - beta2, 1 / h["bc1"],
                                   1 / h["bc2"], eps, BLOCK=block)
    want = adamw_reference(p, g, m, v, h)
    got = (values(p_arr, dtype), values(m_arr, F32), values(v_arr, F32))
    # f32 measured against the step (about lr), bf16 against p (its rounding dominates).
    moved = np.max(np.abs(want[0] - p)) if dtype == F32 else np.max(np.abs(want[0]))
    errors = {"p": float(np.max(np.abs(got[0] - want[0])) / moved),
              "m": relative(got[1], want[1]), "v": relative(got[2], want[2])}
    swapped = adamw_reference(p, g, m, v, dict(h, bc1=h["bc2"], bc2=h["bc1"]))[0]
    return errors, float(np.max(np.abs(got[0] - swapped)) / moved)


def check_head(n, vocab, block, dtype, rng):
    """One head case: the errors of the log-prob (against the largest), the log-sum-exp and the
    logits' gradient, and how far the reference with each target one column over is."""
    z64 = rng.normal(0, 4.0, (n, vocab))
    z64[0] = 1.5  # a row of equal logits
    if n > 1:
        z64[1, :3] = [60.0, -60.0, 30.0]  # logits far apart
    z_arr, z = stored(z64, dtype)
    targets = rng.integers(0, vocab, n).astype(np.int64)
    targets[0] = vocab - 1
    if n > 2:
        targets[2] = 0
    g_arr = rng.normal(0, 1.0, n).astype(np.float32)
    lse_arr, logp_arr = np.zeros(n, np.float32), np.zeros(n, np.float32)
    p = interpret.pointer
    head_softmax.head_log_softmax[(n,)](p(z_arr, dtype), p(targets, "i64"), p(lse_arr, F32),
                                        p(logp_arr, F32), vocab, vocab, BLOCK=block)
    head_softmax.head_logit_grad[(n,)](p(z_arr, dtype), p(targets, "i64"), p(lse_arr, F32),
                                       p(g_arr, F32), vocab, vocab, BLOCK=block)
    top = z.max(-1, keepdims=True)
    lse = np.log(np.exp(z - top).sum(-1)) + top[:, 0]
    rows = np.arange(n)
    g = g_arr.astype(np.float64)[:, None]

    def grad(t):
        onehot = np.zeros_like(z)
        onehot[rows, t] = 1.0
        return g * (onehot - np.exp(z - lse[:, None]))

    errors = {"logp": relative(logp_arr, z[rows, targets] - lse), "lse": relative(lse_arr, lse),
              "dz": relative(values(z_arr, dtype), grad(targets))}
    return errors, relative(values(z_arr, dtype), grad((targets + 1) % vocab))


def check_head_entropy(n, vocab, block, dtype, rng):
    """One case of the head's passes with the entropies: the errors of the log-prob and the entropy
    (against the largest), the log-sum-exp and the logits' gradient, and how far the reference with
    each target one column over is. A fourth row, where there is one, has masked (-inf) logits."""
    z64 = rng.normal(0, 4.0, (n, vocab))
    z64[0] = 1.5  # a row of equal logits: the largest entropy, log V
    if n > 1:
        z64[1, :3] = [60.0, -60.0, 30.0]  # logits far apart: an entropy near 0
    if n > 3:
        z64[3, 1::3] = -np.inf
    z_arr, z = stored(z64, dtype)
    targets = rng.integers(0, vocab, n).astype(np.int64)
    targets[0] = vocab - 1
    if n > 2:
        targets[2] = 0
    if n > 3:
        targets[3] = 0
    g_arr = rng.normal(0, 1.0, n).astype(np.float32)
    g_h_arr = rng.normal(0, 1.0, n).astype(np.float32)
    lse_arr, logp_arr, h_arr = (np.zeros(n, np.float32) for _ in range(3))
    p = interpret.pointer
    head_softmax.head_log_softmax_entropy[(n,)](p(z_arr, dtype), p(targets, "i64"), p(lse_arr, F32),
                                                p(logp_arr, F32), p(h_arr, F32), vocab, vocab,
                                                BLOCK=block)
    head_softmax.head_logit_grad_entropy[(n,)](p(z_arr, dtype), p(targets, "i64"), p(lse_arr, F32),
                                               p(h_arr, F32), p(g_arr, F32), p(g_h_arr, F32), vocab,
                                               vocab, BLOCK=block)
    top = z.max(-1, keepdims=True)
    lse = np.log(np.exp(z - top).sum(-1)) + top[:, 0]
    with np.errstate(invalid="ignore"):
        log_p = z - lse[:, None]
        probs = np.exp(log_p)
        entropy = -np.where(probs > 0, probs * log_p, 0.0).sum(-1)
    rows = np.arange(n)
    g, g_h = g_arr.astype(np.float64)[:, None], g_h_arr.astype(np.float64)[:, None]

    def grad(t):
        onehot = np.zeros_like(z)
        onehot[rows, t] = 1.0
        with np.errstate(invalid="ignore"):
            from_entropy = np.where(probs > 0, probs * (log_p + entropy[:, None]), 0.0)
        return g * (onehot - probs) - g_h * from_entropy

    errors = {"logp": relative(logp_arr, z[rows, targets] - lse), "lse": relative(lse_arr, lse),
              "entropy": relative(h_arr, entropy), "dz": relative(values(z_arr, dtype), grad(targets))}
    return errors, relative(values(z_arr, dtype), grad((targets + 1) % vocab))


def check_accumulate(n, block, dtype, rng):
    """`acc += x` into an f32 accumulator: its error against float64 (one f32 rounding of the sum),
    and how far the sum with `x` read one element over is."""
    acc_arr = rng.normal(0, 1.0, n).astype(np.float32)
    acc = acc_arr.astype(np.float64)
    x_arr, x = stored(rng.normal(0, 1.0, n), dtype)
    accumulate.accumulate_add[(-(-n // block),)](interpret.pointer(acc_arr, F32),
                                                   interpret.pointer(x_arr, dtype), n, BLOCK=block)
    want = acc + x
    return {"acc": relative(acc_arr, want)}, relative(acc_arr, acc + np.roll(x, 1))


def check_accumulate_rows(vocab, n_rows, dim, block, dtype, rng):
    """`acc[ids[i]] += rows[i]` in order into an f32 `[vocab, dim]` accumulator, ids repeated (and
    one outside the table, skipped): the error against float64, and how far the sum with each row
    sent one id over is."""
    acc_arr = rng.normal(0, 1.0, (vocab, dim)).astype(np.float32)
    acc = acc_arr.astype(np.float64)
    ids = rng.integers(0, vocab, n_rows).astype(np.int64)
    ids[: min(n_rows, 3)] = ids[0]  # one id three times
    ids[-1] = vocab  # outside the table
    rows_arr, rows = stored(rng.normal(0, 1.0, (n_rows, dim)), dtype)
    accumulate.accumulate_add_rows[(-(-dim // block),)](interpret.pointer(acc_arr, F32),
                                                        interpret.pointer(ids, "i64"),
                                                        interpret.pointer(rows_arr, dtype), n_rows, vocab,
                                                        dim, BLOCK=block)

    def summed(shift):
        want = acc.copy()
        for i, row in zip(ids, rows):
            if row is not None and 0 <= i < vocab:
                want[(i + shift) % vocab] += row
        return want

    return {"acc": relative(acc_arr, summed(0))}, relative(acc_arr, summed(1))


def cases():
    for dtype in (F32, BF16):
        for one_plus in (False, True):
            for rows, dim, block, pad in ((1, 37, 16, 0), (5, 100, 32, 0), (9, 64, 64, 3),
                                          (33, 300, 128, 8), (6, 2560, 1024, 0)):
                yield (f"rms_norm {dtype} {'1+w' if one_plus else 'w'} {rows}x{dim} block {block}"
                       f"{' strided' if pad else ''}",
                       lambda rng, a=(rows, dim, block, one_plus, dtype, pad): check_norm(*a, rng),
                       dtype)
        for b, heads, length, hd, per_batch in ((1, 1, 1, 64, False), (2, 3, 5, 128, True),
                                                (1, 4, 9, 256, False), (3, 2, 7, 64, True)):
            for inverse in (False, True):
                yield (f"rope {dtype} {'backward' if inverse else 'forward'} {b}x{heads}x{length} hd {hd}"
                       f"{' per batch row' if per_batch else ''}",
                       lambda rng, a=(b, heads, length, hd, per_batch, inverse, dtype): check_rope(*a, rng),
                       dtype)
        for n, vocab, block in ((1, 5, 16), (3, 100, 32), (4, 1000, 256), (2, 4096, 1024)):
            yield (f"head_softmax {dtype} {n}x{vocab} block {block}",
                   lambda rng, a=(n, vocab, block, dtype): check_head(*a, rng), dtype)
            yield (f"head_softmax_entropy {dtype} {n}x{vocab} block {block}",
                   lambda rng, a=(n, vocab, block, dtype): check_head_entropy(*a, rng), dtype)
        for n, step, wd in ((1, 1, 0.0), (1000, 1, 0.1), (4099, 7, 0.0), (300, 1000, 0.01)):
            yield (f"adamw {dtype} n {n} step {step} wd {wd}",
                   lambda rng, a=(n, step, wd, dtype): check_adamw(*a, rng), dtype)
        for n, block in ((3, 16), (1000, 256), (4099, 1024)):
            yield (f"accumulate_add {dtype} n {n} block {block}",
                   lambda rng, a=(n, block, dtype): check_accumulate(*a, rng), dtype)
        for vocab, n_rows, dim, block in ((5, 2, 16, 16), (7, 12, 48, 32), (50, 40, 300, 128)):
            yield (f"accumulate_add_rows {dtype} {n_rows} rows of {dim} into {vocab} block {block}",
                   lambda rng, a=(vocab, n_rows, dim, block, dtype): check_accumulate_rows(*a, rng), dtype)
        for name in ACTIVATIONS:
            for n, block in ((1, 16), (13, 16), (1000, 256), (4096, 1024)):
                yield (f"{name} {dtype} n {n} block {block}",
                       lambda rng, a=(name, n, block, dtype): check_gated(*a, rng), dtype)


def main():
    rng = np.random.default_rng(0)
    failed = 0
    for name, run, dtype in cases():
        errors, caught = run(rng)
        worst = max(errors.values())
        bad = worst > BOUND[dtype] or not np.isfinite(worst)
        blind = caught < 10 * BOUND[dtype]
        shown = " ".join(f"{k} {v:.1e}" for k, v in errors.items())
        print(f"{'FAIL' if bad or blind else 'ok':4} {name}: {shown}; the neighbouring formula "
              f"differs by {caught:.2f}")
        if blind:
            print("     the comparison does not see the neighbouring formula")
        failed += bad or blind
    if failed:
        print(f"{failed} case(s) failed")
        sys.exit(1)


if __name__ == "__main__":
    main()
