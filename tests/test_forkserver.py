"""The fork server Ray workers start through (infra/cluster/forkserver.py): what a forked worker gets from its client
(argv, environment, folder, stdio, exit status, signals), the client's fallback when no server answers, who may ask
it to fork, and how it and its children end. Servers here import a stdlib module instead of torch (their imports are
not what is tested); the real server's workers: test_cluster_security (a run's own local cluster) and
test_deployments (`reflow cluster up`'s)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from reflow.infra.cluster import forkserver
from tests.other_user import as_other_user, needs_root

LIGHT = ("email.message",)  # a module the light servers import, and no child of a plain interpreter has


def _wait(cond, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def server():
    folder = Path(tempfile.mkdtemp(prefix="reflow_fork_test_"))  # 0700, as a cluster's private folder
    s = forkserver.start(folder, watch=os.getpid(), modules=LIGHT)
    assert s.wait_ready(60), s.log.read_text()
    yield s
    s.stop()


# What a forked worker reports: whether it came warm (the server's import), and what it got from its client.
PROBE = textwrap.dedent("""
    import json, os, sys
    warm = "email.message" in sys.modules
    line = sys.stdin.readline().strip()
    print(json.dumps({"warm": warm, "argv": sys.argv[1:], "env": os.environ.get("PROBE_ENV"), "cwd": os.getcwd(),
                      "stdin": line, "pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0),
                      "path_has": os.environ.get("PROBE_PATH", "") in sys.path}), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    sys.exit(int(sys.argv[1]))
""")


def _client(script: Path, *args: str, env: dict[str, str], cwd: Path, **kw) -> subprocess.Popen:
    """A worker's start as the raylet makes it with the runtime_env: the client as its interpreter."""
    cmd = forkserver.runtime_env()["py_executable"].split() + [str(script), *args]
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def test_a_forked_worker_gets_its_clients_argv_env_folder_stdio_and_exit_status(server, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    extra = tmp_path / "on_path"
    env = {**os.environ, forkserver.ENV: server.path, "PROBE_ENV": "from the client", "PROBE_PATH": str(extra),
           "PYTHONPATH": os.pathsep.join([str(extra), os.environ.get("PYTHONPATH", "")])}
    proc = _client(script, "3", "b c", env=env, cwd=tmp_path)
    out, err = proc.communicate("a line for stdin\n", timeout=60)
    got = json.loads(out.splitlines()[-1])
    assert proc.returncode == 3, (out, err)
    assert got["warm"], "the worker was not forked from the server (its import is missing)"
    assert got["argv"] == ["3", "b c"] and got["env"] == "from the client" and got["cwd"] == str(tmp_path)
    assert got["stdin"] == "a line for stdin" and "to stderr" in err
    assert got["ppid"] == server.proc.pid and got["pid"] != proc.pid
    # Its own process group, as Ray's own workers: the raylet kills a finished worker's group
    assert got["pgid"] == got["pid"] != os.getpgid(server.proc.pid)
    assert got["path_has"], "the client's PYTHONPATH did not reach the forked worker's sys.path"


def test_a_forked_worker_ends_as_an_interpreter_would(server, tmp_path):
    """Unflushed output reaches the pipe, atexit handlers run, and an uncaught exception is a traceback and status 1
    (never a return into the server's loop)."""
    env = {**os.environ, forkserver.ENV: server.path}
    env.pop("PYTHONUNBUFFERED", None)
    ends = {"exit": "import atexit, sys; atexit.register(print, 'atexit ran'); print('buffered'); sys.exit(6)",
            "raise": "print('before'); raise KeyError('boom')",
            "message": "import sys; sys.exit('a message')"}
    got = {}
    for name, code in ends.items():
        script = tmp_path / f"{name}.py"
        script.write_text(code + "\n")
        proc = _client(script, env=env, cwd=tmp_path)
        out, err = proc.communicate(timeout=60)
        got[name] = (proc.returncode, out, err)
    assert got["exit"][:2] == (6, "buffered\natexit ran\n"), got["exit"]
    assert got["raise"][0] == 1 and got["raise"][1] == "before\n" and "KeyError: 'boom'" in got["raise"][2], got["raise"]
    assert got["message"][0] == 1 and "a message" in got["message"][2], got["message"]
    assert server.proc.poll() is None and len(psutil.Process(server.proc.pid).children()) == 0


def test_without_a_server_the_client_starts_the_worker_plainly(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    for missing in ({}, {forkserver.ENV: str(tmp_path / "no.sock")}):
        env = {k: v for k, v in os.environ.items() if k != forkserver.ENV} | missing
        proc = _client(script, "4", env=env, cwd=tmp_path)
        out, err = proc.communicate("x\n", timeout=60)
        got = json.loads(out.splitlines()[-1])
        assert proc.returncode == 4, (out, err)
        assert not got["warm"] and got["pid"] == proc.pid  # the interpreter exec'd in the client's own process


def test_signals_reach_the_worker_and_a_killed_client_takes_it_along(server, tmp_path):
    script = tmp_path / "waits.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
        print(os.getpid(), flush=True)
        time.sleep(120)
    """))
    env = {**os.environ, forkserver.ENV: server.path}
    proc = _client(script, env=env, cwd=tmp_path)
    child = int(proc.stdout.readline())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 7  # forwarded, and the worker's status came back
    assert _wait(lambda: not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE)

    proc = _client(script, env=env, cwd=tmp_path)
    child = int(proc.stdout.readline())
    proc.kill()  # as the raylet kills a worker: the client cannot forward this
    proc.wait(30)
    assert _wait(lambda: not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE), \
        "the forked worker outlived its killed client"


def test_after_its_code_changed_workers_start_plainly(tmp_path, monkeypatch):
    """A long-lived server must not hand out code older than a plain start would import: once a file it imported
    changes, each client is told so and execs the interpreter itself."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "reflow_probe_mod.py").write_text("VALUE = 1\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")]))
    s = forkserver.start(tmp_path, watch=os.getpid(), modules=("reflow_probe_mod",))
    try:
        assert s.wait_ready(60), s.log.read_text()
        script = tmp_path / "probe.py"
        script.write_text("import os, sys; print('reflow_probe_mod' in sys.modules, os.getpid()); sys.exit(5)\n")
        env = {**os.environ, forkserver.ENV: s.path}
        warm = []
        for _ in range(2):
            proc = _client(script, env=env, cwd=tmp_path)
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 5, (out, err)
            imported, pid = out.split()
            warm.append((imported == "True", int(pid) == proc.pid))
            later = time.time() + 5
            os.utime(code / "reflow_probe_mod.py", (later, later))  # an edit
        assert warm == [(True, False), (False, True)]  # forked, then the client's own interpreter
        assert "reflow_probe_mod.py changed since this server imported it" in s.log.read_text()
    finally:
        s.stop()


@needs_root
def test_a_client_in_another_network_namespace_starts_its_worker_plainly(server, tmp_path):
    """Another raylet on the same filesystem but in its own network namespace (tests/test_multinode.py's second host)
    finds the socket: a worker forked here would live in the server's network, not its node's. The server compares
    the client's namespaces (by the kernel's peer pid) with its own and refuses."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {**os.environ, forkserver.ENV: server.path}
    cmd = ["unshare", "--net", *forkserver.runtime_env()["py_executable"].split(), str(script), "0"]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate("x\n", timeout=60)
    assert proc.returncode == 0, (out, err)
    got = json.loads(out.splitlines()[-1])
    assert not got["warm"] and got["pid"] == proc.pid, got  # its own interpreter, in its own namespace
    assert "net namespace is not this server's" in server.log.read_text()


@needs_root
def test_another_user_cannot_make_it_fork():
    """The socket sits in a folder only its owner can enter; even where another user can reach it (here: a server
    in an open folder), a peer of another uid gets no child."""
    folder = Path(tempfile.mkdtemp(prefix="reflow_fork_open_"))
    os.chmod(folder, 0o777)
    s = forkserver.start(folder, watch=os.getpid(), modules=LIGHT)
    try:
        assert s.wait_ready(60), s.log.read_text()
        os.chmod(s.path, 0o777)
        before = {c.pid for c in psutil.Process(s.proc.pid).children()}

        def ask(path: str) -> str:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(path)
            request = {"argv": ["-c", "pass"], "env": {}, "cwd": "/", "client": os.getpid()}
            try:
                socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
                conn.settimeout(10)
                return conn.makefile("r").readline()
            except (BrokenPipeError, ConnectionResetError):  # closed before the request was read
                return ""

        assert as_other_user(ask, s.path) == ""  # closed without an answer
        assert {c.pid for c in psutil.Process(s.proc.pid).children()} == before
    finally:
        s.stop()


def test_the_server_ends_with_the_process_it_watches_and_reports_a_failed_start(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    s = forkserver.start(tmp_path, watch=owner.pid, modules=LIGHT)
    assert s.wait_ready(60)
    owner.kill()
    owner.wait()
    assert s.proc.wait(30) == 0 and not os.path.exists(s.path)

    (tmp_path / "b").mkdir()
    broken = forkserver.start(tmp_path / "b", watch=os.getpid(), modules=("reflow_no_such_module",))
    with pytest.raises(RuntimeError, match="reflow_no_such_module"):
        broken.wait_ready(60)
