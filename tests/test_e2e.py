"""End to end on real Ray + DeepSpeed + Prefect: the train flow, 3 iterations, 2 trainer ranks."""
from __future__ import annotations

import asyncio
import base64
import json
import math
import re
import time

import pandas as pd
import pytest

from reflow.infra.config.schema import load_config
from tests import prefect_reads

pytestmark = pytest.mark.slow

METRICS = ["reward_mean", "loss", "pg_loss", "kl", "entropy", "grad_norm", "clip_frac", "ratio_mean",
           "logprob_mismatch", "push_seconds", "time_generate", "time_train", "time_iteration"]


def e2e_config(policy, tmp_path, *extra):
    return load_config(None, [
        "experiment=e2e", f"model.path={policy}", "num_iterations=3", "eval.interval=2",
        "data.num_train=64", "data.num_eval=16", "rollout.prompts_per_iteration=4",
        "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=4", "rollout.num_engines=2", "trainer.num_ranks=2",
        "trainer.zero_stage=2", "trainer.micro_batch_size=4", "trainer.lr=1e-3",
        "algorithm.kl_coef=0.01", "weight_sync.verify=full", f"storage.root=file://{tmp_path}/runs", *extra])


async def _log_messages(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async with get_client() as client:
        logs = await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        return [log.message for log in logs]


def _table(artifact) -> list[dict]:
    return json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data


def _assert_what_the_ui_shows(names: dict, arts: list) -> None:
    """Every iteration's timings add up to its whole (a report and an orchestration row among them),
    its metrics table starts with the key metrics, its log holds the one-line summary; the parent's
    one curves artifact carries the image itself and was updated up to the last policy version."""
    iteration_ids = {names[f"e2e-iter-{i:04d}"].id: i for i in range(3)}
    timings = [a for a in arts if a.key == "e2e-iteration-timings" and a.flow_run_id in iteration_ids]
    assert len(timings) == 3
    for a in timings:
        rows = _table(a)
        assert {"report", "orchestration", "generate", "train"} <= {r["stage"] for r in rows}, rows
        assert sum(float(r["share"].rstrip("%")) for r in rows) == pytest.approx(100, abs=0.5), rows
    for a in (a for a in arts if a.key == "e2e-iteration-metrics" and a.flow_run_id in iteration_ids):
        assert [r["metric"] for r in _table(a)[:5]] == ["reward_mean", "loss", "kl", "entropy", "time_iteration"]
    for run_id, i in iteration_ids.items():
        deadline = time.monotonic() + 15  # run logs reach the server in batches
        while not any(m.startswith(f"iteration {i}: reward ") for m in asyncio.run(_log_messages(run_id))):
            assert time.monotonic() < deadline, f"no metrics summary in the log of iteration {i}"
            time.sleep(1)
    curves = [a for a in arts if a.key == "e2e-curves"]
    assert len(curves) == 1 and curves[0].flow_run_id == names["e2e"].id, curves  # updated in place
    md = curves[0].data
    image = re.search(r"!\[[^]]*\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", md)
    assert image and base64.b64decode(image.group(1)).startswith(b"\x89PNG"), md[:300]
    assert "| 3 |" in md and "| 0 |" in md  # redrawn after the last eval, not only at its creation


def test_train_three_iterations_two_ranks(ray_cluster, prefect_server, tiny_policy, tmp_path):
    from reflow.flows.train import train

    cfg = e2e_config(tiny_policy, tmp_path, "tracking.tensorboard=true", "rollout.update_ahead=true")  # as on GPUs
    called = time.time()
    summary = train(cfg)
    assert summary["iterations"] == 3
    # the training loop's end (the demo's trained_s): a loop's length after the call, before the flow returned
    assert called + summary["loop_seconds"] < summary["loop_ended_at"] < time.time(), summary
    assert sorted(summary["evals"]) == [0, 2, 3]
    for i, m in enumerate(summary["history"]):
        for key in METRICS:
            assert key in m, f"iteration {i}: metric {key} missing"
            assert math.isfinite(m[key]), f"iteration {i}: {key}={m[key]}"
        assert m["push_verified_tensors"] > 0
    # every batch comes from the run's prefetcher, by the policy it trains (synchronous); the updates of the
    # last two were submitted before their flow runs started (tasks/rollout_source.py)
    assert [m["staleness"] for m in summary["history"]] == [0.0, 0.0, 0.0]
    assert [m["async_update_started_ahead"] for m in summary["history"]] == [0.0, 1.0, 1.0]

    names = prefect_reads.flow_runs("e2e", *(f"e2e-iter-{i:04d}" for i in range(3)))
    arts = prefect_reads.artifacts("e2e-iteration-metrics", "e2e-iteration-timings", "e2e-curves")
    assert "e2e" in names and names["e2e"].state.is_completed()
    for i in range(3):
        run = names[f"e2e-iter-{i:04d}"]
        assert run.state.is_completed() and run.parent_task_run_id is not None
    keys = [a.key for a in arts]
    assert keys.count("e2e-iteration-metrics") >= 3
    _assert_what_the_ui_shows(names, arts)

    base = tmp_path / "runs" / "e2e"
    for i in range(3):
        d = base / "iterations" / f"{i:06d}"
        assert json.loads((d / "metrics.json").read_text())["iteration"] == i
        df = pd.read_parquet(d / "rollouts.parquet")
        assert len(df) == 16 and set(df.finish_reason) <= {"stop", "length"}
        stored = json.loads((d / "metrics.json").read_text())
        parts = [v for k, v in stored.items() if k.startswith("time_") and k != "time_iteration"]
        assert {"time_report", "time_orchestration"} <= set(stored)  # every timing is stored
        assert sum(parts) == pytest.approx(stored["time_iteration"], rel=1e-9)
        # timed from the parent flow: creating the iteration's flow run counts as orchestration
        assert 0 < stored["flow_run_start_seconds"] <= stored["time_orchestration"]
    assert len(pd.read_parquet(base / "iterations" / "000000" / "eval" / "heldout" / "samples.parquet")) == 16
    assert json.loads((base / "iterations" / "000002" / "eval" / "heldout" / "summary.json").read_text()) \
        == summary["evals"][2]["heldout"]
    from tests.test_tracking import _scalars

    tb = _scalars(base / "tracking" / "tensorboard")  # the train flow feeds the trackers (infra/store/tracking.py)
    assert [step for step, _ in tb["train/reward_mean"]] == [0, 1, 2]
    assert tb["eval/heldout/pass@1"] == [(v, pytest.approx(summary["evals"][v]["heldout"]["pass@1"])) for v in (0, 2, 3)]
    png = (base / "plots" / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000
    assert "e2e-curves" in keys


def test_missing_checkpoint_is_named(prefect_server, tmp_path):
    from reflow.flows.train import train
    from reflow.infra.ops.preflight import PreflightError

    cfg = e2e_config(tmp_path / "no-such-policy", tmp_path, "experiment=e2e-missing")
    with pytest.raises(PreflightError, match="^model.path: checkpoint folder .*no-such-policy.* does not exist"):
        train(cfg)


def test_raising_reward_function_is_named(prefect_server, tiny_policy, tmp_path):
    """The flow's preflight scores a first row before any cluster starts (the run-time error path of
    a reward function: tests/test_demo_task.py)."""
    from reflow.flows.train import train
    from reflow.infra.ops.preflight import PreflightError

    cfg = e2e_config(tiny_policy, tmp_path, "experiment=e2e-badreward", "trainer.num_ranks=1",
                     "eval.before_train=false", "data.reward_fn=tests.reward_fixtures:raising_reward")
    with pytest.raises(PreflightError) as e:
        train(cfg)
    msg = str(e.value)
    assert "raising_reward" in msg and "sample 0" in msg and "verifier has no answer key" in msg
    assert not (tmp_path / "runs").exists()  # nothing in storage: the preflight's probe comes after the reward


def test_max_train_minutes_ends_the_run_after_the_iteration_that_crosses_it(ray_cluster, prefect_server, tiny_policy,
                                                                            tmp_path):
    """A wall-clock budget (flows/schedule.over_budget) makes the iteration that ends past it the run's last, as
    `reflow ctl stop` does: saved (committed), evaluated, the flow run COMPLETED, and its log says why."""
    from reflow.flows.train import train

    cfg = e2e_config(tiny_policy, tmp_path, "experiment=e2e-budget", "trainer.num_ranks=1", "rollout.num_engines=1",
                     "num_iterations=5", "max_train_minutes=0.0001", "eval.before_train=false")
    summary = train(cfg)
    assert summary["iterations"] == 1 and len(summary["history"]) == 1, summary
    assert sorted(summary["evals"]) == [1]  # the final eval, of the policy the one iteration made
    base = tmp_path / "runs" / "e2e-budget"
    assert (base / "checkpoints" / "latest").read_text().strip() == "iter_000001"
    assert (base / "checkpoints" / "iter_000001" / "COMMITTED").exists()
    assert (base / "iterations" / "000001" / "eval" / "heldout" / "summary.json").exists()
    assert not (base / "iterations" / "000001" / "metrics.json").exists()  # no second iteration
    run = prefect_reads.flow_runs("e2e-budget")["e2e-budget"]
    assert run.state.is_completed(), run.state
    deadline = time.monotonic() + 15  # run logs reach the server in batches
    while not any("max_train_minutes=0.0001: the time budget ends the run after 1 of 5 iterations" in m
                  for m in asyncio.run(_log_messages(run.id))):
        assert time.monotonic() < deadline, "no log line says the budget ended the run"
        time.sleep(1)


def test_debug_exit_after_stops_early(ray_cluster, prefect_server, tiny_policy, tmp_path):
    from reflow.flows.train import train

    cfg = e2e_config(tiny_policy, tmp_path, "experiment=e2e-debug", "trainer.num_ranks=1",
                     "rollout.num_engines=1", "debug_exit_after=1", "eval.before_train=false")
    summary = train(cfg)
    assert summary["iterations"] == 1 and len(summary["history"]) == 1
    assert sorted(summary["evals"]) == [1]  # the last iteration of this invocation is evaluated
    assert not (tmp_path / "runs" / "e2e-debug" / "iterations" / "000001" / "metrics.json").exists()
    # Resumed with a rollout function that raises: the iteration fails naming the function and the
    # sample, and the committed checkpoint of iteration 1 is still the latest.
    base = tmp_path / "runs" / "e2e-debug" / "checkpoints"
    before = (sorted(p.name for p in base.iterdir()), (base / "latest").read_text())
    bad = e2e_config(tiny_policy, tmp_path, "experiment=e2e-debug", "trainer.num_ranks=1", "rollout.num_engines=1",
                     "eval.before_train=false", "rollout.generate_fn=tests.rollout_fixtures:raising_rollout")
    with pytest.raises(Exception, match=r"rollout function tests\.rollout_fixtures:raising_rollout on sample 2 "
                                        r"\(prompt \d+: .*\) raised ConnectionRefusedError"):
        train(bad)
    assert (sorted(p.name for p in base.iterdir()), (base / "latest").read_text()) == before
    assert (base / "iter_000001" / "COMMITTED").exists()
    assert not (tmp_path / "runs" / "e2e-debug" / "iterations" / "000001" / "metrics.json").exists()
