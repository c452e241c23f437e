#!/usr/bin/env python3
"""Float64 losses, gradients and metrics of TRL 1.16's RLOO objective, its loss computed by TRL's own code.

For each family in tests/fixtures/<family>/ this loads model.safetensors in float64 as make_fixtures.py
builds its references (eager attention, `exact_float64()`), reads the family's committed grpo-batch.json
(4 completions of one prompt, old and reference log-probs per position), gives the completions REWARDS, and
for every configuration in VARIANTS:

- computes the advantages as `RLOOTrainer._generate_and_score_completions` does (`rloo_advantages`, its
  lines written out: the first-order KL `Σ m (old − ref)` taken from the reward times `beta`, the
  leave-one-out baseline of each group of `num_generations`, `normalize_advantages` over the batch with
  TRL's unbiased `nanstd`), and the old log-probs' completion sums (`old_logps`);
- calls TRL's own `RLOOTrainer._compute_loss` on a bare `RLOOTrainer.__new__(RLOOTrainer)` (the attributes
  `__init__` sets from an `RLOOConfig`, one process, one accumulation step) with TRL's fused LM head as
  `__init__` adds it, then `loss.backward()`.

"noold" has no old log-probs: as TRL's when the policy that sampled is the one trained, they are the current
policy's (computed here with TRL's own `_get_per_token_logps_and_entropies` under `no_grad`), and the KL reads
them too. It writes

    tests/fixtures/<family>/rloo.safetensors    (float64)
        "<variant>.loss"          [1]
        "<variant>.advantages"    [4]
        "<variant>.<metric>"      [1]  TRL's logged clip_ratio/region_mean ('/' written '_'), and kl (logged
                                       where the advantages are computed) when beta is not 0
        "<variant>.grad.<param>"  d loss / d param, HF parameter names
    tests/fixtures/<family>/lora/rloo.safetensors
        "rloo.*" the same on the family's PEFT adapter, the adapter's gradients keyed as
        adapter_model.safetensors keys them

The Rust tests make the same edits to the batch file (objective "rloo", `rewards`, the variant's settings).

Run: .venv/bin/python scripts/make_rloo_fixtures.py [--only qwen3 ...]   (CPU; needs trl, peft)
"""
import contextlib
import json
import os
import sys
import tempfile
import types
import warnings
from collections import defaultdict

import peft
import torch
import transformers
import trl
from peft import PeftModel
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from trl import RLOOConfig, RLOOTrainer
from trl.trainer.utils import nanstd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixture_tools  # noqa: E402
from grpo_loss_reference import PROMPT_LEN, exact_float64_trl, fused_head  # noqa: E402
from make_fixtures import F64  # noqa: E402
from make_lora_fixtures import load_base, saved_key  # noqa: E402

REWARDS = [1.0, 0.2, -0.5, 0.7]
# name -> (RLOOConfig overrides, drop the old log-probs); TRL's defaults otherwise (beta 0.05, G 2).
VARIANTS = {
    "rloo": ({}, False),
    "normalized": ({"num_generations": 4, "normalize_advantages": True}, False),
    "beta0": ({"beta": 0.0, "epsilon": 0.1, "epsilon_high": 0.28}, False),
    "noold": ({}, True),
    "temperature": ({"temperature": 0.7}, False),
}
METRICS = ("clip_ratio/region_mean",)


def bare_trainer(model, **overrides):
    """An RLOOTrainer with only what `_compute_loss` and `_get_per_token_logps_and_entropies` read."""
    args = RLOOConfig(output_dir=os.path.join(tempfile.gettempdir(), "rloo_fixtures"), use_cpu=True,
                      report_to="none", per_device_train_batch_size=4, **overrides)
    assert args.steps_per_generation == 1 and not args.use_vllm
    t = RLOOTrainer.__new__(RLOOTrainer)
    t.args, t.model = args, model
    t.beta, t.temperature, t.num_generations = args.beta, args.temperature, args.num_generations
    t.normalize_advantages = args.normalize_advantages
    t.epsilon_low = args.epsilon
    t.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    t.aux_loss_enabled, t.current_gradient_accumulation_steps = False, 1
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t.accelerator = types.SimpleNamespace(num_processes=1, process_index=0, is_main_process=True,
                                          autocast=contextlib.nullcontext, gather=lambda x: x,
                                          reduce=lambda x, reduction: x)
    return t


def rloo_advantages(trainer, rewards, old_per_token, ref_per_token, completion_mask):
    """`_generate_and_score_completions`' advantages and logged `kl` (None when beta is 0), its lines for one
    process and scorable rewards."""
    rewards, kl_metric = rewards.clone(), None
    if trainer.beta != 0.0:
        per_token_kl = old_per_token - ref_per_token
        kl = (per_token_kl * completion_mask).sum(-1)
        rewards = rewards - trainer.beta * kl
        kl_stats = torch.stack([(per_token_kl * completion_mask).sum(), completion_mask.sum().to(F64)])
        kl_metric = (kl_stats[0] / kl_stats[1].clamp(min=1.0)).reshape(1)
    num_generations = trainer.num_generations
    grouped_rewards = rewards.view(-1, num_generations)
    scorable_counts = (~torch.isnan(grouped_rewards)).sum(dim=1, keepdim=True)
    grouped_sum = torch.nansum(grouped_rewards, dim=1, keepdim=True)
    baselines = ((grouped_sum - grouped_rewards) / (scorable_counts - 1)).view(-1)
    advantages = rewards - baselines
    if trainer.normalize_advantages:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), kl_metric


def trl_loss(model, batch, overrides, drop_old, key=lambda name: name):
    """TRL's advantages, loss, logged metrics and every trainable parameter's gradient (keyed by `key`)."""
    trainer = bare_trainer(model, **overrides)
    ids, attention = torch.tensor(batch["input_ids"]), torch.tensor(batch["attention_mask"])
    completion_mask = torch.tensor(batch["completion_mask"])[:, PROMPT_LEN:]
    assert attention[:, :PROMPT_LEN].all() and torch.equal(attention[:, PROMPT_LEN:], completion_mask)
    per_token = lambda k: torch.tensor(batch[k], dtype=F64)[:, PROMPT_LEN:]  # aligned with completion_ids
    logits_to_keep = completion_mask.size(1)
    with fused_head(model, trainer.temperature), exact_float64_trl():
        if drop_old:  # the policy that sampled is the one trained: TRL's own old log-probs
            with torch.no_grad():
                old_per_token, _, _ = trainer._get_per_token_logps_and_entropies(
                    model, ids, attention, logits_to_keep)
        else:
            old_per_token = per_token("old_logps")
        advantages, kl_metric = rloo_advantages(trainer, torch.tensor(REWARDS, dtype=F64), old_per_token,
                                                per_token("ref_logps"), completion_mask)
        inputs = {"prompt_ids": ids[:, :PROMPT_LEN], "prompt_mask": attention[:, :PROMPT_LEN],
                  "completion_ids": ids[:, PROMPT_LEN:], "completion_mask": completion_mask,
                  "old_logps": (old_per_token * completion_mask).sum(1), "advantages": advantages}
        model.zero_grad()
        loss = trainer._compute_loss(model, inputs)
        loss.backward()
    out = {"loss": loss.detach().reshape(1).to(F64), "advantages": advantages.to(F64)}
    if kl_metric is not None:
        out["kl"] = kl_metric.to(F64)
    return {**out, **fixture_tools.logged_and_grads(trainer, METRICS, model, key)}


def make_family(name, root):
    d = os.path.join(root, name)
    with open(os.path.join(d, "grpo-batch.json")) as f:
        batch = json.load(f)
    meta = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
            "peft": peft.__version__, "batch": "grpo-batch.json", "rewards": json.dumps(REWARDS),
            "variants": json.dumps(VARIANTS)}
    with exact_float64_trl():
        model = AutoModelForCausalLM.from_pretrained(d, dtype=F64, attn_implementation="eager")
    model.train()  # `_compute_loss` takes its mode from `self.model.training`; no dropout in these configs
    out = {}
    for variant, (overrides, drop_old) in VARIANTS.items():
        got = trl_loss(model, batch, overrides, drop_old)
        out.update({f"{variant}.{k}": v.contiguous() for k, v in got.items()})
        shown = "  ".join(f"{k} {v.item():+.6f}" for k, v in got.items() if v.numel() == 1)
        print(f"{name:7s} {variant:12s} {shown}  advantages {[round(a, 4) for a in got['advantages'].tolist()]}")
    assert any(out[f"{v}.clip_ratio_region_mean"].item() > 0 for v in VARIANTS), "some ratios should clip"
    save_file(out, os.path.join(d, "rloo.safetensors"), metadata=meta)

    with exact_float64_trl():
        base = load_base(name, root, F64)
        model = PeftModel.from_pretrained(base, os.path.join(d, "lora"), is_trainable=True).to(F64)
    model.train()
    got = trl_loss(model, batch, *VARIANTS["rloo"], key=saved_key)
    print(f"{name:7s} rloo (LoRA)  loss {got['loss'].item():+.6f}")
    save_file({f"rloo.{k}": v.contiguous() for k, v in got.items()}, os.path.join(d, "lora", "rloo.safetensors"),
              metadata=meta)


if __name__ == "__main__":
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    fixture_tools.run_families(__doc__, lambda name, root, _: make_family(name, root))
