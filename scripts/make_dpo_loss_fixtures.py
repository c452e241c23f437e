#!/usr/bin/env python3
"""Float64 gradients of TRL's DPO loss types on the tiny model fixtures, computed by TRL's own code.

For each family in tests/fixtures/<family>/ this loads model.safetensors in float64 exactly as
make_fixtures.py builds its references (eager attention, `exact_float64()`), turns dpo-batch.json into
a TRL batch with TRL's own `DataCollatorForPreference`, and calls TRL's `DPOTrainer._compute_loss` (on
a bare `DPOTrainer.__new__(DPOTrainer)`, as scripts/dpo_loss_reference.py does) with the reference
log-probs of the batch file passed in as precomputed (`precompute_ref_log_probs=True`). It writes

    tests/fixtures/<family>/dpo_loss_types.safetensors    (float64)
        "<name>.loss"          shape [1]
        "<name>.grad.<param>"  d loss / d param, HF parameter names (tied embeddings: model.embed_tokens.weight)

for the configurations in LOSSES. TRL calls the model with `fused_lm_head=True`, a head that TRL patches
onto the model and that accumulates in float32; `PlainHead` answers that call with the model's own
logits instead (log softmax of logits[t-1] at input_ids[t], zero where the label is -100), so the
numbers stay float64. Before writing, it checks that loss_type ["sigmoid"] (and ["sigmoid", "sft"]
weighted [1, 0.5]) reproduce `dpo.*` (and `dpo_sft.*`) in reference.safetensors.

Run: .venv/bin/python scripts/make_dpo_loss_fixtures.py [--only qwen3 ...]   (CPU; needs trl)
"""
import json
import os
import types

import torch
import transformers
import trl
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from trl.trainer.dpo_trainer import DataCollatorForPreference

from dpo_loss_reference import bare_trainer
import fixture_tools
from make_fixtures import F64, exact_float64, token_logps

FAMILIES = fixture_tools.FAMILIES
LOSSES = {
    "ipo": dict(loss_type=["ipo"], loss_weights=[1.0]),
    "aot_unpaired": dict(loss_type=["aot_unpaired"], label_smoothing=0.2),
    "sigmoid_bco_sft": dict(loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0]),
}
# Cross-checks against reference.safetensors (make_fixtures.py's own DPO losses): prefix -> TRL config
CHECKS = {
    "dpo": dict(loss_type=["sigmoid"]),
    "dpo_sft": dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5]),  # make_fixtures.SFT_WEIGHT
}
TOLERANCE = 1e-10


class PlainHead:
    """Answers TRL's `model(..., labels=labels, fused_lm_head=True)` from the model's full float64 logits."""

    def __init__(self, model):
        self.model, self.training = model, model.training

    def __call__(self, input_ids, attention_mask, labels, fused_lm_head, use_cache):
        assert fused_lm_head and torch.equal(labels[labels != -100], input_ids[labels != -100])
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache).logits
        mask = labels[:, 1:] != -100
        log_probs = token_logps(logits, input_ids).masked_fill(~mask, 0.0)
        with torch.no_grad():  # the metrics TRL logs from the fused head's other outputs
            logp = torch.log_softmax(logits[:, :-1], dim=-1)
            entropy = -(logp.exp() * logp).sum(-1).masked_fill(~mask, 0.0)
            mean_logits = logits[:, :-1].mean(-1).masked_fill(~mask, 0.0)
            is_top1 = (logits[:, :-1].argmax(-1) == labels[:, 1:]) & mask
        return types.SimpleNamespace(log_probs=log_probs, entropy=entropy, mean_logits=mean_logits,
                                     is_top1=is_top1, aux_loss=None)


def trl_batch(b):
    """dpo-batch.json -> TRL's preference batch ([chosen rows; rejected rows], right-padded with id 0)."""
    examples = []
    for i in range(len(b["chosen_input_ids"])):
        ex, prompts = {}, []
        for side in ("chosen", "rejected"):
            ids, mask, labels = (torch.tensor(b[f"{side}_{k}"][i]) for k in ("input_ids", "attention_mask", "labels"))
            n, start = int(mask.sum()), int((labels != -100).nonzero().min())  # right padding; completion start
            assert mask[:n].all() and (labels[start:n] == ids[start:n]).all() and (labels[n:] == -100).all()
            prompts.append(ids[:start].tolist())
            ex[f"{side}_ids"] = ids[start:n].tolist()
        assert prompts[0] == prompts[1], "chosen and rejected share the prompt"
        ex["prompt_ids"] = prompts[0]
        ex["ref_chosen_logps"], ex["ref_rejected_logps"] = b["ref_chosen_logps"][i], b["ref_rejected_logps"][i]
        examples.append(ex)
    inputs = DataCollatorForPreference(pad_token_id=0)(examples)
    for k in ("ref_chosen_logps", "ref_rejected_logps"):  # the collator builds these with the default dtype
        inputs[k] = torch.tensor([ex[k] for ex in examples], dtype=F64)
    return inputs


def loss_and_grads(model, inputs, beta, cfg):
    model.zero_grad()
    head = PlainHead(model)
    trainer = bare_trainer(cfg["loss_type"], cfg.get("loss_weights"), beta=beta,
                           label_smoothing=cfg.get("label_smoothing", 0.0), model=head)
    loss = trainer._compute_loss(head, dict(inputs), return_outputs=False)
    loss.backward()
    grads = {f"grad.{n}": p.grad.detach().clone() for n, p in model.named_parameters()}
    return {"loss": loss.detach().reshape(1), **grads}


def max_rel_err(got, want):
    return max(((got[k] - want[k]).abs().max() / want[k].abs().max()).item() for k in got)


def make_family(name, root):
    d = os.path.join(root, name)
    with open(os.path.join(d, "dpo-batch.json")) as f:
        b = json.load(f)
    reference = load_file(os.path.join(d, "reference.safetensors"))
    out = {}
    with exact_float64():
        model = AutoModelForCausalLM.from_pretrained(d, dtype=F64, attn_implementation="eager").eval()
        inputs = trl_batch(b)
        for prefix, cfg in CHECKS.items():
            got = loss_and_grads(model, inputs, b["beta"], cfg)
            err = max_rel_err(got, {k: reference[f"{prefix}.{k}"] for k in got})
            print(f"{name}: TRL {cfg} vs reference {prefix}.*: max rel err {err:.2e}")
            assert err < TOLERANCE, f"{name}: TRL's {prefix} disagrees with reference.safetensors ({err})"
        for loss_name, cfg in LOSSES.items():
            got = loss_and_grads(model, inputs, b["beta"], cfg)
            out.update({f"{loss_name}.{k}": v.contiguous() for k, v in got.items()})
            print(f"{name}: {loss_name} loss {got['loss'].item():.12f}")
    meta = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
            "beta": str(b["beta"]), "losses": json.dumps(LOSSES)}
    save_file(out, os.path.join(d, "dpo_loss_types.safetensors"), metadata=meta)


if __name__ == "__main__":
    fixture_tools.run_families(__doc__, lambda name, root, _: make_family(name, root))
