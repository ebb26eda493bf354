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
from engines.router import Router, SGLangRouter, sglang_router_available
from engines.sglang_engine import SGLangEngine
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
    # Where /generate goes: the engines themselves, or one router URL per engine (so a batch is
    # still cut into one shard per engine and the router balances the shards).
    generate_urls: list[str] = field(default_factory=list)
    router: Any = None  # Ray actor handle of the router, when rollout.router


_RUNTIMES: dict[str, Runtime] = {}


def _load_data(cfg: RunConfig, tokenizer) -> tuple[list[Prompt], list[Prompt]]:
    d = cfg.data
    train_rows, eval_rows = load_prompt_rows(d.task, d.path, d.prompt_key, d.label_key, d.seed,
                                             d.num_train, d.num_eval, d.digits)
    return (tokenize_prompts(train_rows, tokenizer, d.max_prompt_len),
            tokenize_prompts(eval_rows, tokenizer, d.max_prompt_len))


def _start_engines(cfg: RunConfig, namespace: str) -> list[Any]:
    """One named engine actor per engine; both backends answer url()/ready()/shutdown() and speak
    SGLang's HTTP API, so nothing after this point knows which one runs."""
    r = cfg.rollout
    if r.backend == "embedded":
        actor_cls, options = ray.remote(EmbeddedEngine), {"num_cpus": 1}
        kwargs = dict(threads=r.engine_threads, max_batch_size=r.max_batch_size)
    else:
        actor_cls, options = ray.remote(SGLangEngine), {"num_cpus": 1, "num_gpus": _engine_gpus(cfg)}
        kwargs = dict(tp_size=r.tp_size, mem_fraction_static=r.mem_fraction_static,
                      enable_memory_saver=cfg.cluster.colocate, seed=cfg.seed, startup_timeout_s=r.startup_timeout_s)
    return [actor_cls.options(name=f"engine-{i}", namespace=namespace, get_if_exists=True, **options)
            .remote(model_path=cfg.model.path, engine_id=f"engine-{i}", **kwargs)
            for i in range(r.num_engines)]


def _start_router(cfg: RunConfig, namespace: str, urls: list[str]) -> tuple[Any, list[str]]:
    """(router actor or None, the URLs /generate requests go to)."""
    if not cfg.rollout.router:
        return None, list(urls)
    actor_cls = ray.remote(SGLangRouter if sglang_router_available() else Router)
    router = actor_cls.options(name="router", namespace=namespace, num_cpus=0, get_if_exists=True).remote(urls)
    ray.get(router.ready.remote())
    return router, [ray.get(router.url.remote())] * len(urls)


def _engine_gpus(cfg: RunConfig) -> float:
    """GPUs Ray reserves per SGLang engine: its TP width, or a share of a trainer's GPU when colocated."""
    if not cfg.cluster.colocate:
        return float(cfg.rollout.tp_size)
    if cfg.rollout.tp_size != 1:
        raise NotImplementedError("cluster.colocate with rollout.tp_size > 1 needs placement-group bundles "
                                  "shared with the trainer ranks, which reflow does not build yet; use tp_size=1")
    return 0.2  # fractional: Ray lets the engine share the GPU a trainer rank holds


def _start_trainers(cfg: RunConfig, namespace: str) -> TrainerGroup:
    t, a = cfg.trainer, cfg.algorithm
    total = t.total_steps_hint or max(1, cfg.num_iterations * t.minibatches_per_iteration)
    ref = (cfg.model.ref_path or cfg.model.path) if a.needs_ref else None
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
    store = ExperimentStore.from_config(cfg.storage, cfg.experiment)
    store.write_text("config.yaml", dump_config(cfg))
    rt = Runtime(cfg=cfg, namespace=namespace, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                 train_prompts=train_prompts, eval_prompts=eval_prompts, trainers=trainers,
                 engines=engines, engine_urls=urls, store=store)
    rt.router, rt.generate_urls = _start_router(cfg, namespace, urls)
    if cfg.cluster.colocate:  # the engines generate first: the trainer starts with its states offloaded
        ray.get(trainers.offload_states())
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
    if rt.router is not None:
        ray.kill(rt.router)
    for e in rt.engines:
        try:
            ray.get(e.shutdown.remote(), timeout=10)
        finally:
            ray.kill(e)
