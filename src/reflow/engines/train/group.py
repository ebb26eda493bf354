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

from reflow.engines.ray_nodes import ActorNotPlaced, wait_placed
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


class _TwoPhase:
    """Mixed in before a rank class: the actor starts without joining the process group, tells where it
    runs (`rendezvous`), and joins once rank 0's answer is known (`join`)."""

    def __init__(self, rank: int, world_size: int, *args, **kwargs):
        self._pending = (rank, world_size, args, kwargs)

    def rendezvous(self) -> tuple[str, int]:
        """This node's IP and a TCP port free on it (rank 0 then serves the process group's store there)."""
        return ray.util.get_node_ip_address(), _free_port()

    def join(self, where: tuple[str, int]) -> dict:
        """The rank class's own __init__ (joins the process group, builds the model), then its ping."""
        rank, world_size, args, kwargs = self._pending
        super().__init__(rank, world_size, where[0], where[1], *args, **kwargs)  # type: ignore[call-arg]
        return self.ping()  # type: ignore[attr-defined]


_TWO_PHASE: dict[type, type] = {}


def two_phase(rank_cls: type) -> type:
    """`rank_cls` started in two phases (`_TwoPhase`); one class per rank class, so Ray exports it once."""
    if rank_cls not in _TWO_PHASE:
        _TWO_PHASE[rank_cls] = type(rank_cls.__name__, (_TwoPhase, rank_cls), {"__module__": __name__})
    return _TWO_PHASE[rank_cls]


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
        self._joins: list = []  # each rank's `join` ref (`create`); `wait_ready` waits on them
        self._placement: tuple[float, dict] = (600.0, {})  # (placement timeout s, what each rank asks for)

    def __len__(self) -> int:
        return len(self.actors)

    @classmethod
    def create(cls, num_ranks: int, namespace: str, name_prefix: str, num_cpus_per_rank: float = 1, *,
               num_gpus_per_rank: float = 0, detached: bool = False, init_timeout_s: float = 600.0,
               master_addr: str | None = None, master_port: int | None = None,
               runtime_env: dict | None = None, options_per_rank: list[dict] | None = None,
               resources: dict[str, float] | None = None, placement_timeout_s: float = 600.0,
               wait: bool = True, **rank_kwargs) -> TrainerGroup:
        """Start `num_ranks` TrainerRank actors and wait until all have joined the process group
        (`wait=False`: return at once; the caller starts other actors meanwhile, then `wait_ready()`).

        `rank_kwargs` go to `rank_cls.__init__` (model_path, settings: a RankSettings, ...); `options_per_rank`
        are extra Ray actor options of each rank (a placement-group bundle); `resources` are Ray custom
        resources every rank asks for (trainer.node_resources: which nodes may host them).

        Two phases, so the rendezvous is on rank 0's node, which on a multi-node cluster need not be the
        driver's: each rank starts without joining, rank 0 names its node's IP and a free port there, and
        every rank joins with that (the reference is passed on, so nothing here waits). `master_addr` /
        `master_port` skip the first phase. A rank no live node can host fails `wait_ready` after
        `placement_timeout_s`, naming the resources and the nodes that offer them.
        """
        options = dict(namespace=namespace, num_cpus=num_cpus_per_rank, num_gpus=num_gpus_per_rank,
                       max_restarts=0)  # a restarted rank could not rejoin the process group
        if detached:
            options["lifetime"] = "detached"
        if runtime_env:
            options["runtime_env"] = runtime_env
        if resources:
            options["resources"] = dict(resources)
        remote_cls = ray.remote(two_phase(cls.rank_cls))
        per = options_per_rank or [{}] * num_ranks  # e.g. a placement-group bundle per rank (colocated mode)
        actors = [remote_cls.options(name=actor_name(name_prefix, r), **options, **per[r])
                  .remote(r, num_ranks, **rank_kwargs) for r in range(num_ranks)]
        fixed = master_addr is not None and master_port is not None
        where = (master_addr, master_port) if fixed else actors[0].rendezvous.remote()
        group = cls(actors, namespace, name_prefix)
        group._joins = [a.join.remote(where) for a in actors]
        group._init = (init_timeout_s, f"{master_addr}:{master_port}" if fixed else "rank 0's node, a free port")
        asks = {"CPU": num_cpus_per_rank, "GPU": num_gpus_per_rank, **(resources or {})}
        group._placement = (placement_timeout_s, {k: v for k, v in asks.items() if v})
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
        placement_s, asks = self._placement
        try:  # a rank no live node can host would stay pending: bounded here, with the nodes named
            wait_placed({actor_name(self.name_prefix, r): (a, asks) for r, a in enumerate(self.actors)}, placement_s)
        except ActorNotPlaced as e:
            self.kill()
            raise TrainerInitError(f"trainer ranks of {self.name_prefix!r}: {e}") from e
        pending = {ref: r for r, ref in enumerate(self._joins or [a.ping.remote() for a in self.actors])}
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
