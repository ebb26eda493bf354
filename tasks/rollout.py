"""Prefect tasks of the rollout side: generate, reward, advantages, evaluate.

Thin wrappers: each submits a Ray remote function and returns a `BatchRef` (an ObjectRef plus
small stats) or a metrics dict. Batches never travel through Prefect results; `NO_CACHE`
because an ObjectRef is not a meaningful cache key.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import ray
from prefect import task
from prefect.cache_policies import NO_CACHE

from engines import rollout as ro
from infra.config import RunConfig
from infra.runtime import Runtime, get_runtime
from infra.storage import ExperimentStore
from rl.types import Prompt, RolloutBatch

_generate = ray.remote(num_cpus=0)(ro.generate)
_score = ray.remote(num_cpus=0, num_returns=2)(ro.score)
_advantages = ray.remote(num_cpus=0, num_returns=2)(ro.advantages)


@ray.remote(num_cpus=0)
def write_table(batch: RolloutBatch, store: ExperimentStore, rel: str) -> str:
    """Write a batch's per-sample table from inside Ray (the batch never reaches the driver)."""
    return store.write_parquet(rel, ro.rollout_table(batch))


@dataclass
class BatchRef:
    """A RolloutBatch that stays in the Ray object store, plus what the driver may look at."""

    ref: ray.ObjectRef
    stats: dict[str, float] = field(default_factory=dict)


def prompts_for_iteration(prompts: list[Prompt], seed: int, iteration: int, k: int) -> list[Prompt]:
    """The k prompts of `iteration`: a pure function of (seed, iteration), so retries and resumes
    take exactly the same prompts. Each epoch is a fresh seeded permutation of the dataset."""
    import torch

    n, out = len(prompts), []
    for pos in range(iteration * k, iteration * k + k):
        epoch, i = divmod(pos, n)
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        out.append(prompts[int(torch.randperm(n, generator=g)[i])])
    return out


def _sp(rt: Runtime, greedy: bool = False) -> dict:
    r = rt.cfg.rollout
    return ro.sampling_params(0.0 if greedy else r.temperature, 1.0 if greedy else r.top_p,
                              -1 if greedy else r.top_k, r.max_new_tokens, [rt.eos_id])


@task(name="generate", cache_policy=NO_CACHE)
def generate(cfg: RunConfig, iteration: int) -> BatchRef:
    rt = get_runtime(cfg)
    prompts = prompts_for_iteration(rt.train_prompts, cfg.data.seed, iteration, cfg.rollout.prompts_per_iteration)
    ref = _generate.remote(rt.engine_urls, prompts, _sp(rt), cfg.rollout.n_samples_per_prompt,
                           iteration, cfg.rollout.request_timeout_s)
    ray.wait([ref], fetch_local=False)
    return BatchRef(ref, {"prompts": len(prompts)})


@task(name="reward", cache_policy=NO_CACHE)
def reward(cfg: RunConfig, batch: BatchRef) -> BatchRef:
    ref, stats = _score.remote(batch.ref, cfg.data.reward_fn)
    return BatchRef(ref, {**batch.stats, **ray.get(stats)})


@task(name="advantages", cache_policy=NO_CACHE)
def advantages(cfg: RunConfig, batch: BatchRef) -> BatchRef:
    ref, stats = _advantages.remote(batch.ref, cfg.algorithm.normalize_std)
    return BatchRef(ref, {**batch.stats, **ray.get(stats)})


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate(cfg: RunConfig, iteration: int) -> dict[str, float]:
    """Greedy held-out accuracy: one greedy sample per eval prompt, scored by the reward fn."""
    rt = get_runtime(cfg)
    batch_ref = _generate.remote(rt.engine_urls, rt.eval_prompts, _sp(rt, greedy=True), 1, iteration,
                                 cfg.rollout.request_timeout_s)
    scored, stats = _score.remote(batch_ref, cfg.data.reward_fn)
    rel = f"{rt.store.iteration_dir(iteration)}/eval/heldout.parquet"
    stats, _ = ray.get([stats, write_table.remote(scored, rt.store, rel)])
    return {"eval_accuracy": stats["reward_mean"], "eval_response_len_mean": stats["response_len_mean"],
            "eval_samples": float(len(rt.eval_prompts))}
