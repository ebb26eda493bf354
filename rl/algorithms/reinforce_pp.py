"""REINFORCE++ and REINFORCE++-baseline (Hu et al. 2025, "REINFORCE++: A Simple and Efficient
Approach for Aligning Large Language Models", §3).

Token reward (eq. 2): r_t = 1[t = last] * r(x, y) - beta * KL_t, with KL_t a per-token estimate of
log pi / pi_ref; return G_t = sum_{s >= t} gamma^(s-t) r_s (gamma = 1 here, the paper's setting);
advantage = G_t whitened over every response token of the *global* batch (eq. 4, "global batch
normalisation"). The -baseline variant first subtracts the group's mean reward from r(x, y)
(the paper's REINFORCE++-baseline, §3.3), then whitens globally the same way.

Whitening is token-weighted with the unbiased variance: A = (G - mean) / sqrt(var + 1e-8) (as
verl's masked_whiten). Without KL in the reward every token of a sequence has the same return, so
the estimator is sequence-level ([N], whitened with each sample weighted by its token count);
with KL in the reward it is token-level ([B, T]) and the trainer computes it after its reference
pass (`kl_shaped_returns` + `whiten_from_moments`, moments all-reduced across ranks).
Departure: gamma is fixed at 1 (the paper's value); samples without tokens get advantage 0.
"""
from __future__ import annotations

import torch
from torch import Tensor

from reflow.rl.algorithms.grpo import group_stats, out_dtype

WHITEN_EPS = 1e-8


def reinforce_pp_scores(rewards: Tensor, group_index: Tensor, baseline: bool) -> Tensor:
    """Sequence scores before whitening [N]: r (REINFORCE++) or r - group mean (-baseline)."""
    if rewards.numel() == 0 or not baseline:
        return rewards.double().clone()
    centred, _, _, flat = group_stats(rewards, group_index)  # [N]
    return torch.where(flat, torch.zeros_like(centred), centred)  # exact 0 for all-equal groups


def moments(x: Tensor, weight: Tensor) -> Tensor:
    """(sum w, sum w x, sum w x^2) in fp64 — all-reduce these (SUM) to whiten over many ranks."""
    w, x = weight.double(), torch.where(weight != 0, x.double(), torch.zeros_like(x, dtype=torch.float64))
    return torch.stack([w.sum(), (w * x).sum(), (w * x.square()).sum()])  # [3]


def whiten_from_moments(x: Tensor, weight: Tensor, m: Tensor) -> Tensor:
    """(x - mean) / sqrt(var_unbiased + eps) with mean/var from `moments` [3]; 0 where weight == 0."""
    n, s, q = (float(v) for v in m)
    if n <= 0:
        return torch.zeros_like(x, dtype=torch.float32)
    mean = s / n
    var = max(q / n - mean * mean, 0.0) * (n / (n - 1) if n > 1 else 0.0)
    out = (x.double() - mean) / (var + WHITEN_EPS) ** 0.5
    return torch.where(weight != 0, out, torch.zeros_like(out)).float()


def reinforce_pp_advantages(rewards: Tensor, group_index: Tensor, lengths: Tensor, baseline: bool) -> Tensor:
    """Sequence-level REINFORCE++(-baseline) without KL in the reward.

    rewards [N], group_index [N], lengths [N] (response tokens) -> advantages [N], whitened over the
    batch's tokens (a sample counts once per token, as whitening the [B, T] returns would).
    """
    if rewards.numel() == 0:
        return rewards.clone()
    s = reinforce_pp_scores(rewards, group_index, baseline)  # [N]
    w = lengths.double()  # [N]
    return whiten_from_moments(s, w, moments(s, w)).to(out_dtype(rewards))


def kl_shaped_returns(scores: Tensor, kl: Tensor, mask: Tensor, kl_coef: float) -> Tensor:
    """Returns G_t with gamma = 1 of r_t = 1[t = last] score - kl_coef * KL_t.

    scores [B], kl [B, T] (per-token estimate), mask [B, T] -> [B, T], 0 where mask is 0.
    Since the score sits on the last response token, every response token's return includes it.
    """
    m = mask != 0  # [B, T]
    pen = torch.where(m, kl.double(), torch.zeros_like(kl, dtype=torch.float64))  # [B, T]
    future_kl = pen.flip(-1).cumsum(-1).flip(-1)  # [B, T] sum_{s >= t} KL_s
    g = scores.double().unsqueeze(-1) - kl_coef * future_kl  # [B, T]
    return torch.where(m, g, torch.zeros_like(g))
