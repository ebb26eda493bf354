"""Algorithms, one module each, chosen by `algorithm.type` (see docs/ALGORITHMS.md).

Each module exports a `SPEC` (`base.AlgorithmSpec`: its config class, its advantage function,
whether it needs a critic, token or sequence ratio, whether KL can go into the reward) and its
config class. `AlgorithmConfig` is the union of those configs, told apart by `type`, so an
option of another algorithm is refused by validation. The rest of reflow reads
`cfg.algorithm.spec`; nothing outside this package compares `algorithm.type` to a name.

Where advantages are computed: every spec's `advantages(batch, cfg)` runs in the rollout stage on
the whole batch (PPO's needs the critic's values, so it runs after the critic's pass); REINFORCE++
with KL in the reward leaves per-sequence scores there, which the trainer finishes with the spec's
`finish_advantages` after its reference pass.
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import Discriminator, Tag

from reflow.rl.algorithms import grpo, gspo, ppo, reinforce_pp, rloo
from reflow.rl.algorithms.base import AlgorithmBase, AlgorithmSpec
from reflow.rl.algorithms.grpo import GRPOConfig
from reflow.rl.algorithms.gspo import GSPOConfig
from reflow.rl.algorithms.ppo import PPOConfig
from reflow.rl.algorithms.reinforce_pp import ReinforcePPBaselineConfig, ReinforcePPConfig
from reflow.rl.algorithms.rloo import RLOOConfig

SPECS: dict[str, AlgorithmSpec] = {s.name: s for s in (grpo.SPEC, rloo.SPEC, reinforce_pp.SPEC,
                                                       reinforce_pp.BASELINE_SPEC, gspo.SPEC, ppo.SPEC)}
DEFAULT_TYPE = "grpo"


def _type_of(value: Any) -> str:
    """The `type` of a config dict (default grpo) or model. An unknown one is returned as is, and
    pydantic's error lists the known tags."""
    return str(value.get("type", DEFAULT_TYPE) if isinstance(value, dict) else getattr(value, "type", ""))


AlgorithmConfig = Annotated[
    Annotated[GRPOConfig, Tag("grpo")] | Annotated[RLOOConfig, Tag("rloo")]
    | Annotated[ReinforcePPConfig, Tag("reinforce_pp")]
    | Annotated[ReinforcePPBaselineConfig, Tag("reinforce_pp_baseline")]
    | Annotated[GSPOConfig, Tag("gspo")] | Annotated[PPOConfig, Tag("ppo")],
    Discriminator(_type_of),
]

__all__ = ["SPECS", "AlgorithmBase", "AlgorithmConfig", "AlgorithmSpec", "GRPOConfig", "GSPOConfig", "PPOConfig",
           "RLOOConfig", "ReinforcePPBaselineConfig", "ReinforcePPConfig", "algorithm_config"]


def algorithm_config(**fields: Any) -> AlgorithmBase:
    """The config of `fields["type"]` (default grpo), validated: for code and tests that build one."""
    kind = _type_of(fields)
    if kind not in SPECS:
        raise ValueError(f"unknown algorithm.type {kind!r}; expected one of {list(SPECS)}")
    return SPECS[kind].config(**fields)
