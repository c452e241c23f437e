"""The attention kernels of `attention.py` under Triton's interpreter (on the CPU, no GPU, no torch)
against a float64 reference, on the shapes a streamed backward gives them: chunk 1, chunks not a
multiple of the block, no earlier keys (s = 0) and the whole prefix (e = T), GQA groups 1 to 8,
sliding windows that cut a chunk, packed documents, padding, head dims 64/128/256, f32 and bf16,
strided layouts, and gradients added into the earlier keys' buffers. Each case also checks that the
comparison would catch a mask off by one (a test that cannot fail proves nothing).

Run: `TRITON_INTERPRET=1 python crates/streambp-kernels/triton/test_attention.py` (the variable is set
here if absent). Needs `triton` and `numpy` only.
"""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import interpret  # noqa: E402
import attention as kernels  # noqa: E402

BF16 = "bf16"
F32 = "fp32"


def to_bf16(x):
    """f64/f32 values -> bf16 bit patterns (uint16), rounded to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def stored(x, dtype):
    """The array the kernel reads for values `x` in `dtype`, and those values in f64."""
    if dtype == BF16:
        bits = to_bf16(x)
        return bits, from_bf16(bits).astype(np.float64)
    arr = np.ascontiguousarray(x, dtype=np.float32)
    return arr, arr.astype(np.float64)


def values(arr, dtype):
    return (from_bf16(arr) if dtype == BF16 else arr).astype(np.float64)


def reads(case, rows, keys):
    """[b, c, n] bool: whether query row i reads key j (absolute indices), as the kernel's mask says,
    or off by one where `case['wrong']` says so."""
    qa = case["q_start"] + np.arange(rows)
    ka = case["k_start"] + np.arange(keys)
    ok = ka[None, :] <= qa[:, None]
    if case["wrong"] == "causal":
        ok = ka[None, :] < qa[:, None]
    w = case["window"]
    if w:
        lowest = qa[:, None] - w + (1 if case["wrong"] == "window" else 0)
        ok = ok & (ka[None, :] > lowest)
    ok = np.broadcast_to(ok, (case["b"], rows, keys)).copy()
    if case["doc_start"] is not None:
        first = case["doc_start"][:, qa]
        ok &= ka[None, None, :] >= first[:, :, None]
    if case["valid"] is not None:
        ok &= case["valid"][:, ka][:, None, :] != 0
    return ok


def reference(case, q, k, v, do):
    """Output, log-sum-exp and gradients in f64 (k, v: both segments' keys side by side)."""
    b, heads, c, hd = q.shape
    group = case["group"]
    kk = np.repeat(k, group, axis=1)
    vv = np.repeat(v, group, axis=1)
    ok = reads(case, c, k.shape[2])[:, None]
    s = case["scale"] * np.einsum("bhid,bhjd->bhij", q, kk)
    s = np.where(ok, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(ok, np.exp(s - m), 0.0)
    total = e.sum(-1, keepdims=True)
    p = e / np.where(total > 0, total, 1.0)
    out = np.einsum("bhij,bhjd->bhid", p, vv)
    lse = np.where(total[..., 0] > 0, m[..., 0] + np.log(np.where(total > 0, total, 1.0))[..., 0], -np.inf)
    delta = (do * out).sum(-1, keepdims=True)
    dp = np.einsum("bhid,bhjd->bhij", do, vv)
    ds = p * (dp - delta)
    dq = case["scale"] * np.einsum("bhij,bhjd->bhid", ds, kk)
    dk = case["scale"] * np.einsum("bhij,bhid->bhjd", ds, q)
    dv = np.einsum("bhij,bhid->bhjd", p, do)
    kv = heads // group
    dk = dk.reshape(b, kv, group, -1, hd).sum(2)
    dv = dv.reshape(b, kv, group, -1, hd).sum(2)
    return out, lse, dq, dk, dv


def strides(arr):
    return [s // arr.itemsize for s in arr.strides]


def run_kernels(case, rng):
    """Inputs drawn, the four kernels run as a streamed chunk runs them; returns what they gave and
    the inputs' values in f64."""
    b, heads, group, c, hd = case["b"], case["heads"], case["group"], case["c"], case["hd"]
    n1, n2, dtype = case["n1"], case["n2"], case["dtype"]
    kv = heads // group
    bm, bn = case["block_m"], case["block_n"]
    # q and the output in the layer's layout [b, c, heads * hd], seen as [b, heads, c, hd].
    q_arr, q64 = stored(rng.standard_normal((b, c, heads, hd)), dtype)
    k1_arr, k1 = stored(rng.standard_normal((b, kv, n1, hd)), dtype)
    v1_arr, v1 = stored(rng.standard_normal((b, kv, n1, hd)), dtype)
    k2_arr, k2 = stored(rng.standard_normal((b, kv, n2, hd)), dtype)
    v2_arr, v2 = stored(rng.standard_normal((b, kv, n2, hd)), dtype)
    do_arr, do64 = stored(rng.standard_normal((b, c, heads, hd)), dtype)
    q_view = q_arr.transpose(0, 2, 1, 3)
    do_view = do_arr.transpose(0, 2, 1, 3)
    store = np.uint16 if dtype == BF16 else np.float32
    o_arr = np.zeros((b, c, heads, hd), store)
    o_view = o_arr.transpose(0, 2, 1, 3)
    lse = np.zeros((b, heads, c), np.float32)
    t_total = case["k_start"] + n1 + n2
    doc = case["doc_start"] if case["doc_start"] is not None else np.zeros((1, 1), np.int64)
    valid = case["valid"] if case["valid"] is not None else np.zeros((1, 1), np.uint8)
    assert doc.shape[-1] in (1, t_total) and valid.shape[-1] in (1, t_total)
    P = interpret.pointer
    q_s, k1_s, v1_s, k2_s, v2_s = (strides(x)[:3] for x in (q_view, k1_arr, v1_arr, k2_arr, v2_arr))
    o_s, do_s = strides(o_view)[:3], strides(do_view)[:3]
    dot = "ieee" if dtype == F32 else "tf32"
    shape = dict(HEAD_DIM=hd, DOT=dot, WIDEN=dtype == BF16)
    mask_args = [case["q_start"], case["k_start"], case["window"],
                 int(case["doc_start"] is not None), int(case["valid"] is not None)]
    kernels.attention_forward[(-(-c // bm), b * heads)](
        P(q_view, dtype), P(k1_arr, dtype), P(v1_arr, dtype), P(k2_arr, dtype), P(v2_arr, dtype),
        P(o_view, dtype), P(lse, F32), P(doc, "i64"), P(valid, "u8"),
        *q_s, *k1_s, *v1_s, *k2_s, *v2_s, *o_s, doc.shape[-1], valid.shape[-1],
        heads, group, c, n1, n2, *mask_args, case["scale"],
        BLOCK_M=bm, BLOCK_N=bn, **shape)
    delta = np.zeros((b, heads, c), np.float32)
    kernels.attention_backward_delta[(-(-c // bm), b * heads)](
        P(o_view, dtype), P(do_view, dtype), P(delta, F32), *o_s, *do_s, heads, c,
        HEAD_DIM=hd, BLOCK_M=bm)
    dq_arr = np.zeros((b, c, heads, hd), store)
    dq_view = dq_arr.transpose(0, 2, 1, 3)
    kernels.attention_backward_queries[(-(-c // bm), b * heads)](
        P(q_view, dtype), P(k1_arr, dtype), P(v1_arr, dtype), P(k2_arr, dtype), P(v2_arr, dtype),
        P(do_view, dtype), P(lse, F32), P(delta, F32), P(dq_view, dtype), P(doc, "i64"),
        P(valid, "u8"), *q_s, *k1_s, *v1_s, *k2_s, *v2_s, *do_s, *strides(dq_view)[:3],
        doc.shape[-1], valid.shape[-1], heads, group, c, n1, n2, *mask_args, case["scale"],
        BLOCK_M=bm, BLOCK_N=bn, **shape)
    # The earlier keys' gradients are added into buffers that already hold earlier chunks' sums; the
    # chunk's own keys' are written.
    prior_dk, _ = stored(rng.standard_normal((b, kv, n1, hd)), dtype)
    prior_dv, _ = stored(rng.standard_normal((b, kv, n1, hd)), dtype)
    grads = []
    for (k_arr, v_arr, n, k_first, dk0, dv0, acc) in (
        (k1_arr, v1_arr, n1, case["k_start"], prior_dk.copy(), prior_dv.copy(), 1),
        (k2_arr, v2_arr, n2, case["k_start"] + n1, np.full(k2_arr.shape, 7, store),
         np.full(v2_arr.shape, 7, store), 0),
    ):
        if n > 0:
            kernels.attention_backward_keys[(-(-n // bn), b * kv)](
                P(q_view, dtype), P(k_arr, dtype), P(v_arr, dtype), P(do_view, dtype), P(lse, F32),
                P(delta, F32), P(dk0, dtype), P(dv0, dtype), P(doc, "i64"), P(valid, "u8"),
                *q_s, *strides(k_arr)[:3], *strides(v_arr)[:3], *do_s, *strides(dk0)[:3],
                *strides(dv0)[:3], doc.shape[-1], valid.shape[-1],
                heads, group, c, n, case["q_start"], k_first, case["window"],
                int(case["doc_start"] is not None), int(case["valid"] is not None), acc,
                case["scale"], BLOCK_M=bm, BLOCK_N=bn, **shape)
        grads.append((values(dk0, dtype), values(dv0, dtype)))
    (dk1, dv1), (dk2, dv2) = grads
    dk1 = dk1 - values(prior_dk, dtype)
    dv1 = dv1 - values(prior_dv, dtype)
    q64 = q64.transpose(0, 2, 1, 3)
    do64 = do64.transpose(0, 2, 1, 3)
    got = dict(
        out=values(o_view, dtype), lse=lse.astype(np.float64), dq=values(dq_view, dtype),
        dk=np.concatenate([dk1, dk2], 2), dv=np.concatenate([dv1, dv2], 2))
    inputs = (q64, np.concatenate([k1, k2], 2), np.concatenate([v1, v2], 2), do64)
    return got, inputs


def error(got, want):
    """The largest difference relative to the reference's largest magnitude (inf matched by inf)."""
    both_inf = np.isinf(got) & np.isinf(want) & (np.sign(got) == np.sign(want))
    with np.errstate(invalid="ignore"):
        diff = np.where(both_inf, 0.0, np.abs(got - want))
    scale = max(np.abs(np.where(np.isfinite(want), want, 0.0)).max(initial=0.0), 1e-30)
    return float(diff.max(initial=0.0) / scale)


def tolerance(dtype, name):
    """f32: the sums' rounding. bf16: outputs and gradients stored in bf16 (2^-8 relative) after
    products of bf16 operands (the probabilities and dS rounded to bf16 first, as FlashAttention's)."""
    if dtype == F32:
        return 2e-5
    return 4e-3 if name == "lse" else 3e-2


def check(case, rng):
    got, (q, k, v, do) = run_kernels(case, rng)
    want = dict(zip(("out", "lse", "dq", "dk", "dv"), reference(case, q, k, v, do)))
    errors = {name: error(got[name], want[name]) for name in want}
    worst = {name: e for name, e in errors.items() if not e <= tolerance(case["dtype"], name)}
    # The comparison must see a mask off by one: the kernel against a reference masking wrongly, by
    # causality and, where the window hides a key from some query, by the window.
    kinds = ["causal"]
    if case["window"] and case["q_start"] + case["c"] - 1 - case["window"] >= case["k_start"]:
        kinds.append("window")
    caught = min(
        max(error(got[name], wrong[name]) for name in ("out", "dq", "dk", "dv"))
        for wrong in (dict(zip(("out", "lse", "dq", "dk", "dv"),
                               reference(dict(case, wrong=kind), q, k, v, do))) for kind in kinds))
    return errors, worst, caught


def case(**kw):
    c = dict(b=1, heads=2, group=1, c=16, n1=0, n2=16, q_start=0, k_start=0, window=0,
             doc_start=None, valid=None, hd=64, dtype=F32, block_m=16, block_n=16, wrong=None)
    c.update(kw)
    c.setdefault("scale", 1.0 / np.sqrt(c["hd"]))
    return c


def packed(b, t, starts_per_row):
    """doc_start [b, t] i64 for documents starting at the given indices in each row."""
    doc = np.zeros((b, t), np.int64)
    for r, starts in enumerate(starts_per_row):
        for s in sorted(starts):
            doc[r, s:] = s
    return doc


def cases():
    yield "whole sequence, one block", case()
    yield "chunk 1 at the end of the prefix", case(c=1, n1=20, n2=1, q_start=20)
    yield "chunk not a multiple of the block, earlier keys not either", case(
        c=21, n1=37, n2=21, q_start=37)
    yield "first chunk (s = 0), GQA 2, batch 2", case(b=2, heads=4, group=2, c=23, n2=23)
    yield "GQA 4, chunk in the middle", case(heads=8, group=4, c=18, n1=30, n2=18, q_start=30)
    yield "GQA 8, head dim 128", case(heads=8, group=8, c=17, n1=15, n2=17, q_start=15, hd=128)
    yield "head dim 256", case(heads=2, group=2, c=9, n1=12, n2=9, q_start=12, hd=256)
    yield "sliding window cutting the chunk", case(c=24, n1=40, n2=24, q_start=40, window=13)
    yield "window wider than the prefix", case(c=16, n1=8, n2=16, q_start=8, window=100)
    yield "window, keys from a later first key", case(c=16, n1=20, n2=16, q_start=28, k_start=8,
                                                        window=9)
    yield "packed documents, batch 2", case(
        b=2, c=19, n1=29, n2=19, q_start=29, doc_start=packed(2, 48, [[0, 11, 30], [0, 40]]))
    yield "right padding, batch 2", case(
        b=2, c=20, n1=20, n2=20, q_start=20,
        valid=np.array([[1] * 40, [1] * 27 + [0] * 13], np.uint8))
    yield "left padding: rows that read nothing", case(
        b=2, c=20, n2=20, valid=np.array([[0] * 5 + [1] * 15, [1] * 20], np.uint8))
    yield "packing, padding, window and GQA together", case(
        b=2, heads=4, group=2, c=17, n1=19, n2=17, q_start=19, window=11,
        doc_start=packed(2, 36, [[0, 9], [0, 25]]),
        valid=np.array([[1] * 36, [1] * 30 + [0] * 6], np.uint8))
    for dtype in (BF16,):
        yield "bf16: chunk in the middle, GQA 2", case(
            heads=4, group=2, c=21, n1=26, n2=21, q_start=26, dtype=dtype)
        yield "bf16: head dim 128, window, packed", case(
            c=18, n1=22, n2=18, q_start=22, hd=128, window=15, dtype=dtype,
            doc_start=packed(1, 40, [[0, 17]]))
    yield "the compiled blocks (64 x 32), hd 64", case(
        c=70, n1=50, n2=70, q_start=50, block_m=64, block_n=32)


def main():
    rng = np.random.default_rng(0)
    failed = 0
    for name, c in cases():
        errors, worst, caught = check(c, rng)
        shown = " ".join(f"{k} {v:.1e}" for k, v in errors.items())
        blind = caught < 0.05
        status = "FAIL" if worst or blind else "ok"
        print(f"{status:4} {name}: {shown}; a wrong mask differs by {caught:.2f}")
        if blind:
            print("     the comparison does not see a mask off by one")
        failed += bool(worst) or blind
    if failed:
        print(f"{failed} case(s) failed")
        sys.exit(1)


if __name__ == "__main__":
    main()
