"""The rollouts' peer: transformers' `generate` sampling GRPO's completions as TRL's GRPOTrainer asks
for them (prompts left-padded, `num_return_sequences` = the group size, one batched forward per new
token through the KV cache), on a model directory streambp can train too.

    # the shipped SFT checkpoint of the built-in task, as `grpo`'s defaults sample it
    python scripts/rollout_peer.py --model crates/streambp-train/assets/arithmetic

Prints one JSON line: seconds per batch of prompts (median of --repeats batches, each new prompts
after --warmup untimed ones) and completions per second. streambp's figure for the same work is
`time/rollouts` in a `grpo` run's metrics.jsonl (sampling and rewards). torch + transformers from
PyPI: `.venv/bin/pip install torch transformers`.
"""
import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

p = argparse.ArgumentParser()
p.add_argument("--model", required=True, help="HF model directory (config.json, tokenizer.json)")
p.add_argument("--prompts", help="JSONL with a prompt column (default: the model dir's train.jsonl)")
p.add_argument("--batch-size", type=int, default=8, help="prompts per generate call")
p.add_argument("--group-size", type=int, default=8, help="completions per prompt")
p.add_argument("--max-new-tokens", type=int, default=6)
p.add_argument("--temperature", type=float, default=1.0)
p.add_argument("--top-p", type=float, default=1.0)
p.add_argument("--threads", type=int, default=os.cpu_count())
p.add_argument("--warmup", type=int, default=3)
p.add_argument("--repeats", type=int, default=20)
a = p.parse_args()

torch.set_num_threads(a.threads)
torch.manual_seed(0)

# The built-in asset names its weights sft-model.safetensors: give transformers the name it expects.
model_dir = a.model
if not os.path.exists(os.path.join(model_dir, "model.safetensors")):
    model_dir = tempfile.mkdtemp()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(a.model, name), model_dir)
    weights = [f for f in os.listdir(a.model) if f.endswith(".safetensors")]
    shutil.copy(os.path.join(a.model, weights[0]), os.path.join(model_dir, "model.safetensors"))

tok = AutoTokenizer.from_pretrained(model_dir)
tok.padding_side = "left"  # as TRL's GRPOTrainer pads prompts
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

prompts_file = a.prompts or os.path.join(a.model, "train.jsonl")
prompts = [json.loads(line)["prompt"] for line in open(prompts_file)]

times = []
for i in range(a.warmup + a.repeats):
    batch = prompts[i * a.batch_size : (i + 1) * a.batch_size]
    enc = tok(batch, return_tensors="pt", padding=True)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            **enc,
            do_sample=True,
            temperature=a.temperature,
            top_p=a.top_p,
            top_k=0,
            max_new_tokens=a.max_new_tokens,
            num_return_sequences=a.group_size,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    if i >= a.warmup:
        times.append(time.perf_counter() - start)

seconds = statistics.median(times)
print(
    json.dumps(
        {
            "torch": torch.__version__,
            "threads": a.threads,
            "prompts": a.batch_size,
            "group": a.group_size,
            "max_new_tokens": a.max_new_tokens,
            "seconds_per_batch": round(seconds, 5),
            "completions_per_second": round(a.batch_size * a.group_size / seconds, 1),
        }
    )
)
