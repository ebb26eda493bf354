"""Exact resume after SIGKILL, on file:// and on a real S3 server (moto) on loopback.

Every run is `reflow train` in a subprocess (fresh Ray, the session's Prefect server), 6 tiny
iterations, a checkpoint after each. Kill points are the fault-injection env vars checked in
tasks/checkpoint.py. One uninterrupted run (module fixture) is the reference for all tests. Each
subprocess run costs ~40-50 s of start-up and shutdown on 2 cores, so one experiment carries several
failures in a row (a failed background commit, a kill mid-save) instead of one experiment each; the S3 run
is killed right after a commit.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pandas as pd
import pytest

from reflow.infra.cluster import leases
from reflow.infra.store import checkpoint as ckpt
from reflow.infra.store.storage import ExperimentStore
from tests import prefect_reads
from tests.ckpt_fixtures import (
    LoopbackS3,
    assert_bit_identical,
    final_weights,
    iteration_rewards,
    reap,
    run_train,
    s3_with_bucket,
    write_config,
)

pytestmark = pytest.mark.slow
N = 6
RETRY_LOGGED = re.compile(r"storage: .* failed \(.*\); retry \d+/\d+")  # infra/storage.with_retries
ROLLOUT_COLUMNS = {"prompt", "response", "prompt_tokens", "response_tokens", "reward", "advantage",
                   "finish_reason", "policy_version"}


@pytest.fixture(scope="module")
def env(prefect_server) -> dict[str, str]:
    """Subprocesses talk to the session's Prefect server instead of starting their own (~12 s each)."""
    from prefect.settings import PREFECT_API_URL

    return {"PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_HOME": os.environ["PREFECT_HOME"]}


@pytest.fixture(scope="module")
def baseline(env, tiny_policy, tmp_path_factory):
    """An uninterrupted 6-iteration run: (per-iteration rewards, final policy weights)."""
    tmp = tmp_path_factory.mktemp("baseline")
    rc, out = run_train(write_config(tmp / "base.yaml", tiny_policy, f"file://{tmp}/runs", "base"), env)
    assert rc == 0, out[-3000:]
    store = ExperimentStore.open(f"file://{tmp}/runs", "base")
    rewards = iteration_rewards(store.read_json, N)
    assert len(set(rewards)) > 1, "rewards never change: the test would not notice a wrong resume"
    return rewards, final_weights(tmp / "runs/base/checkpoints" / ckpt.name_of(N) / "model")


@pytest.fixture(scope="module")
def s3(env):
    with s3_with_bucket() as server:
        yield server


def _s3_store(server, experiment) -> ExperimentStore:
    return ExperimentStore.open("s3://reflow-test/runs", experiment, endpoint_url=server.url, retries=2)


def _assert_matches_baseline(store: ExperimentStore, baseline, tmp: Path) -> None:
    rewards, weights = baseline
    assert iteration_rewards(store.read_json, N) == rewards
    for f in ("model.safetensors", "config.json"):
        store.download(f"{ckpt.ROOT}/{ckpt.name_of(N)}/model", f, tmp / "final")
    assert_bit_identical(final_weights(tmp / "final"), weights)
    for i in range(N):
        df = pd.read_parquet(store.fs.open(store._path(f"iterations/{i:06d}/rollouts.parquet")))
        assert ROLLOUT_COLUMNS <= set(df.columns) and len(df) == 16
        assert set(df.policy_version) == {i}


def _state(flow_run_id: str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state


@pytest.mark.timeout(1500)  # three `reflow train` runs (and the baseline's, when this test runs first): ~4 min quiet
def test_failed_background_commit_kills_and_resume_exactly(env, baseline, tiny_policy, tmp_path):
    """One experiment through three runs, each ending another way:

    A. checkpoints commit in the background while the next iteration runs (checkpoint.background_commit, the
       default, which the baseline ran with); commit 2 fails, which stops the run at the next iteration's end
       with the reason, leaving it uncommitted;
    B. resumed (background mode again), SIGKILLed in the middle of save 5 (files written, never committed; its
       Ray helpers outlive it);
    C. resumed from 4 with synchronous saves: first cleans up after B and marks B's flow run CRASHED, then
       completes bit-identical to the uninterrupted baseline, so both ways of saving checkpoint the same weights,
       with one lineage chain over the three runs.
    (A run of a finished experiment, which trains nothing and says so, is test_ppo's, in-process.)
    (A kill right after a commit, and a resume from it, is test_s3_outage_then_kill_then_resume_exactly's.)"""
    root = f"file://{tmp_path}/runs"
    cfg = write_config(tmp_path / "run.yaml", tiny_policy, root, "killed")
    sync = write_config(tmp_path / "sync.yaml", tiny_policy, root, "killed", **{"checkpoint.background_commit": False})
    store = ExperimentStore.open(root, "killed")

    rc, out = run_train(cfg, env | {"REFLOW_FAULT_FAIL_COMMIT": "2"})
    assert rc != 0 and "checkpoint iter_000002 was not committed (InjectedFault" in out, out[-3000:]
    assert "resume=auto continues from the latest committed checkpoint" in out, out[-3000:]
    assert store.read_text(ckpt.LATEST) == ckpt.name_of(1)
    assert not store.exists(f"{ckpt.ROOT}/{ckpt.name_of(2)}/{ckpt.MARKER}")
    assert not store.exists("iterations/000003/metrics.json")  # no iteration starts once the failure is known

    rc, out = run_train(cfg, env | {"REFLOW_FAULT_KILL_DURING_SAVE": "5"}, leave_leftovers=True)
    assert rc == -9 and f"{ckpt.name_of(1)}: 1 iterations done" in out, out[-3000:]
    assert store.read_text(ckpt.LATEST) == ckpt.name_of(4)
    assert not store.exists(f"{ckpt.ROOT}/{ckpt.name_of(5)}/{ckpt.MARKER}")  # files written, never committed
    killed = leases.read("killed")
    left = [p for p in killed.processes if leases.running(p[0], p[1])]
    assert left, "Ray's agents outlive a SIGKILLed driver: the cleanup below would be checked vacuously"
    assert _state(killed.flow_run_id).type.value == "RUNNING"  # nothing could report the kill

    rc, out = run_train(sync, env)
    assert rc == 0 and f"{ckpt.name_of(4)}: 4 iterations done" in out, out[-3000:]
    # The third run cleaned up after the second before building its runtime.
    assert not [p for p in left if leases.running(p[0], p[1])]
    assert "process(es) left behind by flow run" in out, out[-3000:]
    state = _state(killed.flow_run_id)
    assert state.type.value == "CRASHED" and "marked CRASHED by the next run" in state.message
    _assert_matches_baseline(store, baseline, tmp_path)
    _assert_lineage_after_resumes(store, str(tiny_policy))



def _assert_lineage_after_resumes(store: ExperimentStore, initial: str) -> None:
    """Three runs (A saved 1, its commit 2 failed; B saved 2, 3 and 4, killed saving 5; C saved 5 and 6): one
    chain 6..1 back to the initial model, each checkpoint naming the train flow run that saved it, and
    consuming one iteration."""
    from reflow.infra.store import lineage

    nodes = lineage.chain(store.url(ckpt.ROOT, ckpt.name_of(N)), store)
    assert [n.step for n in nodes] == list(range(N, 0, -1)) and nodes[-1].lineage["initial_model"] == initial
    assert [n.live for n in nodes] == [True, True] + [False] * (N - 2)  # keep_last=2: the rest from records
    train_runs = [n.lineage["flow_runs"]["train"] for n in nodes]  # the flow runs that saved 6, 5, .., 1
    assert train_runs[0] == train_runs[1] and train_runs[2] == train_runs[3] == train_runs[4], train_runs  # C; B
    assert len(set(train_runs)) == 3 and None not in train_runs, train_runs  # A saved 1
    cursors = [n.lineage["data"]["cursor"] for n in nodes]
    assert [(c["from_iteration"], c["to_iteration"]) for c in cursors] == [(s - 1, s) for s in range(N, 0, -1)]
    its = nodes[0].lineage["flow_runs"]["iterations"]
    assert list(its) == [str(N - 1)] and _state(its[str(N - 1)]).type.value == "COMPLETED"
    for run_id in (its[str(N - 1)], train_runs[0]):  # and each run names the checkpoint back
        assert any(nodes[0].url in (a.data or "") for a in prefect_reads.artifacts("killed-checkpoint", flow_run_id=run_id)), run_id
    assert len({n.manifest_sha256 for n in nodes}) == N


def _outage_when(store: ExperimentStore, rel: str, server: LoopbackS3, proc, seconds: float) -> None:
    """Once `rel` exists, stop the S3 server until the run has logged a storage retry (at least
    `seconds`), then start it again on the same port. Waiting for the run to notice, rather than for
    a fixed time, keeps the test honest on a slow machine: a fixed window can fall between two writes."""
    deadline = time.monotonic() + 240
    while not store.exists(rel):
        assert proc.poll() is None, proc.log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, f"the run did not write {rel}"
        time.sleep(0.2)
    server.stop()  # mid-run: the next requests hit a closed port
    down_since = time.monotonic()
    while not RETRY_LOGGED.search(proc.log_path.read_text()) or time.monotonic() - down_since < seconds:
        assert proc.poll() is None, "the run ended during the outage:\n" + proc.log_path.read_text()[-3000:]
        assert time.monotonic() - down_since < 120, "no storage retry logged in 120 s of outage"
        time.sleep(0.2)
    server.start()  # moto's buckets live in this process, so the data is still there


def test_s3_outage_then_kill_then_resume_exactly(env, baseline, s3, tiny_policy, tmp_path):
    """On moto's S3 server: the server goes away for 10 s once iteration 1 is recorded (the run waits
    and retries within `storage.outage_budget_s`, 60 s by default), the run is SIGKILLed after
    checkpoint 3, the resumed run completes; every iteration's records are present and the result
    equals the uninterrupted file:// run."""
    cfg = write_config(tmp_path / "run.yaml", tiny_policy, "s3://reflow-test/runs", "s3-run",
                       **{"storage.endpoint_url": s3.url})
    store = _s3_store(s3, "s3-run")
    proc = run_train(cfg, env | {"REFLOW_FAULT_KILL_AFTER_COMMIT": "3"}, background=True)
    try:
        _outage_when(store, "iterations/000001/metrics.json", s3, proc, seconds=10.0)
        proc.wait(timeout=240)
    finally:
        reap(proc)
    out = proc.log_path.read_text()
    assert proc.returncode == -9, out[-3000:]
    assert RETRY_LOGGED.search(out), "the outage was not noticed: no storage retry logged"
    assert store.read_text(ckpt.LATEST) == ckpt.name_of(3)

    rc, out = run_train(cfg, env)
    assert rc == 0 and f"{ckpt.name_of(3)}: 3 iterations done" in out, out[-3000:]
    _assert_matches_baseline(store, baseline, tmp_path)
    assert "testing" not in store.read_text("config.yaml")  # no credentials saved
