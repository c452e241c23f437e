#!/usr/bin/env python3
"""Float64 references of TRL's ORPO, CPO (SimPO, AlphaPO), KTO and reward-model losses on PEFT LoRA models.

For each family in tests/fixtures/<family>/ this writes two things; it reads, and leaves as they are, the
base fixtures, the adapter in lora/ (make_lora_fixtures.py) and the reward model in reward/
(make_reward_fixtures.py).

A. tests/fixtures/<family>/lora/preference.safetensors    (float64)
   The adapter in lora/ loaded as make_lora_fixtures.py's `references` loads it (the base model in float64,
   eager attention, inside `exact_float64()`; `PeftModel.from_pretrained(..., is_trainable=True)`; LoRA
   dropout 0), and TRL's own loss code on it, then `loss.backward()`:
     orpo       ORPOTrainer.get_batch_loss_metrics, beta 0.1, on dpo-batch.json's rows
     cpo_simpo  CPOTrainer.get_batch_loss_metrics, loss_type simpo, beta 0.1, cpo_alpha 1, simpo_gamma 0.5,
                label_smoothing 0.1, the same rows
     alphapo    the same with cpo_alpha 0 and alpha 0.25 (no label smoothing)
     kto        KTOTrainer._compute_loss, loss_type kto, beta 0.1, weights 1/1, on kto-batch.json's rows,
                `label` and `ref_logps` (precomputed reference); the precomputed ref_KL_logps are the PEFT
                policy's own summed completion log-probs of the KL rows (no_grad, adapter on) minus KL_OFFSET,
                so TRL's KL estimate is KL_OFFSET up to rounding
   (bare trainers, batches and float64 assertions exactly as make_preference_fixtures.py and
   make_kto_fixtures.py build them). Keys:
     "<variant>.loss"                [1]
     "<variant>.grad.<adapter key>"  d loss / d each LoRA matrix, keyed as adapter_model.safetensors keys it
                                     (make_lora_fixtures.py's convention: PEFT's name with `.default` removed)
     "kto.kl"                        [1]  the KL estimate TRL used (its logged "kl")

B. tests/fixtures/<family>/reward/lora/
     adapter_config.json, adapter_model.safetensors
         a PEFT LoRA adapter (task_type SEQ_CLS, written by PEFT's own save_pretrained, float32) on the reward
         fixture model reward/ (<Family>ForSequenceClassification, num_labels 1) with lora/adapter_config.json's
         target_modules, r, lora_alpha and use_rslora, dropout 0; random non-zero A and B drawn as
         make_lora_fixtures.py's `write_adapter` draws them (seed REWARD_SEED + the family's index); and, since
         SEQ_CLS makes PEFT train the head through modules_to_save, a trained copy of `score`: the base model's
         score.weight plus N(0, SCORE_PERTURB^2) noise (same generator), rounded to float32. PEFT saves that
         copy as `base_model.model.score.weight` (not `...score.modules_to_save.weight`).
     reference.safetensors    (float64)
         the adapter loaded with `PeftModel.from_pretrained(base_f64, dir, is_trainable=True)` inside
         `exact_float64()`, and TRL's own `RewardTrainer.compute_loss` (as make_reward_fixtures.py calls it, the
         batch reward/reward-batch.json's rows collated by TRL's DataCollatorForPreference) for
           reward                no margin, no centering
           reward_margin_center  margin [0.5, -0.25], center_rewards_coefficient 0.01
         "rewards"                      [4]  the pooled rewards, chosen_0, chosen_1, rejected_0, rejected_1
         "<variant>.loss"               [1]
         "<variant>.grad.<adapter key>" for every parameter PEFT marks trainable: the LoRA matrices and the
                                        score copy (key base_model.model.score.weight), keyed as
                                        adapter_model.safetensors keys them

Gradients are mapped to adapter keys by PEFT's own `get_peft_model_state_dict` (the map that save_pretrained
uses), and the key set is checked against the adapter file's. Before writing, every variant is recomputed by
hand (ORPO/CPO/KTO: make_preference_fixtures.py's and make_kto_fixtures.py's `hand_loss`, from token
log-probs of separate forwards; reward: the PEFT model's pooled scores, chosen and rejected rows run
separately): loss 1e-12, gradients 1e-10 relative; every gradient is finite and nonzero; everything float64.

Run: .venv/bin/python scripts/make_lora_preference_fixtures.py [--only qwen3 ...]   (CPU; needs trl, peft)
"""
import json
import os
import sys

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import peft  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForSequenceClassification  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import make_kto_fixtures as kto  # noqa: E402
import make_preference_fixtures as pref  # noqa: E402
import make_reward_fixtures as rew  # noqa: E402
import fixture_tools  # noqa: E402
from make_fixtures import F32, F64, exact_float64, token_logps  # noqa: E402
from make_lora_fixtures import load_base, saved_key  # noqa: E402

FAMILIES = fixture_tools.FAMILIES
PREFERENCE_VARIANTS = {
    "orpo": dict(trainer="orpo", beta=0.1),
    "cpo_simpo": dict(trainer="cpo", loss_type="simpo", beta=0.1, cpo_alpha=1.0, simpo_gamma=0.5,
                      label_smoothing=0.1),
    "alphapo": dict(trainer="cpo", loss_type="simpo", beta=0.1, cpo_alpha=0.0, simpo_gamma=0.5, alpha=0.25),
}
KTO_VARIANTS = {"kto": dict(loss_type="kto", beta=0.1, desirable_weight=1.0, undesirable_weight=1.0)}
KL_OFFSET = 0.3  # KL_logps - ref_KL_logps for every KL row: TRL's KL estimate
REWARD_VARIANTS = {
    "reward": dict(margin=None, center_rewards_coefficient=None),
    "reward_margin_center": dict(margin=[0.5, -0.25], center_rewards_coefficient=0.01),
}
REWARD_SEED = 8642  # + the family's index in FAMILIES
SCORE_PERTURB = 0.02
LOSS_TOLERANCE = 1e-12
GRAD_TOLERANCE = 1e-10


class Trainable:
    """The PEFT model as the other scripts' helpers see it: calls and attributes go to the model, but
    named_parameters() yields only the trainable parameters (those helpers read every parameter's .grad)."""

    def __init__(self, model):
        self.__dict__["model"] = model

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def named_parameters(self):
        return ((n, p) for n, p in self.model.named_parameters() if p.requires_grad)

    def __getattr__(self, name):
        return getattr(self.model, name)


def adapter_keys(model, adapter_file):
    """PEFT parameter name -> its key in adapter_model.safetensors, by PEFT's own save map; checked against the file."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    by_id = {id(p): n for n, p in params.items()}
    saved = get_peft_model_state_dict(model, state_dict=dict(params))
    keymap = {by_id[id(v)]: k for k, v in saved.items()}
    stored = load_file(adapter_file)
    assert set(keymap) == set(params), set(keymap) ^ set(params)
    assert set(keymap.values()) == set(stored), set(keymap.values()) ^ set(stored)
    for n, k in keymap.items():
        assert stored[k].dtype == F32 and stored[k].shape == params[n].shape, (k, stored[k].dtype, stored[k].shape)
        assert torch.equal(params[n].detach(), stored[k].to(F64)), f"{k}: the loaded parameter is not the file's"
    return keymap


def load_peft(base, adapter_dir):
    """PeftModel.from_pretrained(..., is_trainable=True) in float64, dropout 0, as make_lora_fixtures.py does."""
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True).to(F64)
    model.train()  # dropout is 0: train mode changes nothing but the trainable flags
    dropouts = {type(m).__name__ for n, m in model.named_modules() if n.endswith("lora_dropout.default")}
    assert dropouts == {"Identity"}, dropouts
    assert all(p.dtype == F64 for p in model.parameters())
    return model


def keyed(got, keymap, keep):
    """The helpers' outputs (PEFT names) -> ours: the `keep` values and grad.<adapter key>."""
    out = {k: got[k] for k in keep}
    for n, k in keymap.items():
        g = got[f"grad.{n}"]
        assert g.dtype == F64 and torch.isfinite(g).all() and g.abs().max() > 0, n
        out[f"grad.{k}"] = g
    assert len(out) == len(keep) + len(keymap)
    return out


# ---------------------------------------------------------------- A: ORPO, CPO, KTO on the causal adapter

def kto_examples(b):
    """kto-batch.json -> TRL's unpaired examples (prompt_ids, completion_ids, KL_completion_ids, label)."""
    examples = []
    for i, label in enumerate(b["label"]):
        ids, labels, kl_ids, kl_labels = (b[k][i] for k in ("input_ids", "labels", "kl_input_ids", "kl_labels"))
        start = next(j for j, x in enumerate(labels) if x != -100)
        kl_start = next(j for j, x in enumerate(kl_labels) if x != -100)
        assert ids[:start] == kl_ids[:kl_start], "a row and its KL row share the prompt"
        examples.append(dict(prompt_ids=ids[:start], completion_ids=[x for x in labels if x != -100],
                             KL_completion_ids=[x for x in kl_labels if x != -100], label=label))
    assert examples == kto.make_examples(), "kto-batch.json is make_kto_fixtures.py's batch"
    return examples


def policy_logps(model, examples):
    """make_kto_fixtures.py's `policy_logps`: TRL's `compute_ref_log_probs` (the precompute path) on the head.
    With peft installed, TRL asks accelerate's `is_peft_model(self.model)`, which reads `_modules`; the head
    gets an empty one, so it is not a PeftModel and TRL keeps the adapter on (on a PeftModel with no ref_model
    TRL would disable the adapter for the reference)."""
    head = kto.Head(model)
    head._modules = {}
    t = kto.bare_trainer(KTO_VARIANTS["kto"], head)
    logps, kl_logps = t.compute_ref_log_probs(head, kto.collate(examples, with_kl=True))
    assert len(head.calls) == 2 and not any(grad for _, grad in head.calls), head.calls  # rows, KL rows; no_grad
    return logps.detach(), kl_logps.detach()


def preference_references(family, fixtures):
    d = os.path.join(fixtures, family)
    adapter_dir = os.path.join(d, "lora")
    with open(os.path.join(d, "dpo-batch.json")) as f:
        dpo_batch = pref.trl_batch(json.load(f))
    with open(os.path.join(d, "kto-batch.json")) as f:
        kb = json.load(f)
    examples = kto_examples(kb)
    assert kb["label"] == kto.LABELS
    rows = tuple(torch.tensor(kb[k], dtype=torch.int64) for k in ("input_ids", "attention_mask", "labels"))
    kl_rows = tuple(torch.tensor(kb[k], dtype=torch.int64) for k in ("kl_input_ids", "kl_attention_mask", "kl_labels"))
    out = {}
    with exact_float64():
        base = load_base(family, fixtures, F64)
        peft_model = load_peft(base, adapter_dir)
        keymap = adapter_keys(peft_model, os.path.join(adapter_dir, "adapter_model.safetensors"))
        assert all(saved_key(n) == k for n, k in keymap.items()), "make_lora_fixtures.py's key convention"
        model = Trainable(peft_model)

        for variant, cfg in PREFERENCE_VARIANTS.items():
            got = pref.trl_loss(model, dpo_batch, cfg)
            value_err, grad_err = pref.compare(family, variant, got, pref.hand_loss(model, dpo_batch, cfg))
            out.update({f"{variant}.{k}": v for k, v in keyed(got, keymap, ["loss"]).items()})
            print(f"{family}: lora {variant:10s} loss {got['loss'].item():.15f}  nll {got['nll_loss'].item():.6f}  "
                  f"vs hand: values {value_err:.1e} grads {grad_err:.1e}")

        # KTO: the reference log-probs from the file; the KL rows' reference is the PEFT policy minus KL_OFFSET
        ref_logps = torch.tensor(kb["ref_logps"], dtype=F64)
        with torch.no_grad():
            ids, mask, labels = kl_rows
            tok = token_logps(peft_model(input_ids=ids, attention_mask=mask, use_cache=False).logits, ids)
            kl_logps = (tok * (labels[:, 1:] != -100)).sum(-1)
        trl_logps, trl_kl_logps = policy_logps(model, examples)  # TRL's precompute path, adapter on
        assert trl_kl_logps.dtype == F64 and (trl_kl_logps - kl_logps).abs().max() < LOSS_TOLERANCE
        ref_kl_logps = kl_logps - KL_OFFSET
        for variant, cfg in KTO_VARIANTS.items():
            batch = kto.collate(examples, True, ref_logps, ref_kl_logps)
            for prefix, (i, m, lab) in (("", rows), ("KL_", kl_rows)):  # TRL's collator builds the file's rows
                assert torch.equal(batch[f"{prefix}input_ids"], i) and torch.equal(batch[f"{prefix}attention_mask"], m)
                assert torch.equal(batch[f"{prefix}completion_mask"].bool(), lab != -100)
            got, n_tensors = kto.trl_loss(model, batch, cfg)
            value_err, grad_err = kto.compare(family, variant, got,
                                              kto.hand_loss(model, rows, kl_rows, ref_logps, ref_kl_logps, cfg))
            assert abs(got["kl"].item() - KL_OFFSET) < 1e-12, got["kl"]
            out.update({f"{variant}.{k}": v for k, v in keyed(got, keymap, ["loss", "kl"]).items()})
            print(f"{family}: lora {variant:10s} loss {got['loss'].item():.15f}  kl {got['kl'].item():.17g}  "
                  f"({n_tensors} float64 tensors in TRL's frames)  vs hand: values {value_err:.1e} grads {grad_err:.1e}")
    out = {k: v.to(F64).contiguous() for k, v in out.items()}
    assert all(v.dtype == F64 for v in out.values())
    meta = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
            "peft": peft.__version__, "adapter": "lora/adapter_model.safetensors",
            "batches": "dpo-batch.json (orpo, cpo_simpo, alphapo); kto-batch.json (kto)",
            "variants": json.dumps({**PREFERENCE_VARIANTS, **KTO_VARIANTS}),
            "kto_ref_kl_logps": f"the PEFT policy's KL-row summed completion log-probs (no_grad, adapter on) - {KL_OFFSET}",
            "kto_ref_kl_logps_values": json.dumps(ref_kl_logps.tolist())}
    save_file(out, os.path.join(adapter_dir, "preference.safetensors"), metadata=meta)
    return out, keymap


# ---------------------------------------------------------------- B: a LoRA reward model

def write_reward_adapter(family, fixtures, gen):
    """A SEQ_CLS PEFT adapter on reward/ with lora/'s settings, random A and B, a perturbed score copy; saved by PEFT."""
    reward_dir = os.path.join(fixtures, family, "reward")
    out = os.path.join(reward_dir, "lora")
    with open(os.path.join(fixtures, family, "lora", "adapter_config.json")) as f:
        causal = json.load(f)
    settings = {k: causal[k] for k in ("target_modules", "r", "lora_alpha", "use_rslora")}
    assert causal["lora_dropout"] == 0.0 and causal["bias"] == "none"
    base = AutoModelForSequenceClassification.from_pretrained(reward_dir, dtype=F32, attn_implementation="eager").eval()
    assert type(base) is rew.CLASSES[family], type(base)
    cfg = LoraConfig(task_type="SEQ_CLS", lora_dropout=0.0, bias="none", **settings)
    model = get_peft_model(base, cfg)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert [n for n in trainable if "lora_" not in n] == ["base_model.model.score.modules_to_save.default.weight"], trainable
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.copy_((torch.rand(p.shape, generator=gen, dtype=F64) * 2 - 1) / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=F64))
            elif "modules_to_save" in name:  # the trained copy of score: base + noise, rounded to float32
                p.copy_(p.to(F64) + SCORE_PERTURB * torch.randn(p.shape, generator=gen, dtype=F64))
    model.save_pretrained(out)
    readme = os.path.join(out, "README.md")
    if os.path.exists(readme):
        os.remove(readme)
    written = set(os.listdir(out)) - {"reference.safetensors"}  # from an earlier run
    assert written == {"adapter_config.json", "adapter_model.safetensors"}, os.listdir(out)
    with open(os.path.join(out, "adapter_config.json")) as f:
        saved_cfg = json.load(f)
    for k, v in settings.items():
        assert (sorted(saved_cfg[k]) == sorted(v)) if k == "target_modules" else saved_cfg[k] == v, (k, saved_cfg[k], v)
    stored = load_file(os.path.join(out, "adapter_model.safetensors"))
    assert all(v.dtype == F32 for v in stored.values())
    base_score = load_file(os.path.join(reward_dir, "model.safetensors"))["score.weight"]
    score = stored["base_model.model.score.weight"]
    assert score.shape == base_score.shape and (score - base_score).abs().min() > 0, "every score entry perturbed"
    for k, v in stored.items():
        if "lora_" in k:
            assert v.abs().min() > 0, k
    return out, settings, saved_cfg, stored


def reward_examples(reward_dir):
    """reward-batch.json -> TRL's reward examples {"chosen_ids", "rejected_ids"} (the real tokens)."""
    with open(os.path.join(reward_dir, "reward-batch.json")) as f:
        b = json.load(f)
    examples = [{} for _ in b["chosen_input_ids"]]
    for side in rew.SIDES:
        for i, (row, m) in enumerate(zip(b[f"{side}_input_ids"], b[f"{side}_attention_mask"])):
            n = sum(m)
            assert m[:n] == [1] * n and not any(m[n:]), f"{side} {i}: right padding"
            examples[i][f"{side}_ids"] = row[:n]
    return examples, b


def hand_reward(model, batch, cfg):
    """The Bradley-Terry loss from the PEFT model's pooled scores, chosen and rejected rows run separately."""
    model.zero_grad()
    inner = model.base_model.model  # the classification model with the LoRA layers and the score wrapper
    r = {}
    for side in rew.SIDES:
        ids = torch.tensor(batch[f"{side}_input_ids"], dtype=torch.int64)
        mask = torch.tensor(batch[f"{side}_attention_mask"], dtype=torch.int64)
        h = inner.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        scores = inner.score(h).squeeze(-1)  # the active adapter's score copy
        r[side] = scores[torch.arange(ids.shape[0]), rew.pool_index(ids)]
    margin = torch.tensor(cfg["margin"] or [0.0, 0.0], dtype=F64)
    loss = -F.logsigmoid(r["chosen"] - r["rejected"] - margin).mean()
    if cfg["center_rewards_coefficient"] is not None:
        loss = loss + cfg["center_rewards_coefficient"] * ((r["chosen"] + r["rejected"]) ** 2).mean()
    loss.backward()
    out = {"loss": loss.detach().reshape(1), "rewards": torch.cat([r["chosen"], r["rejected"]]).detach()}
    out.update({f"grad.{n}": p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
    return out


def reward_references(family, fixtures, adapter_dir):
    reward_dir = os.path.join(fixtures, family, "reward")
    examples, batch = reward_examples(reward_dir)
    old_examples, _ = rew.read_batch(os.path.join(fixtures, family))
    assert examples == old_examples, "reward-batch.json is dpo-batch.json's whole sequences"
    out, rewards = {}, None
    with exact_float64():
        base = AutoModelForSequenceClassification.from_pretrained(reward_dir, dtype=F64, attn_implementation="eager")
        peft_model = load_peft(base, adapter_dir)
        assert type(peft_model).__name__ == "PeftModelForSequenceClassification", type(peft_model)
        trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
        keymap = adapter_keys(peft_model, os.path.join(adapter_dir, "adapter_model.safetensors"))
        score_name = "base_model.model.score.modules_to_save.default.weight"
        assert [n for n in trainable if "lora_" not in n] == [score_name], trainable
        assert keymap[score_name] == "base_model.model.score.weight" != saved_key(score_name)
        frozen_score = dict(peft_model.named_parameters())["base_model.model.score.original_module.weight"]
        assert not frozen_score.requires_grad
        assert torch.equal(frozen_score.detach(), load_file(os.path.join(reward_dir, "model.safetensors"))["score.weight"].to(F64))
        model = Trainable(peft_model)

        for variant, cfg in REWARD_VARIANTS.items():
            got, logits, inputs = rew.trl_loss(model, examples, cfg)
            want = hand_reward(peft_model, batch, cfg)
            loss_err = (got["loss"] - want["loss"]).abs().item()
            reward_err = (logits - want["rewards"]).abs().max().item()
            assert loss_err < LOSS_TOLERANCE and reward_err < LOSS_TOLERANCE, (loss_err, reward_err)
            grad_err = 0.0
            for n in keymap:
                g = got[f"grad.{n}"]
                grad_err = max(grad_err, ((g - want[f"grad.{n}"]).abs().max() / g.abs().max()).item())
            assert grad_err < GRAD_TOLERANCE, grad_err
            if rewards is None:
                rewards = logits
                with torch.no_grad():  # eval mode (no dropout anywhere) gives the same rewards
                    peft_model.eval()
                    again = peft_model(**{k: v for k, v in inputs.items() if k != "margin"}).logits.squeeze(-1)
                    peft_model.train()
                assert (again - rewards).abs().max() < 1e-15
            else:
                assert torch.equal(logits, rewards)
            out.update({f"{variant}.{k}": v for k, v in keyed(got, keymap, ["loss"]).items()})
            print(f"{family}: lora {variant:21s} loss {got['loss'].item():.15f}  acc {got['accuracy'].item():.2f}  "
                  f"vs hand: loss {loss_err:.1e} rewards {reward_err:.1e} grads {grad_err:.1e}")
    out["rewards"] = rewards
    out = {k: v.to(F64).contiguous() for k, v in out.items()}
    assert all(v.dtype == F64 for v in out.values())
    return out, keymap, trainable


def make_family(family, fixtures, seed):
    pref_out, keymap = preference_references(family, fixtures)
    print(f"{family}: lora/preference.safetensors: {len(pref_out)} tensors, adapter keys e.g. {next(iter(keymap.values()))}")

    gen = torch.Generator().manual_seed(seed)
    adapter_dir, settings, saved_cfg, stored = write_reward_adapter(family, fixtures, gen)
    out, keymap, trainable = reward_references(family, fixtures, adapter_dir)
    meta = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
            "peft": peft.__version__, "model": rew.CLASSES[family].__name__, "seed": str(seed),
            "lora": json.dumps({**settings, "lora_dropout": 0.0, "task_type": "SEQ_CLS"}),
            "score": f"base score.weight + N(0, {SCORE_PERTURB}^2), rounded to float32",
            "batch": "reward/reward-batch.json", "variants": json.dumps(REWARD_VARIANTS)}
    save_file(out, os.path.join(adapter_dir, "reference.safetensors"), metadata=meta)
    print(f"{family}: reward/lora adapter_config: task_type {saved_cfg['task_type']}, modules_to_save "
          f"{saved_cfg['modules_to_save']}; {len(trainable)} trainable; non-LoRA saved keys "
          f"{[k for k in stored if 'lora_' not in k]}; rewards {[round(x, 6) for x in out['rewards'].tolist()]}")


if __name__ == "__main__":
    fixture_tools.run_families(__doc__, lambda name, root, i: make_family(name, root, REWARD_SEED + i))
