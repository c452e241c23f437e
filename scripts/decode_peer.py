"""The peer of `examples/decode_speed.rs` (streambp-models): the same decoding loop in transformers on a
random model of a config.json, f32 and bf16 alternated twice: a 64-token prompt for each of `rows`
rows, then `steps` (default 64) greedy tokens one forward at a time through `past_key_values`, as
GRPO samples.

    .venv/bin/python scripts/decode_peer.py benches/configs/qwen3-0.6b.json 8 [steps]

Prints the prompt's seconds and the milliseconds per new token. Threads are torch's default (the
machine's cores). torch + transformers from PyPI: `.venv/bin/pip install torch transformers`.
"""
import json
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

config_path = sys.argv[1] if len(sys.argv) > 1 else "benches/configs/qwen3-small.json"
rows = int(sys.argv[2]) if len(sys.argv) > 2 else 8
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 64
prompt_len = 64
torch.manual_seed(0)
config = AutoConfig.for_model(**json.load(open(config_path)))
ids = torch.tensor([[(i * 7 + r) % config.vocab_size for i in range(prompt_len)] for r in range(rows)])
for dtype in [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]:
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        started = time.time()
        out = model(ids, use_cache=True)
        prompt = time.time() - started
        started = time.time()
        for _ in range(steps):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
        step = (time.time() - started) / steps
    print(
        f"torch {torch.__version__} {str(dtype).removeprefix('torch.')}: {rows} rows, "
        f"prompt of {prompt_len} {prompt:.3f} s, then {step * 1e3:.1f} ms per new token",
        flush=True,
    )
