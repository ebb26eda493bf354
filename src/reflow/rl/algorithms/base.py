"""What an algorithm is to the rest of reflow: a config (its own fields on top of the shared
policy-loss and rollout options, one pydantic model per `type`) and a spec saying what the loop
must do for it. Every other layer asks the spec (`cfg.algorithm.spec`), never the type's name.

`sequence_level` turns an estimator of one value per sample ([N] rewards -> [N] advantages) into the
batch-level `advantages` function of a spec: the rollout stage calls that on the whole batch.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import Tensor

from reflow.rl.registry import spec_problem
from reflow.rl.types import RolloutBatch

Stats = dict[str, float]
# (batch with rewards [and critic values], the algorithm's config) -> (batch with advantages, stats)
BatchAdvantages = Callable[[RolloutBatch, Any], tuple[RolloutBatch, Stats]]
# (trainer shard, config, all_reduce(tensor) summing over ranks in place) -> metrics; rewrites shard["advantages"]
TrainerAdvantages = Callable[[dict[str, Tensor], Any, Callable[[Tensor], Any]], Stats]


class StrictModel(BaseModel):
    """Unknown keys are errors (a typo never silently becomes a default); assignments are validated; every
    float is finite (`trainer.lr=1e999` read as inf, passed, and failed in training with three tracebacks)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class AlgorithmBase(StrictModel):
    """Options every algorithm has: the PPO-clip policy loss and DAPO's rollout-side tricks.
    Subclasses add a `type` literal and their own fields; docs/ALGORITHMS.md maps each to its paper."""

    type: str

    clip_eps_low: float = Field(0.2, ge=0.0, le=1.0, description="PPO clip: lower ratio bound is 1 - clip_eps_low.")
    clip_eps_high: float = Field(0.2, ge=0.0, le=10.0, description="PPO clip: upper ratio bound is 1 + clip_eps_high (DAPO clip-higher when > clip_eps_low).")
    dual_clip_c: float | None = Field(None, gt=1.0, description="Dual-clip PPO: cap the loss of negative-advantage tokens at -c*A (Ye et al. 2020); null disables.")
    kl_coef: float = Field(0.0, ge=0.0, description="Weight of the KL(policy || reference) term in the loss; 0 disables it.")
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = Field("low_var_kl", description="KL estimator (Schulman's k1/k2/k3; low_var_kl = k3 clamped to [-10, 10]), for the loss term and the reward penalty.")
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus weight.")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = Field("token-mean", description="How per-token losses are reduced (seq-mean-token-sum-norm = Dr.GRPO).")
    loss_norm_len: int | None = Field(None, ge=1, description="Constant length of seq-mean-token-sum-norm; default rollout.max_new_tokens.")
    tis_cap: float | None = Field(None, gt=0.0, description="Truncated importance sampling: weight tokens by min(exp(old - rollout logprob), tis_cap); null disables.")
    dynamic_sampling: bool = Field(False, description="DAPO dynamic sampling: drop groups whose rewards are all equal and generate more to keep the batch size.")
    max_sampling_rounds: int = Field(3, ge=1, description="Dynamic sampling: most generation rounds per iteration (the first included).")
    overlong_buffer: int = Field(0, ge=0, description="DAPO soft overlong punishment: penalise responses longer than max_new_tokens - this; 0 disables.")
    overlong_penalty: float = Field(1.0, ge=0.0, description="Overlong punishment at max_new_tokens (the penalty ramps linearly from 0 to -this over the buffer).")
    objective: str | None = Field(None, description="The policy objective the trainer minimises: one registered with reflow.rl.objectives.register_objective, or `package.module:Class` (a reflow.rl.objectives.PolicyObjective); null: the algorithm's own (ppo_clip, with its options above).")

    @field_validator("objective")
    @classmethod
    def _objective_named(cls, v: str | None) -> str | None:
        if v is not None and (why := spec_problem(v, "algorithm.objective", "policy objective")):
            raise ValueError(why)
        return v

    @model_validator(mode="before")
    @classmethod
    def _own_fields_only(cls, data: Any) -> Any:
        """A field of another algorithm type is refused with a message naming the type it belongs to."""
        if not isinstance(data, dict):
            return data
        owners = _owners()
        for key in sorted(set(data) - set(cls.model_fields)):
            if key in owners:
                raise ValueError(f"{key} is an option of algorithm.type={'/'.join(owners[key])}, not of "
                                 f"type={data.get('type', cls.model_fields['type'].default)}: remove it or change the type")
        return data

    @property
    def spec(self) -> AlgorithmSpec:
        from reflow.rl.algorithms import SPECS

        return SPECS[self.type]

    @property
    def kl_reward_coef(self) -> float:
        """Weight of a per-token KL penalty folded into the reward (REINFORCE++ only); 0 = none."""
        return 0.0

    @property
    def needs_ref(self) -> bool:
        """Whether the trainer needs a frozen reference model (a KL term in the loss or the reward)."""
        return self.kl_coef > 0 or self.kl_reward_coef > 0


@functools.cache
def _owners() -> dict[str, list[str]]:
    """{field: algorithm types that have it} over the fields not every type has (fixed once the
    registry exists, so computed once, not on every validation)."""
    from reflow.rl.algorithms import SPECS

    out: dict[str, list[str]] = {}
    for name, spec in SPECS.items():
        for f in set(spec.config.model_fields) - set(AlgorithmBase.model_fields):
            out.setdefault(f, []).append(name)
    return out


@dataclass(frozen=True)
class AlgorithmSpec:
    """What the loop does for one algorithm `type`."""

    name: str
    config: type[AlgorithmBase]
    # Computes the batch's advantages outside the trainer, after reward (and, with a critic, after
    # the critic's values): the rollout stage calls it on the whole batch.
    advantages: BatchAdvantages
    needs_critic: bool = False  # a value model: critic values before `advantages`, a critic update before the actor's
    ratio_level: Literal["token", "sequence"] = "token"  # importance ratio per token, or per sequence (GSPO)
    objective: str = "ppo_clip"  # what the trainer minimises: a name in reflow.rl.objectives.OBJECTIVES
    # Whether the config's kl_reward_coef > 0 can fold a per-token KL penalty into the reward; then
    # `advantages` leaves per-sequence scores and the trainer finishes them after its reference
    # pass with `finish_advantages` (it has the reference logprobs).
    kl_in_reward: bool = False
    finish_advantages: TrainerAdvantages | None = None


def sequence_level(estimate: Callable[[Tensor, Tensor, Tensor, Any], Tensor]) -> BatchAdvantages:
    """A batch-level `advantages` from `estimate(rewards [N], group_index [N], lengths [N], cfg) -> [N]`.

    Stats: `adv_abs_mean` and `groups_with_signal_frac` (groups whose rewards are not all equal).
    When the config folds KL into the reward the values are per-sequence scores, flagged in
    `extra["advantages_are_scores"]` for the trainer.
    """
    def advantages(batch: RolloutBatch, cfg: Any) -> tuple[RolloutBatch, Stats]:
        if batch.rewards is None:
            raise ValueError("advantages need batch.rewards: score the batch first")
        r = torch.tensor(batch.rewards, dtype=torch.float32)  # [N]
        g = torch.tensor(batch.group_index, dtype=torch.long)  # [N]
        lengths = torch.tensor(batch.policy_tokens(), dtype=torch.float32)  # [N] tool tokens not counted
        adv = estimate(r, g, lengths, cfg)  # [N]
        spread = sum(1 for k in range(batch.n_groups) if torch.unique(r[g == k]).numel() > 1)
        stats = {"adv_abs_mean": adv.abs().mean().item() if len(adv) else 0.0,
                 "groups_with_signal_frac": spread / max(batch.n_groups, 1)}
        if not all(math.isfinite(a) for a in adv.tolist()):
            raise FloatingPointError("advantages contain NaN/inf; rewards were " + repr(batch.rewards[:16]))
        extra = {**batch.extra, "advantages_are_scores": cfg.kl_reward_coef > 0}
        return batch.with_(advantages=adv.tolist(), extra=extra), stats

    return advantages
