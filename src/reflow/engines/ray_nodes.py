"""Where actors run on a multi-node Ray cluster, read from Ray's GCS (no call into the actor, which may
be busy, and no dashboard, which reflow's clusters do not run).

An actor that asks for resources no live node offers (`rollout.node_resources`, `trainer.node_resources`
naming a node that died or was never started) stays PENDING_CREATION forever: Ray does not fail it.
`wait_placed` bounds that wait and fails with a message naming the actor, what it asks for and which
nodes offer it, dead ones included, so a lost node ends the run instead of hanging it.
"""
from __future__ import annotations

import time
from collections.abc import Mapping

import ray
from ray._private import state


class ActorNotPlaced(RuntimeError):
    """An actor was not placed on any node within the placement timeout."""


def nodes() -> dict[str, dict]:
    """{node id: {ip, alive, resources}} of every node the cluster has known, dead ones included."""
    return {n["NodeID"]: {"ip": n.get("NodeManagerAddress", ""), "alive": bool(n.get("Alive")),
                          "resources": dict(n.get("Resources") or {})} for n in ray.nodes()}


def label(node_id: str, ip: str) -> str:
    """How a node is named in messages and `reflow cluster status`: its id's first 8 hex digits @ its IP."""
    return f"{node_id[:8]}@{ip}"


def actor_record(handle) -> dict:
    """{state, pid, node_id, ip, placed} of an actor; `placed` once a worker on some node hosts it
    (its constructor may still run: Ray says PENDING_CREATION for both)."""

    info = state.actors(handle._actor_id.hex()) or {}
    address = info.get("Address") or {}
    placed = bool(info.get("Pid")) and bool(address.get("Port"))
    return {"state": info.get("State", "UNKNOWN"), "pid": info.get("Pid") or None, "placed": placed,
            "node_id": address.get("NodeID", "") if placed else "", "ip": address.get("IPAddress", "") if placed else ""}


def offering(resources: Mapping[str, float], known: dict[str, dict]) -> tuple[list[str], list[str]]:
    """(live, dead) nodes (`label`) whose resources include every custom resource asked for; a dead node
    whose resources Ray no longer reports counts as dead and offering (it may be the one that was lost)."""
    custom = [k for k in resources if k not in ("CPU", "GPU", "memory")]
    hits = [(nid, n) for nid, n in known.items()
            if all(k in n["resources"] for k in custom) or (not n["alive"] and not n["resources"])]
    return ([label(nid, n["ip"]) for nid, n in hits if n["alive"]], [label(nid, n["ip"]) for nid, n in hits if not n["alive"]])


def unplaced_message(what: str, resources: Mapping[str, float], timeout_s: float, known: dict[str, dict]) -> str:
    live, dead = offering(resources, known)
    where = (f"live nodes offering them: {', '.join(live)} (busy: other actors hold them)" if live
             else "no live node offers them")
    lost = f"; dead nodes that offered them (or whose resources Ray no longer reports): {', '.join(dead)}" if dead else ""
    return (f"{what} was not placed on any node within {timeout_s:.0f}s: it asks for {dict(resources)}; {where}{lost}. "
            f"Start (or restart) a node with these resources (`ray start --address=... --resources=...`), or change "
            f"rollout.node_resources / trainer.node_resources; cluster.placement_timeout_s bounds this wait")


def wait_placed(actors: Mapping[str, tuple], timeout_s: float, poll_s: float = 0.2) -> None:
    """Wait until every actor ({name: (handle, resources it asks for)}) is hosted by a worker (or dead);
    raise ActorNotPlaced naming the first that is not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    waiting = dict(actors)
    while waiting:
        for name, (handle, _) in list(waiting.items()):
            rec = actor_record(handle)
            if rec["placed"] or rec["state"] == "DEAD":  # a dead one: the caller's next call reports Ray's reason
                waiting.pop(name)
        if waiting and time.monotonic() > deadline:
            name, (_, resources) = next(iter(waiting.items()))
            raise ActorNotPlaced(unplaced_message(name, resources, timeout_s, nodes()))
        if waiting:
            time.sleep(poll_s)
