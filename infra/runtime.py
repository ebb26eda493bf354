"""The builder: turns a `RunConfig` into a live runtime (data, Ray actors, storage).

Config stops here: engines and trainers receive explicit arguments. A runtime is kept per
experiment in this process, so every task of every iteration flow run finds the same actors.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from engines.embedded_engine import EmbeddedEngine
from engines.hf_io import load_tokenizer, resolve_checkpoint
from engines.trainer_group import TrainerGroup
from infra.config import RunConfig, dump_config
from infra.ray_cluster import connect, namespace_for
from infra.storage import ExperimentStore
from rl.data import load_prompt_rows, tokenize_prompts
from rl.rewards import load_reward_fn
from rl.types import Prompt

log = logging.getLogger("reflow.runtime")


@dataclass
class Runtime:
    cfg: RunConfig
    namespace: str
    pad_id: int
    eos_id: int
    train_prompts: list[Prompt]
    eval_prompts: list[Prompt]
    trainers: TrainerGroup
    engines: list[Any]  # Ray actor handles
    engine_urls: list[str]
    store: ExperimentStore
    timings: dict[str, float] = field(default_factory=dict)


_RUNTIMES: dict[str, Runtime] = {}


def _load_data(cfg: RunConfig, tokenizer) -> tuple[list[Prompt], list[Prompt]]:
    d = cfg.data
    train_rows, eval_rows = load_prompt_rows(d.task, d.path, d.prompt_key, d.label_key, d.seed,
                                             d.num_train, d.num_eval, d.digits)
    return (tokenize_prompts(train_rows, tokenizer, d.max_prompt_len),
            tokenize_prompts(eval_rows, tokenizer, d.max_prompt_len))


def _start_engines(cfg: RunConfig, namespace: str) -> list[Any]:
    r = cfg.rollout
    if r.backend != "embedded":
        raise NotImplementedError("rollout.backend=sglang is not available yet; use rollout.backend=embedded")
    actor_cls = ray.remote(EmbeddedEngine)
    return [actor_cls.options(name=f"engine-{i}", namespace=namespace, num_cpus=1, get_if_exists=True)
            .remote(model_path=cfg.model.path, engine_id=f"engine-{i}", threads=r.engine_threads,
                    max_batch_size=r.max_batch_size)
            for i in range(r.num_engines)]


def _start_trainers(cfg: RunConfig, namespace: str) -> TrainerGroup:
    t, a = cfg.trainer, cfg.algorithm
    total = t.total_steps_hint or max(1, cfg.num_iterations * t.minibatches_per_iteration)
    ref = (cfg.model.ref_path or cfg.model.path) if a.kl_coef > 0 else None
    return TrainerGroup.create(
        num_ranks=t.num_ranks, namespace=namespace, name_prefix="policy", num_cpus_per_rank=1,
        model_path=cfg.model.path, zero_stage=t.zero_stage, precision=t.precision, lr=t.lr,
        lr_schedule=t.lr_schedule, warmup_steps=t.warmup_steps, total_steps=total,
        weight_decay=t.weight_decay, grad_clip=t.grad_clip, micro_batch_size=t.micro_batch_size,
        threads=t.threads_per_rank, seed=cfg.seed, ref_model_path=ref)


def build_runtime(cfg: RunConfig) -> Runtime:
    """Validate inputs first (checkpoint, data, reward fn), then start the actors."""
    t0 = time.perf_counter()
    resolve_checkpoint(cfg.model.path)  # a missing checkpoint fails here, before Ray starts
    load_reward_fn(cfg.data.reward_fn)
    tokenizer = load_tokenizer(cfg.model.path)
    train_prompts, eval_prompts = _load_data(cfg, tokenizer)
    namespace = namespace_for(cfg.cluster.namespace_prefix, cfg.experiment)
    log.info(connect(cfg.cluster.address, cfg.cluster.num_cpus, namespace))
    engines = _start_engines(cfg, namespace)
    trainers = _start_trainers(cfg, namespace)
    urls = ray.get([e.url.remote() for e in engines])
    ray.get([e.ready.remote() for e in engines])
    store = ExperimentStore.open(cfg.storage.root, cfg.experiment)
    store.write_text("config.yaml", dump_config(cfg))
    rt = Runtime(cfg=cfg, namespace=namespace, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                 train_prompts=train_prompts, eval_prompts=eval_prompts, trainers=trainers,
                 engines=engines, engine_urls=urls, store=store)
    rt.timings["startup"] = time.perf_counter() - t0
    log.info("runtime ready in %.1fs: %d engine(s) %s, %d trainer rank(s), %d train / %d eval prompts, storage %s",
             rt.timings["startup"], len(engines), urls, cfg.trainer.num_ranks, len(train_prompts),
             len(eval_prompts), store.url())
    return rt


def get_runtime(cfg: RunConfig) -> Runtime:
    rt = _RUNTIMES.get(cfg.experiment)
    if rt is None:
        rt = _RUNTIMES[cfg.experiment] = build_runtime(cfg)
    return rt


def shutdown_runtime(experiment: str) -> None:
    rt = _RUNTIMES.pop(experiment, None)
    if rt is None:
        return
    rt.trainers.kill()
    for e in rt.engines:
        try:
            ray.get(e.shutdown.remote(), timeout=10)
        finally:
            ray.kill(e)
