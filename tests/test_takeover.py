"""A flow run on a long-lived cluster takes over the engines an earlier flow run left, whatever state that run
died in.

A run killed mid-push, or whose trainer node was lost (tests/test_multinode.py, a CI run of session 30), leaves
its engine paused, maybe inside a weight-update session or, colocated, with its memory released (that part:
tests/test_engine.py, `take_over`). The
next run reuses that actor; before the fix it waited 120 s on a health generate the paused engine refused
("HTTP 503: paused or memory released") and failed.
"""
from __future__ import annotations

import pytest

from reflow.engines.rollout_client import EngineClient

pytestmark = pytest.mark.slow


def test_a_later_run_takes_over_an_engine_left_paused_mid_update(ray_cluster, tiny_policy, tmp_path, monkeypatch):
    from reflow.infra.cluster import ray_connect
    from reflow.infra.cluster.runtime import shutdown_runtime, start_runtime
    from reflow.infra.config.schema import load_config

    # As after `cluster.address=...`: the run's actors outlive it and the next flow run reuses them.
    monkeypatch.setattr(ray_connect, "_ATTACHED", ["the session's cluster"])
    cfg = load_config(None, ["experiment=takeover", f"model.path={tiny_policy}", "data.num_train=8", "data.num_eval=4",
                             "rollout.num_engines=1", "trainer.num_ranks=1", f"storage.root=file://{tmp_path}/runs"])
    try:
        first = start_runtime(cfg)
        engine_id = first.actor_ids["engine-0"]
        c = EngineClient(first.engine_urls[0], api_key=first.api_key)
        # Where a run killed mid-push leaves it: paused, a weight update begun and never ended.
        c.pause_generation("abort")
        c.begin_weight_update()
        shutdown_runtime(cfg.experiment, release=False)  # that run's process is gone; its actors stay

        second = start_runtime(cfg)
        assert second.reused == ["engine-0", "policy-trainer-0"]
        assert second.actor_ids["engine-0"] == engine_id  # taken over, not recreated
        out = EngineClient(second.engine_urls[0], api_key=second.api_key).generate(
            input_ids=[5, 6], sampling_params={"max_new_tokens": 3, "ignore_eos": True})
        assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == 3
    finally:
        shutdown_runtime(cfg.experiment, release=True)
