"""Prefect tasks of colocated mode: engines and trainers take turns on the same GPUs.

Per iteration, after the rollout:
  to_trainer  engines release_memory_occupation(tags); trainer (and PPO critic) ranks reload their
              DeepSpeed states
  ... train ...
  to_engines("weights")  trainer ranks offload their states; engines resume their weights (the push
                         writes into them)
  ... push weights ...
  to_engines("rest")     engines resume kv_cache + cuda_graph: ready to generate
This is the order slime/miles use with SGLang (weights first, then the KV cache and CUDA graphs).
On CPU the embedded engine and the trainer implement these as state-checked no-ops.
"""
from __future__ import annotations

import time
from typing import Literal

import ray
from prefect import task
from prefect.cache_policies import NO_CACHE

from reflow.engines.rollout_client import EngineClient
from reflow.infra.cluster.runtime import get_runtime
from reflow.infra.config.schema import RunConfig
from reflow.tasks.evaluate import wait_for_eval_generation


def _each_engine(rt, call) -> None:
    for url in rt.engine_urls:  # a handful of engines: sequential keeps the failing one obvious
        call(EngineClient(url, timeout=120, api_key=rt.api_key))


@task(name="colocate-to-trainer", cache_policy=NO_CACHE)
def to_trainer(cfg: RunConfig) -> dict[str, float]:
    rt = get_runtime(cfg)
    wait_for_eval_generation(rt)  # an eval may still generate on the engines (tasks/evaluate.py)
    t0 = time.perf_counter()
    _each_engine(rt, lambda c: c.release_memory_occupation(list(cfg.cluster.release_tags)))
    critic = rt.critic.reload_states() if rt.critic is not None else []  # PPO: the critic takes turns too
    moves = ray.get(rt.trainers.reload_states())[0]["moves"]
    ray.get(critic)
    return {"time_engines_release": time.perf_counter() - t0, "trainer_state_moves": float(moves)}


@task(name="colocate-to-engines", cache_policy=NO_CACHE)
def to_engines(cfg: RunConfig, stage: Literal["weights", "rest"]) -> dict[str, float]:
    rt = get_runtime(cfg)
    t0 = time.perf_counter()
    tags = [t for t in cfg.cluster.release_tags if (t == "weights") == (stage == "weights")]
    if stage == "weights":
        ray.get(rt.trainers.offload_states() + (rt.critic.offload_states() if rt.critic is not None else []))
    if tags:
        _each_engine(rt, lambda c: c.resume_memory_occupation(tags))
    return {f"time_engines_resume_{stage}": time.perf_counter() - t0}


def hand_back_to_engines(cfg: RunConfig) -> list[list[str]]:
    """After a hand-over cut short (a trainer rank died between `to_trainer` and `to_engines`): every engine back to
    what a fresh one is, its released memory resumed and no weight-update session open (EngineClient.take_over;
    what is already so is skipped), as the run's start leaves them before its first push. Returns each engine's
    steps that changed something."""
    rt = get_runtime(cfg)
    return [EngineClient(url, timeout=120, api_key=rt.api_key).take_over(list(cfg.cluster.release_tags))
            for url in rt.engine_urls]
