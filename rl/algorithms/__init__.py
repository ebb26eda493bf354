"""Advantage estimators, one module each, chosen by `algorithm.type` (see docs/ALGORITHMS.md).

`sequence_advantages` is the single dispatch point the rollout stage calls: every estimator here
that works from sequence rewards returns one value per sample [N]. Token-level estimators run
where their inputs live: REINFORCE++ with KL in the reward needs reference logprobs, so the
trainer finishes it (`reinforce_pp.kl_shaped_returns`); GAE (`gae.py`, algorithm.type=ppo) needs the
critic's values, so `reflow.engines.train.critic.gae_batch` runs it after the critic's pass.
"""
from __future__ import annotations

from typing import Literal, get_args

from torch import Tensor

from reflow.rl.algorithms.grpo import grpo_advantages
from reflow.rl.algorithms.reinforce_pp import reinforce_pp_advantages, reinforce_pp_scores
from reflow.rl.algorithms.rloo import rloo_advantages

AlgorithmType = Literal["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo", "ppo"]
KL_IN_REWARD_TYPES = ("reinforce_pp", "reinforce_pp_baseline")
PPO_IS_TOKEN_LEVEL = ("algorithm.type=ppo is token-level: GAE over the critic's values "
                      "(reflow.engines.train.critic.gae_batch after the critic's pass), not a sequence-level estimator")


def sequence_advantages(kind: str, rewards: Tensor, group_index: Tensor, lengths: Tensor, *,
                        normalize_std: bool = True, kl_in_reward: bool = False) -> Tensor:
    """rewards [N], group_index [N], lengths [N] (response tokens) -> [N].

    With `kl_in_reward` (REINFORCE++ types only) the result is the per-sequence *score* that the
    trainer turns into token-level advantages after its reference pass, not an advantage.
    """
    if kind in ("grpo", "gspo"):  # GSPO changes the ratio, not the advantage
        return grpo_advantages(rewards, group_index, normalize_std=normalize_std)
    if kind == "rloo":
        return rloo_advantages(rewards, group_index)
    if kind in KL_IN_REWARD_TYPES:
        baseline = kind == "reinforce_pp_baseline"
        if kl_in_reward:
            return reinforce_pp_scores(rewards, group_index, baseline).float()
        return reinforce_pp_advantages(rewards, group_index, lengths, baseline)
    if kind == "ppo":
        raise ValueError(PPO_IS_TOKEN_LEVEL)
    raise ValueError(f"unknown algorithm.type {kind!r}; expected one of {get_args(AlgorithmType)}")
