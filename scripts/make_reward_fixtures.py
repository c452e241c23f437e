#!/usr/bin/env python3
"""Float64 losses, gradients and metrics of TRL's RewardTrainer (Bradley-Terry reward model), computed by TRL's own code.

For each family in tests/fixtures/<family>/ this builds a reward model from the causal fixture: transformers'
`<Family>ForSequenceClassification` (Gemma3: the text-only `Gemma3TextForSequenceClassification`, which
`AutoModelForSequenceClassification` picks for `gemma3_text`) with `num_labels=1` and `pad_token_id=0`, every
base weight (`model.*`) copied from model.safetensors and the new head `score.weight` ([1, hidden]) drawn
N(0, SCORE_STD^2) from a seeded generator and rounded to float32, so the checkpoint is exact. It is saved
with `save_pretrained` in float32 and reloaded with `AutoModelForSequenceClassification` (as TRL loads a
reward model) in float64, eager attention, inside `exact_float64()`.

The batch is dpo-batch.json's pairs, whole sequences (prompt + completion, the real tokens: attention mask
1) as TRL's tokenized reward examples {"chosen_ids", "rejected_ids"} (with a "margin" column for the
margin variants), collated by TRL's own `DataCollatorForPreference(pad_token_id=0)` (rows chosen_0,
chosen_1, rejected_0, rejected_1, right-padded with 0 to one length). The script calls TRL's own
`RewardTrainer.compute_loss(model, inputs)` on a bare `RewardTrainer.__new__(RewardTrainer)` with what it
reads (a `RewardConfig`, a stub `model.training`, an accelerator whose gather is the identity, `_metrics`,
`_total_train_tokens`, `_tp_size`), then `loss.backward()`. It writes

    tests/fixtures/<family>/reward/config.json, model.safetensors   the reward model (float32)
    tests/fixtures/<family>/reward/reward-batch.json
        objective "reward", chosen_input_ids, chosen_attention_mask, rejected_input_ids,
        rejected_attention_mask (each side right-padded with 0 to its own longest row, as dpo-batch.json)
    tests/fixtures/<family>/reward/reference.safetensors    (float64)
        "rewards"                [4]  the pooled rewards, chosen_0, chosen_1, rejected_0, rejected_1
        "pool_index"             [4]  int64: the position transformers pooled each row at
        "<variant>.loss"         [1]
        "<variant>.<metric>"     [1]  TRL's logged accuracy, margin, min_reward, mean_reward, max_reward
        "<variant>.grad.<param>" d loss / d param, the classification model's names (score.weight included)

for the configurations in VARIANTS. transformers pools each row at its rightmost position whose input id is
not `pad_token_id` (`GenericForSequenceClassification.forward` in transformers/modeling_layers.py; the
attention mask is not consulted). Before writing, it recomputes every variant by hand from the base model's
last hidden state (after the final norm), separately for the chosen and the rejected rows, each side padded
only to its own length: loss, metrics (1e-12) and gradients (1e-10 relative); it asserts that every
gradient is finite and that score.weight's is nonzero.

Run: .venv/bin/python scripts/make_reward_fixtures.py [--only qwen3 ...]   (CPU; needs trl)
"""
import json
import os
import types
import warnings
from collections import defaultdict

import torch
import torch.nn.functional as F
import transformers
import trl
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    Gemma3TextForSequenceClassification,
    LlamaForSequenceClassification,
    Qwen2ForSequenceClassification,
    Qwen3ForSequenceClassification,
)
from trl import RewardConfig
from trl.trainer.reward_trainer import DataCollatorForPreference, RewardTrainer

import fixture_tools
from make_fixtures import F32, F64, _TO, exact_float64

FAMILIES = fixture_tools.FAMILIES
CLASSES = {
    "qwen2": Qwen2ForSequenceClassification,
    "qwen3": Qwen3ForSequenceClassification,
    "llama3": LlamaForSequenceClassification,
    "gemma3": Gemma3TextForSequenceClassification,
}
PAD = 0
SCORE_STD = 0.02
SEED = 4321  # + the family's index in FAMILIES
MARGINS = [0.5, -0.25]  # one per pair
VARIANTS = {
    "reward": dict(margin=None, center_rewards_coefficient=None),
    "reward_margin": dict(margin=MARGINS, center_rewards_coefficient=None),
    "reward_center": dict(margin=None, center_rewards_coefficient=0.01),
    "reward_margin_center": dict(margin=MARGINS, center_rewards_coefficient=0.01),
}
METRICS = ["accuracy", "margin", "min_reward", "mean_reward", "max_reward"]
SIDES = ("chosen", "rejected")
LOSS_TOLERANCE = 1e-12  # hand recomputation vs TRL, absolute (relative above 1)
GRAD_TOLERANCE = 1e-10  # hand recomputation vs TRL, relative to each gradient's largest entry


def build_reward_model(name, d, out_dir, seed):
    """The causal fixture's base weights under a sequence-classification head; saved to out_dir in float32."""
    cls = CLASSES[name]
    causal = AutoModelForCausalLM.from_pretrained(d, dtype=F32)
    config = type(causal.config).from_dict(causal.config.to_dict())
    config.num_labels = 1
    config.get_text_config().pad_token_id = PAD
    config.architectures = [cls.__name__]
    reward = cls(config).to(F32).eval()
    names = [n for n, _ in reward.named_parameters()]
    assert names[-1] == "score.weight" and all(n.startswith("model.") for n in names[:-1]), names
    base = {k[len("model."):]: v for k, v in causal.state_dict().items() if k.startswith("model.")}
    reward.model.load_state_dict(base, strict=True)
    gen = torch.Generator().manual_seed(seed)
    score = SCORE_STD * torch.randn(reward.score.weight.shape, generator=gen, dtype=F64)
    with torch.no_grad():
        reward.score.weight.copy_(_TO(_TO(score, F32), F64))
    assert reward.score.weight.shape == (1, config.get_text_config().hidden_size)

    os.makedirs(out_dir, exist_ok=True)
    reward.save_pretrained(out_dir, safe_serialization=True)
    for extra_file in ("generation_config.json",):
        path = os.path.join(out_dir, extra_file)
        if os.path.exists(path):
            os.remove(path)
    # Besides an earlier run's batch and references, and make_lora_preference_fixtures.py's lora/:
    written = set(os.listdir(out_dir)) - {"reward-batch.json", "reference.safetensors", "lora"}
    assert written == {"config.json", "model.safetensors"}, os.listdir(out_dir)
    with open(os.path.join(out_dir, "config.json")) as f:
        saved = json.load(f)
    assert saved["architectures"] == [cls.__name__], saved["architectures"]
    assert saved["pad_token_id"] == PAD and len(saved["id2label"]) == 1, (saved["pad_token_id"], saved["id2label"])
    stored = load_file(os.path.join(out_dir, "model.safetensors"))
    causal_file = load_file(os.path.join(d, "model.safetensors"))
    assert set(stored) == set(names), set(stored) ^ set(names)
    assert all(v.dtype == F32 for v in stored.values())
    for k, v in stored.items():
        if k != "score.weight":
            assert torch.equal(v, causal_file[k]), f"{name}: {k} differs from the causal fixture"
    assert torch.equal(stored["score.weight"].to(F64), score.to(F32).to(F64))
    return names, stored


def read_batch(d):
    """dpo-batch.json -> the real tokens of each pair (whole sequences) and reward-batch.json's per-side rows."""
    with open(os.path.join(d, "dpo-batch.json")) as f:
        b = json.load(f)
    examples = [{} for _ in b["chosen_input_ids"]]
    batch = {"objective": "reward"}
    for side in SIDES:
        ids, mask = b[f"{side}_input_ids"], b[f"{side}_attention_mask"]
        for i, (row, m) in enumerate(zip(ids, mask)):
            n = sum(m)
            assert m[:n] == [1] * n and not any(m[n:]) and not any(row[n:]), f"{side} {i}: right padding with id 0"
            examples[i][f"{side}_ids"] = row[:n]
        # each side right-padded with id 0 to its own longest row: dpo-batch.json's ids and masks as they are
        t = max(len(ex[f"{side}_ids"]) for ex in examples)
        batch[f"{side}_input_ids"] = [ex[f"{side}_ids"] + [PAD] * (t - len(ex[f"{side}_ids"])) for ex in examples]
        batch[f"{side}_attention_mask"] = [[1] * len(ex[f"{side}_ids"]) + [0] * (t - len(ex[f"{side}_ids"]))
                                           for ex in examples]
        assert batch[f"{side}_input_ids"] == ids and batch[f"{side}_attention_mask"] == mask
    return examples, batch


def trl_inputs(examples, margin):
    if margin is not None:
        examples = [{**ex, "margin": m} for ex, m in zip(examples, margin)]
    inputs = DataCollatorForPreference(pad_token_id=PAD)(examples)
    rows = [ex["chosen_ids"] for ex in examples] + [ex["rejected_ids"] for ex in examples]
    t = max(map(len, rows))
    assert inputs["input_ids"].tolist() == [r + [PAD] * (t - len(r)) for r in rows]
    assert inputs["attention_mask"].tolist() == [[1] * len(r) + [0] * (t - len(r)) for r in rows]
    if margin is not None:
        # TRL's collator builds the margin column in float32 (dtype=torch.float); these values are exact there,
        # and `rewards_chosen - rewards_rejected - margin` promotes to float64.
        assert inputs["margin"].dtype == F32 and inputs["margin"].tolist() == margin
    return inputs


def pool_index(ids):
    """transformers' rule: the rightmost position whose id is not pad_token_id."""
    positions = torch.arange(ids.shape[-1])
    return (positions * (ids != PAD)).argmax(-1)


def bare_trainer(cfg):
    """A RewardTrainer with only what `compute_loss` reads, set as `__init__` sets them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = RewardConfig(output_dir="/tmp/make_reward_fixtures", use_cpu=True, report_to="none",
                            center_rewards_coefficient=cfg["center_rewards_coefficient"])
    t = RewardTrainer.__new__(RewardTrainer)
    t.args = args
    t.model = types.SimpleNamespace(training=True)  # mode "train", as in training_step
    identity = lambda x: x  # noqa: E731  one process
    t.accelerator = types.SimpleNamespace(gather=identity, gather_for_metrics=identity, device=torch.device("cpu"))
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t._total_train_tokens = 0
    t._tp_size = 1
    return t


def trl_loss(model, examples, cfg):
    model.zero_grad()
    trainer = bare_trainer(cfg)
    inputs = trl_inputs(examples, cfg["margin"])
    loss, outputs = trainer.compute_loss(model, dict(inputs), return_outputs=True)
    assert loss.dtype == F64 and loss.dim() == 0, (loss.dtype, loss.shape)
    assert outputs.logits.dtype == F64 and outputs.logits.shape == (4, 1), (outputs.logits.dtype, outputs.logits.shape)
    loss.backward()
    metrics = trainer._metrics["train"]
    assert metrics["num_tokens"] == [int(inputs["attention_mask"].sum())], metrics["num_tokens"]
    out = {"loss": loss.detach().reshape(1)}
    for m in METRICS:
        assert len(metrics[m]) == 1, (m, metrics[m])
        out[m] = torch.tensor(metrics[m], dtype=F64)
    out.update({f"grad.{n}": p.grad.detach().clone() for n, p in model.named_parameters()})
    return out, outputs.logits.detach().squeeze(-1), inputs


def hand_rewards(model, batch, side):
    """Score of the base model's last hidden state (after the final norm) at the rightmost non-pad position."""
    ids = torch.tensor(batch[f"{side}_input_ids"], dtype=torch.int64)
    mask = torch.tensor(batch[f"{side}_attention_mask"], dtype=torch.int64)
    h = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    scores = (h @ model.score.weight.T).squeeze(-1)  # [B, T]
    idx = pool_index(ids)
    return scores[torch.arange(ids.shape[0]), idx], idx


def hand_loss(model, batch, cfg):
    """The Bradley-Terry loss from the formula, with the chosen and the rejected rows run separately."""
    model.zero_grad()
    rc, _ = hand_rewards(model, batch, "chosen")
    rr, _ = hand_rewards(model, batch, "rejected")
    margin = torch.tensor(cfg["margin"] or [0.0, 0.0], dtype=F64)
    loss = -F.logsigmoid(rc - rr - margin).mean()
    if cfg["center_rewards_coefficient"] is not None:
        loss = loss + cfg["center_rewards_coefficient"] * ((rc + rr) ** 2).mean()
    loss.backward()
    rc, rr = rc.detach(), rr.detach()
    rewards = torch.cat([rc, rr])
    out = {"loss": loss, "accuracy": (rc > rr).to(F64).mean(), "margin": (rc - rr).mean(),  # no margin column
           "min_reward": rewards.min(), "mean_reward": rewards.mean(), "max_reward": rewards.max()}
    out = {k: v.detach().reshape(1) for k, v in out.items()}
    out.update({f"grad.{n}": p.grad.detach().clone() for n, p in model.named_parameters()})
    return out


def compare(name, variant, got, want):
    # The embedding's pad row gets no gradient (transformers' padding_idx); score.weight must get one.
    assert got["grad.score.weight"].abs().max() > 0, f"{name} {variant}: score.weight's gradient is zero"
    return fixture_tools.compare(name, variant, got, want, LOSS_TOLERANCE, GRAD_TOLERANCE, nonzero=False)


def make_family(name, root, seed):
    d = os.path.join(root, name)
    out_dir = os.path.join(d, "reward")
    names, stored = build_reward_model(name, d, out_dir, seed)
    examples, batch = read_batch(d)
    for i, ex in enumerate(examples):
        for side in SIDES:
            if ex[f"{side}_ids"][-1] == PAD:
                print(f"{name}: NOTE {side} row {i} ends in id {PAD}: transformers pools it at an earlier token")
            zeros = [j for j, t in enumerate(ex[f"{side}_ids"]) if t == PAD]
            if zeros:
                print(f"{name}: {side} row {i} has real id {PAD} at {zeros} (not last: pooling unaffected; "
                      f"embed_tokens row {PAD} is padding_idx, no gradient from the lookup)")
    with open(os.path.join(out_dir, "reward-batch.json"), "w") as f:
        json.dump(batch, f)

    out = {}
    with exact_float64():
        model = AutoModelForSequenceClassification.from_pretrained(out_dir, dtype=F64,
                                                                   attn_implementation="eager").eval()
        assert type(model) is CLASSES[name], type(model)
        assert [n for n, _ in model.named_parameters()] == names
        for n, p in model.named_parameters():
            assert p.dtype == F64 and torch.equal(p.detach(), stored[n].to(F64)), n
        assert model.config.num_labels == 1 and model.config.get_text_config().pad_token_id == PAD
        assert model.model.embed_tokens.padding_idx == PAD

        rewards = pool = None
        for variant, cfg in VARIANTS.items():
            got, logits, inputs = trl_loss(model, examples, cfg)
            value_err, grad_err = compare(name, variant, got, hand_loss(model, batch, cfg))
            out.update({f"{variant}.{k}": v.to(F64).contiguous() for k, v in got.items()})
            if rewards is None:
                rewards, pool = logits, pool_index(inputs["input_ids"])
                # the attention mask's last real position agrees here (no real token equals the pad id at a row end)
                last_real = inputs["attention_mask"].sum(-1) - 1
                print(f"{name}: pool_index {pool.tolist()} (attention mask's last real position {last_real.tolist()})")
                with torch.no_grad():  # TRL's rewards are the score at those positions of the collated batch
                    h = model.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                    use_cache=False).last_hidden_state
                    at = (h @ model.score.weight.T).squeeze(-1)[torch.arange(4), pool]
                err = (at - rewards).abs().max().item()
                assert err < LOSS_TOLERANCE, f"{name}: rewards not the score at pool_index ({err})"
                if name == "gemma3":  # the classification head has no final_logit_softcapping
                    cap = model.config.final_logit_softcapping
                    capped = cap * torch.tanh(at / cap)
                    gap = (capped - rewards).abs().max().item()
                    assert gap > 1e-8, gap
                    print(f"{name}: final_logit_softcapping={cap} is not applied to the score "
                          f"(softcapped rewards would differ by {gap:.1e})")
            else:
                assert torch.equal(logits, rewards)
            zero = [k[len("grad."):] for k, v in got.items() if k.startswith("grad.") and not v.abs().max() > 0]
            print(f"{name}: {variant:21s} loss {got['loss'].item():.15f}  acc {got['accuracy'].item():.2f}  "
                  f"margin {got['margin'].item():+.6f}  vs hand: values {value_err:.1e} grads {grad_err:.1e}"
                  + (f"  all-zero grads: {zero}" if zero else ""))
        embed_grad = out["reward.grad.model.embed_tokens.weight"]
        assert not embed_grad[PAD].abs().max() > 0  # padding_idx
        print(f"{name}: rewards {[round(r, 6) for r in rewards.tolist()]}; embed_tokens rows with gradient: "
              f"{(embed_grad.abs().amax(-1) > 0).nonzero().squeeze(-1).tolist()}")
    out["rewards"] = rewards.to(F64).contiguous()
    out["pool_index"] = pool.to(torch.int64).contiguous()
    assert all(v.is_contiguous() and v.dtype == (torch.int64 if k == "pool_index" else F64) for k, v in out.items())
    meta = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
            "batch": "reward-batch.json (dpo-batch.json's whole sequences)", "model": CLASSES[name].__name__,
            "score_init": f"N(0, {SCORE_STD}^2) seed {seed}, rounded to float32", "pad_token_id": str(PAD),
            "pooling": "rightmost position whose input id != pad_token_id", "variants": json.dumps(VARIANTS)}
    save_file(out, os.path.join(out_dir, "reference.safetensors"), metadata=meta)
    print(f"{name}: parameters {names}")


if __name__ == "__main__":
    fixture_tools.run_families(__doc__, lambda name, root, i: make_family(name, root, SEED + i))
