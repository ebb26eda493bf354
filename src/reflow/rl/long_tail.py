"""A random policy whose responses end at a chosen rate: the long tail benchmarks and tests need.

A randomly initialised model almost never samples eos, so every response runs to max_new_tokens and
a batch has no tail. `end_responses_early` points the eos row of the output head along the model's
mean final hidden state, so that eos gets a logit of about `logit` at every step: responses end at a
roughly constant rate, i.e. geometric lengths (p99 about 6.6x the median), whatever the model's size.
"""
from __future__ import annotations

import math

import torch


@torch.no_grad()
def end_responses_early(model, tokenizer, logit: float, texts: list[str] | None = None) -> None:
    """Set the eos row of `model`'s output head (in place) so that eos scores ~`logit` at the positions of `texts`."""
    _set_eos_row(model, tokenizer, _mean_hidden(model, tokenizer, texts or ["12+34=46", "5+6=11", "7+8=15", "40+2=42"]),
                 logit)


def _mean_hidden(model, tokenizer, texts: list[str]) -> torch.Tensor:
    """The model's final hidden state averaged over every position of `texts`, float32 [H]."""
    ids = tokenizer(texts, return_tensors="pt", padding=True)["input_ids"].to(next(model.parameters()).device)
    hidden = model.model(ids).last_hidden_state.float()  # [B, T, H]
    return hidden.reshape(-1, hidden.shape[-1]).mean(0)


def _set_eos_row(model, tokenizer, direction: torch.Tensor, logit: float) -> None:
    """The eos row of the output head along `direction`, scaled so that a hidden state equal to it scores `logit`."""
    row = model.get_output_embeddings().weight
    row[tokenizer.eos_token_id] = (direction * (logit / direction.dot(direction))).to(row.dtype)


@torch.no_grad()
def calibrate_end_rate(model, tokenizer, median: int, texts: list[str], sample_tokens: int = 256,
                       rows: int = 16, seed: int = 0) -> dict[str, float]:
    """Set the eos row (as `end_responses_early`) so that the model's own continuations of `texts` end at about
    ln2/`median` a token, i.e. geometric lengths of median ~`median`. The logit a fixed row gives eos drifts
    with the position (a random model's hidden states move away from those of the short texts), so the rate is
    measured where the samples are: `rows` continuations of `sample_tokens` tokens are sampled with eos
    suppressed, and the row's scale is bisected until eos's mean probability over their positions is the
    target. Returns {"target_rate", "rate"} (the mean probability reached on those positions)."""
    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    enc = tokenizer([texts[i % len(texts)] for i in range(rows)], return_tensors="pt", padding=True,
                    padding_side="left").to(device)
    gen_seed = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
    with gen_seed:
        torch.manual_seed(seed)
        seqs = model.generate(**enc, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                              max_new_tokens=sample_tokens, min_new_tokens=sample_tokens, suppress_tokens=[eos],
                              pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)
    mask = torch.cat([enc["attention_mask"], torch.ones_like(seqs[:, enc["input_ids"].shape[1]:])], dim=1)
    hidden = model.model(input_ids=seqs, attention_mask=mask).last_hidden_state.float()  # [R, T, H]
    hidden = hidden[:, enc["input_ids"].shape[1] - 1:-1].reshape(-1, hidden.shape[-1])  # the positions sampled at
    logits = model.get_output_embeddings()(hidden.to(model.dtype)).float()  # [R * new, V]
    logits[:, eos] = float("-inf")
    others = torch.logsumexp(logits, -1)  # [P]: the log-sum-exp every other token gives
    direction = _mean_hidden(model, tokenizer, texts)  # [H]
    unit = hidden @ direction / direction.dot(direction)  # [P]: eos's logit per unit of the row's scale
    target = math.log(2) / median

    def rate(scale: float) -> float:
        return torch.sigmoid(scale * unit - others).mean().item()

    lo, hi = -1e3, 1e3
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate(mid) < target else (lo, mid)
    scale = (lo + hi) / 2
    _set_eos_row(model, tokenizer, direction, scale)
    return {"target_rate": target, "rate": rate(scale)}
