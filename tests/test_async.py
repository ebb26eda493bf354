"""Asynchronous rollout (rollout.max_staleness, tasks/rollout_source.py): which policy generates which
batch, the off-policy metrics, and an exact resume."""
from __future__ import annotations

import math
import shutil

import pandas as pd
import pytest

from reflow.infra.config.schema import ConfigError, load_config
from reflow.infra.config.settings import ASYNC_TIS_CAP, loss_settings


def test_async_mode_is_refused_with_hand_overs_and_always_corrects_with_tis():
    with pytest.raises(ConfigError, match="hand_over=false"):
        load_config(None, ["rollout.max_staleness=1", "cluster.colocate=true"])
    assert load_config(None, ["rollout.max_staleness=1", "cluster.colocate=true", "cluster.hand_over=false"])
    assert loss_settings(load_config(None, ["rollout.max_staleness=1"])).tis_cap == ASYNC_TIS_CAP
    assert loss_settings(load_config(None, ["rollout.max_staleness=2", "algorithm.tis_cap=3"])).tis_cap == 3
    assert loss_settings(load_config(None, [])).tis_cap is None  # the synchronous loop: as configured


@pytest.mark.slow
def test_async_run_trains_on_one_step_stale_batches_and_resumes_exactly(ray_cluster, prefect_server, tiny_policy,
                                                                         tmp_path):
    """max_staleness=1, 3 iterations straight, against 1 iteration then a resume to 3 (with the stage
    records of the batch generated after the checkpoint deleted, as if the run had died before writing
    them): batch i comes from policy max(0, i-1), the resumed run takes batch 1 from storage and
    generates batch 2 again, and both runs end with the same weights, bit for bit."""
    from reflow.flows.train import train
    from tests.test_algorithms_e2e import _config

    def run(name, *extra):
        return train(_config(tiny_policy, tmp_path, name, ["rollout.max_staleness=1", "num_iterations=3", "data.reward_fn=tests.ckpt_fixtures:digit_reward",
                                                           *extra]))

    straight = run("async-straight")
    assert straight["iterations"] == 3
    root = tmp_path / "runs"
    for i, m in enumerate(straight["history"]):
        assert m["staleness"] == (0 if i == 0 else 1) and m["rollout_policy_version"] == max(0, i - 1)
        versions = pd.read_parquet(root / "algo-async-straight" / "iterations" / f"{i:06d}" / "rollouts.parquet")
        assert set(versions["policy_version"]) == {max(0, i - 1)}  # every sample records its policy
        for key in ("tis_weight_mean", "tis_weight_max", "tis_capped_frac", "async_trainer_wait_s",
                    "async_push_wait_s", "async_engine_idle_s", "time_await_rollouts"):
            assert math.isfinite(m[key]) and m[key] >= 0, (i, key, m.get(key))
        assert 0 <= m["tis_capped_frac"] <= 1 and m["tis_weight_max"] <= ASYNC_TIS_CAP
        assert m["async_engines_sched_idle"] == 1.0  # CPU engines generate on idle CPU time only
    assert any(m["tis_weight_mean"] != 1.0 for m in straight["history"][1:])  # stale batches get weights != 1
    # iterations 1 and 2 started their updates before their flow runs; the resumed run's iteration 1 (its
    # first) could not, so the comparison below also holds an update started ahead against one that was not
    assert [m["async_update_started_ahead"] for m in straight["history"]] == [0.0, 1.0, 1.0]
    assert "time_advantages" not in straight["history"][1] and straight["history"][1]["async_start_ahead_s"] > 0

    first = run("async-resumed", "debug_exit_after=1")
    assert first["iterations"] == 1
    resumed_dir = root / "algo-async-resumed"
    assert (resumed_dir / "iterations" / "000001" / "stages" / "scored.json").exists()  # committed with checkpoint 1
    shutil.rmtree(resumed_dir / "iterations" / "000002" / "stages", ignore_errors=True)
    second = run("async-resumed")
    assert (second["start"], second["iterations"]) == (1, 2)
    assert second["history"][0]["scored_from_storage"] == 1.0  # batch 1: policy 0's, from before the checkpoint
    assert "scored_from_storage" not in second["history"][1]  # batch 2: generated again by policy 1
    assert [m["async_update_started_ahead"] for m in second["history"]] == [0.0, 1.0]
    for a, b in zip(straight["history"][1:], second["history"]):
        assert (a["reward_mean"], a["staleness"], a["loss"]) == (b["reward_mean"], b["staleness"], b["loss"])
    final = [root / f"algo-async-{n}" / "checkpoints" / "iter_000003" / "model" / "model.safetensors"
             for n in ("straight", "resumed")]
    assert final[0].read_bytes() == final[1].read_bytes()


def test_synchronous_prefetcher_is_on_where_asked_and_trains_the_same_weights(ray_cluster, prefect_server,
                                                                            tiny_policy, tmp_path):
    """The synchronous loop's rollout source (tasks/rollout_source.py): on unless rollout.generate_ahead=false;
    it submits updates ahead only where rollout.update_ahead asks (auto: off on this CPU-only cluster; never
    with hand-overs). Generating ahead, submitting updates ahead, or neither (every iteration generating and
    training in its own tasks): 3 iterations end with the same weights, bit for bit."""
    from reflow.flows.train import train
    from reflow.tasks.rollout_source import prefetches, updates_ahead
    from tests.test_algorithms_e2e import _config

    assert prefetches(load_config(None, [])) and not updates_ahead(load_config(None, []))  # auto, no GPU here
    assert updates_ahead(load_config(None, ["rollout.update_ahead=true"]))
    assert not prefetches(load_config(None, ["rollout.generate_ahead=false"]))
    assert prefetches(load_config(None, ["cluster.colocate=true"]))  # hand-overs: generated ahead, updated in the run
    assert not updates_ahead(load_config(None, ["rollout.update_ahead=true", "cluster.colocate=true"]))

    def run(name, *over):
        return train(_config(tiny_policy, tmp_path, name, [*over, "num_iterations=3",
                                                           "data.reward_fn=tests.ckpt_fixtures:digit_reward"]))

    on, ahead, off = (run("sync-ahead", "rollout.update_ahead=true"), run("sync-gen", "rollout.update_ahead=false"),
                      run("sync-own", "rollout.generate_ahead=false"))
    assert [m["async_update_started_ahead"] for m in on["history"]] == [0.0, 1.0, 1.0]
    assert [m["async_update_started_ahead"] for m in ahead["history"]] == [0.0, 0.0, 0.0]
    assert [m["generate_started_ahead"] for m in ahead["history"]] == [1.0, 1.0, 1.0]  # the generation only
    assert [m["generate_started_ahead"] for m in off["history"]] == [0.0, 0.0, 0.0]
    assert all("async_update_started_ahead" not in m for m in off["history"])
    for a, b, c in zip(on["history"], ahead["history"], off["history"]):
        assert (a["staleness"], b["staleness"]) == (0, 0)
        assert a["rollout_policy_version"] == b["rollout_policy_version"] == c["rollout_policy_version"]
        assert (a["reward_mean"], a["loss"]) == (b["reward_mean"], b["loss"]) == (c["reward_mean"], c["loss"])
    final = [tmp_path / "runs" / f"algo-sync-{n}" / "checkpoints" / "iter_000003" / "model" / "model.safetensors"
             for n in ("ahead", "gen", "own")]
    assert final[0].read_bytes() == final[1].read_bytes() == final[2].read_bytes()


def test_a_transient_failure_ahead_leaves_the_batch_to_the_flow_run_and_any_other_is_the_runs_error():
    """An engine lost while the batch was made ahead of its flow run: the flow run's `take` gets no batch and a
    fallback mark, so its own tasks generate (recreating the engine) and train. Anything else (a reward function
    that raises, a bug) is raised by `take` as it came: the flow run's own tasks would only fail the same way
    again, after logging it once more. close() raises neither."""
    from concurrent.futures import Future

    from reflow.engines.rollout_client import EngineError
    from reflow.tasks.rollout_source import RolloutSource

    def failed(e: Exception) -> Future:
        f: Future = Future()
        f.set_exception(e)
        return f

    cfg = load_config(None, ["rollout.update_ahead=true"])
    for ahead in (True, False):  # the update submitted ahead (start_next), or only the batch taken (take)
        p = RolloutSource(cfg, 0, end=0)  # k = 0 and nothing left to generate: no batch is launched
        p.batches[3] = (0, failed(EngineError("http://127.0.0.1:1", "/generate", None, "iteration 3: lost")))
        assert not ahead or p.start_next(3)
        batch, waits = p.take(3)
        assert batch is None and waits["async_fallback"] == 1.0
        p.batches[4] = (0, failed(ValueError("iteration 4: the reward function returned nan")))
        assert not ahead or p.start_next(4)
        with pytest.raises(ValueError, match="iteration 4: the reward function returned nan"):
            p.take(4)
        p.close()
