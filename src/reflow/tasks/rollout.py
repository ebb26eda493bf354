"""Prefect tasks of the rollout side: generate, reward, advantages (evaluation: tasks/evaluate.py).

Thin wrappers: each submits a Ray remote function and returns a `BatchRef` (an ObjectRef plus
small stats) or a metrics dict. Batches never travel through Prefect results; `NO_CACHE`
because an ObjectRef is not a meaningful cache key.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from logging import Logger

import ray
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from reflow.engines import rollout_stages as ro
from reflow.engines.partial_rollout import PartialSettings
from reflow.engines.rollout_fns import BatchRequest, RolloutSettings
from reflow.infra.cluster.runtime import Runtime, ensure_engines, get_runtime
from reflow.infra.config.schema import RunConfig
from reflow.rl.data import prompts_for_iteration
from reflow.rl.scorers import reward_source
from reflow.rl.types import Prompt
from reflow.tasks import stage_cache
from reflow.tasks.faults import transient_fault
from reflow.tasks.state import run_state

# Ray tasks run functions of the worker-side module (engines/rollout_stages.py): a task worker imports only that.
_generate = ray.remote(num_cpus=0, num_returns=2)(ro.generate_timed)
_score = ray.remote(num_cpus=0, num_returns=2)(ro.score)
_advantages = ray.remote(num_cpus=0, num_returns=2)(ro.advantages)
_dynamic_fill = ray.remote(num_cpus=0, num_returns=2)(ro.dynamic_fill)
_carry_of = ray.remote(num_cpus=0)(ro.carry_of)
write_table = ray.remote(num_cpus=0)(ro.write_rollout_table)


@dataclass
class BatchRef:
    """A RolloutBatch that stays in the Ray object store, plus what the driver may look at."""

    ref: ray.ObjectRef
    stats: dict[str, float] = field(default_factory=dict)
    iteration: int | None = None  # set by `generate`; dynamic sampling draws its extra prompts from it
    saving: tuple[ray.ObjectRef, ...] = ()  # stage records still being written (tasks/stage_cache.py)


def uses_adapter(cfg: RunConfig) -> bool:
    """Whether the engines hold the policy as a LoRA adapter that rollout requests must name (every push
    of a LoRA run is an adapter push: engines/weights/adapter_push.py)."""
    return cfg.trainer.lora.rank > 0


def rollout_settings(rt: Runtime) -> RolloutSettings:
    """How the run's training batches are asked of its engines (rollout.*)."""
    r, cfg = rt.cfg.rollout, rt.cfg
    sampling = ro.sampling_params(r.temperature, r.top_p, r.top_k, r.max_new_tokens, [rt.eos_id],
                                  r.skip_special_tokens, r.no_stop_trim)
    partial = None if r.partial == "off" else PartialSettings.of(r.partial, r.partial_chunk_tokens,
                                                                  r.prompts_per_iteration, r.over_sample,
                                                                  closing=r.backend == "embedded")
    return RolloutSettings(rt.generate_urls, sampling, r.n_samples_per_prompt, r.request_timeout_s, rt.api_key,
                           r.generate_fn, r.max_concurrent_requests, r.turn_limits(), uses_adapter(cfg),
                           cfg.seed if r.seeded_sampling else None, partial)  # per-sample seeds: exact resume


def _cached(rt: Runtime, iteration: int, stage: str, log: Logger | None = None) -> BatchRef | None:
    """The stage's persisted result from an earlier (crashed) flow run of this iteration, if any."""
    meta = stage_cache.find(rt.store, iteration, stage, stage_cache.stage_key(rt.cfg, stage))
    if meta is None:
        return None
    ref = stage_cache.load_stage.remote(rt.store, iteration, stage, meta["sha256"])
    ray.wait([ref], fetch_local=False)
    (log or get_run_logger()).info("iteration %d: %s rollouts loaded from storage (%d samples), not generated again",
                                   iteration, stage, meta["samples"])
    return BatchRef(ref, {**meta["stats"], f"{stage}_from_storage": 1.0}, iteration)


def _persist(rt: Runtime, batch: BatchRef, stage: str) -> BatchRef:
    """Start writing the stage's record and go on: the write overlaps the next stages, and `train`
    waits for it before the update can crash (a re-run then finds it); so do the iteration's records."""
    ref = stage_cache.save_stage.remote(batch.ref, rt.store, batch.iteration, stage,
                                        stage_cache.stage_key(rt.cfg, stage), batch.stats)
    return dataclasses.replace(batch, saving=(*batch.saving, ref))


@task(name="generate", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5, retry_condition_fn=transient_fault)
def generate(cfg: RunConfig, iteration: int) -> BatchRef:
    return generate_batch(cfg, iteration)


def generate_batch(cfg: RunConfig, iteration: int, version: int | None = None, log: Logger | None = None) -> BatchRef:
    """Iteration `iteration`'s rollouts (its prompts, its sampling seeds) by the engines' policy `version`:
    by default the iteration's own, after recreating engines that died (the `generate` task); the run's
    rollout source (tasks/rollout_source.py) generates ahead of the iteration and passes the version the
    engines serve."""
    rt = get_runtime(cfg)
    if (cached := _cached(rt, iteration, "generated", log)) is not None:  # an earlier flow run's batch
        return _left_carry(cfg, cached)
    recreated: list[str] = []
    ahead = version is not None
    if version is None:
        # An engine lost since the last push (or during this task's previous attempt: the retry comes
        # back here) is recreated and given the current weights now, not after the retries are spent.
        recreated, version = ensure_engines(cfg, serve_version=iteration), iteration
    ref, timing, prompts = _launch(rt, iteration, version)
    # A failed rollout (an engine lost mid-request) raises here, inside this task's retries; the batch stays in Ray.
    engine_s = ray.get(timing)
    stats = {**engine_s, "prompts": len(prompts), "engines_recreated_before_generate": float(len(recreated)),
             "rollout_policy_version": float(version), "generate_started_ahead": float(ahead)}
    return _left_carry(cfg, _persist(rt, BatchRef(ref, stats, iteration), "generated"))


def _launch(rt: Runtime, iteration: int, version: int) -> tuple[ray.ObjectRef, ray.ObjectRef, list[Prompt]]:
    """Send iteration `iteration`'s prompts (its sampling seeds) to the engines, which serve policy `version`:
    (the batch, its generation seconds, the prompts). With partial rollouts the prompts are the pool's
    candidates (the iteration's own, then over-sampling's from a stream of their own) and the batch
    continues the groups the one before left (`carry_in`)."""
    cfg, r = rt.cfg, rt.cfg.rollout
    prompts = prompts_for_iteration(rt.train_prompts, cfg.data.seed, iteration, r.prompts_per_iteration)
    settings = rollout_settings(rt)
    if settings.partial is None:
        ref, timing = _generate.remote(settings, BatchRequest(prompts, version, seed_key=iteration))
        return ref, timing, prompts
    extra = settings.partial.pool_groups - r.prompts_per_iteration
    prompts += prompts_for_iteration(rt.train_prompts, cfg.data.seed + OVER_SAMPLE_STREAM, iteration, extra) if extra else []
    carry = carry_in(rt, iteration) if r.partial == "carry" else []
    ref, timing = _generate.remote(settings, BatchRequest(prompts, version, seed_key=iteration), carry)
    return ref, timing, prompts


OVER_SAMPLE_STREAM = 104_729  # over-sampled prompts: a seeded stream apart from the iteration's own (data.seed + this)


def carry_in(rt: Runtime, iteration: int) -> object:
    """The groups iteration `iteration`'s batch continues (rollout.partial=carry): left by the batch before in this
    run, read from the checkpoint it resumed from, or (an iteration flow run on its own) taken from the
    previous iteration's generated record; none at iteration 0."""
    known = run_state(rt.cfg).carry
    if iteration in known:
        return known[iteration]
    if iteration == 0:
        return []
    meta = stage_cache.find(rt.store, iteration - 1, "generated", stage_cache.stage_key(rt.cfg, "generated"))
    if meta is None:
        raise RuntimeError(f"iteration {iteration}: rollout.partial=carry continues the groups iteration {iteration - 1} "
                           f"left, but this run did not generate it and {rt.store.url(rt.store.iteration_dir(iteration - 1))} "
                           f"holds no generated record of it with these settings: resume from a checkpoint "
                           f"(it holds the carry), or set rollout.partial=drop")
    return _carry_of.remote(stage_cache.load_stage.remote(rt.store, iteration - 1, "generated", meta["sha256"]))


def _left_carry(cfg: RunConfig, batch: BatchRef) -> BatchRef:
    """Note the groups `batch` leaves for the next iteration (rollout.partial=carry); forget those of older ones."""
    if cfg.rollout.partial == "carry" and batch.iteration is not None:
        known = run_state(cfg).carry
        known[batch.iteration + 1] = _carry_of.remote(batch.ref)
        for old in [i for i in known if i < batch.iteration]:
            del known[old]
    return batch


def extra_prompt_rounds(cfg: RunConfig, prompts: list[Prompt], iteration: int) -> list[list[Prompt]]:
    """Prompts of dynamic sampling's extra rounds: one seeded stream per round, apart from the main
    one, so retries and resumes draw the same prompts (they may repeat a prompt of the epoch)."""
    k = cfg.rollout.prompts_per_iteration
    return [prompts_for_iteration(prompts, cfg.data.seed + 7919 * r, iteration, k)
            for r in range(1, cfg.algorithm.max_sampling_rounds)]


@task(name="reward", cache_policy=NO_CACHE)
def reward(cfg: RunConfig, batch: BatchRef) -> BatchRef:
    return score_batch(cfg, batch)


def score_batch(cfg: RunConfig, batch: BatchRef, log: Logger | None = None) -> BatchRef:
    """Score the batch (reward fn + overlong penalty); with dynamic sampling, top it up to
    `prompts_per_iteration` groups with reward spread (engines/rollout_stages.py `dynamic_fill`)."""
    a = cfg.algorithm
    if batch.iteration is not None and (cached := _cached(get_runtime(cfg), batch.iteration, "scored", log)) is not None:
        return cached
    score_kw = dict(max_new_tokens=cfg.rollout.max_new_tokens, overlong_buffer=a.overlong_buffer,
                    overlong_factor=a.overlong_penalty, fn_timeout_s=cfg.reward.fn_timeout_s)
    ref, stats = _score.remote(batch.ref, reward_source(cfg.reward, cfg.data.reward_fn), **score_kw)
    refs = [stats]
    if a.dynamic_sampling:
        if batch.iteration is None:
            raise ValueError("dynamic sampling needs the batch's iteration (a BatchRef from the generate task)")
        rt = get_runtime(cfg)
        version = int(batch.stats.get("rollout_policy_version", batch.iteration))
        rounds = [BatchRequest(prompts, version, seed_key=batch.iteration)
                  for prompts in extra_prompt_rounds(cfg, rt.train_prompts, batch.iteration)]
        ref, ds = _dynamic_fill.remote(ref, rollout_settings(rt), rounds, reward_source(cfg.reward, cfg.data.reward_fn),
                                       score_kw, cfg.rollout.prompts_per_iteration)
        refs.append(ds)
    merged = {k: v for d in ray.get(refs) for k, v in d.items()}
    out = BatchRef(ref, {**batch.stats, **merged}, batch.iteration, batch.saving)
    return _persist(get_runtime(cfg), out, "scored") if batch.iteration is not None else out


@task(name="advantages", cache_policy=NO_CACHE)
def advantages(cfg: RunConfig, batch: BatchRef) -> BatchRef:
    """The algorithm's advantages (`cfg.algorithm.spec.advantages`) on the whole batch, inside Ray.
    With a critic (PPO), reflow.tasks.train.critic_values has put its values in the batch first."""
    ref, stats = _advantages.remote(batch.ref, cfg.algorithm)
    return BatchRef(ref, {**batch.stats, **ray.get(stats)}, batch.iteration, batch.saving)
