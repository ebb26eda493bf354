"""infra/cluster/leases.py without Ray: a dead holder's leftovers are ended, a live holder refuses a second run, a
reused pid is not mistaken for the holder, and (with the test Prefect server) a dead long run's unfinished
iteration is marked CRASHED. The whole story with a real SIGKILLed `reflow train` (Ray's orphaned agents,
the Prefect states) is in tests/test_resume.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from reflow.infra.cluster import leases

# A holder that starts a long-lived child in its own session (as Ray's agents end up: re-parented
# to init when the holder dies), records it, and SIGKILLs itself.
_HOLDER = textwrap.dedent("""
    import os, signal, subprocess, sys
    from reflow.infra.cluster import leases
    leases.take(sys.argv[1], None)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    leases.record(sys.argv[1])
    print(child.pid, flush=True)
    if sys.argv[2] == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stdin.read()  # "live": hold the lease until the test closes stdin
""")


def _holder(experiment: str, mode: str) -> tuple[subprocess.Popen, int]:
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, experiment, mode], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    return p, int(p.stdout.readline())


@pytest.fixture(autouse=True)
def lease_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("REFLOW_LEASE_DIR", str(tmp_path))


def test_dead_holders_leftovers_are_ended():
    p, child = _holder("exp", "die")
    assert p.wait(timeout=30) == -signal.SIGKILL
    assert psutil.pid_exists(child)  # outlived its holder
    done = leases.take("exp", None)
    try:
        assert any("left behind" in line and str(child) in line for line in done), done
        assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
        assert leases.read("exp").pid == os.getpid()
    finally:
        leases.release("exp")
    assert leases.read("exp") is None


def test_live_holder_refuses_a_second_run():
    p, child = _holder("busy", "live")
    try:
        with pytest.raises(leases.ExperimentBusy, match=f"pid {p.pid}"):
            leases.take("busy", None)
        assert psutil.pid_exists(child)  # nothing of the live run was touched
    finally:
        p.stdin.close()
        p.wait(timeout=30)
        psutil.Process(child).kill()


def test_reused_pid_is_not_the_holder(tmp_path):
    """A lease whose pid now belongs to another process (start time differs) counts as dead, and
    that process is left alone."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        leases._write(leases.Lease("reused", None, __import__("socket").gethostname(), other.pid,
                                   psutil.Process(other.pid).create_time() - 100, 0.0,
                                   [(other.pid, psutil.Process(other.pid).create_time() - 100, "x")]))
        assert leases.take("reused", None) == []
        assert other.poll() is None
    finally:
        leases.release("reused")
        other.kill()
        other.wait()


def test_names_are_single_path_segments():
    with pytest.raises(ValueError):
        leases.take("../evil", None)


def test_a_long_runs_unfinished_iteration_is_marked_crashed(prefect_server):
    """A dead run of hundreds of iterations: its one unfinished iteration flow run is found among more
    finished ones than the API's default page (200 rows) holds."""
    import asyncio

    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Running

    @flow(name="leases-long-run")
    def long_run():
        pass

    @task(name="iteration")
    def iteration():
        pass

    async def make():
        async with get_client() as client:
            parent = await client.create_flow_run(long_run, name="long", state=Running())

            in_parent = await client.create_task_run(iteration, flow_run_id=parent.id, dynamic_key="0")
            calls = asyncio.Semaphore(4)  # a few at a time: the test server's SQLite answers 503 to a crowd

            async def child(i):
                async with calls:
                    return await client.create_flow_run(long_run, name=f"long-iter-{i:04d}", state=Completed(),
                                                        parent_task_run_id=in_parent.id)

            children = await asyncio.gather(*(child(i) for i in range(205)))
            # the API's default order is by id, descending: the smallest id is the one a first page leaves out
            unfinished = min(children, key=lambda r: r.id)
            await client.set_flow_run_state(unfinished.id, Running(), force=True)
            return parent, children, unfinished

    parent, children, unfinished = asyncio.run(make())
    lease = leases.Lease(experiment="long", flow_run_id=str(parent.id), host="h", pid=1, pid_started=0.0,
                         taken_at=0.0)
    said = leases.mark_crashed(lease)
    assert said == [f"marked 2 flow run(s) of dead process 1 CRASHED: long, {unfinished.name}"], said
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(unfinished.id).state.is_crashed()
        assert all(client.read_flow_run(r.id).state.is_completed() for r in children[:3] if r.id != unfinished.id)
