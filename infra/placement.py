"""Colocated mode's placement group: engines and trainer ranks share bundles (GPUs).

One bundle per GPU (one per CPU slot on a CPU-only cluster): trainer rank r (and critic rank r)
in bundle r, engine i in bundle i mod n, n = max(ranks, engines). Each actor takes a fraction of
its bundle's GPU, so Ray shows both the same device and they take turns through SGLang's
release/resume_memory_occupation and DeepSpeed's offload (tasks/colocate.py). Engines with tensor
parallelism > 1 would need several bundles per engine and a base GPU id per engine: not built.
"""
from __future__ import annotations

import ray
from ray.util.placement_group import get_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

NAME = "colocate"
# GPU shares inside one bundle: trainer + critic + engine <= 1.
TRAINER_GPU, CRITIC_GPU, ENGINE_GPU = 0.4, 0.4, 0.2


class PlacementError(RuntimeError):
    """The colocation group cannot be placed (the cluster lacks the resources)."""


def bundles(num_ranks: int, num_engines: int, gpu: bool, critic: bool) -> list[dict[str, float]]:
    """The resources of each bundle: what the actors placed in it ask for."""
    n = max(num_ranks, num_engines)
    out = [{"CPU": 0.0} for _ in range(n)]
    for r in range(num_ranks):
        out[r]["CPU"] += 2.0 if critic else 1.0
    for i in range(num_engines):
        out[i % n]["CPU"] += 1.0
    if gpu:
        for b in out:
            b["GPU"] = 1.0
    return out


def gpus_on(setting: str, sglang: bool, cluster_gpus: float) -> bool:
    """Whether trainer ranks and engines take GPUs (cluster.gpus; SGLang engines always run on GPUs)."""
    if setting == "off" and not sglang:
        return False
    return setting == "on" or sglang or cluster_gpus > 0


def check_gpus(need: float, cluster_gpus: float, layout: str) -> None:
    """Refuse a layout the cluster cannot hold before any actor asks (Ray would leave them pending)."""
    if need > cluster_gpus:
        raise PlacementError(f"{layout} needs {need:g} GPU(s) but the Ray cluster has {cluster_gpus:g}: lower "
                             f"trainer.num_ranks / rollout.num_engines, set cluster.colocate=true (engines share the "
                             f"trainers' GPUs) or cluster.gpus=off (CPU only)")


def group(spec: list[dict[str, float]], namespace: str, detached: bool, timeout_s: float = 120.0):
    """Get (a detached one left by an earlier flow run, when its bundles match) or create the group."""
    name = f"{NAME}-{namespace}"  # one per experiment: group names are shared by every driver of a job namespace
    try:
        existing = get_placement_group(name)
    except ValueError:  # Ray's "not found"
        existing = None
    if existing is not None:
        if ray.util.placement_group_table(existing).get("bundles", {}) == dict(enumerate(spec)):
            return existing
        remove_placement_group(existing)
    pg = placement_group(spec, strategy="PACK", name=name, lifetime="detached" if detached else None)
    if not pg.wait(timeout_s):
        remove_placement_group(pg)
        raise PlacementError(f"colocated mode needs bundles {spec} in namespace {namespace!r}, which the cluster "
                             f"({ray.cluster_resources()}) could not place within {timeout_s:.0f}s: give it more "
                             f"CPUs/GPUs or lower trainer.num_ranks / rollout.num_engines")
    return pg


def in_bundle(pg, index: int) -> dict:
    """Actor options placing it in bundle `index` of `pg` (its tasks are not pulled in)."""
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=index, placement_group_capture_child_tasks=False)}


def release(pg) -> None:
    if pg is not None:
        remove_placement_group(pg)
