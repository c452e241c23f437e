#!/usr/bin/env python3
"""PEFT LoRA adapters on the tiny fixture models, with float64 references from transformers + peft.

For each family in tests/fixtures/<family>/ (made by make_fixtures.py, left untouched) this writes
tests/fixtures/<family>/lora/:
  adapter_config.json, adapter_model.safetensors  a random adapter (non-zero B, so A gets a gradient)
                                                  written by PEFT's own save_pretrained (float32)
  reference.safetensors  float64, on the family's fixture batches, computed by PeftModel loaded from
                         that directory with PeftModel.from_pretrained (so PEFT reads the files too):
                         logits; SFT loss and grad.<adapter key>; DPO (sigmoid; and + SFT term) and
                         GRPO (grpo loss, old and reference log-probs) loss and gradients; the logits of
                         merge_and_unload() (the merged model)
  meta.json              versions, the LoRA settings, max |merged - unmerged| logits

The settings differ per family (targets, rank, alpha, rsLoRA on llama3) so the Rust tests cover each
kind. Gradients are keyed as adapter_model.safetensors keys them (PEFT's saved key, `.default` removed).

Usage: python scripts/make_lora_fixtures.py [--fixtures tests/fixtures] [--only qwen3]
       python scripts/make_lora_fixtures.py --check DIR   # an adapter streambp wrote: see below

--check DIR: DIR holds a streambp-written adapter (adapter_config.json, adapter_model.safetensors) for
the fixture model named in DIR/check.json ({"family": .., "logits": "logits.safetensors"}), and the
logits streambp computed with it on the family's SFT batch; PEFT loads the adapter and the logits are
compared (prints the max relative difference; exits 1 above 1e-8).
"""
import argparse
import json
import os
import sys

import peft
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(__file__))
from make_fixtures import CASES, F32, F64, exact_float64, token_logps  # noqa: E402

SETTINGS = {
    "qwen2": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    "qwen3": dict(r=4, lora_alpha=16, target_modules="all-linear"),
    "llama3": dict(r=2, lora_alpha=6, target_modules=["q_proj", "k_proj", "o_proj", "gate_proj", "up_proj"],
                   use_rslora=True),
    "gemma3": dict(r=3, lora_alpha=4, target_modules="all-linear"),
}


def saved_key(name):
    """PEFT's parameter name -> its key in adapter_model.safetensors."""
    return name.replace(".default.", ".")


def load_base(family, fixtures, dtype):
    """The fixture model in `dtype`; for float64 call it inside exact_float64(), so that buffers made at
    construction (Gemma3's embedding scale) are computed in float64 as make_fixtures.py's were."""
    model_cls = CASES[family][0]
    model = model_cls.from_pretrained(os.path.join(fixtures, family), dtype=dtype, attn_implementation="eager")
    return model.eval()


def write_adapter(family, fixtures, gen):
    """A PEFT adapter with float32-exact random A and B, saved by PEFT."""
    out = os.path.join(fixtures, family, "lora")
    base = load_base(family, fixtures, F32)
    cfg = LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, bias="none", **SETTINGS[family])
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.copy_((torch.rand(p.shape, generator=gen, dtype=F64) * 2 - 1) / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=F64))
    model.save_pretrained(out)
    readme = os.path.join(out, "README.md")
    if os.path.exists(readme):
        os.remove(readme)
    return out


def sft_loss(logits, labels):
    shift_logits = logits[:, :-1, :].reshape(-1, logits.shape[-1])
    return torch.nn.functional.cross_entropy(shift_logits, labels[:, 1:].reshape(-1), ignore_index=-100)


def grads(model):
    return {f"grad.{saved_key(n)}": p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def references(family, fixtures, adapter_dir):
    ref = load_file(os.path.join(fixtures, family, "reference.safetensors"))
    ids, mask, labels = ref["input_ids"], ref["attention_mask"], ref["labels"]
    with open(os.path.join(fixtures, family, "dpo-batch.json")) as f:
        dpo = json.load(f)
    with open(os.path.join(fixtures, family, "grpo-batch.json")) as f:
        grpo = json.load(f)
    out = {}
    with exact_float64():
        base = load_base(family, fixtures, F64)
        model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True).to(F64)
        model.train()  # dropout is 0: train mode changes nothing but the trainable flags
        for p in model.parameters():
            assert not p.requires_grad or p.dtype == F64

        def run(loss_fn, prefix):
            model.zero_grad()
            loss = loss_fn()
            loss.backward()
            out[f"{prefix}.loss"] = loss.detach().reshape(1)
            out.update({f"{prefix}.{k}": v for k, v in grads(model).items()})

        logits = model(input_ids=ids, attention_mask=mask).logits
        out["logits"] = logits.detach().contiguous()
        run(lambda: sft_loss(model(input_ids=ids, attention_mask=mask).logits, labels), "sft")

        def side(name):
            t = lambda k: torch.tensor(dpo[f"{name}_{k}"])  # noqa: E731
            ids_, mask_, labels_ = t("input_ids"), t("attention_mask"), t("labels")
            tok = token_logps(model(input_ids=ids_, attention_mask=mask_).logits, ids_)
            return tok, labels_

        beta = dpo["beta"]
        ref_c, ref_r = torch.tensor(dpo["ref_chosen_logps"], dtype=F64), torch.tensor(dpo["ref_rejected_logps"], dtype=F64)

        def dpo_loss(sft_weight):
            (tc, lc), (tr, lr) = side("chosen"), side("rejected")
            pc, pr = (tc * (lc[:, 1:] != -100)).sum(-1), (tr * (lr[:, 1:] != -100)).sum(-1)
            loss = -torch.nn.functional.logsigmoid(beta * ((pc - ref_c) - (pr - ref_r))).mean()
            if sft_weight:
                loss = loss + sft_weight * -tc[lc[:, 1:] != -100].mean()
            return loss

        run(lambda: dpo_loss(0.0), "dpo")
        run(lambda: dpo_loss(0.5), "dpo_sft")

        g_ids = torch.tensor(grpo["input_ids"])
        g_mask = torch.tensor(grpo["attention_mask"])
        completion = torch.tensor(grpo["completion_mask"])[:, 1:].to(F64)
        adv = torch.tensor(grpo["advantages"], dtype=F64).unsqueeze(1)
        old = torch.tensor(grpo["old_logps"], dtype=F64)[:, 1:]
        refl = torch.tensor(grpo["ref_logps"], dtype=F64)[:, 1:]
        g_beta, eps = grpo["beta"], grpo["epsilon"]

        def grpo_loss():
            lp = token_logps(model(input_ids=g_ids, attention_mask=g_mask).logits, g_ids)
            coef_1 = torch.exp(lp - old)
            coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps)
            per_token = -torch.min(coef_1 * adv, coef_2 * adv)
            per_token = per_token + g_beta * (torch.exp(refl - lp) - (refl - lp) - 1)
            return ((per_token * completion).sum(-1) / completion.sum(-1).clamp(min=1.0)).mean()

        run(grpo_loss, "grpo")

        merged = model.merge_and_unload()
        with torch.no_grad():
            merged_logits = merged(input_ids=ids, attention_mask=mask).logits
        out["merged_logits"] = merged_logits.contiguous()
    valid = mask.bool()
    diff = ((merged_logits - out["logits"]).abs()[valid].max() / out["logits"].abs()[valid].max()).item()
    return {k: v.contiguous() for k, v in out.items()}, diff


def make(family, fixtures, seed):
    gen = torch.Generator().manual_seed(seed)
    adapter_dir = write_adapter(family, fixtures, gen)
    tensors, merge_diff = references(family, fixtures, adapter_dir)
    save_file(tensors, os.path.join(adapter_dir, "reference.safetensors"))
    meta = {"transformers": transformers.__version__, "torch": torch.__version__, "peft": peft.__version__,
            "seed": seed, "lora": {k: v for k, v in SETTINGS[family].items()},
            "merged_vs_adapter_max_rel_err": merge_diff}
    with open(os.path.join(adapter_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    print(f"{family}: sft loss {tensors['sft.loss'].item():.6f}, merged vs adapter {merge_diff:.1e}")
    assert merge_diff < 1e-12, f"{family}: merged logits differ ({merge_diff})"


def check(dir_, fixtures):
    with open(os.path.join(dir_, "check.json")) as f:
        spec = json.load(f)
    family = spec["family"]
    ref = load_file(os.path.join(fixtures, family, "reference.safetensors"))
    ours = load_file(os.path.join(dir_, spec["logits"]))["logits"].to(F64)
    with exact_float64():
        base = load_base(family, fixtures, F64)
        model = PeftModel.from_pretrained(base, dir_).to(F64).eval()
        with torch.no_grad():
            theirs = model(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"]).logits
    valid = ref["attention_mask"].bool()
    err = ((theirs - ours).abs()[valid].max() / theirs.abs()[valid].max()).item()
    print(f"{dir_}: PEFT loaded it; logits max relative difference to streambp's {err:.2e}")
    return err


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures"))
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--check", default=None)
    args = ap.parse_args()
    if args.check:
        sys.exit(0 if check(args.check, args.fixtures) < 1e-8 else 1)
    for i, family in enumerate(SETTINGS):
        if args.only and family not in args.only:
            continue
        make(family, args.fixtures, seed=4321 + i)


if __name__ == "__main__":
    main()
