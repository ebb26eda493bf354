"""Driver-side handle on the trainer ranks: one named Ray actor per data-parallel rank.

Methods fan a call out to every rank and return the ObjectRefs; the caller decides when to wait
(slime's actor-group style). Most trainer methods are collective (torch.distributed / ZeRO-3
gathers inside), so always call them through the group, on all ranks at once, and wait on all refs
before issuing the next collective call.
"""
from __future__ import annotations

import socket
import time

import ray

from reflow.engines.train.trainer import TrainerRank
from reflow.engines.weights.settings import PushSettings


class TrainerInitError(RuntimeError):
    """The trainer ranks could not be started or did not finish initialising."""


def actor_name(name_prefix: str, rank: int) -> str:
    return f"{name_prefix}-trainer-{rank}"


def _free_port() -> int:
    """A TCP port free on this node now (the OS picks it; a small race with other processes remains)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _fan_out(method: str):
    """A TrainerGroup method calling the rank method `method` on every rank (see `TrainerGroup._all`)."""
    def call(self, *args, **kw) -> list:
        return self._all(method, *args, **kw)

    call.__name__ = call.__qualname__ = method
    call.__doc__ = f"`{method}` on every rank at once: one ObjectRef per rank, in rank order."
    return call


class TrainerGroup:
    rank_cls = TrainerRank  # the class each actor hosts (reflow.engines.train.critic.CriticGroup: CriticRank)

    def __init__(self, actors: list, namespace: str, name_prefix: str):
        self.actors, self.namespace, self.name_prefix = actors, namespace, name_prefix
        self._init: tuple[float, str] = (600.0, "unknown")  # (init timeout s, rendezvous) of `create`

    def __len__(self) -> int:
        return len(self.actors)

    @classmethod
    def create(cls, num_ranks: int, namespace: str, name_prefix: str, num_cpus_per_rank: float = 1, *,
               num_gpus_per_rank: float = 0, detached: bool = False, init_timeout_s: float = 600.0,
               master_addr: str | None = None, master_port: int | None = None,
               runtime_env: dict | None = None, options_per_rank: list[dict] | None = None,
               wait: bool = True, **rank_kwargs) -> TrainerGroup:
        """Start `num_ranks` TrainerRank actors and wait until all have joined the process group
        (`wait=False`: return at once; the caller starts other actors meanwhile, then `wait_ready()`).

        `rank_kwargs` go to `rank_cls.__init__` (model_path, settings: a RankSettings, ...); `options_per_rank`
        are extra Ray actor options of each rank (a placement-group bundle). The rendezvous
        address defaults to this node's IP and a free port here, which assumes rank 0 lands on the
        driver's node (true on one machine); on a multi-node cluster pass master_addr/master_port.
        """
        addr = master_addr or ray.util.get_node_ip_address()
        port = master_port or _free_port()
        options = dict(namespace=namespace, num_cpus=num_cpus_per_rank, num_gpus=num_gpus_per_rank,
                       max_restarts=0)  # a restarted rank could not rejoin the process group
        if detached:
            options["lifetime"] = "detached"
        if runtime_env:
            options["runtime_env"] = runtime_env
        remote_cls = ray.remote(cls.rank_cls)
        per = options_per_rank or [{}] * num_ranks  # e.g. a placement-group bundle per rank (colocated mode)
        actors = [remote_cls.options(name=actor_name(name_prefix, r), **options, **per[r])
                  .remote(r, num_ranks, addr, port, **rank_kwargs) for r in range(num_ranks)]
        group = cls(actors, namespace, name_prefix)
        group._init = (init_timeout_s, f"{addr}:{port}")
        if wait:
            group.wait_ready()
        return group

    @classmethod
    def attach(cls, num_ranks: int, namespace: str, name_prefix: str) -> TrainerGroup:
        """Handles on ranks created earlier (e.g. detached, by a previous flow run)."""
        actors = []
        for r in range(num_ranks):
            try:
                actors.append(ray.get_actor(actor_name(name_prefix, r), namespace=namespace))
            except ValueError as e:  # Ray's "actor not found"
                raise TrainerInitError(f"no trainer actor {actor_name(name_prefix, r)!r} in namespace "
                                       f"{namespace!r}: create the group first") from e
        return cls(actors, namespace, name_prefix)

    def wait_ready(self) -> list[dict]:
        """Init is collective, so all actors were created first; now fail fast on the first broken rank."""
        timeout_s, rendezvous = self._init
        pending = {a.ping.remote(): r for r, a in enumerate(self.actors)}
        infos: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self.kill()
                raise TrainerInitError(
                    f"trainer ranks {sorted(pending.values())} of {self.name_prefix!r} did not finish initialising "
                    f"within {timeout_s:.0f}s (rendezvous {rendezvous}). Either the cluster lacks the CPUs/GPUs for "
                    f"{len(self.actors)} ranks (actors stay pending), or a rank hangs in init_distributed waiting "
                    f"for a peer.")
            rank = pending.pop(ready[0])
            try:
                infos[rank] = ray.get(ready[0])
            except ray.exceptions.RayActorError as e:
                self.kill()
                raise TrainerInitError(f"trainer rank {rank} of {self.name_prefix!r} failed to initialise: {e}") from e
        return [infos[r] for r in range(len(self.actors))]

    # Each method below returns one ObjectRef per rank.

    def _all(self, method: str, *args, **kw) -> list:
        """Call `method` on every rank at once; one ObjectRef per rank, in rank order."""
        return [getattr(a, method).remote(*args, **kw) for a in self.actors]

    def ping(self) -> list:
        return self._all("ping")

    def train_iteration(self, batch, **kw) -> list:
        """`batch`: a RolloutBatch or an ObjectRef to one (put once here, so it is not copied per rank)."""
        ref = batch if isinstance(batch, ray.ObjectRef) else ray.put(batch)
        return self._all("train_iteration", ref, **kw)

    def push_weights(self, urls: list[str], version: str, settings: PushSettings, api_key: str | None = None) -> list:
        """Rank 0's result is the push report; the others return {}. `api_key`: the engines'."""
        return self._all("push_weights", urls, version, settings, api_key)

    # Plain fan-outs: the rank method of the same name, same arguments, on every rank.
    offload_states = _fan_out("offload_states")
    reload_states = _fan_out("reload_states")
    named_weights = _fan_out("named_weights")
    save_hf = _fan_out("save_hf")  # (local_dir)
    weights_checksum = _fan_out("weights_checksum")
    fill_weights = _fan_out("fill_weights")  # (value)
    fetch_checkpoint = _fan_out("fetch_checkpoint")  # (store, prefix, manifest)
    load_checkpoint = _fan_out("load_checkpoint")
    drop_fetched_checkpoint = _fan_out("drop_fetched_checkpoint")

    def save_checkpoint(self, store, prefix: str) -> list:
        """Each rank uploads its part under `prefix`; each ref is that rank's {relative path: sha256/bytes}."""
        return self._all("save_checkpoint", store, prefix)

    def kill(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)
