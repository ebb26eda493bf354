"""The builder: turns a `RunConfig` into a live runtime (data, Ray actors, storage).

Config stops here: engines and trainers receive explicit arguments. A runtime is kept per
experiment in this process, so every task of every iteration flow run finds the same actors.
Only the start steps build one (`start_runtime`, `start_eval_runtime`, called by the tasks in
reflow.tasks.cluster); every other caller uses `get_runtime`, which fails when none was started.

Engines and router answer only requests that carry the runtime's API key (a bearer token,
reflow.engines.http_serve). The key is made here, one per runtime, and handed to the actors as
an argument; a later flow run that reuses detached actors asks them for it over Ray
(`runtime_api_key`). It lives in memory only: never logged, in a config, or a Prefect parameter.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Any

import ray

from reflow.engines import ray_nodes
from reflow.engines import rollout_stages as ro
from reflow.engines.embedded.engine import EmbeddedEngine
from reflow.engines.gc_freeze import freeze_actor
from reflow.engines.hf_io import load_tokenizer, model_bytes, resolve_checkpoint
from reflow.engines.http_serve import new_api_key
from reflow.engines.rollout_client import EngineClient
from reflow.engines.sglang.launcher import SGLangEngine, sglang_dtype
from reflow.engines.sglang.router import Router, SGLangRouter, sglang_router_available
from reflow.engines.storage_access import StorageAccess
from reflow.engines.train.critic import CriticGroup
from reflow.engines.train.group import TrainerGroup, TrainerInitError
from reflow.engines.train.settings import Precision, weights_precision
from reflow.infra.cluster import actors, placement
from reflow.infra.cluster.ray_connect import attached_to_running_cluster, connect_for, namespace_for
from reflow.infra.config.schema import RunConfig, dump_config
from reflow.infra.config.settings import (
    critic_rank_settings,
    policy_rank_settings,
    push_settings,
    resolve_precision,
    storage_access,
)
from reflow.infra.inputs.eval_sets import EvalSet, load_eval_sets
from reflow.infra.inputs.prompts import load_prompts
from reflow.infra.store import checkpoint as ckpt
from reflow.infra.store.storage import ExperimentStore
from reflow.rl.rewards import load_reward_fn
from reflow.rl.types import Prompt

log = logging.getLogger("reflow.runtime")


@dataclass
class Runtime:
    cfg: RunConfig
    namespace: str
    pad_id: int
    eos_id: int
    train_prompts: list[Prompt]
    eval_prompts: list[Prompt]
    trainers: TrainerGroup | None  # None in an eval-only runtime (`start_eval_runtime`)
    engines: list[Any]  # Ray actor handles
    engine_urls: list[str]
    store: ExperimentStore
    timings: dict[str, float] = field(default_factory=dict)
    # Where /generate goes: the engines themselves, or one router URL per engine (so a batch is
    # still cut into one shard per engine and the router balances the shards).
    generate_urls: list[str] = field(default_factory=list)
    router: Any = None  # Ray actor handle of the router, when rollout.router
    eval_sets: list[EvalSet] = field(default_factory=list)  # infra/inputs/eval_sets.py, loaded before Ray starts
    # On a long-lived cluster (RAY_ADDRESS) the actors are detached and outlive this process; a
    # later flow run reuses them. `reused`: names of actors an earlier flow run had created.
    persistent: bool = False
    actor_ids: dict[str, str] = field(default_factory=dict)
    reused: list[str] = field(default_factory=list)
    placement: Any = None  # colocated mode's placement group (infra/cluster/placement.py)
    critic: Any = None  # reflow.engines.train.critic.CriticGroup when the algorithm needs a critic
    api_key: str = field(default="", repr=False)  # engines' and router's bearer token (`runtime_api_key`)
    # eval generations the engines still serve: a push or a hand-over waits for them (tasks/evaluate.py)
    eval_generating: list[Any] = field(default_factory=list)


_RUNTIMES: dict[str, Runtime] = {}
# experiment -> (its config as dumped, the runtime being built ahead of the flow: begin_runtime)
_AHEAD: dict[str, tuple[str, Future]] = {}


def model_source(cfg: RunConfig) -> tuple[StorageAccess, dict | None]:
    """How model.path is loaded, on the driver and in every engine: through the run's storage access
    and, when it is a checkpoint's model/ folder, checked against that checkpoint's manifest entries
    (reflow.engines.hf_io.resolve_checkpoint; infra/checkpoint.model_files)."""
    store = ExperimentStore.from_config(cfg.storage, cfg.experiment)
    return storage_access(cfg), ckpt.model_files(cfg.model.path, store)


def runtime_api_key(namespace: str, num_engines: int, timeout_s: float = 30.0) -> str:
    """The API key of `namespace`'s serving actors: the one a router or engine left by an earlier flow
    run holds (they were all made with it, and ones recreated now get it too), else a fresh one.
    Asked over Ray, the trusted channel; never written anywhere."""
    for name in ["router"] + [f"engine-{i}" for i in range(num_engines)]:
        try:
            actor = ray.get_actor(name, namespace=namespace)
        except ValueError:  # deliberate: no such actor (yet)
            continue
        try:
            return ray.get(actor.api_key.remote(), timeout=timeout_s)
        except (ray.exceptions.RayError, AttributeError):  # deliberate: a dead or hung actor is recreated later
            continue
    return new_api_key()


_POLICY_PARAMS: dict[str, int] = {}  # model.path -> its parameters (run_precision asks at every rank and engine built)


def _policy_params(cfg: RunConfig) -> int:
    """model.path's parameter count from its safetensors headers, once per path, in the folder the run loads the
    policy from (model_source: a checkpoint's model/ folder in object storage is the same cached download, not a
    second one under its listing's key)."""
    path = cfg.model.path
    if path not in _POLICY_PARAMS:
        _POLICY_PARAMS[path] = model_bytes(str(resolve_checkpoint(path, *model_source(cfg))))[0]
    return _POLICY_PARAMS[path]


def run_precision(cfg: RunConfig, gpu: bool) -> tuple[Precision, bool]:
    """(precision, tf32) of this run's ranks and engines: trainer.precision=auto decided by the policy's size on GPUs
    (infra/config/settings.resolve_precision), its parameters counted from model.path's safetensors headers once."""
    return resolve_precision(cfg.trainer, gpu, lambda: _policy_params(cfg))


def engine_dtype(cfg: RunConfig, gpu: bool) -> str:
    """What an engine computes in: on a GPU the dtype the trainer holds its weights in, so pushes land unchanged
    (bf16; fp32, and bf16-mixed's fp32 weights); on CPU fp32."""
    return weights_precision(run_precision(cfg, gpu)[0]) if gpu else "fp32"


def decode_fusion(cfg: RunConfig, gpu: bool) -> str | None:
    """The torch.compile backend of an embedded engine's fused decode step (rollout.decode_fusion), None for eager
    kernels: inductor on a GPU (1.19-1.25x the eager step's tokens/s at batch 256 on the 1.5B shape, ~1.4 s more
    warm-up: bench/RESULTS.md 42), none on CPU, where the engine decodes eagerly."""
    return "inductor" if gpu and cfg.rollout.decode_fusion == "auto" else None


def _engine_actor(cfg: RunConfig, namespace: str, i: int, detached: bool, api_key: str, pg=None):
    """Get-or-create engine i (a named actor); both backends answer url()/ready()/shutdown()/api_key() and
    speak SGLang's HTTP API, so nothing after this point knows which one runs."""
    r = cfg.rollout
    if r.backend == "embedded":
        gpu = _engine_gpus(cfg) if use_gpus(cfg) else 0.0
        actor_cls, options = ray.remote(EmbeddedEngine), {"num_cpus": 1, "num_gpus": gpu}
        storage, files = model_source(cfg)
        kwargs = dict(threads=r.engine_threads, max_batch_size=r.max_batch_size, host=cfg.cluster.bind_host,
                      api_key=api_key, storage=storage, model_files=files, device="cuda" if gpu else "cpu",
                      dtype=engine_dtype(cfg, bool(gpu)), fp32_lm_head=cfg.trainer.fp32_lm_head,
                      tf32=run_precision(cfg, bool(gpu))[1], kv_mem_fraction=r.kv_mem_fraction,
                      kv_reserve=r.kv_reserve, kv_cache_dtype=r.kv_cache_dtype,
                      decode_fusion=decode_fusion(cfg, bool(gpu)))
    else:
        actor_cls, options = ray.remote(SGLangEngine), {"num_cpus": 1, "num_gpus": _engine_gpus(cfg)}
        kwargs = dict(tp_size=r.tp_size, mem_fraction_static=r.mem_fraction_static, host=cfg.cluster.bind_host,
                      enable_memory_saver=cfg.cluster.colocate, seed=cfg.seed, startup_timeout_s=r.startup_timeout_s,
                      api_key=api_key, dtype=sglang_dtype(engine_dtype(cfg, True)), lora_rank=cfg.trainer.lora.rank,
                      lora_target_modules=list(cfg.trainer.lora.target_modules),
                      server_args_extra=dict(r.sglang_server_args), kv_cache_dtype=r.kv_cache_dtype,
                      **({"python": r.sglang_python} if r.sglang_python else {}))
    if detached:
        options["lifetime"] = "detached"
    if r.node_resources:  # only nodes started with these custom resources may host it (docs/scale-out.md)
        options["resources"] = dict(r.node_resources)
    if pg is not None:  # colocated: in the bundle (GPU) of trainer rank i mod bundles
        options.update(placement.in_bundle(pg, i % pg.bundle_count))
    return (actor_cls.options(name=f"engine-{i}", namespace=namespace, get_if_exists=True, **options)
            .remote(model_path=cfg.model.path, engine_id=f"engine-{i}", **kwargs))


def _start_engines(cfg: RunConfig, namespace: str, api_key: str, detached: bool = False, pg=None) -> list[Any]:
    """One named engine actor per engine (get-or-create), returned before they have loaded: callers
    start the trainers meanwhile, then `_check_engines`."""
    return [_engine_actor(cfg, namespace, i, detached, api_key, pg) for i in range(cfg.rollout.num_engines)]


def _engine_asks(cfg: RunConfig) -> dict[str, float]:
    """What one engine asks Ray for (named when no node can host it)."""
    gpu = _engine_gpus(cfg) if use_gpus(cfg) else 0.0
    return {"CPU": 1.0, **({"GPU": gpu} if gpu else {}), **cfg.rollout.node_resources}


def _wait_engines_placed(cfg: RunConfig, engines: list[Any], which: list[int]) -> None:
    """Bounded wait (cluster.placement_timeout_s) until engines `which` are hosted somewhere: an engine
    asking for resources no live node offers (its node was lost) fails the run, naming them."""
    asks = _engine_asks(cfg)
    ray_nodes.wait_placed({f"engine-{i}": (engines[i], asks) for i in which}, cfg.cluster.placement_timeout_s)


def _check_engines(cfg: RunConfig, namespace: str, engines: list[Any], api_key: str, detached: bool = False,
                   pg=None) -> list[Any]:
    """Wait until every engine answers. On a long-lived cluster an engine left by an earlier flow
    run that died or hangs is killed and recreated."""
    _wait_engines_placed(cfg, engines, list(range(len(engines))))
    for i, ok in enumerate(actors.answers(engines)):
        if not ok:
            log.warning("engine-%d of %s did not answer: recreating it", i, namespace)
            ray.kill(engines[i], no_restart=True)
            engines[i] = _engine_actor(cfg, namespace, i, detached, api_key, pg)
            _wait_engines_placed(cfg, engines, [i])
    return engines


def _take_over(cfg: RunConfig, engines: list[Any], urls: list[str], api_key: str, before_ids: dict[str, str]) -> None:
    """Engines an earlier flow run left on a long-lived cluster are brought back to what a fresh one is: that run may
    have died mid-push (paused, a weight-update session open) or, colocated, mid-train (memory released), and an
    engine in that state never passes the readiness check's health generate."""
    tags = list(cfg.cluster.release_tags) if cfg.cluster.colocate else []  # a split layout never releases memory
    for i, (engine, url) in enumerate(zip(engines, urls)):
        if before_ids.get(f"engine-{i}") == actors.actor_id(engine):
            client = EngineClient(url, api_key=api_key)
            try:
                done = client.take_over(tags)
            finally:
                client.close()
            log.info("engine-%d (reused): generation continued%s", i, "".join(f", {d}" for d in done))


def _start_router(cfg: RunConfig, namespace: str, urls: list[str], api_key: str) -> tuple[Any, list[str]]:
    """(router actor or None, the URLs /generate requests go to)."""
    if not cfg.rollout.router:
        return None, list(urls)
    # sglang-router fronts real SGLang servers; the embedded engines keep reflow's proxy, whose dead-worker
    # handling (drop and re-send; a 503 "no live engine" once none is left) the rollout's retries rely on.
    real = cfg.rollout.backend == "sglang" and sglang_router_available()
    actor_cls = ray.remote(SGLangRouter if real else Router)
    router = actor_cls.options(name="router", namespace=namespace, num_cpus=0, get_if_exists=True).remote(
        urls, host=cfg.cluster.bind_host, api_key=api_key)
    ray.get(router.ready.remote())
    return router, [ray.get(router.url.remote())] * len(urls)


def use_gpus(cfg: RunConfig) -> bool:
    """Whether this run's trainer ranks and engines take GPUs (cluster.gpus against the connected cluster)."""
    return placement.gpus_on(cfg.cluster.gpus, cfg.rollout.backend == "sglang",
                             ray.cluster_resources().get("GPU", 0.0))


def _check_gpu_room(cfg: RunConfig) -> None:
    """Refuse, before any actor is created, a GPU layout the cluster cannot hold."""
    if not use_gpus(cfg):
        return
    ranks = cfg.trainer.num_ranks * (2 if cfg.algorithm.spec.needs_critic else 1)
    if cfg.cluster.colocate:
        need, layout = max(cfg.trainer.num_ranks, cfg.rollout.num_engines), "colocated mode (one GPU per bundle)"
    else:
        need = ranks + cfg.rollout.num_engines * _engine_gpus(cfg)
        layout = "the split layout (a GPU per trainer rank, critic rank and engine)"
    placement.check_gpus(need, ray.cluster_resources().get("GPU", 0.0), layout)


def _engine_gpus(cfg: RunConfig) -> float:
    """GPUs Ray reserves per engine: its TP width (embedded: one), or a share of a trainer's GPU when colocated."""
    if not cfg.cluster.colocate:
        return float(cfg.rollout.tp_size if cfg.rollout.backend == "sglang" else 1)
    if cfg.rollout.tp_size != 1:
        raise NotImplementedError("cluster.colocate with rollout.tp_size > 1 needs several placement-group bundles "
                                  "per engine and a base GPU id per engine, which reflow does not build yet; use "
                                  "tp_size=1 (one engine per trainer GPU)")
    return placement.ENGINE_GPU  # a share of its bundle's GPU, which a trainer rank shares too


def _attach_trainers(cfg: RunConfig, namespace: str) -> TrainerGroup | None:
    """The policy ranks an earlier flow run left, if every one of them answers; else None (and
    any survivors are killed: a group with a lost rank cannot rejoin its process group)."""
    try:
        group = TrainerGroup.attach(cfg.trainer.num_ranks, namespace, "policy")
    except TrainerInitError:
        group = None
    if group is not None and all(actors.answers(group.actors, "ping")):
        return group
    for name in actors.named_actors(namespace):
        if name.startswith("policy-trainer-"):
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    return None


def _colocation(cfg: RunConfig, namespace: str, detached: bool):
    """The placement group engines and trainers share in colocated mode (infra/cluster/placement.py), else None."""
    if not cfg.cluster.colocate:
        return None
    spec = placement.bundles(cfg.trainer.num_ranks, cfg.rollout.num_engines, use_gpus(cfg),
                             cfg.algorithm.spec.needs_critic, cfg.trainer.node_resources, cfg.rollout.node_resources)
    return placement.group(spec, namespace, detached)


def _rank_options(pg, num_ranks: int, gpu_share: float, gpu: bool) -> dict:
    """Ray options of trainer/critic ranks: a whole GPU each (split layout), or a share of their bundle's."""
    if pg is None:
        return {"num_gpus_per_rank": 1.0} if gpu else {}
    gpu = gpu_share if "GPU" in pg.bundle_specs[0] else 0.0
    return {"num_gpus_per_rank": gpu, "options_per_rank": [placement.in_bundle(pg, r) for r in range(num_ranks)]}


def _rank_nodes(cfg: RunConfig) -> dict:
    """Where trainer/critic ranks may run (trainer.node_resources) and how long they may wait for a node."""
    return {"resources": dict(cfg.trainer.node_resources), "placement_timeout_s": cfg.cluster.placement_timeout_s}


def _start_trainers(cfg: RunConfig, namespace: str, detached: bool = False, pg=None, wait: bool = True) -> TrainerGroup:
    t, gpus = cfg.trainer, use_gpus(cfg)
    ref = (cfg.model.ref_path or cfg.model.path) if cfg.algorithm.needs_ref else None
    return TrainerGroup.create(
        num_ranks=t.num_ranks, namespace=namespace, name_prefix="policy", num_cpus_per_rank=1,
        model_path=cfg.model.path, settings=policy_rank_settings(cfg, gpus, run_precision(cfg, gpus)), ref_model_path=ref, detached=detached,
        wait=wait, **_rank_nodes(cfg), **_rank_options(pg, t.num_ranks, placement.TRAINER_GPU, gpus))


def _start_critic(cfg: RunConfig, namespace: str, pg=None, wait: bool = True) -> CriticGroup | None:
    """PPO's value model: its own DeepSpeed ranks (as many as the policy's, so the batch splits the
    same way), started fresh by every runtime and restored with the policy's checkpoint."""
    if not cfg.algorithm.spec.needs_critic:
        return None
    n, gpus = cfg.trainer.num_ranks, use_gpus(cfg)
    return CriticGroup.create(
        num_ranks=n, namespace=namespace, name_prefix="critic", num_cpus_per_rank=1,
        model_path=cfg.critic.path or cfg.model.path, settings=critic_rank_settings(cfg, gpus, run_precision(cfg, gpus)), wait=wait,
        **_rank_nodes(cfg), **_rank_options(pg, n, placement.CRITIC_GPU, gpus))


# What the iteration's Ray tasks import in their worker (torch, pandas, the reward and rollout modules), imported ahead:
# a driver's task workers start cold (workers belong to one job), and the first generate / score of a run paid it:
# 5.7 s and 3.0 s on 2 cores against 0.1 s after. Besides engines/rollout_stages.py (whose `warm_worker` imports it by
# running): the stage records, the algorithms (their configs are the advantages task's argument) and pandas (the
# tables), and with a critic its values' module (none imports Prefect or this module). rollout_stages itself imports
# neither torch nor pandas (~2 s of CPU a worker on a 2-core AMD EPYC VM): a worker Ray starts later, for a task
# while the warmed ones are busy, goes without them unless its task needs them (a 3-iteration demo run's task workers
# ~1.5 s of CPU each against ~2.6, bench/startup.py --iterations 3); the warmed ones take them here, so iteration 0's
# advantages do not wait for torch (+1.2 s there when they did).
_TASK_MODULES = ("reflow.tasks.stage_cache", "reflow.rl.algorithms", "pandas")
_CRITIC_TASK_MODULES = ("reflow.engines.train.critic",)
# The next rollout (launched ahead) and an eval set generate at once, with a stage record and the records'
# tasks beside them. With 2, an eval waited 2-3 s for a worker in 2 of 4 evals of a 25M run (Ray's timeline).
# On a host of few cores their imports only compete with the actors' own start-up (~6 s of CPU a worker), and a
# worker no task needs is CPU lost: in the CPU suite on 2 cores (a /proc sample of every process), 42 task workers
# ran the warm-up and no task after it, ~240 s of CPU. One per core to spare, up to 3.
_WARM_WORKERS = min(3, max(1, (os.cpu_count() or 1) - 1))


_warm_worker = ray.remote(num_cpus=0)(ro.warm_worker)


def warm_task_workers(freeze: bool = True, critic: bool = False) -> list:
    """Start the iteration's task workers while the actors load (it returns at once): their imports
    then overlap the actors' start-up instead of delaying the first iteration's stages. `critic`: the run has a
    value model, whose values a task attaches (that module imports torch)."""
    modules = _TASK_MODULES + (_CRITIC_TASK_MODULES if critic else ())
    return [_warm_worker.remote(modules, freeze) for _ in range(_WARM_WORKERS)]


def build_runtime(cfg: RunConfig, ahead: bool = False) -> Runtime:
    """The checkpoint and reward fn first, then the actors, and the tokenizer, data and eval sets while they start (on
    a long-lived cluster before its actors are touched); a bad input fails with its own error and the actors asked
    for are killed. `ahead` (begin_runtime): in the Ray this process already started, never a new one (a failed
    preflight stops it while this may still run)."""
    t0 = time.perf_counter()
    local = resolve_checkpoint(cfg.model.path, *model_source(cfg))  # a missing or corrupt one fails here, before Ray starts
    load_reward_fn(cfg.data.reward_fn)
    namespace = namespace_for(cfg.cluster.namespace_prefix, cfg.experiment)
    if ahead and not ray.is_initialized():
        raise RuntimeError("Ray was stopped before the run's actors began (a failed preflight)")
    if not ahead:
        log.info(connect_for(cfg.cluster, namespace))
    persistent = attached_to_running_cluster()
    # On a long-lived cluster the inputs are checked before its actors are touched; on a cluster of the run's own
    # (its actors die with it) they are read while the actors start: the tokenizer and 50k prompts took seconds of
    # the GPU demo's start before any actor was asked for, beside the preflight reading the same in the same process.
    inputs = _read_inputs(cfg, local) if persistent else None
    record, before_ids = actors.prepare_namespace(cfg, namespace) if persistent else (None, {})
    reusable = bool(before_ids)
    _check_gpu_room(cfg)
    if cfg.trainer.precision == "auto":
        gpus = use_gpus(cfg)
        precision, tf32 = run_precision(cfg, gpus)
        size = f"a policy of {_policy_params(cfg) / 1e6:,.0f}M parameters on GPUs" \
            if gpus else "no GPUs"
        log.info("trainer.precision=auto: %s%s (%s; set trainer.precision to choose)", precision,
                 " with TF32 products" if tf32 and precision == "fp32" and gpus else "", size)
    pg = _colocation(cfg, namespace, persistent)
    api_key = runtime_api_key(namespace, cfg.rollout.num_engines)
    # Engines, policy ranks and critic ranks load at the same time (each is seconds of imports and
    # loading); only then is each waited for.
    engines = _start_engines(cfg, namespace, api_key, persistent, pg)
    trainers = _attach_trainers(cfg, namespace) if reusable else None
    fresh = trainers is None
    if fresh:
        trainers = _start_trainers(cfg, namespace, persistent, pg, wait=False)
    critic = _start_critic(cfg, namespace, pg, wait=False)
    warm_task_workers(cfg.cluster.gc_freeze, critic=cfg.algorithm.spec.needs_critic)
    t_asked = time.perf_counter()
    if inputs is None:
        try:
            inputs = _read_inputs(cfg, local)
        except BaseException:  # deliberate: the actors just asked for go, then the input's own error
            _kill_groups(trainers, critic)
            for e in engines:
                ray.kill(e)
            placement.release(pg)
            raise
    tokenizer, train_prompts, eval_prompts, eval_sets = inputs
    try:
        for group in ([trainers] if fresh else []) + ([critic] if critic is not None else []):
            group.wait_ready()  # a group that fails kills its own ranks
    except TrainerInitError:
        _kill_groups(trainers, critic)
        raise
    engines = _check_engines(cfg, namespace, engines, api_key, persistent, pg)
    urls = ray.get([e.url.remote() for e in engines])
    placement.check_layout(cfg.weight_sync, engines, urls, trainers.actors[0])  # before the first push
    _take_over(cfg, engines, urls, api_key, before_ids)
    ray.get([e.ready.remote() for e in engines])
    if cfg.cluster.gc_freeze and not (cfg.cluster.colocate and cfg.cluster.hand_over):
        # Ready and set up: what each holds now leaves the collector's sight (a full collection walked it, 0.26-0.32 s
        # inside some rollout on an H200: bench/gc_pauses.py). Not where engines release and ranks offload at each
        # hand-over: a frozen object that became garbage in a cycle would keep its GPU memory for good.
        ray.get([a.__ray_call__.remote(freeze_actor) for a in
                 engines + trainers.actors + (critic.actors if critic is not None else [])])
    store = ExperimentStore.from_config(cfg.storage, cfg.experiment)  # start_runtime writes the config there
    rt = Runtime(cfg=cfg, namespace=namespace, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                 train_prompts=train_prompts, eval_prompts=eval_prompts, trainers=trainers,
                 engines=engines, engine_urls=urls, store=store, api_key=api_key)
    rt.router, rt.generate_urls = _start_router(cfg, namespace, urls, api_key)
    rt.eval_sets = eval_sets
    rt.persistent = persistent
    rt.critic = critic
    rt.placement = pg
    rt.actor_ids = {name: actors.actor_id(h) for name, h in
                    [(f"engine-{i}", e) for i, e in enumerate(engines)] +
                    [(f"policy-trainer-{r}", a) for r, a in enumerate(trainers.actors)]}
    rt.reused = sorted(n for n, i in rt.actor_ids.items() if before_ids.get(n) == i)  # same actor as last run
    if record is not None:
        ray.get(record.set.remote({"fingerprint": actors.fingerprint(cfg), "actor_ids": rt.actor_ids,
                                   "updated_at": time.time()}))
    if cfg.cluster.colocate and cfg.cluster.hand_over:  # the engines generate first: the trainer starts offloaded
        ray.get(trainers.offload_states() + (critic.offload_states() if critic is not None else []))
    rt.timings["startup"] = time.perf_counter() - t0
    log.info("runtime ready in %.1fs (actors asked for after %.1fs): %d engine(s) %s, %d trainer rank(s), %d train / "
             "%d eval prompts, storage %s", rt.timings["startup"], t_asked - t0, len(engines), urls,
             cfg.trainer.num_ranks, len(train_prompts), len(eval_prompts), store.url())
    return rt


def _kill_groups(*groups) -> None:
    """Kill the ranks of each trainer or critic group (None: none started)."""
    for group in groups:
        if group is not None:
            group.kill()


def _read_inputs(cfg: RunConfig, local) -> tuple[Any, list[Prompt], list[Prompt], list[EvalSet]]:
    """The tokenizer, the train and eval prompts and the eval sets (each read fails with the input's error)."""
    tokenizer = load_tokenizer(str(local))
    train_prompts, eval_prompts = load_prompts(cfg, tokenizer)
    return tokenizer, train_prompts, eval_prompts, load_eval_sets(cfg, tokenizer, eval_prompts)


def ensure_engines(cfg: RunConfig, serve_version: int | None = None) -> list[str]:
    """Recreate engines that died (e.g. mid-rollout, which the router survives) before the control
    plane or a rollout needs every one of them; the router swaps the URLs. Returns the names
    recreated. A new engine starts from `model.path`: with `serve_version` (before a rollout) the
    trainers push it their current weights as that version at once; without (before a push) the
    push that follows does."""
    rt = get_runtime(cfg)
    dead = [i for i, ok in enumerate(actors.answers(rt.engines, "url", timeout_s=10)) if not ok]
    for i in dead:
        log.warning("engine-%d (%s) is gone: recreating it", i, rt.engine_urls[i])
        ray.kill(rt.engines[i], no_restart=True)
        rt.engines[i] = _engine_actor(cfg, rt.namespace, i, rt.persistent, rt.api_key, rt.placement)
        _wait_engines_placed(cfg, rt.engines, [i])  # its node may be the one that was lost
        old, rt.engine_urls[i] = rt.engine_urls[i], ray.get(rt.engines[i].url.remote())
        ray.get(rt.engines[i].ready.remote())
        rt.actor_ids[f"engine-{i}"] = actors.actor_id(rt.engines[i])
        if rt.router is not None:
            ray.get(rt.router.add_worker.remote(rt.engine_urls[i]))
            if old in ray.get(rt.router.workers.remote())["urls"]:  # it may have dropped the dead URL already
                ray.get(rt.router.remove_worker.remote(old))
        else:
            rt.generate_urls[i] = rt.engine_urls[i]
    if dead and serve_version is not None and rt.trainers is not None:
        urls = [rt.engine_urls[i] for i in dead]
        report = next(r for r in ray.get(rt.trainers.push_weights(urls, str(serve_version), push_settings(cfg),
                                                                  api_key=rt.api_key)) if r)
        log.warning("recreated engine(s) %s now serve policy version %d (%d tensors verified)",
                    ", ".join(urls), serve_version, report.get("verified_tensors", 0))
    return [f"engine-{i}" for i in dead]


def recreate_trainers(cfg: RunConfig) -> TrainerGroup:
    """Replace the policy ranks with fresh ones loaded from `model.path`."""
    rt = get_runtime(cfg)
    rt.trainers.kill()
    rt.trainers = _start_trainers(cfg, rt.namespace, rt.persistent, rt.placement)
    rt.reused = [n for n in rt.reused if not n.startswith("policy-trainer-")]
    rt.actor_ids.update({f"policy-trainer-{r}": actors.actor_id(a) for r, a in enumerate(rt.trainers.actors)})
    if cfg.cluster.colocate and cfg.cluster.hand_over:
        ray.get(rt.trainers.offload_states())
    return rt.trainers


class RuntimeNotStarted(RuntimeError):
    """A task asked for the experiment's runtime in a process where no start step built it."""


def _not_started(experiment: str, starter: str) -> RuntimeNotStarted:
    return RuntimeNotStarted(
        f"no runtime for experiment {experiment!r} in this process: the actors are started by the flow's "
        f"{starter!r} task (reflow.tasks.cluster), which must run first and in the same process as the "
        f"tasks that use them (run the flow, not one of its tasks on its own)")


def start_runtime(cfg: RunConfig) -> Runtime:
    """This process's runtime of `cfg.experiment`, built (actors attached, reused or created) on first call,
    or the one `begin_runtime` built ahead for the same config."""
    rt = _RUNTIMES.get(cfg.experiment)
    if rt is None:
        rt = _built_ahead(cfg) or build_runtime(cfg)
        rt.store.write_text("config.yaml", dump_config(cfg))
        _RUNTIMES[cfg.experiment] = rt
    return rt


def begin_runtime(cfg: RunConfig) -> bool:
    """Build `cfg`'s runtime in a background thread now, in the Ray this process has started (the CLI, as soon
    as Ray is up beside its preflight: the actors' imports, model loads and DeepSpeed's set-up then overlap the
    preflight, Prefect's server start and the flow run's); the flow's `start_runtime` takes it. Returns whether it began: not
    when this process already has one, on a long-lived cluster (whose actors a flow run reuses or replaces
    under its lease), or while the experiment's lease file exists (a live run's, or a killed one's whose
    leftovers the flow ends first, infra/cluster/leases.py)."""
    from reflow.infra.cluster.leases import read as read_lease

    if cfg.experiment in _RUNTIMES or cfg.experiment in _AHEAD or attached_to_running_cluster():
        return False
    if read_lease(cfg.experiment) is not None:
        return False
    future: Future = Future()

    def build() -> None:
        try:
            future.set_result(build_runtime(cfg, ahead=True))
        except BaseException as e:  # deliberate: handed to the flow's start_runtime, which raises it
            future.set_exception(e)

    _AHEAD[cfg.experiment] = (dump_config(cfg), future)
    threading.Thread(target=build, name=f"reflow-runtime-{cfg.experiment}", daemon=True).start()
    return True


def forget_ahead(cfg: RunConfig, wait_s: float = 120.0) -> None:
    """The runtime begun ahead is not wanted (a failed preflight; the CLI stops its Ray next, and with it the
    actors). Its build must end first: a Ray call of that thread under way while the CLI's ray.shutdown runs ends
    the whole process (Ray's core worker exits it: "The core worker has already been shutdown") instead of the
    failed preflight's one line and exit status 2. So its actors are killed (again each second, for one the build
    asks for after: it creates them all before it waits for any), which ends its waits at once with an error, and
    the build is waited for (up to `wait_s`, then Ray is stopped anyway, with a warning)."""
    entry = _AHEAD.pop(cfg.experiment, None)
    if entry is None:
        return
    namespace, deadline = namespace_for(cfg.cluster.namespace_prefix, cfg.experiment), time.monotonic() + wait_s
    while time.monotonic() < deadline:
        actors.kill_named(namespace)
        if futures_wait([entry[1]], timeout=1.0).done:
            return
    log.warning("the runtime begun beside the preflight was still starting after %.0f s: stopping Ray anyway", wait_s)


def _built_ahead(cfg: RunConfig) -> Runtime | None:
    """The runtime `begin_runtime` built for this experiment (waited for; its error raised as the build's
    own), or None when there is none or it was built for another config (its actors are then let go)."""
    entry = _AHEAD.pop(cfg.experiment, None)
    if entry is None:
        return None
    dumped, future = entry
    rt = future.result()
    if dumped != dump_config(cfg):
        log.warning("the runtime started ahead of the flow was for another config of %s: building it again",
                    cfg.experiment)
        if rt.critic is not None:
            rt.critic.kill()
        _release(rt)
        return None
    log.info("runtime started ahead of the flow: ready in %.1fs", rt.timings["startup"])
    return rt


def get_runtime(cfg: RunConfig) -> Runtime:
    """The runtime `start_runtime` built for `cfg.experiment`; never builds one (a task run elsewhere
    would otherwise silently start a second cluster)."""
    rt = _RUNTIMES.get(cfg.experiment)
    if rt is None:
        raise _not_started(cfg.experiment, "start-cluster")
    return rt


def shutdown_runtime(experiment: str, release: bool | None = True) -> None:
    """Forget this process's runtime of `experiment`; `release` also kills its actors
    (None: release unless they live on a long-lived cluster, where the next flow run reuses them)."""
    rt = _RUNTIMES.pop(experiment, None)
    if rt is None:
        return
    if rt.critic is not None:  # never kept: every flow run restores the critic from the checkpoint
        rt.critic.kill()
    if release is None:
        release = not rt.persistent
    if not release:
        log.info("keeping %d actor(s) of %s for the next flow run: %s", len(rt.actor_ids), rt.namespace,
                 sorted(rt.actor_ids))
        return
    _release(rt)


def _release(rt: Runtime) -> None:
    """Kill the runtime's actors (and its namespace's record on a long-lived cluster)."""
    if rt.persistent:
        ray.kill(actors.record(rt.namespace), no_restart=True)
    rt.trainers.kill()
    _stop_serving(rt)
    placement.release(rt.placement)


def _stop_serving(rt: Runtime) -> None:
    """Kill the router and shut the engines down (then kill them)."""
    if rt.router is not None:
        ray.kill(rt.router)
    for e in rt.engines:
        try:
            ray.get(e.shutdown.remote(), timeout=10)
        finally:
            ray.kill(e)


# ---------------------------------------------------------------- eval-only runtimes (flows/evaluate.py)


def _eval_namespace(cfg: RunConfig) -> str:
    """A namespace per served checkpoint, apart from the training actors': named actors are
    get-or-create, so sharing the training namespace would evaluate whatever a training run holds."""
    digest = hashlib.sha256(cfg.model.path.encode()).hexdigest()[:8]
    return f"{namespace_for(cfg.cluster.namespace_prefix, cfg.experiment)}-eval-{digest}"


def build_eval_runtime(cfg: RunConfig) -> Runtime:
    """Rollout engines serving `cfg.model.path` (e.g. a checkpoint's model/ folder) and the eval
    sets; no trainers. Inputs are validated before any actor starts, as in `build_runtime`."""
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(str(resolve_checkpoint(cfg.model.path, *model_source(cfg))))  # checked before Ray starts
    _, eval_prompts = load_prompts(cfg, tokenizer)
    eval_sets = load_eval_sets(cfg, tokenizer, eval_prompts)
    namespace = _eval_namespace(cfg)
    log.info(connect_for(cfg.cluster, namespace))
    api_key = runtime_api_key(namespace, cfg.rollout.num_engines)
    engines = _check_engines(cfg, namespace, _start_engines(cfg, namespace, api_key), api_key)
    urls = ray.get([e.url.remote() for e in engines])
    ray.get([e.ready.remote() for e in engines])
    rt = Runtime(cfg=cfg, namespace=namespace, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                 train_prompts=[], eval_prompts=eval_prompts, trainers=None, engines=engines, engine_urls=urls,
                 store=ExperimentStore.from_config(cfg.storage, cfg.experiment), eval_sets=eval_sets, api_key=api_key)
    rt.router, rt.generate_urls = _start_router(cfg, namespace, urls, api_key)
    rt.timings["startup"] = time.perf_counter() - t0
    log.info("eval runtime ready in %.1fs: %d engine(s) serving %s", rt.timings["startup"], len(engines), cfg.model.path)
    return rt


def start_eval_runtime(cfg: RunConfig) -> Runtime:
    """This process's eval-only runtime of the experiment, rebuilt when the checkpoint it serves changes."""
    key = f"{cfg.experiment}/eval-only"
    rt = _RUNTIMES.get(key)
    if rt is not None and rt.cfg.model.path != cfg.model.path:
        shutdown_eval_runtime(cfg.experiment)
        rt = None
    if rt is None:
        rt = _RUNTIMES[key] = build_eval_runtime(cfg)
    return rt


def get_eval_runtime(cfg: RunConfig) -> Runtime:
    """The eval-only runtime `start_eval_runtime` built for `cfg` (serving `cfg.model.path`)."""
    rt = _RUNTIMES.get(f"{cfg.experiment}/eval-only")
    if rt is None or rt.cfg.model.path != cfg.model.path:
        raise _not_started(cfg.experiment, "start-eval-engines")
    return rt


def shutdown_eval_runtime(experiment: str) -> None:
    rt = _RUNTIMES.pop(f"{experiment}/eval-only", None)
    if rt is None:
        return
    _stop_serving(rt)
