"""Reusing an experiment's actors across flow runs on a long-lived cluster.

On a cluster this process did not start (`RAY_ADDRESS`, e.g. `reflow cluster up`), engines and
trainer ranks are *detached* named actors in the namespace `<prefix>-<experiment>`, so they outlive
the flow run that made them. The next flow run of the experiment finds them by name and reuses
them when they were built from the same settings (a fingerprint of the config fields that shape
the actors, kept by a tiny detached `runtime-record` actor) and still answer; otherwise it kills
and recreates them. Whether their *weights* may be reused is decided later against the checkpoint
(flows/train.py: trainer checksum == the checkpoint's recorded checksum).
"""
from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import ray

from reflow.infra.config.schema import RunConfig
from reflow.infra.config.settings import total_steps

log = logging.getLogger("reflow.actors")
RECORD = "runtime-record"


class RuntimeRecord:
    """What the experiment's actors were built from (hosted as a detached, zero-CPU actor)."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}

    def get(self) -> dict[str, Any]:
        return self.data

    def set(self, data: dict[str, Any]) -> None:
        self.data = dict(data)


def actor_spec(cfg: RunConfig) -> dict[str, Any]:
    """The config fields that shape the actors themselves (not per-call arguments)."""
    r, t = cfg.rollout, cfg.trainer
    total = total_steps(cfg)
    spec = {
        "seed": cfg.seed, "model": cfg.model.model_dump(), "colocate": cfg.cluster.colocate,
        "engines": {k: getattr(r, k) for k in ("backend", "num_engines", "engine_threads", "max_batch_size",
                                               "tp_size", "mem_fraction_static", "kv_mem_fraction", "kv_reserve", "kv_cache_dtype",
                                               "router",
                                               "node_resources")},
        "trainer": t.model_dump(exclude={"total_steps_hint"}), "needs_ref": cfg.algorithm.needs_ref,
        # A decaying schedule depends on the run's length; a constant one does not.
        "schedule_steps": None if t.lr_schedule == "constant" else total,
    }
    critic = getattr(cfg, "critic", None)
    if critic is not None and cfg.algorithm.spec.needs_critic:
        spec["critic"] = critic.model_dump()
    return spec


def fingerprint(cfg: RunConfig) -> str:
    return hashlib.sha256(json.dumps(actor_spec(cfg), sort_keys=True, default=str).encode()).hexdigest()[:16]


def actor_id(handle) -> str:
    return handle._actor_id.hex()


def record(namespace: str):
    return (ray.remote(RuntimeRecord).options(name=RECORD, namespace=namespace, lifetime="detached",
                                              num_cpus=0, get_if_exists=True).remote())


def named_actors(namespace: str) -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == namespace)


def kill_named(namespace: str, keep: tuple[str, ...] = ()) -> list[str]:
    """Kill every named actor of `namespace` except `keep`; returns the names killed."""
    killed = []
    for name in named_actors(namespace):
        if name in keep:
            continue
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
            killed.append(name)
        except ValueError:  # deliberate: it died between listing and killing
            pass
    return killed


def answers(handles: list, method: str = "url", timeout_s: float = 30.0) -> list[bool]:
    """Which actors answer a cheap call in time (a dead or hung actor does not)."""
    refs = [getattr(h, method).remote() for h in handles]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    ok = []
    for ref in refs:
        if ref not in ready:
            ok.append(False)
            continue
        try:
            ray.get(ref)
            ok.append(True)
        except ray.exceptions.RayActorError:
            ok.append(False)
    return ok


def prepare_namespace(cfg: RunConfig, namespace: str) -> tuple[Any, dict[str, str]]:
    """(record actor, {name: actor id} of the actors an earlier flow run left that may be reused;
    empty when there are none). Actors built from other settings are killed here, so the builder's
    get-or-create makes fresh ones."""
    rec = record(namespace)
    old = ray.get(rec.get.remote())
    fp = fingerprint(cfg)
    if old and old.get("fingerprint") != fp:
        killed = kill_named(namespace, keep=(RECORD,))
        log.warning("actors of %s were built from other settings (fingerprint %s, now %s): recreated %s",
                    namespace, old.get("fingerprint"), fp, killed)
        return rec, {}
    return rec, dict(old.get("actor_ids", {}))


def release(namespace: str) -> list[str]:
    """Kill every actor of an experiment, the record included."""
    return kill_named(namespace)
