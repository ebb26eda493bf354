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

from collections.abc import Callable
from typing import Any, Literal

import torch
from pydantic import Field
from torch import Tensor

from reflow.rl.algorithms.base import AlgorithmBase, AlgorithmSpec, Stats, sequence_level
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


class ReinforcePPConfig(AlgorithmBase):
    type: Literal["reinforce_pp"] = "reinforce_pp"
    kl_in_reward: float = Field(0.0, ge=0.0, description="Weight beta of the per-token KL penalty folded into the reward (estimated with kl_estimator between the old policy and the reference); 0 disables it.")

    @property
    def kl_reward_coef(self) -> float:
        return self.kl_in_reward


class ReinforcePPBaselineConfig(ReinforcePPConfig):
    type: Literal["reinforce_pp_baseline"] = "reinforce_pp_baseline"  # type: ignore[assignment]


def _estimator(baseline: bool) -> Callable[[Tensor, Tensor, Tensor, Any], Tensor]:
    def estimate(rewards: Tensor, group_index: Tensor, lengths: Tensor, cfg: Any) -> Tensor:
        """Whitened advantages [N]; with KL in the reward, the scores `finish_in_trainer` finishes."""
        if cfg.kl_reward_coef > 0:
            return reinforce_pp_scores(rewards, group_index, baseline).float()
        return reinforce_pp_advantages(rewards, group_index, lengths, baseline)

    return estimate


def finish_in_trainer(shard: dict[str, Tensor], cfg: Any, all_reduce: Callable[[Tensor], Any]) -> Stats:
    """Replace the per-sequence scores in `shard["advantages"]` [B] by token-level advantages
    [B, T-1]: returns of score - beta * KL_t (KL of the old policy against the reference, both in the
    shard after the trainer's logprob pass), whitened over the response tokens of *all* ranks
    (`all_reduce` sums the moments in place)."""
    from reflow.rl.losses import kl_estimate  # rl.losses imports this package (GSPO's ratio)

    mask = shard["loss_mask"]  # [B, T-1]
    kl = kl_estimate(shard["old_logprobs"], shard["ref_logprobs"], cfg.kl_estimator)  # [B, T-1]
    returns = kl_shaped_returns(shard["advantages"], kl, mask, cfg.kl_reward_coef)  # [B, T-1]
    m = torch.cat([moments(returns, mask), moments(kl, mask)[1:2]])  # [4]: n, sum, sum sq, kl sum
    all_reduce(m)
    shard["advantages"] = whiten_from_moments(returns, mask, m[:3])  # [B, T-1]
    return {"kl_in_reward_mean": float(m[3] / m[0]) if m[0] > 0 else 0.0}


SPEC = AlgorithmSpec(name="reinforce_pp", config=ReinforcePPConfig, advantages=sequence_level(_estimator(False)),
                     kl_in_reward=True, finish_advantages=finish_in_trainer)
BASELINE_SPEC = AlgorithmSpec(name="reinforce_pp_baseline", config=ReinforcePPBaselineConfig,
                              advantages=sequence_level(_estimator(True)), kl_in_reward=True,
                              finish_advantages=finish_in_trainer)
