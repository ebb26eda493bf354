"""The policy's training objective of one micro-batch: the `PolicyObjective` interface and its registry.

An objective turns the trainer's per-token tensors of one micro-batch into its loss (reduced with
`LossSettings.loss_agg`) and its metrics; the trainer only weighs the micro-batches into the global
mini-batch, scales the loss for gradient accumulation and data parallelism, and combines the metrics
as the objective declares (`means`, `token_means`, `maxima`, `minima`). Each algorithm spec names
its objective (`AlgorithmSpec.objective`); `algorithm.objective` (a registered name or
`package.module:Class`) overrides it. One of one's own:

    from reflow.rl.objectives import PolicyObjective, register_objective

    class ReinforceLoss(PolicyObjective):
        means = ("pg_loss",)
        def loss(self, t, hp):
            pg = aggregate(-t.advantages[:, None] * t.logprobs, t.mask, hp.loss_agg, hp.loss_norm_len)
            return pg, {"pg_loss": pg.detach()}

    register_objective("reinforce", ReinforceLoss)   # or algorithm.objective: my_project.rl:ReinforceLoss

Built on the driver (`build_objective`) and sent whole to the trainer ranks: it must pickle, and its
module must import there.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from reflow.rl.losses import aggregate, kl_estimate, policy_loss
from reflow.rl.registry import Registry

if TYPE_CHECKING:
    from reflow.rl.losses import LossSettings


@dataclass(frozen=True)
class PolicyTerms:
    """One micro-batch as an objective sees it. T positions, already cut to the scored columns."""

    logprobs: Tensor  # [b, T] of the policy being trained (carries the gradient)
    old_logprobs: Tensor  # [b, T] of the policy that is the ratio's denominator (detached)
    advantages: Tensor  # [b] per sequence or [b, T] per token
    mask: Tensor  # [b, T] 1 on response tokens trained on
    entropy: Tensor  # [b, T] of softmax(logits / temperature) (carries the gradient)
    ref_logprobs: Tensor | None  # [b, T] of the reference model, when LossSettings.kl_coef > 0
    is_weights: Tensor | None  # [b, T] truncated importance weights (LossSettings.tis_cap), detached


class PolicyObjective(ABC):
    """Loss and metrics of one micro-batch. The trainer reports `loss` itself (the returned loss, combined
    like `means`); every name the class lists must be in the metrics `loss` returns (scalar tensors)."""

    # Combined like the loss: each micro-batch weighed by its share of the mini-batch, mini-batches averaged.
    means: ClassVar[tuple[str, ...]] = ()
    # Per-token means over every response token of the step (weighed by the micro-batch's tokens).
    token_means: ClassVar[tuple[str, ...]] = ()
    # Extremes over the micro-batches that have response tokens, {name: value reported when none has}.
    maxima: ClassVar[Mapping[str, float]] = {}
    minima: ClassVar[Mapping[str, float]] = {}

    @abstractmethod
    def loss(self, t: PolicyTerms, hp: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
        """(this micro-batch's loss [] reduced over its tokens with hp.loss_agg / hp.loss_norm_len, metrics)."""

    def metric_names(self) -> tuple[str, ...]:
        return (*self.means, *self.token_means, *self.maxima, *self.minima)


@dataclass(frozen=True)
class PPOClip(PolicyObjective):
    """PPO-clip (`reflow.rl.losses.policy_loss`: clip-higher, dual clip, TIS weights, GSPO's sequence ratio
    by hp.ratio_level) + kl_coef * KL(policy || reference) - entropy_coef * entropy, each reduced with
    hp.loss_agg. Without an entropy bonus the entropy is a metric only (no gradient is asked for)."""

    means: ClassVar[tuple[str, ...]] = ("pg_loss", "kl", "entropy")
    token_means: ClassVar[tuple[str, ...]] = ("clip_frac", "ratio_mean", "approx_kl")
    maxima: ClassVar[Mapping[str, float]] = {"ratio_max": 1.0}
    minima: ClassVar[Mapping[str, float]] = {"ratio_min": 1.0}

    def loss(self, t: PolicyTerms, hp: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
        agg, norm_len = hp.loss_agg, hp.loss_norm_len
        pg, pm = policy_loss(t.logprobs, t.old_logprobs, t.advantages, t.mask, hp.clip_eps_low, hp.clip_eps_high,
                             agg, norm_len=norm_len, dual_clip_c=hp.dual_clip_c, is_weights=t.is_weights,
                             ratio_level=hp.ratio_level)
        if hp.kl_coef > 0:
            assert t.ref_logprobs is not None, "kl_coef > 0 needs the reference model's logprobs"
            kl = aggregate(kl_estimate(t.logprobs, t.ref_logprobs, hp.kl_estimator), t.mask, agg, norm_len)
        else:
            kl = torch.zeros(())
        ent = aggregate(t.entropy if hp.entropy_coef > 0 else t.entropy.detach(), t.mask, agg, norm_len)
        total = pg + hp.kl_coef * kl - hp.entropy_coef * ent
        return total, {"pg_loss": pg.detach(), "kl": kl.detach(), "entropy": ent.detach(), **pm}


ObjectiveFactory = Callable[[], PolicyObjective]
OBJECTIVES: Registry[ObjectiveFactory] = Registry(
    "policy objective", "subclass reflow.rl.objectives.PolicyObjective and name it in algorithm.objective as "
                        "'package.module:Class', or register it with reflow.rl.objectives.register_objective")


def register_objective(name: str, factory: ObjectiveFactory) -> ObjectiveFactory:
    """Make an objective choosable by name (`algorithm.objective`, `AlgorithmSpec.objective`); `factory()`
    builds it (a PolicyObjective subclass whose __init__ takes no argument is one)."""
    return OBJECTIVES.register(name, factory)


register_objective("ppo_clip", PPOClip)


def build_objective(name: str, field: str = "algorithm.objective") -> PolicyObjective:
    """The objective registered as `name`, or `package.module:Class`'s, built; errors name `field`."""
    built = OBJECTIVES.resolve(name, field)()
    if not isinstance(built, PolicyObjective):  # deliberate: a user's factory is checked once, here
        raise ValueError(f"{field}={name!r} built a {type(built).__name__}, not a "
                         f"reflow.rl.objectives.PolicyObjective: subclass it and implement loss(terms, settings)")
    return built
