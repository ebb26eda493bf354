"""Re-export of the advantage estimators, which now live one per module under `rl/algorithms/`.

Kept so `from rl.advantages import grpo_advantages` keeps working.
"""
from __future__ import annotations

from rl.algorithms import sequence_advantages
from rl.algorithms.gae import gae_advantages
from rl.algorithms.grpo import grpo_advantages
from rl.algorithms.reinforce_pp import reinforce_pp_advantages
from rl.algorithms.rloo import rloo_advantages

__all__ = ["gae_advantages", "grpo_advantages", "reinforce_pp_advantages", "rloo_advantages",
           "sequence_advantages"]
