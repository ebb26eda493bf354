"""Another account on the same machine (uid 65534) cannot reach a run's Ray cluster or its weights
(issue 51, points 2 and 3).

Point 2: Ray makes its temp dir, session_*, sockets/ and logs/ mode 0777 (no sticky bit), so whatever
sits there (logs, the run's auth_token, the Unix sockets) was open to every local user. reflow puts
Ray's temp dir inside a fresh 0700 folder; each way reflow starts Ray is checked here as another uid.
Point 3: predictable /tmp paths (the default weight-push folder, the merged copy of a LoRA checkpoint)
that another user could create first are private folders now, and reflow's engine loads a disk push
only when its files match the digests the pusher computed.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from reflow.infra import ray_head
from tests.other_user import as_other_user, attempts, needs_root

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unix_connect(path: str) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)


def _replace_with_own(path: str) -> None:
    """Put a file of one's own at `path` (what a user does to swap the run's auth token)."""
    mine = f"/tmp/reflow-test-other-user-{os.getpid()}"
    with open(mine, "w") as f:
        f.write("0" * 64)
    try:
        os.replace(mine, path)
    finally:
        if os.path.exists(mine):
            os.unlink(mine)


def _ray_tree_attempts(temp: str, session: str, token: str) -> dict[str, str]:
    """As another user: everything that must fail against a running cluster's temp tree (listed here as
    the run's user first, so the other user is told what to try)."""
    logs, sockets = Path(session) / "logs", Path(session) / "sockets"
    log_file = max((p for p in logs.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    socks = sorted(str(p) for p in sockets.iterdir() if p.is_socket())
    assert socks, f"no Unix sockets under {sockets}: the check would pass vacuously"
    tries = {"list Ray's temp dir": lambda: os.listdir(temp), "list the session folder": lambda: os.listdir(session),
             "list logs/": lambda: os.listdir(logs), f"read logs/{log_file.name}": lambda: log_file.read_bytes()[:32768],
             "replace auth_token": lambda: _replace_with_own(token), "delete auth_token": lambda: os.unlink(token)}
    tries.update({f"connect to sockets/{Path(s).name}": (lambda s=s: _unix_connect(s)) for s in socks})
    return as_other_user(attempts, {"sanity: list /tmp": lambda: os.listdir("/tmp"), **tries})


def _all_refused(found: dict[str, str]) -> None:
    assert found.pop("uid") == "65534" and found.pop("sanity: list /tmp") == "succeeded", found
    allowed = {k: v for k, v in found.items() if v != "PermissionError"}
    assert not allowed, f"another local user could: {allowed}"


@needs_root
@pytest.mark.slow  # a Ray cluster in a separate driver, ~10 s
def test_local_cluster_of_a_flow_is_closed_to_other_users(tmp_path):
    """No RAY_ADDRESS: the cluster `ray_connect.connect` starts inside the run's driver (a separate process)."""
    code = textwrap.dedent("""
        import json, os, sys, ray
        from reflow.infra.ray_connect import connect
        connect(None, 1, "reflow-local-users")
        assert ray.get(ray.remote(lambda: 42).remote()) == 42  # a worker has started and logged
        node = ray._private.worker._global_node
        print("PATHS", json.dumps({"temp": node.get_temp_dir_path(), "session": node.get_session_dir_path(),
                                   "token": os.environ["RAY_AUTH_TOKEN_PATH"]}), flush=True)
        sys.stdin.readline()
        ray.shutdown()
    """)
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    p = subprocess.Popen([sys.executable, "-c", code], env={**base, "HOME": str(tmp_path)}, cwd=REPO, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = next((x for x in p.stdout if x.startswith("PATHS ")), None)
        assert line, p.stderr.read()[-3000:] if p.poll() is not None else "the driver printed no paths"
        paths = json.loads(line.removeprefix("PATHS "))
        _all_refused(_ray_tree_attempts(paths["temp"], paths["session"], paths["token"]))
    finally:
        p.communicate("\n", timeout=60)


@needs_root
@pytest.mark.slow  # a `ray start` head, ~8 s
def test_cluster_up_head_is_closed_to_other_users(tmp_path):
    """`reflow cluster up`: the long-lived head's temp tree (its token lives in the state folder)."""
    info, started = ray_head.up(tmp_path / "cluster", port=_free_port(), num_cpus=1)
    assert started
    try:
        session = Path(info.temp_dir) / "session_latest"
        deadline = time.monotonic() + 90  # the port opens before the raylet has made its sockets
        while not any(p.is_socket() for p in (session / "sockets").iterdir()) and time.monotonic() < deadline:
            time.sleep(0.2)
        _all_refused(_ray_tree_attempts(info.temp_dir, str(session.resolve()), info.token_path))
    finally:
        ray_head.down(tmp_path / "cluster")
