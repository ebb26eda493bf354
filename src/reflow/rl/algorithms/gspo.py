"""GSPO: sequence-level importance ratio (Zheng et al. 2025, "Group Sequence Policy Optimization").

s_i = (pi(y_i|x) / pi_old(y_i|x))^(1/|y_i|) = exp(mean_t log(pi_t / old_t))   (eq. 7)
J = E[1/G sum_i min(s_i A_i, clip(s_i, 1 - eps, 1 + eps) A_i)]                (eq. 5)

Advantages are GRPO's (group-normalised, sequence-level). We use the GSPO-token form (eq. 13-14):
log s_{i,t} = sg[log s_i] + log pi_t - sg[log pi_t], whose value is s_i at every token and whose
gradient with a sequence-level A_i equals GSPO's; the clipped PPO loss is then built on it as
usual. With loss_agg = seq-mean-token-mean this is exactly eq. 5; other aggregations weigh the
per-sequence terms differently (documented in docs/ALGORITHMS.md). Pure torch.
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from reflow.rl.algorithms import grpo
from reflow.rl.algorithms.base import AlgorithmBase, AlgorithmSpec


def gspo_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """logprobs, old_logprobs, mask [B, T] -> per-token log ratio [B, T] of GSPO-token (eq. 13).

    Sequences without response tokens get log ratio 0 (ratio 1); masked positions hold the row's
    value too but are ignored by every reduction.
    """
    m = mask != 0  # [B, T]
    diff = torch.where(m, logprobs - old_logprobs, torch.zeros_like(logprobs))  # [B, T]
    n = m.sum(-1, keepdim=True).clamp_min(1).to(logprobs.dtype)  # [B, 1]
    seq = diff.sum(-1, keepdim=True) / n  # [B, 1] mean token log-ratio = log s_i
    return seq.detach() + logprobs - logprobs.detach()  # [B, T]


class GSPOConfig(AlgorithmBase):
    type: Literal["gspo"] = "gspo"
    normalize_std: bool = Field(True, description="Divide by the group's reward std, as GRPO (False = Dr.GRPO's advantages).")


# GSPO changes the ratio, not the advantage: GRPO's estimator, on GSPO's config (its normalize_std).
SPEC = AlgorithmSpec(name="gspo", config=GSPOConfig, advantages=grpo.SPEC.advantages, ratio_level="sequence")
