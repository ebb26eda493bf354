"""Prefect tasks of the trainer side: train one iteration, push weights to the engines."""
from __future__ import annotations

import time

import ray
from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.config import RunConfig
from infra.runtime import get_runtime
from tasks.rollout import BatchRef


@task(name="train", cache_policy=NO_CACHE)
def train(cfg: RunConfig, batch: BatchRef) -> dict[str, float]:
    """PPO-clip update(s) on every trainer rank; every rank returns the same reduced metrics."""
    rt = get_runtime(cfg)
    a = cfg.algorithm
    refs = rt.trainers.train_iteration(
        batch.ref, minibatches=cfg.trainer.minibatches_per_iteration, temperature=cfg.rollout.temperature,
        clip_eps_low=a.clip_eps_low, clip_eps_high=a.clip_eps_high, kl_coef=a.kl_coef,
        kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef, loss_agg=a.loss_agg, pad_id=rt.pad_id,
        dual_clip_c=a.dual_clip_c, tis_cap=a.tis_cap, ratio_level="sequence" if a.type == "gspo" else "token",
        loss_norm_len=a.loss_norm_len or cfg.rollout.max_new_tokens, kl_in_reward=a.kl_in_reward)
    return ray.get(refs)[0]


@task(name="push-weights", cache_policy=NO_CACHE)
def push_weights(cfg: RunConfig, version: int) -> dict[str, float]:
    """Trainer -> every engine, inside a weight session, then verified against the engines."""
    rt = get_runtime(cfg)
    w = cfg.weight_sync
    t0 = time.perf_counter()
    results = ray.get(rt.trainers.push_weights(rt.engine_urls, str(version), w.bucket_mb << 20, w.verify,
                                               w.verify_sample, mode=w.mode, verify_atol=w.verify_atol,
                                               disk_dir=w.disk_dir, backend=w.backend))
    stats = next((r for r in results if r), {})
    return {"push_seconds": time.perf_counter() - t0,
            **{f"push_{k}": float(v) for k, v in stats.items() if isinstance(v, (int, float))}}
