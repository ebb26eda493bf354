"""The control API (infra/ops/control.py, `reflow ctl`), periodic stack dumps (infra/ops/stack_dumps.py) and
the trainer fault-tolerance controller (flows/recovery.py) against one real train run: health,
metrics, pause (no new iteration starts), save while paused, resume, a trainer rank SIGKILLed
mid-iteration (recovered), stop (a committed checkpoint, a COMPLETED parent flow run, every
iteration's records), then `reflow ctl` on no live run. A second, short run gives up after its bound."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from reflow.infra.ops import control
from reflow.infra.store import checkpoint as ckpt
from reflow.infra.store.storage import ExperimentStore
from tests import prefect_reads
from tests.ckpt_fixtures import REFLOW, REPO
from tests.test_e2e import e2e_config

EXP = "ctl"
N = 40  # far more than the test lets it run: only /stop ends it
# stages of flows/iteration.py up to its push, and the parent's start of the next flow run, while the update
# submitted ahead of it runs (tasks/rollout_source.py): on this tiny model the generate and train stages of a
# flow run mostly only collect what was started before it, too briefly for a poll to see them
MID_ITERATION = {"generate", "reward", "advantages", "train", "push"}


def _mid_iteration(stage: str) -> bool:
    return stage in MID_ITERATION or stage.startswith("iteration ")


def _ask(command: str) -> dict:
    r = control.request(EXP, command)
    assert r.status_code == 200, r.text
    return r.json()


def _wait(what: str, check, timeout: float = 180.0, thread: threading.Thread | None = None):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except control.NoLiveRun:
            value = None
        if value:
            return value
        assert thread is None or thread.is_alive(), f"the run ended while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.2)


def _parent_state(flow_run_id: str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state


def _metrics() -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    r = control.request(EXP, "metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def _start(cfg) -> tuple[threading.Thread, dict]:
    from reflow.flows.train import train

    out: dict = {}

    def run() -> None:
        try:
            out["summary"] = train(cfg)
        except BaseException as e:  # deliberate: the test thread reports it
            out["error"] = e

    thread = threading.Thread(target=run, name="train", daemon=True)
    thread.start()
    return thread, out


def _kill_trainer_mid_iteration(rank: int, after: int, thread: threading.Thread, exp: str = EXP) -> dict:
    """SIGKILL trainer rank `rank` while an iteration past `after` is under way (up to its push)."""
    h = _wait("an iteration mid-way", lambda: (h := control.request(exp, "health").json())["iteration"] > after
              and _mid_iteration(h["stage"]) and h, thread=thread, timeout=120)
    os.kill({a["name"]: a for a in h["actors"]}[f"policy-trainer-{rank}"]["pid"], signal.SIGKILL)
    return h


def _artifact_rows(key: str) -> list[dict]:
    import json

    found = prefect_reads.artifacts(key)
    assert found, f"no artifact {key}"
    latest = max(found, key=lambda a: a.created)
    return json.loads(latest.data) if isinstance(latest.data, str) else latest.data


def _ctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([REFLOW, "ctl", EXP, *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_control_api_stack_dumps_and_trainer_recovery(ray_cluster, prefect_server, tiny_policy, tmp_path):
    cfg = e2e_config(tiny_policy, tmp_path, f"experiment={EXP}", f"num_iterations={N}", "rollout.num_engines=1",
                     "trainer.num_ranks=1", "eval.before_train=false", "eval.interval=null",
                     "checkpoint.save_every_minutes=null", "checkpoint.save_interval=3", "debug.stack_dump_interval_s=5",
                     "fault_tolerance.max_trainer_recoveries=1",
                     # colocated with hand-overs (as on one GPU): a rank killed after the engines released their
                     # memory for training; the recovery gives it back to them before its push (flows/session.py)
                     "cluster.colocate=true")
    store = ExperimentStore.open(f"file://{tmp_path}/runs", EXP)
    thread, out = _start(cfg)
    try:
        health = _wait("iteration 1 done", lambda: (h := _ask("health"))["iteration"] >= 1 and h, thread=thread)
        actors = {a["name"]: a for a in health["actors"]}
        assert set(actors) == {"engine-0", "policy-trainer-0"} and {a["state"] for a in actors.values()} == {"ALIVE"}
        assert str(actors["engine-0"]["weight_version"]).isdigit() and actors["policy-trainer-0"]["pid"] > 0
        assert health["experiment"] == EXP and health["num_iterations"] == N and not health["paused"]
        record = control.read_record(EXP)
        assert record["url"].startswith("http://127.0.0.1:")
        assert (control.token_path(EXP).stat().st_mode & 0o777) == 0o600
        bare = httpx.get(f"{record['url']}/health", timeout=10)  # no token: refused, like every other path
        assert bare.status_code == 401 and httpx.post(f"{record['url']}/stop", timeout=10).status_code == 401
        cli = _ctl("health")
        assert cli.returncode == 0 and f'"experiment": "{EXP}"' in cli.stdout, cli.stderr

        m = _metrics()
        assert m[("reflow_actor_alive", (("actor", "policy-trainer-0"), ("kind", "trainer")))] == 1.0
        assert m[("reflow_num_iterations", ())] == N and ("reflow_iteration_metric", (("metric", "reward_mean"),)) in m

        assert _ask("pause")["accepted"] == "pause"
        paused = _wait("the pause", lambda: (h := _ask("health"))["stage"] == "paused" and h, thread=thread)
        n = paused["iteration"]
        iteration_s = _metrics()[("reflow_iteration_metric", (("metric", "time_iteration"),))]
        time.sleep(max(3.0, 3 * iteration_s))  # several iterations' time: none may start
        assert _ask("health")["iteration"] == n and _ask("health")["stage"] == "paused"
        assert not store.exists(f"iterations/{n:06d}/metrics.json")
        assert _metrics()[("reflow_paused", ())] == 1.0

        _ask("save")  # while paused: at once, of the n iterations done
        _wait("the checkpoint", lambda: _ask("health")["last_checkpoint"] == n, thread=thread)
        assert store.read_text(ckpt.LATEST) == ckpt.name_of(n)

        _ask("resume")
        killed = _kill_trainer_mid_iteration(0, n, thread)  # bound 1: recovered
        k = killed["iteration"]
        _wait("the recovery", lambda: (h := _ask("health"))["trainer_recoveries"] == 1 and h["iteration"] > k + 1,
              thread=thread)
        assert _metrics()[("reflow_trainer_recoveries_total", ())] == 1.0
        assert _ask("stop")["accepted"] == "stop"
        thread.join(timeout=180)
    finally:
        if thread.is_alive():  # the run did not stop: end it the way an operator would
            control.request(EXP, "stop")
            thread.join(timeout=180)
    assert "error" not in out, out.get("error")
    summary = out["summary"]
    done = summary["iterations"]
    assert n < done < N, summary
    assert store.read_text(ckpt.LATEST) == ckpt.name_of(done)
    assert store.exists(f"{ckpt.ROOT}/{ckpt.name_of(done)}/{ckpt.MARKER}")
    assert all(store.exists(f"iterations/{i:06d}/metrics.json") for i in range(done))
    assert not store.exists(f"iterations/{done:06d}/metrics.json")
    [row] = _artifact_rows(f"{EXP}-trainer-recoveries")
    assert row["iteration"] in (k, k + 1) and row["dead_ranks"] == "policy-trainer-0" and row["restored_step"] <= row["iteration"]
    state = _parent_state(health["flow_run_id"])
    assert state.type.value == "COMPLETED", state
    assert control.read_record(EXP) is None and not control.token_path(EXP).exists()
    gone = _ctl("health")
    assert gone.returncode == 2 and f"no live run of experiment '{EXP}'" in gone.stderr, gone.stderr

    dumps = [store.read_text(f"debug/stacks/{f}") for f in sorted(store.listdir("debug/stacks"))]
    assert dumps, "no stack dump written"

    def section(dump: str, name: str) -> str:
        return dump.split(f"==== {name} (pid ", 1)[1].split("\n====", 1)[0] if f"==== {name} (pid " in dump else ""

    def whole(dump: str) -> bool:  # a dump taken while the killed rank was being replaced may lack its stacks
        return all("Thread " in section(dump, n) and "py-spy failed" not in section(dump, n)
                   for n in ("driver", "engine-0", "policy-trainer-0"))
    assert any(whole(d) for d in dumps), dumps[-1][:3000]
    assert "_train" in section(next(d for d in reversed(dumps) if whole(d)), "driver")  # the flow's own frames


def test_trainer_recovery_gives_up_after_its_bound(ray_cluster, prefect_server, tiny_policy, tmp_path):
    """Two ranks, bound 0: rank 1 SIGKILLed mid-iteration; rank 0, which would wait for it inside a
    collective, is ended by the watcher, and the run fails at once with the reason."""
    from reflow.flows.session import TrainerGroupLost

    exp = "ctl-giveup"
    cfg = e2e_config(tiny_policy, tmp_path, f"experiment={exp}", f"num_iterations={N}", "rollout.num_engines=1",
                     "eval.before_train=false", "fault_tolerance.max_trainer_recoveries=0")
    thread, out = _start(cfg)
    try:
        health = _kill_trainer_mid_iteration(1, 0, thread, exp)
        thread.join(timeout=120)
    finally:
        if thread.is_alive():
            control.request(exp, "stop")
            thread.join(timeout=180)
    error = out.get("error")
    assert isinstance(error, TrainerGroupLost), out
    # the iteration whose stage saw the death: the one health showed, or the next, whose update was
    # submitted before its flow run (tasks/rollout_source.py)
    assert any(f"policy-trainer-1 died during iteration {i} " in str(error)
               for i in (health["iteration"], health["iteration"] + 1)), error
    assert "max_trainer_recoveries=0, so it gives up" in str(error)
    state = _parent_state(health["flow_run_id"])
    assert state.type.value == "FAILED" and "max_trainer_recoveries=0" in state.message, state


# ---------------------------------------------------------------- quick: no run


def test_ctl_without_a_live_run_says_so(capsys):
    from reflow.flows.cli import main

    with pytest.raises(SystemExit) as e:
        main(["ctl", "no-such-run", "health"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "no live run of experiment 'no-such-run'" in err and "control record" in err


def test_a_record_left_by_a_dead_run_is_not_a_live_run(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    started = time.time() - 5
    control.record_path("ghost").parent.mkdir(parents=True, exist_ok=True)
    control.record_path("ghost").write_text(
        f'{{"url": "http://127.0.0.1:9", "token_file": "{tmp_path}/t", "pid": {gone.pid}, "pid_started": {started}, '
        f'"flow_run_id": "f-1"}}')
    try:
        with pytest.raises(control.NoLiveRun, match=r"wrote .*ghost.control.json \(pid \d+, flow run f-1\) is no longer"):
            control.request("ghost", "health")
        me = psutil.Process()  # a live pid with another start time is a reused pid, not the run
        control.record_path("ghost").write_text(f'{{"pid": {me.pid}, "pid_started": {me.create_time() - 100}}}')
        with pytest.raises(control.NoLiveRun, match="no longer running"):
            control.request("ghost", "health")
    finally:
        control.record_path("ghost").unlink()


def test_stack_dump_of_another_python_process():
    from reflow.infra.ops.stack_dumps import dump_pid, own_threads, py_spy

    assert "test_stack_dump_of_another_python_process" in own_threads()
    if py_spy() is None:
        pytest.skip("py-spy is not installed (reflow's debug extra)")
    secret = "s3cr3t-key-of-the-run"
    child = subprocess.Popen([sys.executable, "-c", "import time\ndef parked():\n    time.sleep(60)\nparked()",
                              "--api-key", secret, f"--token={secret}"])
    try:
        deadline = time.monotonic() + 20
        while "parked" not in (text := dump_pid(child.pid)):
            assert time.monotonic() < deadline, text
            time.sleep(0.2)
    finally:
        child.kill()
        child.wait()
    # py-spy heads a dump with the process's command line: a key given there never reaches the stored file
    assert secret not in text and "--api-key <redacted>" in text, text
    assert dump_pid(child.pid).startswith(f"py-spy failed on pid {child.pid}")


def test_give_up_message_names_the_rank_the_iteration_and_the_bound():
    from reflow.flows.session import RunSession, TrainerGroupLost
    from reflow.infra.config.schema import load_config

    cfg = load_config(None, ["experiment=giveup-msg", "fault_tolerance.max_trainer_recoveries=2"])
    session = RunSession(cfg, release_cluster=None)
    session.control = ctl = control.RunControl(cfg, "f-1", 7)
    ctl.counters["trainer_recoveries"] = 2
    error = RuntimeError("The actor died unexpectedly before finishing this task.\n\tclass_name: TrainerRank")
    with pytest.raises(TrainerGroupLost) as e:
        session.recover(7, 7, ["policy-trainer-1"], error)
    assert str(e.value).startswith("trainer rank(s) policy-trainer-1 died during iteration 7 (RuntimeError: The "
                                   "actor died unexpectedly before finishing this task.); this run already recovered "
                                   "2 time(s) and fault_tolerance.max_trainer_recoveries=2, so it gives up")
    assert "class_name" not in str(e.value) and e.value.__cause__ is error


def test_half_open_connections_are_bounded_and_time_out(tmp_path, monkeypatch):
    """Any local user can connect to the control API (loopback) without the token and send nothing: each such
    connection held a file descriptor of the driver for good (300 took it from 10 to 311 open files, issue 51).
    The server keeps at most MAX_CONNECTIONS, closes the rest at once, and closes an idle one after its timeout;
    a request with the token still gets through afterwards."""
    from reflow.engines.http_serve import ThreadedServer
    from reflow.infra.config.schema import load_config

    monkeypatch.setenv("REFLOW_LEASE_DIR", str(tmp_path / "leases"))
    cfg = load_config(None, ["experiment=halfopen", "control.enabled=true"])
    ctl = control.start_control(cfg, None, 0)
    server = ctl.server
    port = server.port
    held = []

    def server_side() -> int:
        return sum(1 for c in psutil.net_connections("tcp4") if c.laddr and c.laddr.port == port
                   and c.status == psutil.CONN_ESTABLISHED and c.raddr)

    try:
        for _ in range(300):
            held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        # Handshakes the server has not accepted yet (its listen backlog) count as established too, so it gets a
        # moment to accept and close the extra ones (3 xdist workers on 2 cores left 33 after a fixed second) -
        # less than the idle timeout, which would close all of them whatever the bound.
        deadline, seen = time.monotonic() + 0.8 * ThreadedServer.IDLE_TIMEOUT_S, server_side()
        while seen > control.MAX_CONNECTIONS and time.monotonic() < deadline:
            time.sleep(0.1)
            seen = server_side()
        assert 0 < seen <= control.MAX_CONNECTIONS, seen
        deadline = time.monotonic() + ThreadedServer.IDLE_TIMEOUT_S + 10
        while server_side() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server_side() == 0, "idle connections that never sent a request were kept open"
        for s in held:
            s.close()
        r = httpx.post(f"{server.url()}/resume", headers={"Authorization": f"Bearer {ctl.token}"}, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        for s in held:
            s.close()
        ctl.close()
