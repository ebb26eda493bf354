"""RLOO: REINFORCE with a leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024, eq. 5).

A_i = r_i - 1/(G-1) * sum_{j != i} r_j, which equals G/(G-1) * (r_i - mean(r_group)).
Sequence-level: one advantage per sample, broadcast over its tokens by the loss.
Departure: a group of one has no other sample to form a baseline; its advantage is 0 (no signal)
rather than undefined. All-equal groups give exactly 0 (the fp64 centring cancels exactly).
"""
from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from reflow.rl.algorithms.base import AlgorithmBase, AlgorithmSpec, sequence_level
from reflow.rl.algorithms.grpo import group_stats, out_dtype


def rloo_advantages(rewards: Tensor, group_index: Tensor) -> Tensor:
    """rewards [N], group_index [N] -> advantages [N]."""
    if rewards.numel() == 0:
        return rewards.clone()
    centred, _, count, flat = group_stats(rewards, group_index)  # [N] each
    adv = centred * count / (count - 1).clamp_min(1.0)  # [N]
    adv = torch.where(flat | (count < 2), torch.zeros_like(adv), adv)
    return adv.to(out_dtype(rewards))


class RLOOConfig(AlgorithmBase):
    type: Literal["rloo"] = "rloo"


def _estimate(rewards: Tensor, group_index: Tensor, lengths: Tensor, cfg: Any) -> Tensor:
    return rloo_advantages(rewards, group_index)


SPEC = AlgorithmSpec(name="rloo", config=RLOOConfig, advantages=sequence_level(_estimate))
