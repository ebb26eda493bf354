"""Prefect tasks of the trainer side: train one iteration (PPO: critic values and critic update
too), push weights to the engines."""
from __future__ import annotations

import time

import ray
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from reflow.engines.train.critic import attach_values
from reflow.infra.config import RunConfig
from reflow.infra.runtime import ensure_engines, get_runtime
from reflow.tasks.evaluate import wait_for_eval_generation
from reflow.tasks.faults import fault_point
from reflow.tasks.rollout import BatchRef

_attach_values = ray.remote(num_cpus=0)(attach_values)


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
    if batch.iteration is not None:  # tests: the driver dies while the ranks are mid-update
        fault_point("KILL_DURING_TRAIN", batch.iteration)
    return ray.get(refs)[0]


def actor_updates(cfg: RunConfig, iteration: int) -> bool:
    """False during PPO's critic warm-up: the first `critic.warmup_iterations` train the critic alone."""
    return cfg.algorithm.type != "ppo" or iteration >= cfg.critic.warmup_iterations


@task(name="critic-values", cache_policy=NO_CACHE)
def critic_values(cfg: RunConfig, batch: BatchRef) -> BatchRef:
    """PPO: V(s_t) of every response token from the critic ranks (before their update). Each rank's
    values go straight into a Ray task that merges them into the batch: nothing reaches the driver."""
    rt = get_runtime(cfg)
    ref = _attach_values.remote(batch.ref, *rt.critic.compute_values(batch.ref, pad_id=rt.pad_id))
    ray.wait([ref], fetch_local=False)
    return BatchRef(ref, dict(batch.stats), batch.iteration)


@task(name="train-critic", cache_policy=NO_CACHE)
def train_critic(cfg: RunConfig, batch: BatchRef) -> dict[str, float]:
    """PPO: clipped value-loss step(s) on the critic ranks towards the batch's GAE returns."""
    rt = get_runtime(cfg)
    refs = rt.critic.train_iteration(batch.ref, minibatches=cfg.trainer.minibatches_per_iteration,
                                     pad_id=rt.pad_id, clip_eps=cfg.algorithm.value_clip)
    return ray.get(refs)[0]


@task(name="push-weights", cache_policy=NO_CACHE)
def push_weights(cfg: RunConfig, version: int) -> dict[str, float]:
    """Trainer -> every engine, inside a weight session, then verified against the engines. First
    waits for evals still generating on the engines' current weights (tasks/evaluate.py)."""
    rt = get_runtime(cfg)
    w = cfg.weight_sync
    eval_wait = wait_for_eval_generation(rt.namespace)
    recreated = ensure_engines(cfg)  # an engine lost mid-rollout (the router finished its work) comes back here
    t0 = time.perf_counter()
    results = ray.get(rt.trainers.push_weights(rt.engine_urls, str(version), w.bucket_mb << 20, w.verify,
                                               w.verify_sample, mode=w.mode, verify_atol=w.verify_atol,
                                               verify_rows=w.verify_rows,
                                               disk_dir=w.disk_dir, backend=w.backend))
    stats = next((r for r in results if r), {})
    return {"push_seconds": time.perf_counter() - t0, "push_eval_wait_seconds": eval_wait,
            "engines_recreated": float(len(recreated)),
            **{f"push_{k}": float(v) for k, v in stats.items() if isinstance(v, (int, float))}}


def engines_hold(rt, version: int) -> bool:
    """Whether every engine was reused from an earlier flow run and serves policy `version`."""
    from reflow.engines.rollout_client import EngineClient

    names = [f"engine-{i}" for i in range(len(rt.engine_urls))]
    if not all(n in rt.reused for n in names):
        return False
    return all(EngineClient(u, timeout=30).model_info().get("weight_version") == str(version) for u in rt.engine_urls)


@task(name="initial-push", cache_policy=NO_CACHE)
def initial_push(cfg: RunConfig, version: int, trainers_loaded: bool) -> dict[str, float]:
    """The loop's first push, skipped when the engines (and trainers) of the previous flow run of this
    experiment already hold policy `version`: nothing was reloaded and the engines report it."""
    rt = get_runtime(cfg)
    if not trainers_loaded and engines_hold(rt, version):
        get_run_logger().info("engines from the previous flow run already serve policy version %d: no push", version)
        return {"push_skipped": 1.0}
    return push_weights.fn(cfg, version)
