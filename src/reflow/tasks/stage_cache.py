"""Stage results persisted per (experiment, iteration, stage), so a re-run skips finished stages.

After `generate` and after `reward` the batch is written (from inside Ray: it never reaches the
driver) as `iterations/NNNNNN/stages/<stage>.batch.json`, then a small `<stage>.json` naming its sha256,
the stats the driver needs and a key of every setting that shaped it. The JSON is written last,
so its presence marks a complete record. A flow run that crashed in `train` (or later) and is run
again loads the iteration's scored rollouts instead of asking the engines again; a record whose
key differs (the sampling settings, the data or the reward changed) is ignored and overwritten.
The policy version of iteration i is a function of the checkpoint it resumed from, so the same
(iteration, key) means the same rollouts.

Plain JSON, never pickle: anyone who can write the bucket can replace these files (and the sha256
record beside them), so reading one back must not be able to run code.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import TYPE_CHECKING, Any

import ray

from reflow.infra.store.storage import ExperimentStore
from reflow.rl.types import RolloutBatch

if TYPE_CHECKING:  # the config's schema imports torch (its algorithms); save_stage/load_stage's task workers need neither
    from reflow.infra.config.schema import RunConfig

STAGES = ("generated", "scored")


def stage_key(cfg: RunConfig, stage: str) -> str:
    """sha256 of the settings that determine a stage's output (besides the iteration)."""
    r, a = cfg.rollout, cfg.algorithm
    parts = {"seed": cfg.seed, "model": cfg.model.path, "data": cfg.data.model_dump(),
             "sampling": {k: getattr(r, k) for k in ("prompts_per_iteration", "n_samples_per_prompt", "temperature",
                                                     "top_p", "top_k", "max_new_tokens", "seeded_sampling",
                                                     "skip_special_tokens", "no_stop_trim")}}
    if r.generate_fn != type(r).model_fields["generate_fn"].default:  # default: the key records made before it had
        parts["generate_fn"] = r.generate_fn
    if r.max_staleness:  # an asynchronous run's batch i comes from an older policy than a synchronous run's
        parts["max_staleness"] = r.max_staleness
    if r.partial != "off":  # partial rollouts: the pool, its rounds and what it carries shape the batch
        parts["partial"] = [r.partial, r.partial_chunk_tokens, r.over_sample]
    if stage == "scored":
        parts["reward"] = {k: getattr(a, k) for k in ("dynamic_sampling", "max_sampling_rounds", "overlong_buffer",
                                                      "overlong_penalty")}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


FORMAT = "json-v1"  # records of other formats (the pickles of earlier versions) are never loaded
_FIELDS = {f.name for f in dataclasses.fields(RolloutBatch)}


def _rel(store: ExperimentStore, iteration: int, stage: str, ext: str) -> str:
    return f"{store.iteration_dir(iteration)}/stages/{stage}.{ext}"


def save_stage_local(batch: RolloutBatch, store: ExperimentStore, iteration: int, stage: str, key: str,
                     stats: dict[str, float]) -> str:
    """The batch as JSON (`<stage>.batch.json`), then its record (`<stage>.json`, written last)."""
    fields = {f: getattr(batch, f) for f in sorted(_FIELDS)}
    data = json.dumps({"format": FORMAT, "fields": fields}, default=_plain).encode()
    store.write_bytes(_rel(store, iteration, stage, "batch.json"), data)
    return store.write_json(_rel(store, iteration, stage, "json"),
                            {"key": key, "format": FORMAT, "sha256": hashlib.sha256(data).hexdigest(),
                             "samples": len(batch), "stats": stats})


def load_stage_local(store: ExperimentStore, iteration: int, stage: str, sha256: str) -> RolloutBatch:
    """The batch `save_stage_local` wrote: plain JSON into RolloutBatch's own fields, nothing else."""
    rel = _rel(store, iteration, stage, "batch.json")
    data = store.read_bytes(rel)
    again = f"delete {store.url(store.iteration_dir(iteration), 'stages')} to generate it again"
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError(f"{store.url(rel)}: sha256 does not match its record; {again}")
    doc = json.loads(data)
    fields = doc.get("fields") if isinstance(doc, dict) and doc.get("format") == FORMAT else None
    if not isinstance(fields, dict):
        raise ValueError(f"{store.url(rel)}: not a {FORMAT} stage file; {again}")
    unknown = sorted(set(fields) - _FIELDS)
    if unknown:
        raise ValueError(f"{store.url(rel)}: unknown fields {unknown[:5]} for a rollout batch; {again}")
    return RolloutBatch(**fields)


def _plain(x: Any) -> Any:
    """numpy scalars and arrays (labels read from parquet) as plain JSON values."""
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"cannot store a {type(x).__name__} in a stage file")


save_stage = ray.remote(num_cpus=0)(save_stage_local)
load_stage = ray.remote(num_cpus=0)(load_stage_local)


def find(store: ExperimentStore, iteration: int, stage: str, key: str) -> dict | None:
    """The record of a complete persisted stage with this key, or None."""
    rel = _rel(store, iteration, stage, "json")
    if not store.exists(rel):
        return None
    meta = store.read_json(rel)
    return meta if meta.get("key") == key and meta.get("format") == FORMAT else None
