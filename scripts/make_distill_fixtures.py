#!/usr/bin/env python3
"""Float64 losses, gradients and metrics of TRL 1.16's distillation loss, computed by TRL's own code.

A teacher wider than every student: tests/fixtures/teacher/ (a tiny Qwen3, hidden size 48 where the students'
is 32, the students' vocabulary of 96; random weights from a fixed seed, saved as float32 by transformers'
`save_pretrained`; written when absent). For each family in tests/fixtures/<family>/ this loads the student's
model.safetensors and the teacher in float64 as make_fixtures.py builds its references (eager attention,
`exact_float64()`), reads the family's committed grpo-batch.json (4 rows, a prompt of 4 tokens, completions of
5, 3, 6 and 2), and for every configuration in VARIANTS calls TRL's own `DistillationTrainer._compute_loss` on
a bare `DistillationTrainer.__new__(DistillationTrainer)` (the attributes it reads, set as `__init__` sets them
from a `DistillationConfig`; one process, so the loss is the mean over the completion positions), then
`loss.backward()`. It writes

    tests/fixtures/<family>/distill.safetensors    (float64)
        "<variant>.loss"          [1]
        "<variant>.entropy"       [1]  TRL's logged student entropy (its entropy sum over the positions counted)
        "<variant>.grad.<param>"  d loss / d param, HF parameter names
    tests/fixtures/<family>/lora/distill.safetensors
        "reverse_kl.*" the same on the family's PEFT adapter, the adapter's gradients keyed as
        adapter_model.safetensors keys them

The Rust tests make the same edits to the batch file (objective "distill", the variant's beta and temperature).

Run: .venv/bin/python scripts/make_distill_fixtures.py [--only qwen3 ...]   (CPU; needs trl)
"""
import contextlib
import inspect
import json
import os
import sys
import tempfile
import types
import warnings

import torch
import transformers
import trl
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM
from trl import DistillationConfig, DistillationTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixture_tools  # noqa: E402
import peft  # noqa: E402
from peft import PeftModel  # noqa: E402
from make_lora_fixtures import load_base, saved_key  # noqa: E402
from grpo_loss_reference import PROMPT_LEN, exact_float64_trl  # noqa: E402
from make_fixtures import F32, F64  # noqa: E402

TEACHER = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=12, max_position_embeddings=64, rope_theta=10000.0,
               tie_word_embeddings=False, pad_token_id=0, attention_dropout=0.0)
TEACHER_SEED = 4242
# name -> DistillationConfig overrides (TRL's defaults otherwise: beta 1.0, the reverse KL; temperature 1.0).
VARIANTS = {
    "reverse_kl": {},
    "forward_kl": {"beta": 0.0},
    "jsd": {"beta": 0.5},
    "jsd_temperature": {"beta": 0.3, "temperature": 0.7},
}


def teacher_dir(root):
    """tests/fixtures/teacher, written once: a wider Qwen3 with the students' vocabulary."""
    d = os.path.join(root, "teacher")
    if not os.path.exists(os.path.join(d, "model.safetensors")):
        torch.manual_seed(TEACHER_SEED)
        model = Qwen3ForCausalLM(Qwen3Config(**TEACHER)).to(F32)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
        model.save_pretrained(d, safe_serialization=True)
        generation = os.path.join(d, "generation_config.json")
        if os.path.exists(generation):
            os.remove(generation)
    return d


@contextlib.contextmanager
def exact_float64_divergence():
    """`exact_float64_trl`, plus the float32 tiles (torch.empty) of TRL's chunked divergence kernel."""
    orig_empty = torch.empty

    def empty(*args, **kwargs):
        if kwargs.get("dtype") is F32:
            kwargs["dtype"] = F64
        return orig_empty(*args, **kwargs)

    torch.empty = empty
    try:
        with exact_float64_trl():
            yield
    finally:
        torch.empty = orig_empty


def bare_trainer(student, teacher, **overrides):
    """A DistillationTrainer with only what `_compute_loss` reads."""
    args = DistillationConfig(output_dir=os.path.join(tempfile.gettempdir(), "distill_fixtures"), use_cpu=True,
                              report_to="none", **overrides)
    t = DistillationTrainer.__new__(DistillationTrainer)
    t.args, t.teacher_model = args, teacher
    t.beta, t.temperature = args.beta, args.temperature
    t.accelerator = types.SimpleNamespace(unwrap_model=lambda m: m, is_main_process=True)
    t._forward_redirection = lambda wrapper, unwrapped, fn, *a, **k: fn(*a, **k)
    t.model_kwarg_keys, t._is_vlm = inspect.signature(student.forward).parameters.keys(), False
    return t


def trl_loss(student, teacher, batch, overrides, key=lambda name: name):
    """TRL's loss, the student's mean entropy over the counted positions, and every parameter's gradient."""
    trainer = bare_trainer(student, teacher, **overrides)
    ids, attention = torch.tensor(batch["input_ids"]), torch.tensor(batch["attention_mask"])
    completion_mask = torch.tensor(batch["completion_mask"])[:, PROMPT_LEN:]
    assert attention[:, :PROMPT_LEN].all() and torch.equal(attention[:, PROMPT_LEN:], completion_mask)
    inputs = {"prompt_ids": ids[:, :PROMPT_LEN], "prompt_mask": attention[:, :PROMPT_LEN],
              "completion_ids": ids[:, PROMPT_LEN:], "completion_mask": completion_mask}
    student.zero_grad()
    with exact_float64_divergence():
        loss, entropy_sum, n_valid = trainer._compute_loss(student, inputs, None)
        loss.backward()
    out = {"loss": loss.detach().reshape(1).to(F64), "entropy": (entropy_sum / n_valid).reshape(1).to(F64)}
    for n, p in student.named_parameters():
        if p.requires_grad:
            assert torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, f"{n}: gradient zero or not finite"
            out[f"grad.{key(n)}"] = p.grad.detach().to(F64).clone()
    for p in teacher.parameters():
        assert p.grad is None, "the teacher is forward only"
    return out


def make_family(name, root):
    d = os.path.join(root, name)
    with open(os.path.join(d, "grpo-batch.json")) as f:
        batch = json.load(f)
    with exact_float64_trl():
        student = AutoModelForCausalLM.from_pretrained(d, dtype=F64, attn_implementation="eager")
        teacher = AutoModelForCausalLM.from_pretrained(teacher_dir(root), dtype=F64, attn_implementation="eager")
    assert teacher.config.hidden_size != student.config.hidden_size
    assert teacher.config.vocab_size == student.config.vocab_size
    student.train()
    for p in teacher.parameters():
        p.requires_grad_(False)
    out = {}
    for variant, overrides in VARIANTS.items():
        got = trl_loss(student, teacher, batch, overrides)
        out.update({f"{variant}.{k}": v.contiguous() for k, v in got.items()})
        print(f"{name:7s} {variant:16s} loss {got['loss'].item():+.12f}  entropy {got['entropy'].item():.6f}")
    meta = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
            "batch": "grpo-batch.json", "teacher": "teacher", "variants": json.dumps(VARIANTS)}
    save_file(out, os.path.join(d, "distill.safetensors"), metadata=meta)

    # The student's PEFT adapter (tests/fixtures/<family>/lora): TRL's default divergence, the adapter's
    # gradients keyed as adapter_model.safetensors keys them.
    with exact_float64_trl():
        base = load_base(name, root, F64)
        student = PeftModel.from_pretrained(base, os.path.join(d, "lora"), is_trainable=True).to(F64)
    student.train()
    got = trl_loss(student, teacher, batch, VARIANTS["reverse_kl"], key=saved_key)
    print(f"{name:7s} reverse_kl (LoRA) loss {got['loss'].item():+.12f}")
    meta["peft"] = peft.__version__
    save_file({f"reverse_kl.{k}": v.contiguous() for k, v in got.items()},
              os.path.join(d, "lora", "distill.safetensors"), metadata=meta)


if __name__ == "__main__":
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    fixture_tools.run_families(__doc__, lambda name, root, _: make_family(name, root))
