"""Prefect tasks around checkpoints: storage preflight, choosing a resume point, save, restore.

The trainer ranks upload and download their own files (engines/trainer_ckpt.py); the driver only
merges their manifests, commits, and decides which checkpoint to load (infra/checkpoint.py).
"""
from __future__ import annotations

import ray
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from infra import checkpoint as ckpt
from infra.config import RunConfig, dump_config
from infra.runtime import get_runtime
from infra.storage import ExperimentStore


class ResumeError(RuntimeError):
    """The requested resume cannot be honoured (no valid checkpoint, or resume=never on a used prefix)."""


def experiment_store(cfg: RunConfig) -> ExperimentStore:
    return ExperimentStore.from_config(cfg.storage, cfg.experiment)


@task(name="check-storage", cache_policy=NO_CACHE)
def check_storage(cfg: RunConfig) -> str:
    store = experiment_store(cfg)
    store.preflight()
    return store.url()


@task(name="find-checkpoint", cache_policy=NO_CACHE)
def find_checkpoints(cfg: RunConfig) -> list[tuple[ckpt.Checkpoint, dict]]:
    """Resume candidates (checkpoint, manifest files), best first; [] = start from model.path."""
    store = experiment_store(cfg)
    if cfg.resume == "never":
        if ckpt.committed(store):
            raise ResumeError(f"resume=never but {store.url(ckpt.ROOT)} already holds committed checkpoints; "
                              f"use resume=auto, a new experiment name, or delete that prefix")
        return []
    if cfg.resume != "auto":
        ck = ckpt.from_url(cfg.resume, store)
        return [(ck, ckpt.check(ck))]  # explicit: no fallback, a bad one is an error
    found = ckpt.valid_candidates(store)
    if not found and ckpt.candidates(store):
        raise ResumeError(f"{store.url(ckpt.ROOT)} holds checkpoints but none is valid (see the warnings "
                          f"above); refusing to silently start over. Use resume=never with a new experiment.")
    return [(ck, files) for ck, files, _ in found]


def _try_fetch(trainers, ck: ckpt.Checkpoint, files: dict) -> str | None:
    """None if every rank downloaded and verified its files, else why not."""
    errors = []
    for ref in trainers.fetch_checkpoint(ck.store, ck.prefix, files):  # every ref is read: no unhandled errors
        try:
            ray.get(ref)
        except ray.exceptions.RayTaskError as e:  # deliberate: a bad checkpoint means trying the next one
            errors.append(str(e.cause if getattr(e, "cause", None) else e).splitlines()[0][:500])
    if not errors:
        return None
    ray.get(trainers.drop_fetched_checkpoint())
    return errors[0]


def load_first_valid(trainers, found: list[tuple[ckpt.Checkpoint, dict]], num_ranks: int) -> ckpt.Checkpoint:
    """Load into every rank the first candidate whose files all verify; warn about each one skipped."""
    for ck, files in found:
        state = ckpt.read_state(ck, files)
        if state["num_trainer_ranks"] != num_ranks:
            raise ResumeError(f"{ck.url} was saved by {state['num_trainer_ranks']} trainer ranks; resume "
                              f"with trainer.num_ranks={state['num_trainer_ranks']}")
        why = _try_fetch(trainers, ck, files)
        if why is not None:
            ckpt.log.warning("skipping checkpoint %s: %s", ck.url, why)
            continue
        ray.get(trainers.load_checkpoint())
        return ck
    raise ResumeError("no checkpoint could be loaded: " + ", ".join(ck.url for ck, _ in found))


@task(name="restore-checkpoint", cache_policy=NO_CACHE)
def restore(cfg: RunConfig, found: list[tuple[ckpt.Checkpoint, dict]]) -> int:
    """Load the newest loadable candidate into the trainer ranks; returns iterations done."""
    ck = load_first_valid(get_runtime(cfg).trainers, found, cfg.trainer.num_ranks)
    get_run_logger().info("resumed from %s: %d iterations done", ck.url, ck.step)
    return ck.step


def save(trainers, store: ExperimentStore, step: int, state: dict, config_yaml: str,
         keep_last: int) -> str:
    """Every rank uploads its part, then MANIFEST -> COMMITTED -> latest; then retention."""
    ck = ckpt.at_step(store, step)
    ckpt.begin(ck)
    files: dict[str, dict] = {}
    for rank_files in ray.get(trainers.save_checkpoint(store, ck.prefix)):
        files.update(rank_files)
    ckpt.fault_point("KILL_DURING_SAVE", step)
    url = ckpt.commit(ck, files, state, config_yaml)
    ckpt.fault_point("KILL_AFTER_COMMIT", step)
    ckpt.apply_retention(store, keep_last)
    return url


@task(name="save-checkpoint", cache_policy=NO_CACHE)
def save_checkpoint(cfg: RunConfig, step: int) -> str:
    rt = get_runtime(cfg)
    state = ckpt.state_for(step, cfg.rollout.prompts_per_iteration, cfg.data.seed, cfg.trainer.num_ranks)
    return save(rt.trainers, rt.store, step, state, dump_config(cfg), cfg.checkpoint.keep_last)
