"""Connecting to Ray: `RAY_ADDRESS` (or the config's address) when set, else a local cluster.

Actors of one experiment live in the namespace `<prefix>-<experiment>`, so two experiments on
one cluster never collide and a later driver finds an experiment's actors by name.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import ray
from ray._private import auto_init_hook

from reflow.infra.cluster import forkserver
from reflow.infra.cluster.ray_head import (
    has_nvidia_gpu,
    private_temp_dir,
    ray_env,
    read_head,
    use_ray_env,
    worker_pool_config,
    write_token,
)
from reflow.infra.store import signing

log = logging.getLogger("reflow.ray")
_ATTACHED: list[str] = []  # the address this process attached to (empty: a cluster of its own, or none)
_CONNECTED: list[str] = []  # what connect() did first in this process (the CLI connects before the flow runs)
_QUIET: list[bool] = [False]  # the CLI asked for a quiet terminal (ops/console.py sets it)
_FORK: list[forkserver.Server] = []  # the fork server of the local cluster this process started last, if any

# Passed to every worker so actors find the same JIT-extension cache and stay quiet.
# S3-compatible endpoints and regions (not secrets) go along too, so model paths and disk pushes
# at s3:// URLs reach the same server from every actor; credentials stay with the AWS chain.
_WORKER_ENV_KEYS = ("TORCH_EXTENSIONS_DIR", "REFLOW_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_REGION",
                    "TORCHINDUCTOR_CACHE_DIR")


def namespace_for(prefix: str, experiment: str) -> str:
    return f"{prefix}-{experiment}"


def worker_env() -> dict[str, str]:
    env = {k: os.environ[k] for k in _WORKER_ENV_KEYS if k in os.environ}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.cwd() / ".cache" / "torch_extensions"))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no weight-loading bars from every actor
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return env


@contextlib.contextmanager
def inherited_by_workers(env: dict[str, str]) -> Iterator[None]:
    """`env` in this process's environment while a local cluster starts (ray.init), then as it was.

    Ray's processes of a cluster this process starts inherit its environment, and its workers theirs,
    so this is how a local cluster's workers get `env` without a job `runtime_env`: with one, even of
    env_vars only, Ray starts every worker through ray/_private/workers/setup_worker.py, a Python process
    that imports Ray's runtime-env code and then execs the real worker, after a round trip to the
    runtime-env agent: 0.31 s of CPU more for each worker on a 2-core VM (bench/worker_env.py, RESULTS 38).
    A cluster this process attaches to needs the runtime_env: its raylets were started elsewhere."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def connect(address: str | None, num_cpus: int | None, namespace: str, logging_level: int | None = None,
            fork_workers: bool = False) -> str:
    """Attach to (or start) Ray; return a short description for the logs. `fork_workers`: a local cluster's workers
    start through a fork server (`fork_workers_wanted`).

    Already-initialised Ray (tests, a notebook) is reused as it is.
    """
    if ray.is_initialized():
        how = f" ({_CONNECTED[0]})" if _CONNECTED else ""
        return f"reusing the Ray cluster this process is already connected to{how}"
    _CONNECTED[:] = [_connect(address, num_cpus, namespace, logging_level, fork_workers)]
    return _CONNECTED[0]


def connect_for(cluster, namespace: str, logging_level: int | None = None) -> str:
    """`connect` with a run's cluster settings (config `cluster`)."""
    return connect(cluster.address, cluster.num_cpus, namespace, logging_level, fork_workers_wanted(cluster))


def fork_workers_wanted(cluster) -> bool:
    """cluster.fork_workers resolved. Attaching (an address): whether to use the fork server `reflow cluster up`
    started with the head, if it did (auto, on). A local cluster: only on. Its server's imports cost more CPU than a
    short run's few actors save: `bench/startup.py` (one `reflow train` of the demo, ABBA) spent 1.28x and 1.59x the
    CPU with it, for a first iteration 0.74x and 1.05x as late (bench/RESULTS.md 56); a long-lived head's server
    serves every run."""
    if cluster.address or os.environ.get("RAY_ADDRESS"):
        return cluster.fork_workers != "off"
    return cluster.fork_workers == "on"


def quiet_ray(on: bool) -> None:
    """Ray's own INFO lines ("Started a local Ray instance") are left out of a quiet terminal."""
    _QUIET[0] = on


def ray_logging_level() -> int:
    """For ray.init: INFO, or WARNING while the terminal is quiet."""
    return logging.WARNING if _QUIET[0] else logging.INFO


def _connect(address: str | None, num_cpus: int | None, namespace: str, logging_level: int | None = None,
             fork_workers: bool = False) -> str:
    signing.hold_env_key()  # a local cluster's processes inherit this environment: the signing key stays here
    level = ray_logging_level() if logging_level is None else logging_level
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        # The head `reflow cluster up` recorded (in this folder's .reflow/cluster or
        # $REFLOW_CLUSTER_DIR) lends its token file and loopback switch when the shell lacks them.
        head = read_head()
        if head is not None and head.address == address and "RAY_AUTH_TOKEN_PATH" not in os.environ:
            use_ray_env({k: v for k, v in head.env().items() if k != "RAY_ADDRESS"})
        job_env: dict = {"env_vars": worker_env()}
        forked = fork_workers and head is not None and head.address == address and head.fork_socket
        if forked:  # the head's fork server (workers on other nodes find no socket there and start plainly)
            job_env = {"env_vars": {**job_env["env_vars"], forkserver.ENV: head.fork_socket},
                       **forkserver.runtime_env()}
        try:
            ray.init(address=address, namespace=namespace, runtime_env=job_env, log_to_driver=True,
                     logging_level=level)
        except ConnectionError as e:
            hint = ("" if os.environ.get("RAY_AUTH_TOKEN_PATH") or os.environ.get("RAY_AUTH_MODE") == "token" else
                    " Ray 2.60 clusters use token auth: export what `reflow cluster up` printed (RAY_AUTH_MODE, "
                    "RAY_AUTH_TOKEN_PATH, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER) before starting this process.")
            raise ConnectionError(f"cannot attach to the Ray cluster at {address}: {e}.{hint} Is it up? "
                                  f"(`reflow cluster status`)") from e
        _ATTACHED[:] = [address]
        return f"connected to Ray at {address}" + (", its workers forked from the head's warm process" if forked else "")
    cpus = num_cpus or max(4, os.cpu_count() or 1)
    # A fresh temp dir (a stale ray_current_cluster file from an earlier `ray stop` would make
    # ray.init try to join a dead cluster), inside a folder only this user can enter.
    tmp = private_temp_dir()
    _closed_local_cluster(tmp.parent)
    env, job_env = worker_env(), None
    if fork_workers:  # it imports while Ray starts
        env[forkserver.ENV], job_env = _start_fork_server(tmp.parent), forkserver.runtime_env()
    for attempt in range(1, _LOCAL_START_ATTEMPTS + 1):
        if attempt > 1:  # a fresh temp dir beside the first, under the same token (Ray keeps the one it read)
            tmp = tmp.parent / f"r{attempt}"
        try:
            with inherited_by_workers(env):
                ray.init(num_cpus=cpus, namespace=namespace, include_dashboard=False, _temp_dir=str(tmp),
                         log_to_driver=True, logging_level=level, _system_config=worker_pool_config(cpus),
                         runtime_env=job_env)
            break
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this; any other is re-raised
            if attempt == _LOCAL_START_ATTEMPTS or _START_TIMEOUT not in str(e):
                raise
            log.warning("the local Ray cluster in %s did not start: %s (Ray waits a fixed 30 s for its node to "
                        "register; a loaded machine?): stopping what it started and starting once more", tmp, e)
            _stop_local_start(tmp)
    forked = ", workers forked from a warm process" if fork_workers and _fork_server_ready() else ""
    return f"started a local Ray cluster ({cpus} logical CPUs, temp dir {tmp}, loopback only, token auth{forked})"


# How long a run waits, after Ray is up, for its fork server to listen (its imports: ~8 s of CPU on a 2-core VM). Past
# it the run goes on: a worker that finds no server starts as Ray would start it.
_FORK_READY_S = 120.0


def _start_fork_server(private: Path) -> str:
    """A fork server for the local cluster about to start (infra/cluster/forkserver.py), its socket in the cluster's
    private folder; it exits with this process. One at a time: a server of an earlier cluster is stopped."""
    while _FORK:
        _FORK.pop().stop()
    _FORK.append(forkserver.start(private, watch=os.getpid()))
    return _FORK[0].path


def _fork_server_ready() -> bool:
    try:
        if _FORK[0].wait_ready(_FORK_READY_S):
            return True
        log.warning("the fork server did not listen within %.0f s (its log: %s): workers start as Ray starts them "
                    "until it does", _FORK_READY_S, _FORK[0].log)
    except RuntimeError as e:
        log.warning("%s; workers start as Ray starts them (cluster.fork_workers=off leaves the server out)", e)
    return False


# Ray's message when its node did not register in the GCS within its fixed wait (ray/_private/node.py: 30 s, a local
# variable there). Under load (session 47's clean-clone suite: two `reflow train` runs starting beside both pytest
# processes on 2 cores) a run was lost to it. One more start gets another 30 s (tests/test_ray_start_timeout.py).
_START_TIMEOUT = "timed out during startup"
_LOCAL_START_ATTEMPTS = 2


def _stop_local_start(tmp: Path) -> None:
    """After a local start that failed: Ray's own state reset, and every process still running from it (its GCS,
    raylet and agents, each started with `tmp`, a folder only this run made, in its command line) killed, so the
    next start has the machine."""
    with contextlib.suppress(Exception):  # deliberate: nothing may have been set up to shut down
        ray.shutdown()
    for p in psutil.process_iter(["cmdline"]):
        if p.pid != os.getpid() and str(tmp) in " ".join(p.info["cmdline"] or ()):
            with contextlib.suppress(psutil.Error):  # gone meanwhile
                p.kill()


class EarlyConnect:
    """A local cluster of this process's own, started by a thread while the CLI's preflight runs (`cluster.
    start_early`): ray.init of a fresh cluster took ~5 s of a GPU run's start. `then` runs in that thread once
    Ray is up (the CLI begins the run's actors there: their imports, loads and DeepSpeed's set-up, ~15 s on the
    H200, then overlap the preflight too). `join` after the preflight passed; `abandon` when it failed (waits for
    the start to end, then stops the cluster, and with it what `then` began: a bad input leaves nothing
    running). A failed start is not reported here: the normal connect that follows says why."""

    def __init__(self, num_cpus: int | None, namespace: str, verbose: bool,
                 then: Callable[[], object] | None = None, fork_workers: bool = False) -> None:
        self.description: str | None = None
        self._then, self.then_result = then, None  # what `then` returned (read after `join`)
        self._args = (None, num_cpus, namespace, logging.INFO if verbose else logging.WARNING, fork_workers)
        self._done, self._stopped = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="reflow-ray-start", daemon=True)

    @classmethod
    def begin(cls, cfg, verbose: bool, then: Callable[[], object] | None = None) -> EarlyConnect | None:
        """Started where it applies: start_early on (auto: an NVIDIA GPU here, cluster.gpus not off), no cluster
        address (config or RAY_ADDRESS) and no Ray in this process yet."""
        c = cfg.cluster
        wanted = c.start_early if c.start_early is not None else (c.gpus != "off" and has_nvidia_gpu())
        if not wanted or c.address or os.environ.get("RAY_ADDRESS") or ray.is_initialized():
            return None
        early = cls(c.num_cpus, namespace_for(c.namespace_prefix, cfg.experiment), verbose, then,
                    fork_workers_wanted(c))
        early._thread.start()
        return early

    def _run(self) -> None:
        quiet = _NotMainThreadWarning()
        logging.getLogger("ray._private.worker").addFilter(quiet)  # its SIGTERM line: the CLI handles SIGTERM
        try:
            self.description = connect(*self._args)
        except Exception as e:  # deliberate: the normal connect after the preflight tries again and says why
            log.debug("Ray's start beside the preflight failed (%s); connecting again after it", e)
        finally:
            logging.getLogger("ray._private.worker").removeFilter(quiet)
        if self.description is not None and self._then is not None and not self._stopped.is_set():
            try:
                self.then_result = self._then()
            except Exception as e:  # deliberate: what `then` began is begun again (or not) after the preflight
                log.debug("what was to start once Ray was up failed (%s)", e)
        self._done.set()
        # Ray's daemons die with the *thread* that started them (Linux's parent-death signal follows the
        # thread): this one stays until the cluster is stopped or the process ends.
        self._stopped.wait()

    def join(self) -> str | None:
        """After the preflight: what the start did (None when it failed)."""
        self._done.wait()
        return self.description

    def abandon(self) -> None:
        """The preflight failed: stop the cluster this thread started (the actors `then` began die with it)."""
        self._done.wait()
        if self.description is not None and ray.is_initialized():
            _no_auto_init()  # what `then` began may still call Ray: that must fail, not start another cluster
            ray.shutdown()
            _CONNECTED.clear()
        self._stopped.set()


def _no_auto_init() -> None:
    """Ray starts a local cluster on a call made without one (`ray.get`, an actor's creation), unless told not to
    (RAY_ENABLE_AUTO_CONNECT=0, read once at import: the module's flag is set here, so it holds now)."""

    os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"
    auto_init_hook.enable_auto_connect = False


class _NotMainThreadWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "not the main thread" not in record.getMessage()


def _closed_local_cluster(private: Path) -> None:
    """Make the cluster `ray.init` is about to start in this process loopback-only and token-
    authenticated, as `reflow cluster up` does (infra/cluster/ray_head.py says why each piece is needed).
    The token file is private to this run: 0600, in the 0700 folder around Ray's temp dir (`private`),
    never in Ray's temp dir itself, which Ray makes 0777; Ray's own default, ~/.ray/auth_token, is
    created world-readable."""
    use_ray_env(ray_env(write_token(private / "auth_token"), "127.0.0.1"))


def attached_to_running_cluster() -> bool:
    """True when this process attached to a cluster that outlives it (RAY_ADDRESS / cluster.address):
    then an experiment's actors are detached and later flow runs reuse them."""
    return bool(_ATTACHED) and ray.is_initialized()
