"""The attention of one streamed chunk on the card, fused: query rows [s, e) of a sequence against its
keys [0, e), never writing a score out (FlashAttention-2's scheme).

Four kernels, in the order a step launches them:

- `attention_forward`: the output and each row's log-sum-exp, reading the keys in two segments (the
  chunk's earlier keys, held outside the graph, then its own) with one online softmax over both;
- `attention_backward_delta`: delta = rowsum(dO * O), which both gradient kernels read;
- `attention_backward_queries`: dQ over both key segments;
- `attention_backward_keys`: dK and dV of one key segment, summed over the query heads of its
  key/value head (GQA), written or added into the segment's gradient buffers (the earlier keys'
  gradients accumulate across the chunks of a streamed backward).

Which keys a query reads: query index i (absolute, `q_start + row`) reads key j (absolute) when
j <= i (causal, aligned bottom-right for a chunk against its prefix), j > i - window (Gemma3's sliding
layers; window 0: none), j >= doc_start[b, i] (packed documents: `position_ids` restarting), and
valid[b, j] != 0 (padding). A row that reads no key (only padding can) gets output 0 and
log-sum-exp -inf, and no gradient.

Layouts: every tensor's last dimension is contiguous; the others come as strides, so q may be the
layer's `[b, heads, c, hd]`, the output `[b, c, heads * hd]`. Query head h reads key/value head
h // group. Strides are 64-bit, so offsets past 2^31 elements hold. Scores, the softmax and every
accumulator are f32; the products take the inputs' dtype (bf16 on tensor cores, f32 in IEEE
precision, not TF32). `WIDEN` multiplies in f32 whatever the inputs: for Triton's interpreter, whose
bf16 `tl.dot` is wrong (triton issue 11584); bf16 products are exact in f32, so the sums match.

Compiled ahead of time by `scripts/compile_triton.py`; tested under the interpreter against float64 by
`test_attention.py` beside this file; launched from Rust by `src/ops/attention/fused.rs`.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _dot(a, b, DOT: tl.constexpr, WIDEN: tl.constexpr):
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT)


@triton.jit
def _reads(rows, cols, n_keys, k_first, rule):
    """[M, N]: whether chunk row `rows` reads key `cols` of a segment whose first key is `k_first`
    (`rule`: the chunk's rows c, its first query, the window, the tables' rows and whether they are
    given)."""
    c, q_start, window, doc_row, valid_row, has_docs, has_valid = rule
    qa = (q_start + rows)[:, None]
    ka = (k_first + cols)[None, :]
    ok = (rows[:, None] < c) & (cols[None, :] < n_keys) & (ka <= qa)
    if window > 0:
        ok = ok & (ka > qa - window)
    if has_docs != 0:
        first = tl.load(doc_row + q_start + rows, mask=rows < c, other=0)
        ok = ok & (ka >= first[:, None])
    if has_valid != 0:
        valid = tl.load(valid_row + k_first + cols, mask=cols < n_keys, other=0)
        ok = ok & (valid[None, :] != 0)
    return ok


@triton.jit
def _key_span(m0, segment, rule, BLOCK_M: tl.constexpr):
    """The keys [lo, hi) of a segment that rows [m0, m0 + BLOCK_M) may read."""
    n_keys, k_first = segment[4], segment[5]
    c, q_start, window = rule[0], rule[1], rule[2]
    last = q_start + tl.minimum(m0 + BLOCK_M, c) - 1
    hi = tl.minimum(n_keys, tl.maximum(last - k_first + 1, 0))
    lo = 0
    if window > 0:
        lo = tl.minimum(tl.maximum(q_start + m0 - window + 1 - k_first, 0), hi)
    return lo, hi


@triton.jit
def _program(heads, group, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A row-blocked program's place: its first row, batch-row-and-head index, batch row, head,
    key/value head, its rows and the head's dims."""
    m0 = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    h = bh % heads
    return m0, bh, bh // heads, h, h // group, m0 + tl.arange(0, BLOCK_M), tl.arange(0, HEAD_DIM)


@triton.jit
def _segment(K, V, b, kvh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, n_keys,
             k_first):
    """A key segment as `_key_block` reads it: batch row b's key/value head kvh."""
    return (K + b * stride_kb + kvh * stride_kh, V + b * stride_vb + kvh * stride_vh, stride_kn,
            stride_vn, n_keys, k_first)


@triton.jit
def _key_block(q, segment, start, rows, rule, qk_scale, HEAD_DIM: tl.constexpr,
               BLOCK_N: tl.constexpr, DOT: tl.constexpr, WIDEN: tl.constexpr):
    """The block of keys from `start` of `segment` (keys, values, their row strides, how many, the
    first's index): their values [N, D], the scores q kᵀ in log2 units [M, N], which of them the
    rows read, and the keys [N, D]."""
    K, V, stride_kn, stride_vn, n_keys, k_first = segment
    dims = tl.arange(0, HEAD_DIM)
    cols = start + tl.arange(0, BLOCK_N)
    in_seg = (cols < n_keys)[:, None]
    k = tl.load(K + cols[:, None] * stride_kn + dims[None, :], mask=in_seg, other=0.0)
    v = tl.load(V + cols[:, None] * stride_vn + dims[None, :], mask=in_seg, other=0.0)
    s = _dot(q, tl.trans(k), DOT, WIDEN) * qk_scale
    ok = _reads(rows, cols, n_keys, k_first, rule)
    return v, s, ok, k


@triton.jit
def _forward_segment(acc, m_i, l_i, q, segment, rows, rule, qk_scale, m0, HEAD_DIM: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
                     WIDEN: tl.constexpr):
    """The online softmax over one key segment: (acc, m, l) updated, m in log2 units."""
    lo, hi = _key_span(m0, segment, rule, BLOCK_M)
    for start in range(lo, hi, BLOCK_N):
        v, s, ok, _ = _key_block(q, segment, start, rows, rule, qk_scale, HEAD_DIM, BLOCK_N, DOT,
                                 WIDEN)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT, WIDEN)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def attention_forward(
    Q, K1, V1, K2, V2, O, LSE, DOC, VALID,
    stride_qb, stride_qh, stride_qm,
    stride_k1b, stride_k1h, stride_k1n, stride_v1b, stride_v1h, stride_v1n,
    stride_k2b, stride_k2h, stride_k2n, stride_v2b, stride_v2h, stride_v2n,
    stride_ob, stride_oh, stride_om, stride_docb, stride_validb,
    heads, group, c, n1, n2, q_start, k_start, window, has_docs, has_valid, scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT: tl.constexpr, WIDEN: tl.constexpr,
):
    """O [b, heads, c, hd] (strided) and LSE [b, heads, c] f32 of rows [s, e) over the earlier keys
    K1/V1 (n1 of them, from absolute index k_start; n1 may be 0) and the chunk's own K2/V2 (n2, from
    k_start + n1). Grid: (cdiv(c, BLOCK_M), b * heads)."""
    m0, bh, b, h, kvh, rows, dims = _program(heads, group, BLOCK_M, HEAD_DIM)
    q_ptrs = Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + dims[None, :]
    q = tl.load(q_ptrs, mask=(rows < c)[:, None], other=0.0)
    rule = (c, q_start, window, DOC + b * stride_docb, VALID + b * stride_validb, has_docs,
            has_valid)
    qk_scale = scale * LOG2E
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    first = _segment(K1, V1, b, kvh, stride_k1b, stride_k1h, stride_k1n, stride_v1b, stride_v1h,
                     stride_v1n, n1, k_start)
    own = _segment(K2, V2, b, kvh, stride_k2b, stride_k2h, stride_k2n, stride_v2b, stride_v2h,
                   stride_v2n, n2, k_start + n1)
    acc, m_i, l_i = _forward_segment(acc, m_i, l_i, q, first, rows, rule, qk_scale, m0, HEAD_DIM,
                                     BLOCK_M, BLOCK_N, DOT, WIDEN)
    acc, m_i, l_i = _forward_segment(acc, m_i, l_i, q, own, rows, rule, qk_scale, m0, HEAD_DIM,
                                     BLOCK_M, BLOCK_N, DOT, WIDEN)
    read_any = l_i > 0.0
    out = acc / tl.where(read_any, l_i, 1.0)[:, None]
    lse = tl.where(read_any, (m_i + tl.log2(tl.where(read_any, l_i, 1.0))) * LN2, float("-inf"))
    o_ptrs = O + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + dims[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=(rows < c)[:, None])
    tl.store(LSE + bh.to(tl.int64) * c + rows, lse, mask=rows < c)


@triton.jit
def attention_backward_delta(
    O, DO, DELTA,
    stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom,
    heads, c,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """DELTA [b, heads, c] f32 = rowsum(dO * O). Grid: (cdiv(c, BLOCK_M), b * heads)."""
    _, bh, b, h, _, rows, dims = _program(heads, 1, BLOCK_M, HEAD_DIM)
    in_rows = (rows < c)[:, None]
    o = tl.load(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + dims[None, :],
                mask=in_rows, other=0.0).to(tl.float32)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_dom + dims[None, :],
                 mask=in_rows, other=0.0).to(tl.float32)
    tl.store(DELTA + bh.to(tl.int64) * c + rows, tl.sum(o * do, 1), mask=rows < c)


@triton.jit
def _queries_segment(dq, q, do, lse2, delta, segment, rows, rule, qk_scale, m0,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     DOT: tl.constexpr, WIDEN: tl.constexpr):
    """dS K summed over one key segment into dq (unscaled)."""
    lo, hi = _key_span(m0, segment, rule, BLOCK_M)
    for start in range(lo, hi, BLOCK_N):
        v, s, ok, k = _key_block(q, segment, start, rows, rule, qk_scale, HEAD_DIM, BLOCK_N, DOT,
                                 WIDEN)
        p = tl.where(ok, tl.exp2(s - lse2[:, None]), 0.0)
        dp = _dot(do, tl.trans(v), DOT, WIDEN)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, DOT, WIDEN)
    return dq


@triton.jit
def attention_backward_queries(
    Q, K1, V1, K2, V2, DO, LSE, DELTA, DQ, DOC, VALID,
    stride_qb, stride_qh, stride_qm,
    stride_k1b, stride_k1h, stride_k1n, stride_v1b, stride_v1h, stride_v1n,
    stride_k2b, stride_k2h, stride_k2n, stride_v2b, stride_v2h, stride_v2n,
    stride_dob, stride_doh, stride_dom, stride_dqb, stride_dqh, stride_dqm,
    stride_docb, stride_validb,
    heads, group, c, n1, n2, q_start, k_start, window, has_docs, has_valid, scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT: tl.constexpr, WIDEN: tl.constexpr,
):
    """DQ (strided like Q) over both key segments, as `attention_forward` reads them.
    Grid: (cdiv(c, BLOCK_M), b * heads)."""
    m0, bh, b, h, kvh, rows, dims = _program(heads, group, BLOCK_M, HEAD_DIM)
    in_rows = (rows < c)[:, None]
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + dims[None, :],
                mask=in_rows, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_dom + dims[None, :],
                 mask=in_rows, other=0.0)
    lse2 = tl.load(LSE + bh.to(tl.int64) * c + rows, mask=rows < c, other=0.0) * LOG2E
    delta = tl.load(DELTA + bh.to(tl.int64) * c + rows, mask=rows < c, other=0.0)
    rule = (c, q_start, window, DOC + b * stride_docb, VALID + b * stride_validb, has_docs,
            has_valid)
    qk_scale = scale * LOG2E
    first = _segment(K1, V1, b, kvh, stride_k1b, stride_k1h, stride_k1n, stride_v1b, stride_v1h,
                     stride_v1n, n1, k_start)
    own = _segment(K2, V2, b, kvh, stride_k2b, stride_k2h, stride_k2n, stride_v2b, stride_v2h,
                   stride_v2n, n2, k_start + n1)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    dq = _queries_segment(dq, q, do, lse2, delta, first, rows, rule, qk_scale, m0, HEAD_DIM, BLOCK_M,
                          BLOCK_N, DOT, WIDEN)
    dq = _queries_segment(dq, q, do, lse2, delta, own, rows, rule, qk_scale, m0, HEAD_DIM, BLOCK_M,
                          BLOCK_N, DOT, WIDEN)
    dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqm + dims[None, :]
    tl.store(dq_ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=in_rows)


@triton.jit
def attention_backward_keys(
    Q, K, V, DO, LSE, DELTA, DK, DV, DOC, VALID,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh,
    stride_dvn, stride_docb, stride_validb,
    heads, group, c, n_keys, q_start, k_first, window, has_docs, has_valid, accumulate, scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT: tl.constexpr, WIDEN: tl.constexpr,
):
    """DK, DV [b, kv_heads, n_keys, hd] (strided) of one key segment (first key at absolute index
    k_first), summed over the `group` query heads of each key/value head; added into what DK/DV hold
    when `accumulate` is nonzero. Grid: (cdiv(n_keys, BLOCK_N), b * kv_heads)."""
    n0 = tl.program_id(0) * BLOCK_N
    bk = tl.program_id(1)
    kv_heads = heads // group
    b = bk // kv_heads
    kvh = bk % kv_heads
    cols = n0 + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    in_seg = (cols < n_keys)[:, None]
    k = tl.load(K + b * stride_kb + kvh * stride_kh + cols[:, None] * stride_kn + dims[None, :],
                mask=in_seg, other=0.0)
    v = tl.load(V + b * stride_vb + kvh * stride_vh + cols[:, None] * stride_vn + dims[None, :],
                mask=in_seg, other=0.0)
    rule = (c, q_start, window, DOC + b * stride_docb, VALID + b * stride_validb, has_docs,
            has_valid)
    qk_scale = scale * LOG2E
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    # The rows that may read these keys: at or after the first (causal), before the last plus the
    # window.
    lo = tl.minimum(tl.maximum(k_first + n0 - q_start, 0), c)
    hi = c
    if window > 0:
        hi = tl.maximum(tl.minimum(c, k_first + n0 + BLOCK_N - 1 + window - q_start), lo)
    lo = lo // BLOCK_M * BLOCK_M
    for g in range(0, group):
        h = kvh * group + g
        bh = (b * heads + h).to(tl.int64)
        for start in range(lo, hi, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            in_rows = (rows < c)[:, None]
            q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + dims[None, :],
                        mask=in_rows, other=0.0)
            do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_dom
                         + dims[None, :], mask=in_rows, other=0.0)
            lse2 = tl.load(LSE + bh * c + rows, mask=rows < c, other=0.0) * LOG2E
            delta = tl.load(DELTA + bh * c + rows, mask=rows < c, other=0.0)
            s = _dot(q, tl.trans(k), DOT, WIDEN) * qk_scale
            ok = _reads(rows, cols, n_keys, k_first, rule)
            p = tl.where(ok, tl.exp2(s - lse2[:, None]), 0.0)
            dv += _dot(tl.trans(p.to(do.dtype)), do, DOT, WIDEN)
            dp = _dot(do, tl.trans(v), DOT, WIDEN)
            ds = p * (dp - delta[:, None])
            dk += _dot(tl.trans(ds.to(q.dtype)), q, DOT, WIDEN)
    dk = dk * scale
    dk_ptrs = DK + b * stride_dkb + kvh * stride_dkh + cols[:, None] * stride_dkn + dims[None, :]
    dv_ptrs = DV + b * stride_dvb + kvh * stride_dvh + cols[:, None] * stride_dvn + dims[None, :]
    if accumulate != 0:
        dk += tl.load(dk_ptrs, mask=in_seg, other=0.0).to(tl.float32)
        dv += tl.load(dv_ptrs, mask=in_seg, other=0.0).to(tl.float32)
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=in_seg)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=in_seg)
