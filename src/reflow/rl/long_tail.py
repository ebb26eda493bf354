"""A random policy whose responses end at a chosen rate: the long tail benchmarks and tests need.

A randomly initialised model almost never samples eos, so every response runs to max_new_tokens and
a batch has no tail. `end_responses_early` points the eos row of the output head along the model's
mean final hidden state, so that eos gets a logit of about `logit` at every step: responses end at a
roughly constant rate, i.e. geometric lengths (p99 about 6.6x the median), whatever the model's size.
"""
from __future__ import annotations

import torch


@torch.no_grad()
def end_responses_early(model, tokenizer, logit: float, texts: list[str] | None = None) -> None:
    """Set the eos row of `model`'s output head (in place) so that eos scores ~`logit` at the positions of `texts`."""
    texts = texts or ["12+34=46", "5+6=11", "7+8=15", "40+2=42"]
    device = next(model.parameters()).device
    ids = tokenizer(texts, return_tensors="pt", padding=True)["input_ids"].to(device)
    hidden = model.model(ids).last_hidden_state.float()  # [B, T, H]
    mean = hidden.reshape(-1, hidden.shape[-1]).mean(0)  # [H]
    row = model.get_output_embeddings().weight
    row[tokenizer.eos_token_id] = (mean * (logit / mean.dot(mean))).to(row.dtype)
