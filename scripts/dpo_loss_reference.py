"""Reference values of TRL's DPO `loss_type` variants, for testing the Rust implementation.

TRL (>= 1.x) has no standalone `dpo_loss`: every loss type is computed inline in
`DPOTrainer._compute_loss`, right after the policy forward. This script calls that method itself,
on a bare `DPOTrainer.__new__(DPOTrainer)` with the attributes it reads, and a stub "model" whose
per-token log-probabilities sum to chosen values of `chosen_logps` / `rejected_logps` (leaf tensors,
float64). The reference log-probs come in through `inputs` (as with `precompute_ref_log_probs=True`).

For each loss type (and two weighted combinations) it prints JSON with the loss and
d(loss)/d(chosen_logps), d(loss)/d(rejected_logps) from torch.autograd. A sequence's log-prob
reaches the loss through one of its completion tokens (the others are fixed), so for `sft`, which
averages per-token log-probs, the gradient shown is that of one token: -1 / (chosen tokens in batch).

Run: .venv/bin/python scripts/dpo_loss_reference.py > fixture.json   (CPU; needs `pip install trl`)
"""

import json
import types
from collections import defaultdict

import torch
import trl
from trl import DPOConfig, DPOTrainer

BETA, LABEL_SMOOTHING = 0.1, 0.2
LOSS_TYPES = ["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"]
COMBINATIONS = [(["sigmoid", "sft"], [1.0, 1.0]), (["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0])]

# A batch of 4 pairs: rows 0..3 chosen, 4..7 rejected (TRL's layout). Prompt and completion lengths in tokens.
PROMPT_LENS = [3, 2, 4, 3, 3, 2, 4, 3]
COMPLETION_LENS = [5, 3, 7, 4, 6, 4, 3, 7]
SEQ_LEN = max(p + c for p, c in zip(PROMPT_LENS, COMPLETION_LENS)) + 1  # one column of right padding


def make_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = len(PROMPT_LENS)
    completion_mask = torch.zeros(rows, SEQ_LEN, dtype=torch.long)
    attention_mask = torch.zeros(rows, SEQ_LEN, dtype=torch.long)
    for i, (p, c) in enumerate(zip(PROMPT_LENS, COMPLETION_LENS)):
        completion_mask[i, p : p + c] = 1
        attention_mask[i, : p + c] = 1
    shift_mask = completion_mask[:, 1:].double()
    # Per-token policy log-probs of the completion tokens, and reference ones a little off them.
    tokens = -torch.rand(rows, SEQ_LEN - 1, generator=g, dtype=torch.float64) * 3.0 * shift_mask
    ref_tokens = (tokens + torch.randn(rows, SEQ_LEN - 1, generator=g, dtype=torch.float64) * 0.8) * shift_mask
    inputs = {
        "input_ids": torch.randint(5, 100, (rows, SEQ_LEN), generator=g) * attention_mask,
        "attention_mask": attention_mask,
        "completion_mask": completion_mask,
    }
    ref = ref_tokens.sum(1)
    inputs["ref_chosen_logps"], inputs["ref_rejected_logps"] = ref.chunk(2)
    return inputs, tokens


class StubModel:
    """Stands in for the policy: returns fixed per-token log-probs whose row sums are the leaf `logps`."""

    training = True

    def __init__(self, tokens, logps, shift_mask):
        last = torch.zeros_like(tokens)
        for i in range(tokens.size(0)):
            last[i, shift_mask[i].nonzero().max()] = 1.0  # the last completion token carries the gradient
        self.log_probs = tokens + last * (logps - tokens.sum(1)).unsqueeze(1)

    def __call__(self, input_ids, attention_mask, labels, fused_lm_head, use_cache):
        assert fused_lm_head and torch.equal(labels[:, 1:] != -100, self.log_probs != 0)
        zeros = torch.zeros_like(self.log_probs)
        return types.SimpleNamespace(log_probs=self.log_probs, entropy=zeros, mean_logits=zeros,
                                     is_top1=zeros.bool(), aux_loss=None)


def bare_trainer(loss_types, loss_weights=None, beta=BETA, label_smoothing=LABEL_SMOOTHING, model=None):
    """A DPOTrainer with only what `_compute_loss` reads (scripts/make_dpo_loss_fixtures.py uses it too)."""
    args = DPOConfig(output_dir="/tmp/dpo_loss_reference", loss_type=loss_types, loss_weights=loss_weights,
                     beta=beta, label_smoothing=label_smoothing, precompute_ref_log_probs=True, use_cpu=True,
                     report_to="none")
    t = DPOTrainer.__new__(DPOTrainer)  # the attributes `_compute_loss` reads, set as `__init__` sets them
    t.args, t.beta, t.precompute_ref_logps = args, args.beta, args.precompute_ref_log_probs
    t.loss_types, t.loss_weights = args.loss_type, args.loss_weights or [1.0] * len(args.loss_type)
    t.ld_alpha, t.label_smoothing, t.use_weighting = args.ld_alpha, args.label_smoothing, args.use_weighting
    t.f_divergence_type, t.f_alpha_divergence_coef = args.f_divergence_type, args.f_alpha_divergence_coef
    t.aux_loss_enabled, t._tp_size, t._total_train_tokens = False, 1, 0
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t.accelerator = types.SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x,
                                          gather_for_metrics=lambda x: x)
    t.model = model
    return t


def run(loss_types, loss_weights=None):
    inputs, tokens = make_batch()
    logps = tokens.sum(1).clone().requires_grad_(True)
    model = StubModel(tokens, logps, inputs["completion_mask"][:, 1:])
    trainer = bare_trainer(loss_types, loss_weights, model=model)
    loss = trainer._compute_loss(model, inputs, return_outputs=False)
    (grad,) = torch.autograd.grad(loss, logps)
    d_chosen, d_rejected = grad.chunk(2)
    return {"loss": loss.item(), "d_chosen_logps": d_chosen.tolist(), "d_rejected_logps": d_rejected.tolist()}


def main():
    inputs, tokens = make_batch()
    chosen, rejected = tokens.sum(1).chunk(2)
    n_chosen, n_rejected = torch.tensor(COMPLETION_LENS).chunk(2)
    out = {
        "trl_version": trl.__version__,
        "beta": BETA,
        "label_smoothing": LABEL_SMOOTHING,
        "discopop_tau": DPOConfig.discopop_tau,
        "chosen_logps": chosen.tolist(),
        "rejected_logps": rejected.tolist(),
        "ref_chosen_logps": inputs["ref_chosen_logps"].tolist(),
        "ref_rejected_logps": inputs["ref_rejected_logps"].tolist(),
        "chosen_completion_tokens": n_chosen.tolist(),
        # `sft` averages these per-token log-probs of the chosen completions (sequence i: its first n tokens)
        "chosen_token_logps": [row[m.bool()].tolist() for row, m in zip(tokens, inputs["completion_mask"][:4, 1:])],
        "rejected_completion_tokens": n_rejected.tolist(),
        "losses": {},
    }
    for loss_type in LOSS_TYPES:
        try:
            out["losses"][loss_type] = run([loss_type])
        except Exception as e:  # report, and go on with the others
            out["losses"][loss_type] = {"error": f"{type(e).__name__}: {e}"}
    for loss_types, weights in COMBINATIONS:
        out["losses"]["+".join(f"{w}*{t}" for t, w in zip(loss_types, weights))] = run(loss_types, weights)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
