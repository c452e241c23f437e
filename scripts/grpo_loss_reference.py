#!/usr/bin/env python3
"""Checks make_fixtures.py's hand-written GRPO losses against TRL's own `GRPOTrainer._compute_loss`, in float64.

`make_fixtures.grpo_case` writes TRL's loss variants out by hand (`trl_loss`, `variants`). For each model family
this script rebuilds the fixture exactly (it runs `make_fixtures.make_case` with the same seed into a temporary
directory and captures the model, batch and reference tensors that `grpo_case` produced), then, for every variant,
calls TRL's real `_compute_loss(model, inputs)` on a bare trainer (`GRPOTrainer.__new__`, with only the attributes
that method reads, set as `__init__` sets them) configured for that variant, and compares TRL's loss, the
gradients of all parameters, and TRL's logged `kl` / clip-ratio metrics with the fixture's.

TRL computes the log-probs with its fused LM head (`add_fused_lm_head`: temperature, Gemma's soft-cap), whose
kernel keeps float32 accumulators; they are promoted to float64 here, as `exact_float64` does for transformers.

Run: .venv/bin/python scripts/grpo_loss_reference.py   (CPU, a few seconds per family)
"""
import contextlib
import os
import sys
import tempfile
import types
import warnings
from collections import defaultdict

import torch
import transformers
import trl
from trl import GRPOConfig, GRPOTrainer
from accelerate.utils import is_peft_model
from trl.trainer.utils import add_fused_lm_head

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402

F32, F64 = mf.F32, mf.F64
PROMPT_LEN = 4
LOSS_TOL, GRAD_TOL, METRIC_TOL = 1e-12, 1e-10, 1e-12

# make_fixtures.grpo_case's `variants`, in TRL's terms: (GRPOConfig overrides, edits to TRL's inputs).
VARIANTS = {
    "grpo": ({}, {}),
    "bnpo": ({"loss_type": "bnpo"}, {}),
    "dr_grpo": ({"loss_type": "dr_grpo"}, {}),
    "dapo": ({"loss_type": "dapo"}, {"num_items_scale": 3}),  # as if this were a third of the global batch
    "cispo": ({"loss_type": "cispo", "epsilon_high": mf.CISPO_EPSILON_HIGH}, {}),
    "sapo": ({"loss_type": "sapo"}, {}),
    "plain_kl": ({"use_bias_correction_kl": False}, {}),
    "noold": ({"beta": 0.0}, {"drop_old": True}),
    "temperature": ({"temperature": mf.GRPO_TEMPERATURE}, {}),
    "masked_row": ({}, {"masked_row": mf.MASKED_ROW}),
}


@contextlib.contextmanager
def exact_float64_trl():
    """`make_fixtures.exact_float64`, plus the float32 buffers (torch.zeros / torch.full) of TRL's fused LM head."""
    orig_zeros, orig_full = torch.zeros, torch.full

    def promoted(fn):
        def wrapper(*args, **kwargs):
            if kwargs.get("dtype") is F32:
                kwargs["dtype"] = F64
            return fn(*args, **kwargs)
        return wrapper

    torch.zeros, torch.full = promoted(orig_zeros), promoted(orig_full)
    try:
        with mf.exact_float64():
            yield
    finally:
        torch.zeros, torch.full = orig_zeros, orig_full


def fixture(name):
    """Runs make_fixtures.make_case(name) into a temporary directory; returns grpo_case's model, batch, tensors."""
    captured = {}
    orig_grpo_case = mf.grpo_case

    def capturing_grpo_case(model, vocab, gen):
        batch, tensors = orig_grpo_case(model, vocab, gen)
        captured.update(model=model, batch=batch, tensors=tensors)
        return batch, tensors

    mf.grpo_case = capturing_grpo_case
    try:
        with tempfile.TemporaryDirectory() as tmp:
            mf.make_case(name, tmp, seed=1234 + list(mf.CASES).index(name))  # make_fixtures.main's seeds
    finally:
        mf.grpo_case = orig_grpo_case
    return captured["model"], captured["batch"], captured["tensors"]


def bare_trainer(model, batch, **overrides):
    """A GRPOTrainer with only what `_compute_loss` reads: one process, one accumulation step, no vLLM."""
    args = GRPOConfig(output_dir=os.path.join(tempfile.gettempdir(), "grpo_loss_reference"), use_cpu=True,
                      report_to="none", per_device_train_batch_size=4, num_generations=4,
                      **{"loss_type": "grpo", "beta": batch["beta"], "epsilon": batch["epsilon"],
                         "max_completion_length": batch["max_completion_length"], **overrides})
    assert args.steps_per_generation == 1 and not args.use_vllm and args.delta is None
    t = GRPOTrainer.__new__(GRPOTrainer)
    t.args, t.model = args, model
    t.loss_type, t.beta, t.temperature = args.loss_type, args.beta, args.temperature
    t.max_completion_length = args.max_completion_length
    t.epsilon_low = args.epsilon
    t.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    t.importance_sampling_level, t.off_policy_mask_threshold = args.importance_sampling_level, args.off_policy_mask_threshold
    t.top_entropy_quantile, t.entropy_coef = args.top_entropy_quantile, args.entropy_coef
    t.use_adaptive_entropy = args.use_adaptive_entropy
    t._entropy_bonus_enabled = t.entropy_coef != 0.0 or t.use_adaptive_entropy
    t.use_vllm, t.vllm_importance_sampling_correction = False, args.vllm_importance_sampling_correction
    t.aux_loss_enabled, t.current_gradient_accumulation_steps = False, 1
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t.accelerator = types.SimpleNamespace(num_processes=1, is_main_process=True, autocast=contextlib.nullcontext,
                                          sync_gradients=True, pad_across_processes=lambda x, dim, pad_index: x,
                                          gather=lambda x: x, reduce=lambda x, reduction: x)
    return t


def trl_inputs(batch, num_items_scale=1, drop_old=False, masked_row=None):
    """The fixture batch as `_generate_and_score_completions` hands it to `_compute_loss`."""
    ids, attention_mask = torch.tensor(batch["input_ids"]), torch.tensor(batch["attention_mask"])
    completion_mask = torch.tensor(batch["completion_mask"])[:, PROMPT_LEN:]
    assert attention_mask[:, :PROMPT_LEN].all() and torch.equal(attention_mask[:, PROMPT_LEN:], completion_mask)
    num_items = num_items_scale * completion_mask.sum().to(F64)  # before any row is masked, like the fixture
    if masked_row is not None:  # mask_truncated_completions
        completion_mask = completion_mask.clone()
        completion_mask[masked_row] = 0
    per_token = lambda key: torch.tensor(batch[key], dtype=F64)[:, PROMPT_LEN:]  # aligned with completion_ids
    return {
        "prompt_ids": ids[:, :PROMPT_LEN], "prompt_mask": attention_mask[:, :PROMPT_LEN],
        "completion_ids": ids[:, PROMPT_LEN:], "completion_mask": completion_mask,
        "advantages": torch.tensor(batch["advantages"], dtype=F64),
        "old_per_token_logps": None if drop_old else per_token("old_logps"),
        "ref_per_token_logps": per_token("ref_logps"),
        "num_items_in_batch": num_items,
    }


@contextlib.contextmanager
def fused_head(model, temperature):
    """TRL's fused LM head on `model` (a PEFT model's on its base model) as the trainers' `__init__`
    adds it, for the duration; the class's forward again after."""
    head_model = model.get_base_model() if is_peft_model(model) else model
    add_fused_lm_head(head_model, temperature=temperature, outputs=("log_probs", "entropy"))
    try:
        yield
    finally:
        del head_model.forward


def check(name, model, batch, tensors, variant, overrides, edits):
    trainer = bare_trainer(model, batch, **overrides)
    with fused_head(model, trainer.temperature), exact_float64_trl():
        model.zero_grad()
        loss = trainer._compute_loss(model, trl_inputs(batch, **edits))
        loss.backward()
    key = f"grpo.{variant}"
    loss_diff = abs(loss.item() - tensors[f"{key}.loss"].item())
    grad_diff = 0.0
    for n, p in model.named_parameters():
        ref = tensors[f"{key}.grad.{n}"]
        grad_diff = max(grad_diff, ((p.grad - ref).abs().max() / ref.abs().max().clamp(min=1e-300)).item())
    metrics = trainer._metrics["train"]
    clip = metrics.get("cispo_clip_ratio") or metrics.get("clip_ratio/region_mean")  # sapo logs none
    metric_diffs = {"kl": metrics.get("kl"), "clip_ratio": clip}
    metric_diffs = {k: abs(v[-1] - tensors[f"{key}.{k}"].item()) for k, v in metric_diffs.items() if v}
    print(f"{name:7s} {variant:12s} loss {loss.item():+.15f}  |dloss| {loss_diff:.1e}  max rel dgrad {grad_diff:.1e}  "
          + "  ".join(f"|d{k}| {d:.1e}" for k, d in metric_diffs.items()))
    assert loss_diff < LOSS_TOL, f"{name}/{variant}: loss differs by {loss_diff}"
    assert grad_diff < GRAD_TOL, f"{name}/{variant}: gradients differ by {grad_diff} (relative)"
    assert all(d < METRIC_TOL for d in metric_diffs.values()), f"{name}/{variant}: metrics differ {metric_diffs}"


def main():
    transformers.utils.logging.disable_progress_bar()  # make_case's save_pretrained
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)  # GRPOConfig
    print(f"trl {trl.__version__}, torch {torch.__version__}")
    for name in mf.CASES:
        model, batch, tensors = fixture(name)
        model.train()  # `_compute_loss` takes its mode from `self.model.training`; no dropout in these configs
        for variant, (overrides, edits) in VARIANTS.items():
            check(name, model, batch, tensors, variant, overrides, edits)
    print("all GRPO variants match TRL")


if __name__ == "__main__":
    main()
