"""Stage results persisted per (experiment, iteration, stage), so a re-run skips finished stages.

After `generate` and after `reward` the batch is written (from inside Ray: it never reaches the
driver) as `iterations/NNNNNN/stages/<stage>.pkl`, then a small `<stage>.json` naming its sha256,
the stats the driver needs and a key of every setting that shaped it. The JSON is written last,
so its presence marks a complete record. A flow run that crashed in `train` (or later) and is run
again loads the iteration's scored rollouts instead of asking the engines again; a record whose
key differs (the sampling settings, the data or the reward changed) is ignored and overwritten.
The policy version of iteration i is a function of the checkpoint it resumed from, so the same
(iteration, key) means the same rollouts.
"""
from __future__ import annotations

import hashlib
import json
import pickle

import ray

from reflow.infra.config import RunConfig
from reflow.infra.storage import ExperimentStore
from reflow.rl.types import RolloutBatch

STAGES = ("generated", "scored")


def stage_key(cfg: RunConfig, stage: str) -> str:
    """sha256 of the settings that determine a stage's output (besides the iteration)."""
    r, a = cfg.rollout, cfg.algorithm
    parts = {"seed": cfg.seed, "model": cfg.model.path, "data": cfg.data.model_dump(),
             "sampling": {k: getattr(r, k) for k in ("prompts_per_iteration", "n_samples_per_prompt", "temperature",
                                                     "top_p", "top_k", "max_new_tokens", "seeded_sampling")}}
    if stage == "scored":
        parts["reward"] = {k: getattr(a, k) for k in ("dynamic_sampling", "max_sampling_rounds", "overlong_buffer",
                                                      "overlong_penalty")}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _rel(store: ExperimentStore, iteration: int, stage: str, ext: str) -> str:
    return f"{store.iteration_dir(iteration)}/stages/{stage}.{ext}"


@ray.remote(num_cpus=0)
def save_stage(batch: RolloutBatch, store: ExperimentStore, iteration: int, stage: str, key: str,
               stats: dict[str, float]) -> str:
    data = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
    store.write_bytes(_rel(store, iteration, stage, "pkl"), data)
    return store.write_json(_rel(store, iteration, stage, "json"),
                            {"key": key, "sha256": hashlib.sha256(data).hexdigest(), "samples": len(batch),
                             "stats": stats})


@ray.remote(num_cpus=0)
def load_stage(store: ExperimentStore, iteration: int, stage: str, sha256: str) -> RolloutBatch:
    data = store.read_bytes(_rel(store, iteration, stage, "pkl"))
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError(f"{store.url(_rel(store, iteration, stage, 'pkl'))}: sha256 does not match its record; "
                         f"delete {store.url(store.iteration_dir(iteration), 'stages')} to generate it again")
    return pickle.loads(data)


def find(store: ExperimentStore, iteration: int, stage: str, key: str) -> dict | None:
    """The record of a complete persisted stage with this key, or None."""
    rel = _rel(store, iteration, stage, "json")
    if not store.exists(rel):
        return None
    meta = store.read_json(rel)
    return meta if meta.get("key") == key else None
