"""Each estimator path (and the DAPO rollout options, and PPO with its critic) runs 2 iterations of a
tiny demo end to end on real Ray + DeepSpeed + Prefect without NaN or error. One trainer rank, one
engine, tiny batches."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from reflow.infra.config.schema import load_config

pytestmark = pytest.mark.slow

# Through the flow, one case per distinct path: rloo (driver-side advantages, TIS cap), reinforce_pp (KL in
# the reward, advantages finished in the trainer), dapo (dynamic sampling rounds, overlong penalty), ppo (a
# critic's ranks). GRPO itself runs in tests/test_e2e.py. Dr. GRPO's aggregation, GSPO's sequence ratio and
# REINFORCE++-baseline's whitening add no flow path: a real DeepSpeed rank checks them against a
# single-process reference (tests/test_algorithms_trainer.py) and tests/test_algorithms.py their math.
CASES = {
    "rloo": ["algorithm.type=rloo", "algorithm.loss_agg=seq-mean-token-sum", "algorithm.tis_cap=2"],
    "reinforce_pp": ["algorithm.type=reinforce_pp", "algorithm.kl_in_reward=0.01", "algorithm.kl_estimator=k1"],
    "dapo": ["algorithm.type=grpo", "algorithm.clip_eps_high=0.28", "algorithm.dual_clip_c=3",
             "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=3", "algorithm.overlong_buffer=2",
             "algorithm.overlong_penalty=0.5"],
    # The critic trains alone in iteration 0 (warm-up), then critic and policy; value clipping on.
    "ppo": ["algorithm.type=ppo", "critic.warmup_iterations=1", "algorithm.value_clip=0.2", "critic.lr=1e-3"],
}
METRICS = ["reward_mean", "loss", "pg_loss", "kl", "entropy", "grad_norm", "clip_frac", "ratio_mean",
           "tis_weight_mean", "adv_abs_mean"]
PPO_METRICS = ["value_loss", "value_clip_frac", "values_mean", "returns_mean", "critic_grad_norm", "explained_variance",
               "adv_abs_mean"]


def _config(policy, tmp_path, name, extra):
    return load_config(None, [
        f"experiment=algo-{name}", f"model.path={policy}", "num_iterations=2", "eval.before_train=false",
        "data.num_train=64", "data.num_eval=8", "rollout.prompts_per_iteration=4", "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=4", "trainer.num_ranks=1", "trainer.micro_batch_size=16", "trainer.lr=1e-3",
        "weight_sync.verify=sample", f"storage.root=file://{tmp_path}/runs", *extra])


@pytest.mark.parametrize("name", list(CASES))
def test_estimator_two_iterations(ray_cluster, prefect_server, tiny_policy, tmp_path, name, request):
    from reflow.flows.train import train

    if name == "ppo":  # the run test_ppo resumes (conftest's ppo_run): made once for both
        tmp_path, summary = request.getfixturevalue("ppo_run")
    else:
        summary = train(_config(tiny_policy, tmp_path, name, CASES[name]))
    assert summary["iterations"] == 2
    for i, m in enumerate(summary["history"]):
        warmup = name == "ppo" and i == 0  # the policy does not update during the critic's warm-up
        keys = (PPO_METRICS if name == "ppo" else []) + ([] if warmup else METRICS)
        for key in keys:
            assert key in m and math.isfinite(m[key]), f"{name} iteration {i}: {key}={m.get(key)}"
        if warmup:
            assert "pg_loss" not in m and "grad_norm" not in m
        if name == "reinforce_pp":
            assert math.isfinite(m["kl_in_reward_mean"])
        if name == "dapo":
            assert 1 <= m["sampling_rounds"] <= 3 and "overlong_penalty_mean" in m
        df = pd.read_parquet(tmp_path / "runs" / f"algo-{name}" / "iterations" / f"{i:06d}" / "rollouts.parquet")
        assert len(df) == 16 and df.advantage.map(math.isfinite).all()
