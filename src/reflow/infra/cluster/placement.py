"""Colocated mode's placement group: engines and trainer ranks share bundles (GPUs).

One bundle per GPU (one per CPU slot on a CPU-only cluster): trainer rank r (and critic rank r)
in bundle r, engine i in bundle i mod n, n = max(ranks, engines). Each actor takes a fraction of
its bundle's GPU, so Ray shows both the same device and they take turns through SGLang's
release/resume_memory_occupation and DeepSpeed's offload (tasks/colocate.py). Engines with tensor
parallelism > 1 would need several bundles per engine and a base GPU id per engine: not built.
"""
from __future__ import annotations

from urllib.parse import urlsplit

import ray
from ray.util.placement_group import get_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

NAME = "colocate"
# GPU shares inside one bundle: trainer + critic + engine <= 1.
TRAINER_GPU, CRITIC_GPU, ENGINE_GPU = 0.4, 0.4, 0.2


class PlacementError(RuntimeError):
    """The colocation group cannot be placed (the cluster lacks the resources)."""


def bundles(num_ranks: int, num_engines: int, gpu: bool, critic: bool, rank_resources: dict | None = None,
            engine_resources: dict | None = None) -> list[dict[str, float]]:
    """The resources of each bundle: what the actors placed in it ask for (custom node resources too,
    so a bundle lands on a node that offers them, and the group spans nodes when one cannot hold it)."""
    n = max(num_ranks, num_engines)
    out: list[dict[str, float]] = [{"CPU": 0.0} for _ in range(n)]
    for r in range(num_ranks):
        out[r]["CPU"] += 2.0 if critic else 1.0
        for _ in range(2 if critic else 1):
            _add(out[r], rank_resources or {})
    for i in range(num_engines):
        out[i % n]["CPU"] += 1.0
        _add(out[i % n], engine_resources or {})
    if gpu:
        for b in out:
            b["GPU"] = 1.0
    return out


def _add(bundle: dict[str, float], resources: dict[str, float]) -> None:
    for k, v in resources.items():
        bundle[k] = bundle.get(k, 0.0) + v


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
    # PACK is soft: bundles go on one node when it can hold them all, else across nodes.
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


# ---------------------------------------------------------------- engines and trainers on different nodes

LOOPBACK = ("127.", "localhost", "::1")


def layout_problem(mode: str, disk_dir: str | None, engines: dict[str, tuple[str, str]], trainer_ip: str,
                   cluster_ips: set[str]) -> str | None:
    """Why this layout cannot work, or None. `engines`: {name: (advertised URL, IP of its node)};
    `trainer_ip`: trainer rank 0's node IP (it pushes); `cluster_ips`: IPs of the live nodes."""
    loopback = sorted(n for n, (url, _) in engines.items() if (urlsplit(url).hostname or "").startswith(LOOPBACK))
    if loopback and len(cluster_ips) > 1:
        return (f"{', '.join(loopback)} listen on loopback (cluster.bind_host), but the Ray cluster spans hosts "
                f"{sorted(cluster_ips)}: trainers and rollout tasks on another host cannot reach them. Set "
                f"cluster.bind_host=0.0.0.0 (engines then advertise their node's IP; every request needs the run's "
                f"API key)")
    away = sorted(f"{n} on {ip}" for n, (_, ip) in engines.items() if ip != trainer_ip)
    if away and mode == "tensor":
        return (f"weight_sync.mode=tensor passes shared-memory handles that only a process on trainer rank 0's host "
                f"({trainer_ip}) can open, but {', '.join(away)}: set weight_sync.mode=distributed (a broadcast "
                f"group across nodes; backend nccl between GPUs) or disk with weight_sync.disk_dir every node can "
                f"read (s3://..., or a shared mount)")
    if away and mode == "disk" and not disk_dir:
        return (f"weight_sync.mode=disk without weight_sync.disk_dir writes to a temp folder on trainer rank 0's host "
                f"({trainer_ip}), but {', '.join(away)}: set weight_sync.disk_dir to a location every node can read "
                f"(s3://bucket/prefix, or a shared mount)")
    return None


def check_layout(sync, engines: list, urls: list[str], trainer0) -> None:
    """Refuse, before the first push, engines the trainers cannot reach or push to (`layout_problem`);
    `sync`: the run's WeightSyncConfig, `trainer0`: rank 0's actor handle."""
    from reflow.engines import ray_nodes

    where = {f"engine-{i}": (url, ray_nodes.actor_record(e)["ip"]) for i, (e, url) in enumerate(zip(engines, urls))}
    ips = {n["ip"] for n in ray_nodes.nodes().values() if n["alive"]}
    problem = layout_problem(sync.mode, sync.disk_dir, where, ray_nodes.actor_record(trainer0)["ip"], ips)
    if problem is not None:
        raise PlacementError(problem)
