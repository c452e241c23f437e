"""The PyTorch peer of the bench: one forward + backward of a random-init transformers model, batch 1,
SFT loss on every token (labels = inputs), with or without gradient checkpointing.

Two ways to run it (torch + transformers from PyPI: `.venv/bin/pip install torch transformers`):

    # standalone: JSON lines, one per (T, mode), the median of --repeats after a warm-up
    python scripts/peer_bench.py --config benches/configs/qwen3-small.json --seqs 2048,4096

    # where its time goes: after the timed steps, one more step per (T, mode) under torch's profiler,
    # its operators' own times (what the peer's step spends in products, attention, element-wise
    # work), to set beside the bench's --op-times
    python scripts/peer_bench.py --config benches/configs/qwen3-small.json --seqs 2048 --modes gc \
        --profile

    # as the bench's peer (streambp-bench --peer python): reads "T MODE" lines on stdin, answers one
    # JSON line per request, so the bench can alternate the peer's steps with its own in one run
    python scripts/peer_bench.py --config benches/configs/qwen3-small.json --serve

With --memory each step also reports `peak_bytes`: the process's heap peak above what was live before
the step (the weights; gradients set to None), counted by scripts/heap_peak.c preloaded into it (the
script compiles it with `cc` into target/ and starts itself again with it), as the bench counts ours.

MODE is `none` (transformers, no checkpointing) or `gc` (gradient checkpointing of every decoder
layer with transformers' defaults: `activation_checkpointing_enable()`, formerly
`gradient_checkpointing_enable()`). Threads: --threads (default: every core this process may run
on, as candle's CPU backend uses; `taskset -c 0,1` gives both sides the same two).
"""
import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--config", required=True, help="an HF config.json (model_type picks the class)")
p.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
p.add_argument("--device", default="cpu")
p.add_argument("--threads", type=int,
               default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
p.add_argument("--attn", default="sdpa", help="transformers' attention implementation")
p.add_argument("--seqs", default="1024,2048", help="standalone: sequence lengths")
p.add_argument("--modes", default="none,gc", help="standalone: none, gc or both")
p.add_argument("--repeats", type=int, default=3, help="standalone: timed steps per point")
p.add_argument("--serve", action="store_true", help="answer 'T MODE' lines on stdin")
p.add_argument("--profile", action="store_true",
               help="standalone: one more step per point under torch's profiler, its table after the JSON")
p.add_argument("--memory", action="store_true",
               help="report each step's heap peak (scripts/heap_peak.c preloaded; host memory only)")
a = p.parse_args()


def heap_counter():
    """The preloaded heap counter, or None; with --memory and none loaded, this script again with it."""
    lib = ctypes.CDLL(None)
    if hasattr(lib, "heap_peak_bytes"):
        for f in (lib.heap_live_bytes, lib.heap_peak_bytes):
            f.restype = ctypes.c_longlong
        return lib
    if not a.memory:
        return None
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source, shim = os.path.join(repo, "scripts", "heap_peak.c"), os.path.join(repo, "target", "heap_peak.so")
    if not os.path.exists(shim) or os.path.getmtime(shim) < os.path.getmtime(source):
        os.makedirs(os.path.dirname(shim), exist_ok=True)
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", shim, source], check=True)
    env = dict(os.environ, LD_PRELOAD=shim)
    os.execve(sys.executable, [sys.executable] + sys.argv, env)


heap = heap_counter()
if a.memory and a.device != "cpu":
    sys.exit("--memory counts host memory: use it with --device cpu")

torch.set_num_threads(a.threads)
dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
cfg = AutoConfig.from_pretrained(a.config)
cfg._attn_implementation = a.attn
torch.manual_seed(0)
with torch.device(a.device):
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
model.train()
# Dropout off, as in the bench (the configs have none; a pretrained config may).
for module in model.modules():
    if isinstance(module, torch.nn.Dropout):
        module.p = 0.0


def synchronize():
    if a.device.startswith("cuda"):
        torch.cuda.synchronize()


def step(t, mode):
    """Seconds of one forward + backward at `t` tokens in `mode`, its loss, and (with a heap counter)
    its heap peak above what was live before it."""
    # transformers 5.2x renamed gradient_checkpointing_* to activation_checkpointing_*.
    new_names = hasattr(model, "activation_checkpointing_enable")
    if mode == "gc":
        (model.activation_checkpointing_enable if new_names else model.gradient_checkpointing_enable)()
    else:
        (model.activation_checkpointing_disable if new_names else model.gradient_checkpointing_disable)()
    # The bench's synthetic ids, the same formula.
    ids = torch.tensor([[((i * 2654435761) >> 7) % cfg.vocab_size for i in range(t)]], device=a.device)
    model.zero_grad(set_to_none=True)
    synchronize()
    if heap:
        heap.heap_peak_reset()
        before = heap.heap_live_bytes()
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    synchronize()
    seconds = time.perf_counter() - start
    peak = heap.heap_peak_bytes() - before if heap else None
    return seconds, loss.item(), peak


def info():
    return dict(torch=torch.__version__, transformers=__import__("transformers").__version__,
                threads=torch.get_num_threads(), attn=a.attn, dtype=a.dtype)


if a.serve:
    print(json.dumps(dict(ready=True, **info())), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        t, mode = line.split()
        seconds, loss, peak = step(int(t), mode)
        print(json.dumps(dict(T=int(t), mode=mode, seconds=seconds, loss=loss, peak_bytes=peak)), flush=True)
else:
    for t in (int(s) for s in a.seqs.split(",")):
        for mode in a.modes.split(","):
            step(t, mode)  # warm-up
            steps = [step(t, mode) for _ in range(a.repeats)]
            times = [s[0] for s in steps]
            print(json.dumps(dict(T=t, mode=mode, median_s=statistics.median(times), runs=times,
                                  peak_bytes=steps[-1][2], **info())), flush=True)
            if a.profile:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    seconds, _, _ = step(t, mode)
                print(f"# torch profiler, T={t} {mode} {a.dtype}: one step, {seconds:.3f} s under the "
                      f"profiler (the timed steps' median: {statistics.median(times):.3f} s)")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
