#!/usr/bin/env python3
"""Tiny random Hugging Face models of each family, with float64 reference outputs from transformers.

Writes tests/fixtures/<case>/{config.json, model.safetensors, reference.safetensors, meta.json}.
The Rust tests compare against these, so CI needs no Python. See docs/fixtures.md.

Exactness: even with `model.double()`, transformers computes RMSNorm, rotary tables and the eager
softmax in float32. `exact_float64()` promotes those casts to float64 while the reference is built and
run, and `check_finite_differences` checks the resulting gradients against central differences.

Usage: python scripts/make_fixtures.py [--out tests/fixtures]
"""
import argparse
import contextlib
import json
import os

import torch
import transformers
from safetensors.torch import save_file
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

F32, F64 = torch.float32, torch.float64
_TO = torch.Tensor.to  # the unpatched cast, for rounding weights to float32 inside exact_float64()


@contextlib.contextmanager
def exact_float64():
    """Turns every float32 cast inside transformers into float64 (and the default dtype too)."""
    orig_float, orig_to = torch.Tensor.float, torch.Tensor.to
    orig_arange, orig_softmax = torch.arange, torch.nn.functional.softmax
    orig_default = torch.get_default_dtype()

    def promote(x):
        return F64 if x is F32 else x

    def to(self, *args, **kwargs):
        args = tuple(promote(a) for a in args)
        if "dtype" in kwargs:
            kwargs["dtype"] = promote(kwargs["dtype"])
        return orig_to(self, *args, **kwargs)

    def arange(*args, **kwargs):
        if "dtype" in kwargs:
            kwargs["dtype"] = promote(kwargs["dtype"])
        return orig_arange(*args, **kwargs)

    def softmax(*args, **kwargs):
        if "dtype" in kwargs:
            kwargs["dtype"] = promote(kwargs["dtype"])
        return orig_softmax(*args, **kwargs)

    torch.Tensor.float = lambda self, *a, **k: orig_to(self, F64)
    torch.Tensor.to = to
    torch.arange = arange
    torch.nn.functional.softmax = softmax
    torch.set_default_dtype(F64)
    try:
        yield
    finally:
        torch.Tensor.float, torch.Tensor.to = orig_float, orig_to
        torch.arange, torch.nn.functional.softmax = orig_arange, orig_softmax
        torch.set_default_dtype(orig_default)


COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    attn_implementation="eager",
)

# Each case exercises what its family's real checkpoints do, plus the awkward parts of our engine.
CASES = {
    # Bias on q/k/v, GQA 4:2, untied head.
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, dict(num_hidden_layers=2, tie_word_embeddings=False)),
    # q/k norms, head_dim (16) != hidden/heads (8), tied embeddings like Qwen3-0.6B.
    "qwen3": (
        Qwen3ForCausalLM,
        Qwen3Config,
        dict(num_hidden_layers=2, head_dim=16, tie_word_embeddings=True),
    ),
    # llama3 rope scaling with a short original context so that it changes most frequencies at the test
    # length; tied embeddings like Llama-3.2-1B.
    "llama3": (
        LlamaForCausalLM,
        LlamaConfig,
        dict(
            num_hidden_layers=2,
            head_dim=16,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    # Sliding window 4 < T on two local layers, one global layer with linear rope scaling, MQA, a
    # query_pre_attn_scalar that differs from head_dim, and the final logit soft-cap.
    "gemma3": (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        dict(
            num_hidden_layers=3,
            num_key_value_heads=1,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=4,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1000000.0),
                "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
            },
            final_logit_softcapping=3.0,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
        ),
    ),
}

BATCH, SEQ = 3, 11
LENGTHS = [11, 7, 9]  # right-padded rows


def randomize(model, family, gen):
    """Non-trivial weights, exactly representable in float32 (the checkpoint is stored in float32)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                base = 0.0 if family == "gemma3" else 1.0
                v = base + 0.2 * torch.randn(p.shape, generator=gen, dtype=F64)
            elif name.endswith("bias"):
                v = 0.1 * torch.randn(p.shape, generator=gen, dtype=F64)
            else:
                v = torch.randn(p.shape, generator=gen, dtype=F64) / p.shape[-1] ** 0.5
                if "embed_tokens" in name:
                    v = v * 2.0
            p.copy_(_TO(_TO(v, F32), F64))


def batch(gen, vocab):
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    mask = torch.zeros(BATCH, SEQ, dtype=torch.int64)
    for r, n in enumerate(LENGTHS):
        mask[r, :n] = 1
    ids = ids * mask  # pad id 0 (any id works: padded keys are masked)
    # id 0 as a real token too: Gemma3's pad_token_id, whose embedding row transformers' lookup gives no
    # gradient (nn.Embedding's padding_idx); an ordinary token for the other families.
    ids[0, 4] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[0, :3] = -100  # a prompt that is not trained on
    return ids, mask, labels


def sft_loss(logits, labels):
    """transformers' causal-LM loss: shift, ignore -100, mean over the batch's target tokens."""
    shift_logits = logits[:, :-1, :].reshape(-1, logits.shape[-1])
    shift_labels = labels[:, 1:].reshape(-1)
    return torch.nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="mean")


def token_logps(logits, ids):
    """log p(ids[t]) from logits[t-1]: [B, T-1], aligned with positions 1..T-1."""
    logp = torch.log_softmax(logits[:, :-1, :], dim=-1)
    return logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def pad_rows(rows, t, fill):
    return torch.stack([torch.cat([r, torch.full((t - len(r),), fill, dtype=r.dtype)]) for r in rows])


SFT_WEIGHT = 0.5


def dpo_case(model, vocab, gen):
    """Two pairs with unequal chosen/rejected lengths and a shared prompt that is not trained on."""
    prompt = torch.randint(0, vocab, (3,), generator=gen)
    lengths = {"chosen": [9, 6], "rejected": [7, 10]}
    out, seqs = {}, {}
    for side, lens in lengths.items():
        rows = [torch.cat([prompt, torch.randint(0, vocab, (n - 3,), generator=gen)]) for n in lens]
        t = max(lens)
        ids = pad_rows(rows, t, 0)
        mask = pad_rows([torch.ones(n, dtype=torch.int64) for n in lens], t, 0)
        labels = ids.clone()
        labels[mask == 0] = -100
        labels[:, :3] = -100
        out[f"{side}_input_ids"], out[f"{side}_attention_mask"], out[f"{side}_labels"] = ids, mask, labels
    ref_chosen = -20.0 + 2.0 * torch.randn(2, generator=gen, dtype=F64)
    ref_rejected = -20.0 + 2.0 * torch.randn(2, generator=gen, dtype=F64)
    beta = 0.1

    def seq_logps(side):
        ids, mask, labels = out[f"{side}_input_ids"], out[f"{side}_attention_mask"], out[f"{side}_labels"]
        logits = model(input_ids=ids, attention_mask=mask).logits
        tok = token_logps(logits, ids)
        return (tok * (labels[:, 1:] != -100)).sum(-1)

    model.zero_grad()
    pc, pr = seq_logps("chosen"), seq_logps("rejected")
    chosen_logratios, rejected_logratios = pc - ref_chosen, pr - ref_rejected
    loss = -torch.nn.functional.logsigmoid(beta * (chosen_logratios - rejected_logratios)).mean()
    loss.backward()
    batch = {"objective": "dpo", **{k: v.tolist() for k, v in out.items()},
             "ref_chosen_logps": ref_chosen.tolist(), "ref_rejected_logps": ref_rejected.tolist(), "beta": beta}
    chosen_rewards, rejected_rewards = beta * chosen_logratios.detach(), beta * rejected_logratios.detach()
    tensors = {
        "dpo.loss": loss.detach().reshape(1),
        "dpo.rewards_chosen": chosen_rewards.mean().reshape(1),
        "dpo.rewards_rejected": rejected_rewards.mean().reshape(1),
        "dpo.accuracy": (chosen_rewards > rejected_rewards).to(F64).mean().reshape(1),
    }
    tensors.update({f"dpo.grad.{n}": p.grad.detach().clone() for n, p in model.named_parameters()})

    # TRL's loss_type=["sigmoid", "sft"] with loss_weights=[1, SFT_WEIGHT]: plus the mean token NLL of the
    # chosen completions (`-chosen_per_token_logps[chosen_mask].mean()`).
    model.zero_grad()
    ids, mask, labels = out["chosen_input_ids"], out["chosen_attention_mask"], out["chosen_labels"]
    chosen_tok = token_logps(model(input_ids=ids, attention_mask=mask).logits, ids)
    nll = -chosen_tok[labels[:, 1:] != -100].mean()
    pc, pr = seq_logps("chosen"), seq_logps("rejected")
    sigmoid = -torch.nn.functional.logsigmoid(beta * ((pc - ref_chosen) - (pr - ref_rejected))).mean()
    loss = sigmoid + SFT_WEIGHT * nll
    loss.backward()
    tensors["dpo_sft.loss"] = loss.detach().reshape(1)
    tensors["dpo_sft.nll"] = nll.detach().reshape(1)
    tensors.update({f"dpo_sft.grad.{n}": p.grad.detach().clone() for n, p in model.named_parameters()})
    return batch, tensors


GRPO_TEMPERATURE = 0.7
CISPO_EPSILON_HIGH = 1.2
MASKED_ROW = 1


def grpo_case(model, vocab, gen):
    """A group of 4 completions of one prompt, padded, with old log-probs that make some ratios clip."""
    prompt_len, completion_lens = 4, [5, 3, 6, 2]
    t = prompt_len + max(completion_lens)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=gen)
    rows = [torch.cat([prompt, torch.randint(0, vocab, (n,), generator=gen)]) for n in completion_lens]
    ids = pad_rows(rows, t, 0)
    attention_mask = pad_rows([torch.ones(prompt_len + n, dtype=torch.int64) for n in completion_lens], t, 0)
    completion_mask = torch.zeros_like(ids)
    for i, n in enumerate(completion_lens):
        completion_mask[i, prompt_len:prompt_len + n] = 1
    advantages = torch.tensor([1.0, -0.5, 0.8, -1.3], dtype=F64)
    with torch.no_grad():
        current = token_logps(model(input_ids=ids, attention_mask=attention_mask).logits, ids)
    mask = completion_mask[:, 1:].to(F64)
    old = (current + 0.3 * torch.randn(current.shape, generator=gen, dtype=F64)) * mask
    ref = (current + 0.2 * torch.randn(current.shape, generator=gen, dtype=F64)) * mask
    beta, eps, max_completion_length = 0.04, 0.2, 8

    def trl_loss(loss_type, old_logps, beta, temperature=1.0, bias_correction_kl=True, num_items=None,
                 eps_high=eps, sapo_pos=1.0, sapo_neg=1.05, masked_row=None):
        """TRL 1.16's GRPOTrainer._compute_loss (token-level importance sampling, one process, one
        accumulation step: `num_items` stands for the global batch's completion tokens)."""
        mask = completion_mask[:, 1:].to(F64)
        if masked_row is not None:  # mask_truncated_completions: that completion leaves the loss
            mask = mask.clone()
            mask[masked_row] = 0
        # TRL's _get_per_token_logps_and_entropies: logits / temperature, then the log-softmax.
        logits = model(input_ids=ids, attention_mask=attention_mask).logits / temperature
        per_token_logps = token_logps(logits, ids)
        old_per_token_logps = per_token_logps.detach() if old_logps is None else old_logps
        coef_1 = torch.exp(per_token_logps - old_per_token_logps)
        adv = advantages.unsqueeze(1)
        kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        if bias_correction_kl:
            kl = kl * coef_1
        if loss_type == "cispo":
            clamped = torch.clamp(coef_1, max=eps_high).detach()
            per_token_loss = -clamped * adv * per_token_logps
        elif loss_type == "sapo":
            temps = torch.where(adv > 0, sapo_pos, sapo_neg)
            per_token_loss = -(torch.sigmoid(temps * (coef_1 - 1)) * 4 / temps) * adv
        else:
            coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps_high)
            per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
        if beta != 0.0:
            per_token_loss = per_token_loss + beta * kl
        if loss_type in ("grpo", "sapo"):
            loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        elif loss_type == "bnpo":
            loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
        elif loss_type == "dr_grpo":
            loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
        else:  # dapo, cispo
            loss = (per_token_loss * mask).sum() / max(num_items or mask.sum().item(), 1.0)
        if loss_type == "cispo":
            clipped = (coef_1 > eps_high) & (adv > 0)
        else:
            clipped = ((coef_1 < 1 - eps) & (adv < 0)) | ((coef_1 > 1 + eps_high) & (adv > 0))
        clip_ratio = (clipped.to(F64) * mask).sum() / mask.sum()
        mean_kl = (kl * mask).sum() / mask.sum()
        return loss, clip_ratio.detach(), mean_kl.detach()

    def aligned(x):  # [B, T-1] for positions 1.. -> [B, T] aligned with input_ids
        return torch.cat([torch.zeros(x.shape[0], 1, dtype=F64), x], dim=1).tolist()

    batch = {"objective": "grpo", "input_ids": ids.tolist(), "attention_mask": attention_mask.tolist(),
             "completion_mask": completion_mask.tolist(), "advantages": advantages.tolist(),
             "old_logps": aligned(old), "ref_logps": aligned(ref), "beta": beta, "epsilon": eps,
             "max_completion_length": max_completion_length}
    tensors = {}
    tokens = mask.sum().item()
    # name -> (loss type, old log-probs, beta, extra arguments); the tests make the same batch edits.
    variants = {
        "grpo": ("grpo", old, beta, {}),
        "bnpo": ("bnpo", old, beta, {}),
        "dr_grpo": ("dr_grpo", old, beta, {}),
        # dapo's normaliser is the whole global batch's tokens: as if this were a third of it (not
        # half: 2 x 16 tokens would equal dr_grpo's 4 completions x 8 and hide a swapped normaliser).
        "dapo": ("dapo", old, beta, {"num_items": 3 * tokens}),
        "cispo": ("cispo", old, beta, {"eps_high": CISPO_EPSILON_HIGH}),
        "sapo": ("sapo", old, beta, {}),
        "plain_kl": ("grpo", old, beta, {"bias_correction_kl": False}),
        "noold": ("grpo", None, 0.0, {}),
        # Sampled at temperature 0.7: the policy's log-probs at 0.7 too (the batch's old and
        # reference log-probs are given as they are).
        "temperature": ("grpo", old, beta, {"temperature": GRPO_TEMPERATURE}),
        # A truncated completion masked out (mask_truncated_completions): its row counts in grpo's
        # mean over sequences with nothing in it.
        "masked_row": ("grpo", old, beta, {"masked_row": MASKED_ROW}),
    }
    for name, (loss_type, old_logps, b, extra) in variants.items():
        model.zero_grad()
        loss, clip_ratio, mean_kl = trl_loss(loss_type, old_logps, b, **extra)
        loss.backward()
        tensors[f"grpo.{name}.loss"] = loss.detach().reshape(1)
        tensors[f"grpo.{name}.clip_ratio"] = clip_ratio.reshape(1)
        tensors[f"grpo.{name}.kl"] = mean_kl.reshape(1)
        tensors.update({f"grpo.{name}.grad.{n}": p.grad.detach().clone() for n, p in model.named_parameters()})
    assert tensors["grpo.grpo.clip_ratio"].item() > 0, "the fixture should make some ratios clip"
    return batch, tensors


def check_finite_differences(model, ids, mask, labels, gen, probes=8, eps=1e-4):
    """Central differences of the SFT loss against autograd on a few entries of a few parameters."""
    params = dict(model.named_parameters())
    names = sorted(params)
    worst = 0.0
    for i in range(probes):
        name = names[(i * 7 + 3) % len(names)]
        p = params[name]
        idx = tuple(int(torch.randint(0, s, (1,), generator=gen)) for s in p.shape)
        with torch.no_grad():
            orig = p[idx].item()
            p[idx] = orig + eps
            up = sft_loss(model(input_ids=ids, attention_mask=mask).logits, labels).item()
            p[idx] = orig - eps
            down = sft_loss(model(input_ids=ids, attention_mask=mask).logits, labels).item()
            p[idx] = orig
        fd = (up - down) / (2 * eps)
        an = p.grad[idx].item()
        # Truncation error is O(eps²); roundoff is ~1e-16/eps absolute, hence the floor.
        err = abs(fd - an) / max(abs(an), 1e-3)
        worst = max(worst, err)
    return worst


def make_case(name, out_root, seed):
    model_cls, config_cls, extra = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    with exact_float64():
        config = config_cls(**{**COMMON, **extra})
        model = model_cls(config).to(F64).eval()
        randomize(model, name, gen)
        ids, mask, labels = batch(gen, config.vocab_size)
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = sft_loss(logits, labels)
        model.zero_grad()
        loss.backward()
        fd_err = check_finite_differences(model, ids, mask, labels, gen)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        dpo_batch, dpo_tensors = dpo_case(model, config.vocab_size, gen)
        grpo_batch, grpo_tensors = grpo_case(model, config.vocab_size, gen)

    # transformers as users run it (float32 casts in place), for the f32 tolerance of our tests.
    model32 = model_cls(config).to(F32).eval()
    model32.load_state_dict({k: v.to(F32) for k, v in model.state_dict().items()}, strict=False)
    with torch.no_grad():
        logits32 = model32(input_ids=ids, attention_mask=mask).logits.to(F64)
    valid = mask.bool()
    ref = logits.detach()
    hf32_err = ((logits32 - ref).abs()[valid].max() / ref.abs()[valid].max()).item()

    out = os.path.join(out_root, name)
    os.makedirs(out, exist_ok=True)
    model32.save_pretrained(out, safe_serialization=True)
    for extra_file in ("generation_config.json",):
        path = os.path.join(out, extra_file)
        if os.path.exists(path):
            os.remove(path)
    tensors = {
        "input_ids": ids.to(torch.int64),
        "attention_mask": mask.to(torch.int64),
        "labels": labels.to(torch.int64),
        "logits": ref.contiguous(),
        "loss": loss.detach().reshape(1),
    }
    tensors.update({f"grad.{n}": g.contiguous() for n, g in grads.items()})
    tensors.update({k: v.contiguous() for k, v in {**dpo_tensors, **grpo_tensors}.items()})
    save_file(tensors, os.path.join(out, "reference.safetensors"))
    for file_name, batch_json in (("dpo-batch.json", dpo_batch), ("grpo-batch.json", grpo_batch)):
        with open(os.path.join(out, file_name), "w") as f:
            json.dump(batch_json, f)
    meta = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "seed": seed,
        "lengths": LENGTHS,
        "hf_float32_max_rel_err": hf32_err,
        "finite_difference_max_rel_err": fd_err,
    }
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    print(f"{name}: loss {loss.item():.6f}, hf f32 err {hf32_err:.2e}, finite-difference err {fd_err:.2e}")
    assert fd_err < 1e-6, f"{name}: float64 reference disagrees with finite differences ({fd_err})"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures"))
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    for i, name in enumerate(CASES):
        if args.only and name not in args.only:
            continue
        make_case(name, args.out, seed=1234 + i)


if __name__ == "__main__":
    main()
