#!/usr/bin/env python3
"""PyTorch's SDPA on the card on the shapes `attention_card` times (the peer of issue 59): queries
[s, e) of a Qwen3-8B layer (32 heads, 8 key/value heads by GQA, head dim 128, bf16) against keys
[0, e), causal aligned bottom-right, forward and forward + backward. One JSON line per shape, TFLOP/s
counted as `attention_card` counts them. Needs torch with CUDA (the GPU machines' /opt/torch/.venv).

Usage: python scripts/sdpa_peer.py [T:CHUNK ...]   (default 4096:4096 16384:16384 16384:2048)
"""

import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def timed(fn, repeats=3):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def main():
    shapes = [tuple(int(x) for x in a.split(":")) for a in sys.argv[1:]] or [
        (4096, 4096), (16384, 16384), (16384, 2048)]
    heads, kv_heads, hd = 32, 8, 128
    for t, c in shapes:
        s = t - c
        q = torch.randn(1, heads, c, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, kv_heads, t, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, kv_heads, t, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def forward():
            with torch.no_grad():
                if s == 0:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(c, t),
                                                      enable_gqa=True)

        def both():
            mask = dict(is_causal=True) if s == 0 else dict(attn_mask=causal_lower_right(c, t))
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **mask)
            out.float().sum().backward()

        pairs = c * s + c * (c + 1) / 2
        flops = 4.0 * hd * heads * pairs
        fwd = timed(forward)
        bwd = max(timed(both) - fwd, 1e-9)
        print(json.dumps(dict(path="torch-sdpa", T=t, chunk=c, heads=heads, kv_heads=kv_heads,
                              head_dim=hd, forward_ms=round(fwd * 1e3, 3), backward_ms=round(bwd * 1e3, 3),
                              forward_tflops=round(flops / fwd / 1e12, 1),
                              backward_tflops=round(2.5 * flops / bwd / 1e12, 1),
                              torch=torch.__version__, card=torch.cuda.get_device_name())), flush=True)


if __name__ == "__main__":
    main()
