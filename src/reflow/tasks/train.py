"""Prefect tasks of the trainer side: train one iteration (PPO: critic values and critic update
too), push weights to the engines."""
from __future__ import annotations

import time

import ray
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from reflow.engines.rollout_client import EngineClient
from reflow.engines.train.critic import attach_values
from reflow.infra.cluster.runtime import ensure_engines, get_runtime
from reflow.infra.config.schema import RunConfig
from reflow.infra.config.settings import loss_settings, push_settings
from reflow.tasks.evaluate import wait_for_eval_generation
from reflow.tasks.faults import fault_point
from reflow.tasks.rollout import BatchRef
from reflow.tasks.state import run_state

_attach_values = ray.remote(num_cpus=0)(attach_values)


def start_update(cfg: RunConfig, batch: BatchRef) -> None:
    """Submit the policy update on `batch` now; the `train` task given the same batch waits for it
    instead of submitting another (an asynchronous run starts an update before its flow run: see
    tasks/rollout_source.RolloutSource.start_next). The ranks run calls in order, so nothing submitted
    after this (a checkpoint) sees the weights before it."""
    run_state(cfg).update_ahead = (batch.ref.hex(), _submit_update(cfg, batch))


def drop_started_update(cfg: RunConfig) -> None:
    """Forget an update submitted ahead (its trainer group was rebuilt, or the run ends without it)."""
    run_state(cfg).update_ahead = None


def _submit_update(cfg: RunConfig, batch: BatchRef) -> list:
    rt = get_runtime(cfg)
    return rt.trainers.train_iteration(batch.ref, minibatches=cfg.trainer.minibatches_per_iteration,
                                       pad_id=rt.pad_id, loss=loss_settings(cfg), algorithm=cfg.algorithm)


@task(name="train", cache_policy=NO_CACHE)
def train(cfg: RunConfig, batch: BatchRef) -> dict[str, float]:
    """PPO-clip update(s) on every trainer rank; every rank returns the same reduced metrics."""
    state = run_state(cfg)
    ahead, state.update_ahead = state.update_ahead, None
    if ahead is not None and ahead[0] != batch.ref.hex():  # the ranks would train twice in one iteration
        raise RuntimeError(f"iteration {batch.iteration}: an update on another batch was submitted ahead of this "
                           f"flow run; not training on both (a bug in the asynchronous loop: please report it)")
    refs = ahead[1] if ahead is not None else _submit_update(cfg, batch)
    t0 = time.perf_counter()
    ray.get(list(batch.saving))  # the scored rollouts are in storage before the update can crash (a re-run loads them)
    waited = time.perf_counter() - t0
    if batch.iteration is not None:  # tests: the driver dies while the ranks are mid-update
        fault_point("KILL_DURING_TRAIN", batch.iteration)
    return {**ray.get(refs)[0], "train_stage_records_wait_seconds": waited}


def actor_updates(cfg: RunConfig, iteration: int) -> bool:
    """False during the critic's warm-up (PPO): the first `critic.warmup_iterations` train the critic alone."""
    return not cfg.algorithm.spec.needs_critic or iteration >= cfg.critic.warmup_iterations


@task(name="critic-values", cache_policy=NO_CACHE)
def critic_values(cfg: RunConfig, batch: BatchRef) -> BatchRef:
    """PPO: V(s_t) of every response token from the critic ranks (before their update). Each rank's
    values go straight into a Ray task that merges them into the batch: nothing reaches the driver."""
    rt = get_runtime(cfg)
    ref = _attach_values.remote(batch.ref, *rt.critic.compute_values(batch.ref, pad_id=rt.pad_id))
    ray.wait([ref], fetch_local=False)
    return BatchRef(ref, dict(batch.stats), batch.iteration, batch.saving)


@task(name="train-critic", cache_policy=NO_CACHE)
def train_critic(cfg: RunConfig, batch: BatchRef) -> dict[str, float]:
    """PPO: clipped value-loss step(s) on the critic ranks towards the batch's GAE returns."""
    rt = get_runtime(cfg)
    refs = rt.critic.train_iteration(batch.ref, minibatches=cfg.trainer.minibatches_per_iteration,
                                     pad_id=rt.pad_id, clip_eps=cfg.algorithm.value_clip)  # a critic: PPO
    return ray.get(refs)[0]


@task(name="push-weights", cache_policy=NO_CACHE)
def push_weights(cfg: RunConfig, version: int) -> dict[str, float]:
    """Trainer -> every engine, inside a weight session, then verified against the engines. First
    waits for evals still generating on the engines' current weights (tasks/evaluate.py)."""
    rt = get_runtime(cfg)
    eval_wait = wait_for_eval_generation(rt)
    recreated = ensure_engines(cfg)  # an engine lost mid-rollout (the router finished its work) comes back here
    t0 = time.perf_counter()
    results = ray.get(rt.trainers.push_weights(rt.engine_urls, str(version), push_settings(cfg), api_key=rt.api_key))
    stats = next((r for r in results if r), {})
    return {"push_call_seconds": time.perf_counter() - t0, "push_eval_wait_seconds": eval_wait,
            "engines_recreated": float(len(recreated)),
            **{f"push_{k}": float(v) for k, v in stats.items() if isinstance(v, (int, float))}}


def engines_hold(rt, version: int) -> bool:
    """Whether every engine was reused from an earlier flow run and serves policy `version`."""

    names = [f"engine-{i}" for i in range(len(rt.engine_urls))]
    if not all(n in rt.reused for n in names):
        return False
    return all(EngineClient(u, timeout=30, api_key=rt.api_key).model_info().get("weight_version") == str(version)
               for u in rt.engine_urls)


@task(name="initial-push", cache_policy=NO_CACHE)
def initial_push(cfg: RunConfig, version: int, trainers_loaded: bool) -> dict[str, float]:
    """The loop's first push, skipped when the engines (and trainers) of the previous flow run of this
    experiment already hold policy `version`: nothing was reloaded and the engines report it."""
    rt = get_runtime(cfg)
    if not trainers_loaded and engines_hold(rt, version):
        get_run_logger().info("engines from the previous flow run already serve policy version %d: no push", version)
        return {"push_skipped": 1.0}
    return push_weights.fn(cfg, version)
