"""GRPO group-relative advantages (Shao et al. 2024, DeepSeekMath §4.1.2, outcome supervision).

Each sample's advantage is its reward relative to the other responses to the same prompt:
A_i = (r_i - mean(r_group)) / (std(r_group) + eps). With `normalize_std=False` the division is
dropped (Dr.GRPO, Liu et al. 2025 §3.1, eq. 3's A_i = R_i - mean(R)), which removes the bias toward
easy/hard prompts.

Choice of std: the *unbiased* (Bessel-corrected, n-1) sample std, i.e. `torch.std`'s default,
which is what verl and TRL compute, so advantages here match those references number for number.
The paper does not specify. Departures: a group of size 1 and a group whose rewards are all
equal get advantage exactly 0 (no signal), never NaN and never eps-amplified rounding noise.
"""
from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field
from torch import Tensor

from reflow.rl.algorithms.base import AlgorithmBase, AlgorithmSpec, sequence_level


def group_stats(rewards: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-sample (centred = r - group mean, unbiased group std, group size, flat) — all [N], fp64.

    `flat` is True where the sample's group has all-equal rewards (including groups of one).
    """
    r = rewards.double()  # [N] fp64 so group means of equal rewards cancel exactly
    _, g = torch.unique(group_index, return_inverse=True)  # [N] dense ids 0..K-1
    k = int(g.max()) + 1
    count = torch.bincount(g, minlength=k).double()  # [K]
    mean = torch.zeros(k, dtype=r.dtype).index_add_(0, g, r) / count  # [K]
    centred = r - mean[g]  # [N]
    sq = torch.zeros(k, dtype=r.dtype).index_add_(0, g, centred.square())  # [K]
    std = torch.sqrt(sq / (count - 1).clamp_min(1.0))  # [K] unbiased; size-1 groups are flat anyway
    gmax = torch.full((k,), -torch.inf, dtype=r.dtype).scatter_reduce_(0, g, r, "amax")  # [K]
    gmin = torch.full((k,), torch.inf, dtype=r.dtype).scatter_reduce_(0, g, r, "amin")  # [K]
    flat = (gmax == gmin)[g]  # [N]
    return centred, std[g], count[g], flat


def out_dtype(rewards: Tensor) -> torch.dtype:
    return rewards.dtype if rewards.is_floating_point() else torch.float32


def grpo_advantages(rewards: Tensor, group_index: Tensor, normalize_std: bool = True,
                    eps: float = 1e-6) -> Tensor:
    """rewards [N] float, group_index [N] long (any ids; equal id = same prompt) -> advantages [N]."""
    if rewards.numel() == 0:
        return rewards.clone()
    centred, std, _, flat = group_stats(rewards, group_index)  # [N] each
    adv = centred / (std + eps) if normalize_std else centred  # [N]
    adv = torch.where(flat, torch.zeros_like(adv), adv)
    return adv.to(out_dtype(rewards))


class GRPOConfig(AlgorithmBase):
    type: Literal["grpo"] = "grpo"
    normalize_std: bool = Field(True, description="Divide by the group's reward std (False = Dr.GRPO).")


def _estimate(rewards: Tensor, group_index: Tensor, lengths: Tensor, cfg: Any) -> Tensor:
    return grpo_advantages(rewards, group_index, normalize_std=cfg.normalize_std)


SPEC = AlgorithmSpec(name="grpo", config=GRPOConfig, advantages=sequence_level(_estimate))
