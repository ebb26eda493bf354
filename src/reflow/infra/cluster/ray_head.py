"""A long-lived local Ray head for reflow: `reflow cluster up|down|status`.

`up` starts `ray start --head --block` in its own process session (no dashboard, no usage stats,
its own temp dir) and records where it is in a state file; flows attach through `RAY_ADDRESS`.
`down` releases reflow's actors and ends *that* head by PID: `ray stop` would kill every Ray
process on the machine, including other people's clusters.

Closed to the network by default:
- Token authentication is always on. `up` writes a fresh 256-bit token to `<state dir>/auth_token`
  (mode 0600; Ray's own ~/.ray/auth_token is created world-readable) and starts Ray with
  `RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=<that file>`; clients get the same two variables from
  `HeadInfo.env()` (the path, never the token, is printed). Without it Ray 2.60 turns auth on only
  when ~/.ray/auth_token already exists, and otherwise runs code for anyone who reaches the port.
- On a loopback host every Ray socket is bound to loopback. `ray start --node-ip-address=127.0.0.1`
  alone is not enough on Linux: Ray swaps a loopback node address for the machine's own address and
  its gRPC servers bind every interface, unless `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` ("single-node
  cluster") is set, which `up` does for loopback hosts (and `HeadInfo.env()` for its clients). Pass another host only for a multi-node
  cluster; the token then guards it (tests/test_cluster_security.py checks both).
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_STATE_DIR = Path(".reflow") / "cluster"
DEFAULT_PORT = 6390


class ClusterError(RuntimeError):
    """The head could not be started, found or stopped; the message says what to do."""


@dataclass
class HeadInfo:
    address: str  # host:port clients pass as RAY_ADDRESS
    pid: int  # the `ray start --block` process; SIGTERM ends the head and its children
    temp_dir: str
    num_cpus: int
    started_at: float
    token_path: str = ""  # the head's auth token file (heads recorded before it existed: "")
    fork_socket: str = ""  # the socket of the fork server beside the head (infra/cluster/forkserver.py); "": none

    def env(self) -> dict[str, str]:
        """What a shell, a Prefect worker or a test needs to attach flows to this head."""
        if not self.token_path:  # recorded by an older reflow: the token sits in ~/.ray/auth_token
            return {"RAY_ADDRESS": self.address, "RAY_AUTH_MODE": "token"}
        return {"RAY_ADDRESS": self.address, **ray_env(Path(self.token_path), self.address.rsplit(":", 1)[0])}


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def worker_pool_config(cpus: int) -> dict[str, int | bool]:
    """Ray's worker pool for a cluster reflow starts.

    Ray keeps at most `num_workers_soft_limit` worker processes (default: the node's CPUs), actors'
    included, and kills idle task workers above it after a second. The engines and trainer ranks take
    most of that, so an iteration's short tasks (scoring, advantages, stage records) kept starting
    new workers, ~0.25 s of an iteration's reward stage with 2 engines on 2 cores, and more when an
    asynchronous run's rollouts add tasks of their own. Twice the CPUs keeps them warm.

    Ray also starts one idle worker per logical CPU when the first driver connects, and holds that
    driver's `ray.init` until they are up (raylet's worker pool). reflow's actors never use them (they
    get workers of their own) and its tasks need a few, so those starts were CPU taken from the
    driver's and the actors' own start-up: 16 workers importing Ray beside them on a 16-core GPU
    machine, 4 on a 2-core VM. Workers now start when a task first needs one (bench/RESULTS.md 19).

    Ray starts every worker at nice 15 (`worker_niceness`); a run's workers are the run itself (trainer ranks,
    engines, the rollout's tasks), so beside any other busy process on the host they all but stopped: an actor's
    2 s of CPU took 40 s beside two busy loops at nice 0, against 2 s at nice 0 (bench/worker_niceness.py,
    2 cores). They run at the niceness of everything else."""
    return {"num_workers_soft_limit": 2 * cpus, "prestart_worker_first_driver": False, "worker_niceness": 0}


def ray_setting_env(settings: dict[str, int | bool]) -> dict[str, str]:
    """Ray's settings as the RAY_<name> variables its processes read (`ray start` takes no dict)."""
    return {f"RAY_{k}": str(v).lower() if isinstance(v, bool) else str(v) for k, v in settings.items()}


def private_temp_dir() -> Path:
    """Ray's temp dir for a cluster reflow starts: `<fresh 0700 folder>/r`, not yet made (Ray makes it).

    Ray makes its temp dir, session_*, sockets/ and logs/ mode 0777 without the sticky bit, whatever
    mode they had: any local user could read the logs, replace or delete files there (a run's auth
    token: new actors then fail with InvalidAuthToken) and reach the Unix sockets. The parent, made by
    mkdtemp (0700, an unpredictable name, created exclusively) and never touched by Ray, lets no other
    user past it. Ray's sockets live under its temp dir and AF_UNIX paths are capped at 107 bytes, so
    it stays short: /tmp/reflow_ray_XXXXXXXX/r."""
    return Path(tempfile.mkdtemp(prefix="reflow_ray_", dir="/tmp")) / "r"


def write_token(path: Path) -> Path:
    """A fresh 256-bit Ray auth token in `path`, readable by its owner only (created 0600, so it is
    never readable by others, not even for a moment)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def ray_env(token_path: Path, host: str) -> dict[str, str]:
    """Environment for Ray processes of a cluster reflow starts: token auth with `token_path`, and
    single-node (loopback-only) binding when `host` is a loopback address. Clients need the same:
    without the single-node switch a client swaps a loopback address for the machine's own one and
    finds no head there."""
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}
    if host in LOOPBACK_HOSTS:
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    return env


def state_dir(path: str | Path | None = None) -> Path:
    return Path(path or os.environ.get("REFLOW_CLUSTER_DIR") or DEFAULT_STATE_DIR)


def _alive(pid: int) -> bool:
    try:  # reap it first if it is our own exited child (a zombie still answers kill 0)
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_head(path: str | Path | None = None) -> HeadInfo | None:
    """The recorded head if its process still runs; a stale record is removed."""
    f = state_dir(path) / "head.json"
    if not f.is_file():
        return None
    info = HeadInfo(**json.loads(f.read_text()))
    if not _alive(info.pid):
        f.unlink(missing_ok=True)
        return None
    return info


def has_nvidia_gpu() -> bool:
    """Whether this machine shows an NVIDIA GPU (its driver's control device), without importing torch."""
    return Path("/dev/nvidiactl").exists()


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def up(path: str | Path | None = None, port: int = DEFAULT_PORT, num_cpus: int | None = None,
       host: str = "127.0.0.1", timeout_s: float = 60.0,
       resources: dict[str, float] | None = None, fork_workers: str = "auto") -> tuple[HeadInfo, bool]:
    """Start the head unless one is recorded and alive; returns (head, started_now). `resources`: Ray
    custom resources of the head node (e.g. {"reflow_engine_node": 1}: engines asking for them run here).
    `fork_workers` (on, off, auto: on where this machine has no NVIDIA GPU): a fork server beside the head, which
    flows attaching with cluster.fork_workers not off start this node's workers through (infra/cluster/forkserver.py;
    it ends with the head, and a worker whose code changed since it imported starts plainly)."""
    current = read_head(path)
    if current is not None:
        return current, False
    if _port_open(host, port):
        raise ClusterError(f"port {host}:{port} is taken by another process; pass --port to pick another "
                           f"(or attach to that cluster with RAY_ADDRESS={host}:{port} RAY_AUTH_MODE=token)")
    d = state_dir(path).resolve()
    d.mkdir(parents=True, exist_ok=True)
    tmp = private_temp_dir()
    cpus = num_cpus or max(4, os.cpu_count() or 1)
    token = write_token(d / "auth_token")
    ray_bin = Path(sys.executable).with_name("ray")
    cmd = [str(ray_bin), "start", "--head", f"--port={port}", f"--node-ip-address={host}", "--block",
           "--include-dashboard=false", "--disable-usage-stats", f"--num-cpus={cpus}", f"--temp-dir={tmp}"]
    if resources:
        cmd.append(f"--resources={json.dumps(resources)}")
    log = open(d / "head.log", "ab")
    # Ray 2.60's head drains for up to 30 s on SIGTERM (for Ray Serve replicas on Kubernetes);
    # `reflow cluster down` means stop now, and reflow runs no Serve, so the drain is turned off.
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"}, **ray_env(token, host),
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
           **ray_setting_env(worker_pool_config(cpus))}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    fork = None
    if fork_workers == "on" or (fork_workers == "auto" and not has_nvidia_gpu()):
        from reflow.infra.cluster import forkserver

        fork = forkserver.start(tmp.parent, watch=proc.pid, new_session=True)  # it imports while the head starts
    deadline = time.monotonic() + timeout_s
    while not _port_open(host, port):
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            raise ClusterError(f"the Ray head did not come up on {host}:{port} within {timeout_s:.0f}s; "
                               f"see {d / 'head.log'}")
        time.sleep(0.2)
    time.sleep(1.0)  # the GCS port opens before the raylet registers; let it settle
    fork_socket = ""
    if fork is not None:
        try:
            if fork.wait_ready(timeout_s):
                fork_socket = fork.path
            else:  # unrecorded, no run would ask it: not left importing and idling for the head's lifetime
                fork.stop()
                print(f"reflow: no fork server beside the head: it did not listen within {timeout_s:.0f} s "
                      f"(its log: {fork.log})", file=sys.stderr)
        except RuntimeError as e:  # deliberate: the head works without it; say why it is missing
            print(f"reflow: no fork server beside the head: {e}", file=sys.stderr)
    info = HeadInfo(address=f"{host}:{port}", pid=proc.pid, temp_dir=str(tmp), num_cpus=cpus,
                    started_at=time.time(), token_path=str(token), fork_socket=fork_socket)
    (d / "head.json").write_text(json.dumps(asdict(info), indent=2))
    return info, True


def down(path: str | Path | None = None, timeout_s: float = 30.0) -> HeadInfo | None:
    """End the recorded head (and with it every actor on it); None if none was running."""
    info = read_head(path)
    if info is None:
        return None
    os.killpg(info.pid, signal.SIGTERM)  # `ray start --block` stops its children on SIGTERM
    deadline = time.monotonic() + timeout_s
    while _alive(info.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(info.pid):
        os.killpg(info.pid, signal.SIGKILL)
    (state_dir(path) / "head.json").unlink(missing_ok=True)
    return info


def use_ray_env(env: dict[str, str]) -> None:
    """Apply `env` (from `ray_env` / `HeadInfo.env()`) to this process, whose Ray is imported already:
    Ray read the single-node switch and the auth mode at import, so both are re-read here (what Ray
    itself does when it turns token auth on). Ray processes this one starts inherit the environment."""
    from ray._private import ray_constants
    from ray._raylet import Config

    os.environ.pop("RAY_AUTH_TOKEN", None)  # it would win over RAY_AUTH_TOKEN_PATH
    os.environ.update(env)
    if env.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0":
        ray_constants.ENABLE_RAY_CLUSTER = False
    Config.initialize("")


def _attach(info: HeadInfo) -> None:
    import ray

    if not ray.is_initialized():
        use_ray_env(info.env())
        ray.init(address=info.address, namespace="reflow-cli", log_to_driver=False)


def experiment_actors(prefix: str = "reflow-") -> dict[str, list[str]]:
    """{namespace: [actor names]} of reflow experiments on the connected cluster."""
    import ray

    out: dict[str, list[str]] = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"].startswith(prefix) and a["namespace"] != "reflow-cli":
            out.setdefault(a["namespace"], []).append(a["name"])
    return {ns: sorted(names) for ns, names in sorted(out.items())}


def _describe(namespace: str, name: str, known: dict[str, dict]) -> dict[str, object]:
    import ray

    from reflow.infra.cluster.actors import actor_id

    h = ray.get_actor(name, namespace=namespace)
    row: dict[str, object] = {"namespace": namespace, "actor": name, "id": actor_id(h), "node": _node_of(h, known)}
    method = "stats" if name.startswith("engine-") else "ping" if "-trainer-" in name else None
    if method is not None:
        try:
            info = ray.get(getattr(h, method).remote(), timeout=10)
            row.update({k: info[k] for k in ("weight_version", "sequences", "pid") if k in info})
            row["alive"] = True
        except (ray.exceptions.RayError, AttributeError) as e:  # deliberate: status reports it, not raises
            row["alive"] = f"no answer ({type(e).__name__})"
    return row


def status(path: str | Path | None = None) -> dict[str, object]:
    """The head (if up) and every reflow actor on it, with the node each runs on. Without a recorded head,
    the cluster `RAY_ADDRESS` names when something listens there (e.g. from a Prefect worker beside a
    KubeRay head), with the Ray environment this process has."""
    import ray

    info = read_head(path)
    if info is None:
        address = os.environ.get("RAY_ADDRESS", "")
        host, _, port = address.rpartition(":")
        if not (host and port.isdigit() and _port_open(host, int(port))):
            return {"up": False}
        if not ray.is_initialized():
            ray.init(address=address, namespace="reflow-cli", log_to_driver=False)
        return {"up": True, "address": address, "recorded": False, **_cluster_rows()}
    _attach(info)
    return {"up": True, **asdict(info), "env": info.env(), **_cluster_rows()}


def _cluster_rows() -> dict[str, list]:
    """{nodes: [...], actors: [...]}: every node Ray knows and every reflow actor with its node."""
    from reflow.engines import ray_nodes

    known = ray_nodes.nodes()
    rows = [_describe(ns, name, known) for ns, names in experiment_actors().items() for name in names]
    nodes = [{"node": ray_nodes.label(nid, n["ip"]), "alive": n["alive"],
              "custom_resources": {k: v for k, v in n["resources"].items() if _custom(k)}} for nid, n in known.items()]
    return {"nodes": nodes, "actors": rows}


def _custom(resource: str) -> bool:
    return resource not in ("CPU", "GPU", "memory", "object_store_memory") and not resource.startswith("node:")


def _node_of(handle, known: dict[str, dict]) -> str:
    """`<node id[:8]>@<ip>` of the node hosting the actor (from Ray's actor table), `(dead node)`
    appended when that node is gone; `pending` while no node hosts it."""
    from reflow.engines import ray_nodes

    rec = ray_nodes.actor_record(handle)
    if not rec["placed"]:
        return "pending" if rec["state"] != "DEAD" else "dead"
    node = known.get(rec["node_id"], {})
    return ray_nodes.label(rec["node_id"], rec["ip"]) + ("" if node.get("alive", True) else " (dead node)")


def release_experiments(path: str | Path | None = None, experiment: str | None = None,
                        prefix: str = "reflow") -> list[str]:
    """Kill the actors of one experiment (or of all) on the recorded head; returns what was killed."""
    from reflow.infra.cluster.actors import release

    info = read_head(path)
    if info is None:
        return []
    _attach(info)
    namespaces = experiment_actors(f"{prefix}-")
    if experiment is not None:
        namespaces = {ns: v for ns, v in namespaces.items() if ns == f"{prefix}-{experiment}"}
    return [f"{ns}/{name}" for ns in namespaces for name in release(ns)]
