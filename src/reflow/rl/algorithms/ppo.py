"""PPO with a learned critic: token-level GAE (`gae.py`) over the critic's values.

The critic itself (value model, its DeepSpeed ranks, `compute_values`) is engines/train/critic.py;
this module is what PPO adds to the loop: its config and `gae_batch`, the advantages of a batch
that already carries the critic's values (see docs/ALGORITHMS.md for alignment and departures).
"""
from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import Field

from reflow.rl.algorithms.base import AlgorithmBase, AlgorithmSpec, Stats
from reflow.rl.algorithms.gae import gae_advantages
from reflow.rl.algorithms.reinforce_pp import moments, whiten_from_moments
from reflow.rl.types import RolloutBatch


class PPOConfig(AlgorithmBase):
    type: Literal["ppo"] = "ppo"
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="GAE discount per response token.")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda (bias/variance trade-off of the advantage).")
    value_clip: float | None = Field(0.2, gt=0.0, description="Clip the critic's new value to old +- this in the value loss (PPO2-style); null disables.")


def gae_batch(batch: RolloutBatch, gamma: float, lam: float) -> tuple[RolloutBatch, Stats]:
    """Token-level GAE: reward = the sequence reward on the last response token (0 elsewhere);
    advantages [per token] whitened over all response tokens of the batch (as verl/OpenRLHF; not
    in the GAE paper), returns = A + V before whitening (the critic's targets). `advantages` per
    sample = its first response token's (whitened) advantage, for the rollout table."""
    if batch.values is None or batch.rewards is None:
        raise ValueError("gae_batch needs batch.rewards and batch.values (critic values) first")
    lengths = [len(r) for r in batch.response_ids]
    B, T = len(batch), max(lengths, default=0) or 1
    rewards, values, mask = torch.zeros(B, T), torch.zeros(B, T), torch.zeros(B, T)  # [B, T] response tokens
    for i, (n, v) in enumerate(zip(lengths, batch.values)):
        if n:
            values[i, :n] = torch.tensor(v, dtype=torch.float32)
            # Tool tokens (response_mask 0) are holes the recursion skips (gae.py); the reward sits on
            # the last response token, so on a trajectory ending in tool output it is carried back.
            mask[i, :n] = 1.0 if batch.response_mask is None else torch.tensor(batch.response_mask[i], dtype=torch.float32)
            rewards[i, _last_kept(mask[i, :n])] = batch.rewards[i]
    adv, ret = gae_advantages(rewards, values, mask, gamma, lam)  # [B, T]
    white = whiten_from_moments(adv, mask, moments(adv, mask))  # [B, T]
    if not bool(torch.isfinite(white).all()):
        raise FloatingPointError("GAE advantages contain NaN/inf; rewards were " + repr(batch.rewards[:16]))

    def rows(x: torch.Tensor) -> list[list[float]]:
        return [x[i, :n].tolist() for i, n in enumerate(lengths)]

    out = batch.with_(token_advantages=rows(white), returns=rows(ret),
                      advantages=[float(white[i, 0]) if n else 0.0 for i, n in enumerate(lengths)])
    return out, gae_stats(values, ret, white, mask)


def _last_kept(row: torch.Tensor) -> int:
    """Index of the last policy token of a response mask row (the last token when there is none)."""
    kept = (row != 0).nonzero()
    return int(kept[-1]) if len(kept) else len(row) - 1


def gae_stats(values: torch.Tensor, returns: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> Stats:
    """Token means, and explained variance 1 - Var(R - V) / Var(R) of the critic before its update."""
    m = mask != 0
    v, r = values[m].double(), returns[m].double()  # [N]
    if v.numel() == 0:
        return {"values_mean": 0.0, "returns_mean": 0.0, "explained_variance": 0.0, "adv_abs_mean": 0.0}
    var_r = float(r.var(unbiased=False))
    ev = 1.0 - float((r - v).var(unbiased=False)) / var_r if var_r > 0 else math.nan
    return {"values_mean": float(v.mean()), "returns_mean": float(r.mean()), "explained_variance": ev,
            "adv_abs_mean": float(adv[m].abs().mean())}


def _advantages(batch: RolloutBatch, cfg: Any) -> tuple[RolloutBatch, Stats]:
    return gae_batch(batch, cfg.gamma, cfg.lam)


SPEC = AlgorithmSpec(name="ppo", config=PPOConfig, advantages=_advantages, needs_critic=True)
