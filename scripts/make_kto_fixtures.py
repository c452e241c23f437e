#!/usr/bin/env python3
"""Float64 losses, gradients and metrics of TRL's KTO objective (and its apo_zero_unpaired variant), computed by TRL's own code.

For each family in tests/fixtures/<family>/ this loads model.safetensors in float64 exactly as
make_fixtures.py builds its references (eager attention, `exact_float64()`), builds one fixed unpaired
batch (the same for every family: 3 rows labelled desirable, desirable, undesirable, with their
mismatched KL rows), batches it with TRL's own `DataCollatorForUnpairedPreference`, and calls TRL's own
`KTOTrainer._compute_loss` on a bare `KTOTrainer.__new__(KTOTrainer)` that has the attributes `__init__`
sets from a `KTOConfig` (with `precompute_ref_log_probs=True`: the reference log-probs come in with the
batch, so no reference model is needed), then `loss.backward()`. It writes

    tests/fixtures/<family>/kto-batch.json
        input_ids, attention_mask, labels (HF labels: the id on completion tokens, -100 elsewhere), label
        (desirable flags), kl_input_ids, kl_attention_mask, kl_labels (the KL rows: prompt i with completion
        i-1, as TRL builds them), ref_logps, ref_kl_logps, beta
    tests/fixtures/<family>/kto.safetensors    (float64)
        "logps"                  [3]  the policy's summed completion log-probs of the rows
        "kl_logps"               [3]  the same for the KL rows
        "<variant>.loss"         [1]
        "<variant>.kl"           [1]  the KL estimate TRL used (its logged metric "kl"; 0 without KL rows)
        "<variant>.<metric>"     [1]  TRL's metrics rewards/chosen, rewards/rejected, rewards/margins,
                                      logps/chosen, logps/rejected, with '/' written '_'
        "<variant>.grad.<param>" d loss / d param, HF parameter names (tied embeddings: model.embed_tokens.weight)

for the configurations in VARIANTS. The reference log-probs are the policy's own minus REF_OFFSETS (and the
KL rows' minus REF_KL_OFFSETS), so the log-ratios are REF_OFFSETS (both signs) and TRL's KL estimate,
mean(KL_logps - ref_KL_logps), is mean(REF_KL_OFFSETS) > 0 and not clamped. The policy log-probs are
computed by TRL's own `compute_ref_log_probs` (the precompute path) and checked against `token_logps`.

TRL calls the model with `fused_lm_head=True`, a head that accumulates in float32; `PlainHead` (from
make_dpo_loss_fixtures.py) answers that call from the model's own float64 logits. The script asserts that
every floating tensor in `_compute_loss`'s and `_compute_kl_logps`'s frames is float64, recomputes every
variant by hand from `token_logps` (the formulas in `hand_loss`, separate forwards of the rows and the KL
rows) and checks loss, kl and metrics (1e-12) and gradients (1e-10 relative) against TRL's, and that every
gradient is finite and nonzero.

Run: .venv/bin/python scripts/make_kto_fixtures.py [--only qwen3 ...]   (CPU; needs trl)
"""
import contextlib
import json
import os
import sys
import types
import warnings
from collections import defaultdict

import torch
import torch.nn.functional as F
import transformers
import trl
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from trl import KTOConfig, KTOTrainer
from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

from make_dpo_loss_fixtures import PlainHead
import fixture_tools
from make_fixtures import F64, exact_float64, token_logps

FAMILIES = fixture_tools.FAMILIES
VARIANTS = {
    "kto": dict(loss_type="kto", beta=0.1, desirable_weight=1.0, undesirable_weight=1.0),
    "kto_weighted": dict(loss_type="kto", beta=0.3, desirable_weight=1.33, undesirable_weight=0.5),
    # TRL turns the KL term off for this loss type (no KL rows are built; kl = 0)
    "apo_zero_unpaired": dict(loss_type="apo_zero_unpaired", beta=0.1, desirable_weight=1.0, undesirable_weight=1.0),
}
METRICS = ["kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"]

# The batch (the same for every family)
SEED, VOCAB, PAD = 1234, 96, 0
LABELS = [True, True, False]  # desirable flags
PROMPT_LENS = [3, 2, 4]
COMPLETION_LENS = [4, 2, 3]
REF_OFFSETS = [0.4, -0.3, 0.7]  # logps - ref_logps: the log-ratios
REF_KL_OFFSETS = [0.5, 0.2, 0.9]  # KL_logps - ref_KL_logps: their mean is TRL's KL estimate
JSON_BETA = 0.1

LOSS_TOLERANCE = 1e-12  # hand recomputation vs TRL, absolute (relative above 1)
GRAD_TOLERANCE = 1e-10  # hand recomputation vs TRL, relative to each gradient's largest entry


def make_examples():
    """Token ids of the prompts and completions, and the KL completions rotated by +1 as TRL's
    `_prepare_dataset` (`add_kl_completion_ids`) does within a batch: (x_1, y_n), (x_2, y_1), ..."""
    g = torch.Generator().manual_seed(SEED)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    completions = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in COMPLETION_LENS]
    kl_completions = completions[-1:] + completions[:-1]
    return [dict(prompt_ids=p, completion_ids=c, KL_completion_ids=k, label=lab)
            for p, c, k, lab in zip(prompts, completions, kl_completions, LABELS)]


def hand_rows(prompts, completions):
    """Right-padded ids, attention mask and HF labels, built without TRL."""
    t = max(len(p) + len(c) for p, c in zip(prompts, completions))
    ids, mask, labels = [], [], []
    for p, c in zip(prompts, completions):
        pad = t - len(p) - len(c)
        ids.append(p + c + [PAD] * pad)
        mask.append([1] * (len(p) + len(c)) + [0] * pad)
        labels.append([-100] * len(p) + c + [-100] * pad)
    return (torch.tensor(x, dtype=torch.int64) for x in (ids, mask, labels))


def collate(examples, with_kl, ref_logps=None, ref_kl_logps=None):
    """TRL's own collator; the KL rows only where TRL builds them (calculate_KL)."""
    examples = [{k: v for k, v in ex.items() if with_kl or k != "KL_completion_ids"} for ex in examples]
    batch = DataCollatorForUnpairedPreference(pad_token_id=PAD)(examples)
    if ref_logps is not None:  # the collator builds these with the default dtype; keep the exact float64
        batch["ref_logps"] = ref_logps.clone()
        if with_kl:
            batch["ref_KL_logps"] = ref_kl_logps.clone()
    return batch


def bare_trainer(cfg, model):
    """A KTOTrainer with only what `_compute_loss` (and `compute_ref_log_probs`) read, set as `__init__` sets them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = KTOConfig(output_dir="/tmp/make_kto_fixtures", use_cpu=True, report_to="none", bf16=False,
                         precompute_ref_log_probs=True, per_device_train_batch_size=len(LABELS), **cfg)
    t = KTOTrainer.__new__(KTOTrainer)
    t.args, t.beta, t.precompute_ref_logps, t.loss_type = args, args.beta, args.precompute_ref_log_probs, args.loss_type
    t.desirable_weight, t.undesirable_weight = args.desirable_weight, args.undesirable_weight
    t.calculate_KL = args.loss_type not in ["apo_zero_unpaired"]  # as KTOTrainer.__init__ sets it
    t.aux_loss_enabled, t.router_aux_loss_coef = False, 0.0
    t._tp_size, t._total_train_tokens = 1, 0
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t.accelerator = types.SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x,
                                          autocast=contextlib.nullcontext)
    t.model, t.ref_model = model, None  # `self.model.training` picks the metrics' mode: "train"
    return t


class Head(PlainHead):
    """PlainHead in training mode, asserting its float64 outputs and recording grad mode per call."""

    def __init__(self, model):
        super().__init__(model)
        self.training, self.is_gradient_checkpointing, self.calls = True, False, []
        # With peft installed, TRL asks accelerate's is_peft_model, which reads `_modules`.
        self._modules = {}

    def __call__(self, use_cache=False, **kw):  # compute_ref_log_probs passes no use_cache
        out = super().__call__(use_cache=use_cache, **kw)
        assert all(x.dtype == F64 for x in (out.log_probs, out.entropy, out.mean_logits))
        self.calls.append((tuple(kw["input_ids"].shape), torch.is_grad_enabled()))
        return out


@contextlib.contextmanager
def frame_locals(*functions):
    """Collects the local variables of `functions` as they return (to check the dtypes TRL computes in)."""
    codes = {f.__code__: f.__name__ for f in functions}
    seen = defaultdict(list)

    def profile(frame, event, arg):
        if event == "return" and frame.f_code in codes:
            seen[codes[frame.f_code]].append(dict(frame.f_locals))

    sys.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(None)


def assert_float64(seen):
    n = 0
    for name, frames in seen.items():
        for f in frames:
            for k, v in f.items():
                tensors = [(k, v)] if isinstance(v, torch.Tensor) else []
                if isinstance(v, types.SimpleNamespace):
                    tensors = [(f"{k}.{a}", x) for a, x in vars(v).items() if isinstance(x, torch.Tensor)]
                for kk, x in tensors:
                    if x.is_floating_point():
                        assert x.dtype == F64, f"{name}: {kk} is {x.dtype}"
                        n += 1
    return n


def policy_logps(model, examples):
    """The policy's summed completion log-probs of the rows and the KL rows, by TRL's `compute_ref_log_probs`."""
    head = Head(model)
    t = bare_trainer(VARIANTS["kto"], head)
    logps, kl_logps = t.compute_ref_log_probs(head, collate(examples, with_kl=True))
    return logps.detach(), kl_logps.detach()


def trl_loss(model, batch, cfg):
    model.zero_grad()
    head = Head(model)
    trainer = bare_trainer(cfg, head)
    with frame_locals(KTOTrainer._compute_loss, KTOTrainer._compute_kl_logps) as seen:
        loss = trainer._compute_loss(head, dict(batch), return_outputs=False)
    n = assert_float64(seen)
    assert loss.dtype == F64 and loss.dim() == 0, (loss.dtype, loss.shape)
    # one forward with grad (the rows), and with the KL term one more without (the KL rows)
    want = [(tuple(batch["input_ids"].shape), True)]
    if trainer.calculate_KL:
        want.insert(0, (tuple(batch["KL_input_ids"].shape), False))
    assert head.calls == want, head.calls
    loss.backward()
    metrics = trainer._metrics["train"]
    assert not trainer._metrics["eval"] and all(len(metrics[m]) == 1 for m in METRICS), dict(metrics)
    out = {"loss": loss.detach().reshape(1)}
    out.update({m.replace("/", "_"): torch.tensor(metrics[m], dtype=F64) for m in METRICS})
    out.update({f"grad.{n}": p.grad.detach().clone() for n, p in model.named_parameters()})
    return out, n


def hand_loss(model, rows, kl_rows, ref_logps, ref_kl_logps, cfg):
    """The same objective from the formulas, with the rows and the KL rows built and run without TRL."""
    model.zero_grad()
    beta, wd, wu = cfg["beta"], cfg["desirable_weight"], cfg["undesirable_weight"]
    desirable = torch.tensor(LABELS)

    def summed(ids, mask, labels):
        tok = token_logps(model(input_ids=ids, attention_mask=mask, use_cache=False).logits, ids)
        return (tok * (labels[:, 1:] != -100)).sum(-1)  # logits[t-1] score token t, completion tokens only

    logps = summed(*rows)
    lr = logps - ref_logps
    if cfg["loss_type"] == "kto":
        with torch.no_grad():
            kl = (summed(*kl_rows) - ref_kl_logps).mean().clamp(min=0)  # the micro-batch mean, detached
        row_losses = torch.where(desirable, 1 - torch.sigmoid(beta * (lr - kl)), 1 - torch.sigmoid(beta * (kl - lr)))
    else:  # apo_zero_unpaired
        kl = torch.zeros((), dtype=F64)
        row_losses = torch.where(desirable, 1 - torch.sigmoid(beta * lr), torch.sigmoid(beta * lr))
    loss = (torch.where(desirable, wd, wu) * row_losses).mean()  # over all rows, desirable and undesirable
    loss.backward()
    rewards = beta * lr.detach()
    out = {"loss": loss, "kl": kl, "rewards_chosen": rewards[desirable].mean(),
           "rewards_rejected": rewards[~desirable].mean(),
           "rewards_margins": rewards[desirable].mean() - rewards[~desirable].mean(),
           "logps_chosen": logps[desirable].mean(), "logps_rejected": logps[~desirable].mean()}
    out = {k: v.detach().reshape(1) for k, v in out.items()}
    out.update({f"grad.{n}": p.grad.detach().clone() for n, p in model.named_parameters()})
    return out


def compare(name, variant, got, want):
    for k in got:
        assert got[k].dtype == F64 and want[k].dtype == F64, (k, got[k].dtype, want[k].dtype)
    return fixture_tools.compare(name, variant, got, want, LOSS_TOLERANCE, GRAD_TOLERANCE)


def make_family(name, root):
    d = os.path.join(root, name)
    with open(os.path.join(d, "config.json")) as f:
        assert json.load(f)["vocab_size"] == VOCAB
    examples = make_examples()
    rows = tuple(hand_rows([e["prompt_ids"] for e in examples], [e["completion_ids"] for e in examples]))
    kl_rows = tuple(hand_rows([e["prompt_ids"] for e in examples], [e["KL_completion_ids"] for e in examples]))
    out = {}
    with exact_float64():
        model = AutoModelForCausalLM.from_pretrained(d, dtype=F64, attn_implementation="eager").eval()

        # the policy's own log-probs, by TRL's precompute path and by hand
        logps, kl_logps = policy_logps(model, examples)
        with torch.no_grad():
            for (ids, mask, labels), trl_value in ((rows, logps), (kl_rows, kl_logps)):
                tok = token_logps(model(input_ids=ids, attention_mask=mask).logits, ids)
                by_hand = (tok * (labels[:, 1:] != -100)).sum(-1)
                assert trl_value.dtype == F64 and (trl_value - by_hand).abs().max() < LOSS_TOLERANCE
        ref_logps = logps - torch.tensor(REF_OFFSETS, dtype=F64)
        ref_kl_logps = kl_logps - torch.tensor(REF_KL_OFFSETS, dtype=F64)
        assert (kl_logps - ref_kl_logps).mean() > 0.1, "the KL estimate must not be clamped"
        out["logps"], out["kl_logps"] = logps.contiguous(), kl_logps.contiguous()

        for variant, cfg in VARIANTS.items():
            with_kl = cfg["loss_type"] != "apo_zero_unpaired"
            batch = collate(examples, with_kl, ref_logps, ref_kl_logps)
            # TRL's collator builds exactly the rows hand_rows builds (completion mask = labels != -100)
            for prefix, (ids, mask, labels) in [("", rows)] + ([("KL_", kl_rows)] if with_kl else []):
                assert torch.equal(batch[f"{prefix}input_ids"], ids)
                assert torch.equal(batch[f"{prefix}attention_mask"], mask)
                assert torch.equal(batch[f"{prefix}completion_mask"].bool(), labels != -100)
            assert with_kl == ("KL_input_ids" in batch) and torch.equal(batch["label"], torch.tensor(LABELS))
            got, n_tensors = trl_loss(model, batch, cfg)
            if not with_kl:  # KL rows in the batch change nothing when TRL does not use them
                again, _ = trl_loss(model, collate(examples, True, ref_logps, ref_kl_logps), cfg)
                assert all(torch.equal(got[k], again[k]) for k in got)
            value_err, grad_err = compare(name, variant, got, hand_loss(model, rows, kl_rows, ref_logps,
                                                                        ref_kl_logps, cfg))
            out.update({f"{variant}.{k}": v.to(F64).contiguous() for k, v in got.items()})
            print(f"{name}: {variant:17s} loss {got['loss'].item():.15f}  kl {got['kl'].item():.15f}  "
                  f"margin {got['rewards_margins'].item():+.6f}  ({n_tensors} float64 tensors in TRL's frames)  "
                  f"vs hand: values {value_err:.1e} grads {grad_err:.1e}")
    assert all(v.dtype == F64 and v.is_contiguous() for v in out.values())
    meta = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
            "batch": "kto-batch.json", "variants": json.dumps(VARIANTS), "seed": str(SEED),
            "ref_offsets": json.dumps(REF_OFFSETS), "ref_kl_offsets": json.dumps(REF_KL_OFFSETS)}
    save_file(out, os.path.join(d, "kto.safetensors"), metadata=meta)

    (ids, mask, labels), (kl_ids, kl_mask, kl_labels) = rows, kl_rows
    batch_json = {"objective": "kto", "input_ids": ids.tolist(), "attention_mask": mask.tolist(),
                  "labels": labels.tolist(), "label": LABELS, "kl_input_ids": kl_ids.tolist(),
                  "kl_attention_mask": kl_mask.tolist(), "kl_labels": kl_labels.tolist(),
                  "ref_logps": ref_logps.tolist(), "ref_kl_logps": ref_kl_logps.tolist(), "beta": JSON_BETA}
    with open(os.path.join(d, "kto-batch.json"), "w") as f:
        json.dump(batch_json, f)
        f.write("\n")


if __name__ == "__main__":
    fixture_tools.run_families(__doc__, lambda name, root, _: make_family(name, root))
