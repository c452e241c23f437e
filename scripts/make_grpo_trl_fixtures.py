#!/usr/bin/env python3
"""Float64 losses, gradients and metrics of TRL 1.16's GRPO options beyond the six token-level loss types,
computed by TRL's own `GRPOTrainer._compute_loss`: sequence-level importance sampling (GSPO), the `luspo`
and `vespo` loss types, and the off-policy sequence mask.

For each family in tests/fixtures/<family>/ this loads model.safetensors in float64 as make_fixtures.py
builds its references (eager attention, `exact_float64()`), reads that family's committed grpo-batch.json
(4 completions of one prompt with old and reference log-probs; its `beta`, `epsilon`,
`max_completion_length`), and for every configuration in VARIANTS calls TRL's `_compute_loss` on the bare
trainer of grpo_loss_reference.py (one process, one accumulation step, no vLLM), then
`loss.backward()`. It writes

    tests/fixtures/<family>/grpo_trl.safetensors    (float64)
        "<variant>.loss"          [1]
        "<variant>.<metric>"      [1]  TRL's logged kl, clip_ratio/region_mean (or cispo_clip_ratio),
                                       vespo/phi_seq_mean where it logs them, and entropy, '/' written '_'
        "<variant>.grad.<param>"  d loss / d param, HF parameter names
        "off_policy.threshold"    [1]  the off-policy variant's threshold (below)
    tests/fixtures/<family>/lora/grpo_trl.safetensors
        the same for LORA_VARIANTS on the family's PEFT adapter (PeftModel.from_pretrained, float64), the
        adapter's gradients keyed as adapter_model.safetensors keys them

The batch edits the Rust tests make are the same: `epsilon` GSPO_EPSILON where given, `num_items_scale` 3 for the dapo-reduced types (as if the
batch were a third of the global one). The off-policy threshold lies halfway between the two negative-
advantage rows' mean `old − logp`, so that exactly one of them leaves the policy term.

Run: .venv/bin/python scripts/make_grpo_trl_fixtures.py [--only qwen3 ...]   (CPU; needs trl)
"""
import json
import os
import sys
import warnings

import torch
import transformers
import trl
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixture_tools  # noqa: E402
import peft  # noqa: E402
from peft import PeftModel  # noqa: E402
from make_lora_fixtures import load_base, saved_key  # noqa: E402
from grpo_loss_reference import PROMPT_LEN, bare_trainer, exact_float64_trl, fused_head, trl_inputs  # noqa: E402
from make_fixtures import F64, token_logps  # noqa: E402

# A row's mean log-ratio is small: a tighter clip than the batch's 0.2 makes some sequence weights clip.
GSPO_EPSILON = 0.05
# name -> (GRPOConfig overrides, edits to TRL's inputs); `None` for off_policy_mask_threshold is set per family.
VARIANTS = {
    "gspo": ({"importance_sampling_level": "sequence", "loss_type": "grpo", "epsilon": GSPO_EPSILON}, {}),
    "gspo_plain_kl": ({"importance_sampling_level": "sequence", "loss_type": "grpo", "epsilon": GSPO_EPSILON,
                       "use_bias_correction_kl": False}, {}),
    "gspo_cispo": ({"importance_sampling_level": "sequence", "loss_type": "cispo", "epsilon_high": 1.02}, {}),
    "gspo_sapo": ({"importance_sampling_level": "sequence", "loss_type": "sapo"}, {}),
    "gspo_noold": ({"importance_sampling_level": "sequence", "loss_type": "grpo", "beta": 0.0}, {"drop_old": True}),
    "luspo": ({"importance_sampling_level": "sequence", "loss_type": "luspo", "epsilon": GSPO_EPSILON}, {}),
    "luspo_token": ({"loss_type": "luspo"}, {}),
    "vespo": ({"loss_type": "vespo"}, {"num_items_scale": 3}),
    "vespo_shape": ({"loss_type": "vespo", "vespo_k_pos": 1.5, "vespo_lambda_pos": 0.5, "vespo_k_neg": 0.7,
                     "vespo_lambda_neg": 4.0}, {"num_items_scale": 3}),
    "vespo_sequence": ({"loss_type": "vespo", "importance_sampling_level": "sequence"}, {"num_items_scale": 3}),
    "off_policy": ({"loss_type": "grpo", "off_policy_mask_threshold": None}, {}),
    "off_policy_gspo": ({"loss_type": "dapo", "importance_sampling_level": "sequence",
                         "off_policy_mask_threshold": None}, {"num_items_scale": 3}),
    "entropy_bonus": ({"loss_type": "grpo", "entropy_coef": 0.05}, {}),
    "top_entropy": ({"loss_type": "dapo", "top_entropy_quantile": 0.3}, {"num_items_scale": 3}),
    "top_entropy_bonus": ({"loss_type": "bnpo", "top_entropy_quantile": 0.5, "entropy_coef": -0.1}, {}),
    "entropy_gspo": ({"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": GSPO_EPSILON,
                      "entropy_coef": 0.02, "top_entropy_quantile": 0.0}, {}),
}
# Those run on the PEFT adapter too (one per kind of term).
LORA_VARIANTS = ("gspo", "luspo", "vespo", "off_policy_gspo", "top_entropy_bonus")
METRICS = ("kl", "clip_ratio/region_mean", "cispo_clip_ratio", "vespo/phi_seq_mean", "entropy")


def off_policy_threshold(model, batch):
    """Halfway between the negative-advantage rows' mean `old − logp` over their completion tokens."""
    ids, attention = torch.tensor(batch["input_ids"]), torch.tensor(batch["attention_mask"])
    with torch.no_grad(), exact_float64_trl():
        logp = token_logps(model(input_ids=ids, attention_mask=attention).logits, ids)
    mask = torch.tensor(batch["completion_mask"], dtype=F64)[:, 1:]
    old = torch.tensor(batch["old_logps"], dtype=F64)[:, 1:]
    means = ((old - logp) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    negative = sorted(m.item() for m, a in zip(means, batch["advantages"]) if a < 0)
    assert len(negative) == 2 and negative[1] - negative[0] > 1e-3, negative
    return (negative[0] + negative[1]) / 2


def trl_loss(model, batch, overrides, edits, key=lambda name: name):
    """TRL's loss, its logged metrics and the gradient of every trainable parameter (keyed by `key`)."""
    trainer = bare_trainer(model, batch, **overrides)
    with fused_head(model, trainer.temperature), exact_float64_trl():
        model.zero_grad()
        loss = trainer._compute_loss(model, trl_inputs(batch, **edits))
        loss.backward()
    return {"loss": loss.detach().reshape(1).to(F64), **fixture_tools.logged_and_grads(trainer, METRICS, model, key)}


def make_family(name, root):
    d = os.path.join(root, name)
    with open(os.path.join(d, "grpo-batch.json")) as f:
        batch = json.load(f)
    assert all(m[:PROMPT_LEN] == [0] * PROMPT_LEN for m in batch["completion_mask"])
    out = {}
    with exact_float64_trl():
        model = AutoModelForCausalLM.from_pretrained(d, dtype=F64, attn_implementation="eager")
    model.train()  # `_compute_loss` takes its mode from `self.model.training`; no dropout in these configs
    threshold = off_policy_threshold(model, batch)
    out["off_policy.threshold"] = torch.tensor([threshold], dtype=F64)
    for variant, (overrides, edits) in VARIANTS.items():
        if "off_policy_mask_threshold" in overrides:
            overrides = {**overrides, "off_policy_mask_threshold": threshold}
        got = trl_loss(model, batch, overrides, edits)
        out.update({f"{variant}.{k}": v.contiguous() for k, v in got.items()})
        shown = "  ".join(f"{k} {v.item():+.6f}" for k, v in got.items() if not k.startswith("grad."))
        print(f"{name:7s} {variant:16s} {shown}")
    meta = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
            "batch": "grpo-batch.json", "variants": json.dumps(VARIANTS)}
    save_file(out, os.path.join(d, "grpo_trl.safetensors"), metadata=meta)

    # The same on the family's PEFT adapter (tests/fixtures/<family>/lora), gradients of the adapter.
    out = {"off_policy.threshold": torch.tensor([threshold], dtype=F64)}
    with exact_float64_trl():
        base = load_base(name, root, F64)
        model = PeftModel.from_pretrained(base, os.path.join(d, "lora"), is_trainable=True).to(F64)
    model.train()
    for variant in LORA_VARIANTS:
        overrides, edits = VARIANTS[variant]
        if "off_policy_mask_threshold" in overrides:
            overrides = {**overrides, "off_policy_mask_threshold": threshold}
        got = trl_loss(model, batch, overrides, edits, key=saved_key)
        out.update({f"{variant}.{k}": v.contiguous() for k, v in got.items()})
        print(f"{name:7s} {variant:16s} loss {got['loss'].item():+.6f} (LoRA)")
    meta["peft"] = peft.__version__
    save_file(out, os.path.join(d, "lora", "grpo_trl.safetensors"), metadata=meta)


if __name__ == "__main__":
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)  # GRPOConfig
    fixture_tools.run_families(__doc__, lambda name, root, _: make_family(name, root))
