#!/usr/bin/env python3
"""Float64 losses, gradients and metrics of TRL's ORPO and CPO (SimPO, AlphaPO) objectives, computed by TRL's own code.

For each family in tests/fixtures/<family>/ this loads model.safetensors in float64 exactly as
make_fixtures.py builds its references (eager attention, `exact_float64()`), turns dpo-batch.json into
TRL's preference batch (`chosen_input_ids`, `chosen_attention_mask`, `chosen_labels` and the same for
`rejected`, int64, as TRL's `DPODataCollatorWithPadding` hands them over; `concatenated_inputs` pads both
sides to one length and stacks chosen rows then rejected rows) and calls TRL's own
`ORPOTrainer.get_batch_loss_metrics` / `CPOTrainer.get_batch_loss_metrics` (trl.experimental, on a bare
`Trainer.__new__(Trainer)` with the attributes their `__init__` sets from `ORPOConfig` / `CPOConfig`),
then `loss.backward()`. It writes

    tests/fixtures/<family>/preference.safetensors    (float64)
        "<variant>.loss"          shape [1]
        "<variant>.<metric>"      shape [1]: TRL's metrics rewards/chosen, rewards/rejected, rewards/accuracies,
                                  rewards/margins, logps/chosen, logps/rejected, nll_loss (and for ORPO
                                  log_odds_ratio, log_odds_chosen), with '/' written '_'
        "<variant>.grad.<param>"  d loss / d param, HF parameter names (tied embeddings: model.embed_tokens.weight)

for the configurations in VARIANTS. TRL's ORPO casts the sequence log-probs with `.float()`; inside
`exact_float64()` that is a float64 cast, and the script asserts that the log-probs, losses and rewards TRL
computes are float64. Before writing, it recomputes every variant by hand from `token_logps` (separate
forwards of the chosen and rejected rows, the formulas in `hand_loss`) and checks the loss, the metrics
(1e-12) and the gradients (1e-10 relative) against TRL's, and that every gradient is finite and nonzero.

Run: .venv/bin/python scripts/make_preference_fixtures.py [--only qwen3 ...]   (CPU; needs trl)
"""
import json
import os
import types
import warnings

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch
import torch.nn.functional as F
import transformers
import trl
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from trl.experimental.cpo import CPOConfig, CPOTrainer
from trl.experimental.orpo import ORPOConfig, ORPOTrainer

import fixture_tools
from make_fixtures import F64, exact_float64, token_logps

FAMILIES = fixture_tools.FAMILIES
VARIANTS = {
    "orpo": dict(trainer="orpo", beta=0.1),
    "orpo_beta_half": dict(trainer="orpo", beta=0.5),
    "cpo_sigmoid": dict(trainer="cpo", loss_type="sigmoid", beta=0.1, cpo_alpha=1.0, label_smoothing=0.1),
    "cpo_hinge": dict(trainer="cpo", loss_type="hinge", beta=0.1, cpo_alpha=0.5),
    "cpo_ipo": dict(trainer="cpo", loss_type="ipo", beta=0.1, cpo_alpha=1.0),
    "simpo": dict(trainer="cpo", loss_type="simpo", beta=2.0, cpo_alpha=0.0, simpo_gamma=0.5),
    "cpo_simpo": dict(trainer="cpo", loss_type="simpo", beta=2.0, cpo_alpha=1.0, simpo_gamma=0.5,
                      label_smoothing=0.1),
    "alphapo": dict(trainer="cpo", loss_type="simpo", beta=2.0, cpo_alpha=0.0, simpo_gamma=0.5, alpha=0.25),
}
METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "nll_loss"]
ORPO_METRICS = METRICS + ["log_odds_ratio", "log_odds_chosen"]
SIDES = ("chosen", "rejected")
LOSS_TOLERANCE = 1e-12  # hand recomputation vs TRL, absolute (relative above 1)
GRAD_TOLERANCE = 1e-10  # hand recomputation vs TRL, relative to each gradient's largest entry


def trl_batch(b):
    """dpo-batch.json -> TRL's (pre-concatenation) preference batch: chosen_* and rejected_* int64 tensors."""
    batch = {}
    for side in SIDES:
        ids, mask, labels = (torch.tensor(b[f"{side}_{k}"], dtype=torch.int64)
                             for k in ("input_ids", "attention_mask", "labels"))
        keep = labels != -100
        assert torch.equal(labels[keep], ids[keep]) and mask[keep].all(), f"{side}: labels are the completion ids"
        for row in mask:  # right padding
            n = int(row.sum())
            assert row[:n].all() and not row[n:].any()
        batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"], batch[f"{side}_labels"] = ids, mask, labels
    return batch


def bare_trainer(cfg):
    """An ORPOTrainer / CPOTrainer with only what `get_batch_loss_metrics` reads, set as `__init__` sets them."""
    cfg = {k: v for k, v in cfg.items() if k != "trainer"}
    common = dict(output_dir="/tmp/make_preference_fixtures", use_cpu=True, report_to="none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if "loss_type" not in cfg:  # ORPO
            args = ORPOConfig(**common, **cfg)
            t = ORPOTrainer.__new__(ORPOTrainer)
            t.padding_value = args.padding_value if args.padding_value is not None else 0  # the tokenizer's pad id
        else:
            args = CPOConfig(**common, **cfg)
            t = CPOTrainer.__new__(CPOTrainer)
            t.pad_token_id = 0
            t.label_smoothing, t.loss_type, t.cpo_alpha = args.label_smoothing, args.loss_type, args.cpo_alpha
            t.simpo_gamma, t.alpha = args.simpo_gamma, args.alpha
    t.args, t.beta, t.is_encoder_decoder = args, args.beta, False
    t.aux_loss_enabled, t.aux_loss_coef = False, 0.0
    t.accelerator = types.SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x)
    return t


def check_float64(trainer):
    """Wraps the trainer's loss function so that it asserts its inputs and outputs are float64."""
    name = "odds_ratio_loss" if isinstance(trainer, ORPOTrainer) else "cpo_loss"
    inner = getattr(trainer, name)

    def wrapped(chosen_logps, rejected_logps):
        assert chosen_logps.dtype == F64 and rejected_logps.dtype == F64, (chosen_logps.dtype, rejected_logps.dtype)
        out = inner(chosen_logps, rejected_logps)
        assert all(x.dtype == F64 for x in out), [x.dtype for x in out]
        return out

    setattr(trainer, name, wrapped)


def trl_loss(model, batch, cfg):
    model.zero_grad()
    trainer = bare_trainer(cfg)
    check_float64(trainer)
    loss, metrics = trainer.get_batch_loss_metrics(model, dict(batch))
    assert loss.dtype == F64 and loss.dim() == 0, (loss.dtype, loss.shape)
    loss.backward()
    out = {"loss": loss.detach().reshape(1)}
    for m in ORPO_METRICS if cfg["trainer"] == "orpo" else METRICS:
        out[m.replace("/", "_")] = torch.tensor([metrics[m]], dtype=F64)
    out.update({f"grad.{n}": p.grad.detach().clone() for n, p in model.named_parameters()})
    return out


def log1mexp(x):
    """log(1 - exp(x)) for x < 0, written independently of TRL's."""
    return torch.where(x < -0.5, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def hand_loss(model, batch, cfg):
    """The same objective from the formulas, with the chosen and the rejected rows run separately."""
    model.zero_grad()
    tok, comp, real = {}, {}, {}
    for side in SIDES:
        ids, mask, labels = (batch[f"{side}_{k}"] for k in ("input_ids", "attention_mask", "labels"))
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        tok[side] = token_logps(logits, ids)  # [B, T-1], position t predicts ids[:, t + 1]
        comp[side] = labels[:, 1:] != -100  # completion tokens (the labels)
        real[side] = mask[:, 1:] == 1  # every real next token, prompt included
    s = {side: (tok[side] * comp[side]).sum(-1) for side in SIDES}  # summed completion log-probs
    a = {side: s[side] / comp[side].sum(-1) for side in SIDES}  # averaged
    beta = cfg["beta"]
    out = {}
    if cfg["trainer"] == "orpo":
        # mean of -log p over all real next tokens of all chosen rows (prompt included)
        nll = -(tok["chosen"] * real["chosen"]).sum() / real["chosen"].sum()
        pc, pr = a["chosen"], a["rejected"]
        log_odds = (pc - pr) - (log1mexp(pc) - log1mexp(pr))
        ratio = F.logsigmoid(log_odds)
        loss = nll - beta * ratio.mean()
        rc, rr = beta * pc, beta * pr
        out["log_odds_ratio"], out["log_odds_chosen"] = ratio.mean(), log_odds.mean()
    else:
        loss_type, ls = cfg["loss_type"], cfg.get("label_smoothing", 0.0)
        cpo_alpha, gamma, alpha = cfg.get("cpo_alpha", 1.0), cfg.get("simpo_gamma", 0.5), cfg.get("alpha", 0.0)
        # mean of -log p over the completion (label) tokens of all chosen rows
        nll = -(tok["chosen"] * comp["chosen"]).sum() / comp["chosen"].sum()
        p = a if loss_type in ("ipo", "simpo") else s
        pc, pr = p["chosen"], p["rejected"]
        if alpha != 0.0:  # AlphaPO: r = (1 - p^-alpha) / alpha with p = exp(log-prob)
            r = {side: (1 - torch.exp(-alpha * p[side])) / alpha for side in SIDES}
        else:
            r = p
        d = r["chosen"] - r["rejected"]
        if loss_type in ("sigmoid", "simpo"):
            z = beta * d - (gamma if loss_type == "simpo" else 0.0)
            losses = -F.logsigmoid(z) * (1 - ls) - F.logsigmoid(-z) * ls
        elif loss_type == "hinge":
            losses = torch.relu(1 - beta * d)
        elif loss_type == "ipo":
            losses = (d - 1 / (2 * beta)) ** 2
        loss = losses.mean() + (cpo_alpha * nll if cpo_alpha != 0 else 0.0)
        if cpo_alpha == 0:
            nll = torch.zeros(())
        rc, rr = beta * r["chosen"], beta * r["rejected"]
    loss.backward()
    out.update({"loss": loss, "rewards_chosen": rc.mean(), "rewards_rejected": rr.mean(),
                "rewards_accuracies": (rc > rr).to(F64).mean(), "rewards_margins": (rc - rr).mean(),
                "logps_chosen": pc.mean(), "logps_rejected": pr.mean(), "nll_loss": nll})
    out = {k: v.detach().reshape(1) for k, v in out.items()}
    out.update({f"grad.{n}": p.grad.detach().clone() for n, p in model.named_parameters()})
    return out


def compare(name, variant, got, want):
    return fixture_tools.compare(name, variant, got, want, LOSS_TOLERANCE, GRAD_TOLERANCE)


def make_family(name, root):
    d = os.path.join(root, name)
    with open(os.path.join(d, "dpo-batch.json")) as f:
        batch = trl_batch(json.load(f))
    out = {}
    with exact_float64():
        model = AutoModelForCausalLM.from_pretrained(d, dtype=F64, attn_implementation="eager").eval()
        for variant, cfg in VARIANTS.items():
            got = trl_loss(model, batch, cfg)
            value_err, grad_err = compare(name, variant, got, hand_loss(model, batch, cfg))
            out.update({f"{variant}.{k}": v.to(F64).contiguous() for k, v in got.items()})
            print(f"{name}: {variant:15s} loss {got['loss'].item():.15f}  nll {got['nll_loss'].item():.6f}  "
                  f"margin {got['rewards_margins'].item():+.6f}  vs hand: values {value_err:.1e} grads {grad_err:.1e}")
    assert all(v.dtype == F64 and v.is_contiguous() for v in out.values())
    meta = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
            "batch": "dpo-batch.json", "variants": json.dumps(VARIANTS)}
    save_file(out, os.path.join(d, "preference.safetensors"), metadata=meta)


if __name__ == "__main__":
    fixture_tools.run_families(__doc__, lambda name, root, _: make_family(name, root))
