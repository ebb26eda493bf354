"""A flow run given inputs it cannot use (a bad `config` parameter, a file reference with a bad override,
a model folder that is not there, new data without a fixed eval set) is named after its experiment and
fails with the one-line reason as its state message, before any cluster starts. Real Prefect (the
session's server); the flows are called as Prefect calls a deployment's entrypoint, with raw parameters.
The deployments themselves: tests/test_deployments.py."""
from __future__ import annotations

import pytest

from reflow.flows.cli import DEMO_CONFIG
from reflow.infra.config.schema import ConfigError
from reflow.infra.ops.preflight import PreflightError

pytestmark = pytest.mark.slow


def _last_run() -> tuple[str, str, str]:
    """(name, state type, state message) of the newest flow run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        run = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)[0]
    return run.name, run.state.type.value, run.state.message or ""


@pytest.mark.parametrize("config,error,message", [
    ({"file": str(DEMO_CONFIG), "overrides": ["experiment=bad-override", "rollout.top_p=0"]}, ConfigError,
     f"invalid configuration ({DEMO_CONFIG} + overrides): rollout.top_p: Input should be greater than 0 (got 0)"),
    ({"experiment": "bad-full", "rollout": {"top_p": 0}}, ConfigError,
     "invalid configuration (the flow's config parameter, full form): rollout.top_p: Input should be greater than 0 "
     "(got 0)"),
    ({"file": str(DEMO_CONFIG), "overrides": ["experiment=bad-model", "model.path=/nonexistent/policy"]},
     PreflightError, "model.path: "),
])
def test_train_run_is_named_after_its_experiment_and_says_why_first(prefect_server, config, error, message):
    from reflow.flows.train import train

    with pytest.raises(error):
        train(config)
    name, state, msg = _last_run()
    assert (name, state) == (config.get("experiment") or config["overrides"][0].split("=")[1], "FAILED")
    assert msg.startswith(message) and "\n" not in msg, msg


def test_retrain_with_new_data_refuses_a_heldout_eval_set(prefect_server, tmp_path):
    from reflow.flows.retrain import retrain

    with pytest.raises(ConfigError):
        retrain({"file": str(DEMO_CONFIG), "overrides": ["experiment=needs-fixed-eval"]}, new_data=str(tmp_path))
    name, state, msg = _last_run()
    assert (name, state) == ("needs-fixed-eval-retrain", "FAILED")
    assert msg.startswith("retrain with new_data needs a fixed eval set"), msg


def test_evaluate_run_is_named_after_its_experiment_and_says_why_first(prefect_server):
    from reflow.flows.evaluate import evaluate

    with pytest.raises(ConfigError):
        evaluate({"file": str(DEMO_CONFIG), "overrides": ["experiment=bad-eval", "rollout.top_p=0"]})
    name, state, msg = _last_run()
    assert (name, state) == ("bad-eval-eval", "FAILED")
    assert msg.startswith(f"invalid configuration ({DEMO_CONFIG} + overrides): rollout.top_p: "), msg
