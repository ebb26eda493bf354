"""The Ray clusters reflow starts are closed to the network: token authentication always on, and
every socket of every Ray process bound to loopback (issue 13, point 1).

Both ways reflow starts Ray are covered: `reflow cluster up` (a long-lived head, `ray start`) and
a flow with no RAY_ADDRESS (`ray_connect.connect` starts a cluster inside the driver). Clients are
separate processes with their own HOME, so a token lying in the real ~/.ray cannot help them.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from reflow.infra.cluster import ray_head

pytestmark = pytest.mark.slow  # ~1 min: a head, a cluster, five client drivers

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}

REPO = Path(__file__).resolve().parents[1]


def listeners(root: int) -> list[tuple[str, str, int]]:
    """(process name, ip, port) of every listening TCP socket of `root` and its descendants: Ray's
    own processes and the workers it forks (and the driver, when the cluster lives in it)."""
    procs = [psutil.Process(root)]
    procs += procs[0].children(recursive=True)
    out = []
    for p in procs:
        try:
            conns = p.net_connections(kind="tcp")
        except psutil.Error:  # exited meanwhile
            continue
        out += [(p.name(), c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def _gone_soon(pid: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _client(address: str, env: dict[str, str], home: Path) -> subprocess.CompletedProcess:
    """A separate driver that attaches to `address` and runs one task."""
    code = (f"import ray; ray.init(address={address!r}, log_to_driver=False); "
            "print('ANSWER', ray.get(ray.remote(lambda: 41 + 1).remote())); "
            "import os; print('NICE', ray.get(ray.remote(lambda: os.nice(0)).remote()))")
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return subprocess.run([sys.executable, "-c", code], env={**base, "HOME": str(home), **env},
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    d = tmp_path_factory.mktemp("cluster")
    info, started = ray_head.up(d, port=_free_port(), num_cpus=1, fork_workers="off")  # its own tests: test_forkserver
    assert started
    try:
        yield d, info
    finally:
        ray_head.down(d)


def test_head_refuses_clients_without_its_token(head, tmp_path):
    d, info = head
    wrong = tmp_path / "wrong_token"
    wrong.write_text("0" * 64)
    single_node = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # else the client looks on the public address
    envs = (single_node, {**single_node, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(wrong)})
    with ThreadPoolExecutor(len(envs)) as pool:  # each refused client retries for ~20 s: at once
        refused = list(pool.map(lambda env: _client(info.address, env, tmp_path), envs))
    for env, p in zip(envs, refused):
        assert p.returncode != 0 and "ANSWER" not in p.stdout, (env, p.stdout[-2000:])
        assert "Failed to connect" in p.stderr or "uthentication" in p.stderr, p.stderr[-2000:]
    ok = _client(info.address, info.env(), tmp_path)
    assert "ANSWER 42" in ok.stdout, ok.stderr[-3000:]


def test_head_token_is_private_and_never_printed(head):
    d, info = head
    token_file = Path(info.env()["RAY_AUTH_TOKEN_PATH"])
    assert token_file.stat().st_mode & 0o077 == 0  # readable by its owner only
    token = token_file.read_text().strip()
    assert len(token) >= 32
    assert token not in (d / "head.log").read_text()
    assert token not in (d / "head.json").read_text()
    assert token not in json.dumps(info.env())


def test_head_listens_on_loopback_only(head, tmp_path):
    d, info = head
    out = _client(info.address, info.env(), tmp_path).stdout
    assert "ANSWER 42" in out  # workers started too
    # Ray's default worker_niceness of 15 left a run's actors ~1/70 of a core beside a busy process (bench/worker_niceness.py)
    assert "NICE 0" in out, out
    found = listeners(info.pid)
    assert found, "no listening sockets found: the check would pass vacuously"
    open_ = [f for f in found if f[1] not in LOOPBACK]
    assert not open_, f"Ray processes listening beyond loopback: {open_}"


def test_local_cluster_of_a_flow_is_loopback_and_token_authenticated(tmp_path):
    """No RAY_ADDRESS: the flow's own cluster, started by `connect`, inside a fresh process, with its workers forked
    from a warm process as a run's are where no GPU is (cluster.fork_workers auto; infra/cluster/forkserver.py): the
    forked workers are the driver's descendants too, so their sockets are counted; the fork server goes with the
    driver."""
    code = textwrap.dedent("""
        import json, os, sys, psutil, ray
        from tests.test_cluster_security import listeners
        from reflow.infra.cluster.ray_connect import connect
        print(connect(None, 1, "reflow-sec", fork_workers=True), file=sys.stderr)
        assert ray.get(ray.remote(lambda: 42).remote()) == 42

        @ray.remote
        def where():
            parent = psutil.Process(os.getppid())
            return {"warm": "transformers.models.llama.modeling_llama" in sys.modules, "parent": parent.cmdline(),
                    "parent_pid": parent.pid, "nice": os.nice(0)}

        from ray._raylet import AuthenticationMode, get_authentication_mode
        print("RESULT", json.dumps({"listeners": listeners(os.getpid()), "worker": ray.get(where.remote()),
                                    "token": get_authentication_mode() == AuthenticationMode.TOKEN}))
        ray.shutdown()
    """)
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    p = subprocess.run([sys.executable, "-c", code], env={**base, "HOME": str(tmp_path)}, capture_output=True,
                       text=True, timeout=240, cwd=REPO)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(line.removeprefix("RESULT "))
    worker = res["worker"]
    assert res["token"] and worker["nice"] == 0, res
    assert "workers forked from a warm process" in p.stderr, p.stderr[-3000:]
    assert worker["warm"] and "--serve" in worker["parent"], worker
    assert not psutil.pid_exists(worker["parent_pid"]) or _gone_soon(worker["parent_pid"]), \
        "the fork server outlived its driver"
    assert res["listeners"], "no listening sockets found: the check would pass vacuously"
    open_ = [f for f in res["listeners"] if f[1] not in LOOPBACK]
    assert not open_, f"Ray processes listening beyond loopback: {open_}"
