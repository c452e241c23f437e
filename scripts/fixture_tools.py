"""What the fixture scripts share: the families, their command line, and the check of TRL's numbers
against the same numbers recomputed by hand from the formulas."""
import argparse
import os

import torch

FAMILIES = ["qwen2", "qwen3", "llama3", "gemma3"]


def run_families(doc, make_family):
    """`[--fixtures DIR] [--only FAMILY ...]`: calls `make_family(name, fixtures_dir, index)` for each."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures"))
    ap.add_argument("--only", nargs="*", default=FAMILIES)
    args = ap.parse_args()
    for name in args.only:
        make_family(name, args.fixtures, FAMILIES.index(name))


def compare(name, variant, got, want, loss_tolerance, grad_tolerance, nonzero=True):
    """TRL's values and gradients (`got`) against a recomputation (`want`), same keys: values within
    `loss_tolerance` (relative, floor 1), every gradient finite (and not all zero when `nonzero`) and
    within `grad_tolerance` of the larger maximum. Returns the worst value and gradient errors."""
    worst_value, worst_grad = 0.0, 0.0
    assert set(got) == set(want), set(got) ^ set(want)
    for k in got:
        if k.startswith("grad."):
            g = got[k]
            assert torch.isfinite(g).all(), f"{name} {variant}: {k} is not finite"
            assert not nonzero or g.abs().max() > 0, f"{name} {variant}: {k} is all zero"
            scale = max(g.abs().max().item(), want[k].abs().max().item())
            err = 0.0 if scale == 0 else (g - want[k]).abs().max().item() / scale
            worst_grad = max(worst_grad, err)
        else:
            err = ((got[k] - want[k]).abs() / want[k].abs().clamp(min=1.0)).max().item()
            assert err < loss_tolerance, f"{name} {variant}: {k} TRL {got[k].item()} by hand {want[k].item()}"
            worst_value = max(worst_value, err)
    assert worst_grad < grad_tolerance, f"{name} {variant}: gradients differ by {worst_grad}"
    return worst_value, worst_grad


def logged_and_grads(trainer, metrics, model, key=lambda name: name):
    """A bare TRL trainer's last logged value of each of `metrics` it logged (float64 [1], '/' written '_'),
    and the gradient of every trainable parameter of `model` as `grad.<key(name)>`, each asserted finite and
    not all zero."""
    out = {}
    logged = trainer._metrics["train"]
    out.update({m.replace("/", "_"): torch.tensor([logged[m][-1]], dtype=torch.float64) for m in metrics if m in logged})
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, f"{n}: gradient zero or not finite"
            out[f"grad.{key(n)}"] = p.grad.detach().to(torch.float64).clone()
    return out
