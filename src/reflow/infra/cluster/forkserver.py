"""Ray workers forked from a process that has already imported torch, transformers and DeepSpeed.

Ray starts every worker as a fresh interpreter, and a trainer rank or engine then spends most of its start importing:
~8 s of a tiny trainer rank's ~10 s of CPU on a 2-core VM (bench/RESULTS.md 55). Ray has no fork server for workers,
so this is one:

- `start(folder)` runs the server (`python forkserver.py --serve <socket> ...`) and returns while it imports the
  modules workers need (`MODULES`); then it listens on a Unix socket in `folder` (make it private: only this user may
  ask it to fork; a peer of another uid is refused anyway), and forks one child per request. Not Ray: its C++ core
  reads the worker's job id from the environment once, when it is loaded, so a server that had loaded it forks
  workers that abort (`Check failed: !job_id_env.empty()`).
- `runtime_env()` is the job's runtime_env: `py_executable` makes the raylet start this file's client as the
  worker's interpreter (`python forkserver.py --client default_worker.py ...`). The client hands the server its argv,
  environment, working folder and stdio (the socket's path comes in the environment, REFLOW_FORK_SERVER); the forked
  child takes them and runs Ray's default_worker.py as `__main__`. The client stays the process the raylet started:
  it forwards signals to the child and exits with its status, and the child exits when the client goes (a kill).
  Where the server cannot be reached the client execs the interpreter: the worker starts as Ray would have.

Used by `reflow cluster up`'s heads (infra/cluster/ray_head.py; runs attached to one use it, config
cluster.fork_workers), by a run's own local cluster where cluster.fork_workers is on (infra/cluster/ray_connect.py),
and by the test session's cluster (tests/conftest.py): 32 end-to-end tests in 158 s and 215 s of machine CPU against
284 s and 452 s started plainly (RESULTS 55).
"""
from __future__ import annotations

import sys

ENV = "REFLOW_FORK_SERVER"  # the server's socket, in the environment the workers inherit

if __name__ == "__main__" and sys.argv[1:2] == ["--client"]:  # a worker's interpreter: import nothing heavy here
    import json
    import os
    import signal
    import socket

    argv = sys.argv[2:]
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(os.environ[ENV])
    except (KeyError, OSError):  # no server: start as Ray would have
        os.execv(sys.executable, [sys.executable, *argv])
    request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "client": os.getpid()}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    answers = conn.makefile("r")
    answer = json.loads(answers.readline() or "{}")
    if "pid" not in answer:  # refused (its code changed since it imported, another namespace): start as Ray would
        conn.close()
        os.execv(sys.executable, [sys.executable, *argv])
    child = answer["pid"]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, lambda num, _frame: os.kill(child, num))
    line = answers.readline()
    sys.exit(json.loads(line)["status"] if line else 1)

import json  # noqa: E402
import os  # noqa: E402
import select  # noqa: E402
import socket  # noqa: E402
import struct  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

# What a trainer rank, an engine and the iteration's task workers import (torch and transformers under them) that
# does not import Ray (the critic's and the stage cache's modules do; they load in the worker, over these);
# "deepspeed" through ds_rank.import_deepspeed, which leaves out two imports a CPU rank never uses.
MODULES = ("torch", "transformers.models.llama.modeling_llama", "reflow.engines.train.trainer",
           "reflow.engines.embedded.engine", "reflow.rl.algorithms", "pandas", "deepspeed")


def serve(path: str, watch: int | None = None, modules: tuple[str, ...] = MODULES) -> None:
    """Import `modules`, listen on `path`, fork a worker per request; report each child's exit to its client. With
    `watch` (a pid: the process that started the cluster), exit when that process does."""
    import importlib

    if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)  # run as a script: its own folder would come first on the path, ahead of the stdlib
    t0 = time.process_time()
    for name in modules:
        if name == "deepspeed":
            from reflow.engines.train.ds_rank import import_deepspeed

            import_deepspeed()
        else:
            importlib.import_module(name)
    if "ray._raylet" in sys.modules:
        raise RuntimeError("the fork server imported Ray's core; its workers would abort: keep Ray out of MODULES")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a CUDA context does not survive fork
        raise RuntimeError("the fork server's imports initialised CUDA; its workers could not use the GPU")
    stamps = _stamps()
    watched = [os.pidfd_open(watch)] if watch is not None else []
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".new")  # bound under another name, listening, then renamed: a client that finds the path can
    server.listen(64)           # connect (before, it starts its worker plainly)
    os.rename(path + ".new", path)
    print(json.dumps({"ready": True, "import_cpu_s": round(time.process_time() - t0, 2)}), flush=True)
    children: dict[int, socket.socket] = {}
    while True:
        readable, _, _ = select.select([server, *watched], [], [], 0.2)
        if watched and watched[0] in readable:  # the cluster's starter is gone: so is the cluster
            os.unlink(path)
            return
        while children:  # reaped here, not in threads: a child forked while another thread held a lock inherits it held
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:  # deliberate: the client is gone already (killed), nobody to tell
                    pass
                conn.close()
        if server not in readable:
            continue
        conn, _ = server.accept()
        peer_pid, peer_uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[:2]
        if peer_uid != os.getuid():
            conn.close()  # another user's process: never fork for it
            continue
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(message)
        request["client"] = peer_pid  # the kernel's word, in this server's pid namespace, not the client's
        refused = _changed(stamps) or _other_namespace(peer_pid)
        if refused is not None:  # a worker forked now would run old code, or in this server's namespaces: plainly
            print(f"{refused}: this worker starts as Ray starts it", flush=True)
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"refused": refused}).encode() + b"\n")
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:
            _become_worker(server, conn, fds, request)
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        children[pid] = conn


NAMESPACES = ("net", "mnt", "pid", "ipc", "uts", "user", "cgroup")


def _other_namespace(pid: int) -> str | None:
    """Which namespace of process `pid` differs from this server's (a client in a network namespace of its own, e.g.
    another raylet's on the same filesystem: its worker, forked here, would live in this server's network), or None."""
    for ns in NAMESPACES:
        try:
            if os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"):
                return f"the client's {ns} namespace is not this server's"
        except OSError:  # deliberate: a namespace this kernel lacks is nobody's; a client gone is refused
            if not os.path.exists(f"/proc/{pid}"):
                return "the client is gone"
    return None


def _stamps() -> dict[str, int]:
    """The modification time of every imported module's file (~3,000 after torch, transformers and DeepSpeed)."""
    out = {}
    for module in list(sys.modules.values()):
        f = getattr(module, "__file__", None)
        if f and f not in out:
            try:
                out[f] = os.stat(f).st_mtime_ns
            except OSError:  # deliberate: a module without a file on disk (zip, frozen) cannot go stale here
                pass
    return out


def _changed(stamps: dict[str, int]) -> str | None:
    """The first imported file that changed (or went) since `stamps`, else None: checked before each fork, so a
    long-lived cluster's workers never run code older than what a plain start would import."""
    for f, mtime in stamps.items():
        try:
            same = os.stat(f).st_mtime_ns == mtime
        except OSError:  # gone
            same = False
        if not same:
            return f"{f} changed since this server imported it"
    return None


def _become_worker(server: socket.socket, conn: socket.socket, fds: list[int], request: dict) -> None:
    """In the forked child: the client's stdio, environment and folder, then Ray's worker as __main__."""
    import random
    import threading

    # Its own process group, as Ray starts each worker: after a worker exits the raylet kills the group it was in
    # (what the worker spawned goes with it); in the server's, that took the server and every other worker along.
    os.setpgid(0, 0)
    server.close()
    conn.close()
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    # What a fresh interpreter would have put on sys.path from the worker's PYTHONPATH (a job's runtime_env may set
    # one the server's lacks), ahead of the rest as there.
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = extra
    random.seed()  # each child draws its own sequence, not the server's
    client = os.pidfd_open(request["client"])

    def client_gone() -> None:  # the raylet killed the process it started: this one goes with it
        select.select([client], [], [])
        os._exit(1)

    threading.Thread(target=client_gone, daemon=True).start()
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(sys.argv[0])  # as `python default_worker.py` would have it
    os._exit(_run_main(sys.argv[0]))


def _run_main(path: str) -> int:
    """Run `path` as __main__ and end as an interpreter would: its exit status (an uncaught exception's traceback and
    1; sys.exit's message and 1), the atexit handlers, and stdout and stderr flushed (os._exit would drop what a
    pipe's buffer holds). Never returns into the server's loop, whatever the script raised."""
    import atexit
    import runpy
    import traceback

    status = 1
    try:
        runpy.run_path(path, run_name="__main__")
        status = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # deliberate: reported as the interpreter would, then the status
        traceback.print_exc()
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # deliberate: a closed or broken stream has nothing left to write
                pass
    return status


class Server:
    """A fork server this process started (`start`): its socket's path, its log, and the means to wait for and stop it."""

    def __init__(self, proc: subprocess.Popen, path: str, log: Path) -> None:
        self.proc, self.path, self.log = proc, path, log

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether the server listens within `timeout_s` (its imports: ~8 s of CPU on a 2-core VM); raises if it exited
        first (its log says why)."""
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.path):
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
                raise RuntimeError(f"the fork server exited with status {self.proc.returncode} before it listened "
                                   f"(its log, {self.log}):\n{tail}")
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self) -> None:
        """Stop it (the workers it forked go with their own clients, not with it)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def start(folder: Path, watch: int | None = None, modules: tuple[str, ...] = MODULES,
          new_session: bool = False) -> Server:
    """Start a fork server with its socket in `folder` (one only this user can enter) and its output in
    `folder/fork-server.log`; returns at once, while it imports `modules` (`Server.wait_ready`). With `watch` (a pid)
    it exits when that process does; otherwise the caller stops it when its cluster is down. `new_session`: it
    outlives the caller (a head's, which `reflow cluster up` leaves running)."""
    path = str(folder / "fork.sock")
    root = str(Path(__file__).resolve().parents[3])  # src/ (or site-packages): reflow importable as in the caller
    env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    log = folder / "fork-server.log"
    cmd = [sys.executable, __file__, "--serve", path, "--modules", ",".join(modules),
           *(["--watch", str(watch)] if watch is not None else [])]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=new_session)
    return Server(proc, path, log)


def runtime_env() -> dict:
    """The job runtime_env whose workers start through the fork server named in REFLOW_FORK_SERVER."""
    return {"py_executable": f"{sys.executable} {__file__} --client"}


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:  # --serve PATH --modules a,b [--watch PID]
    serve(sys.argv[2], int(sys.argv[6]) if sys.argv[5:6] == ["--watch"] else None,
          tuple(m for m in sys.argv[4].split(",") if m))
