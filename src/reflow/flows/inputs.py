"""What every flow does with its inputs first: resolve the config, run the preflight, and turn a
mistake in them into a FAILED run whose message is the one-line reason (flows/train.py, evaluate.py,
retrain.py)."""
from __future__ import annotations

from prefect import get_run_logger
from prefect.states import Failed, State

from reflow.infra.config.flow_params import ExperimentFile, InvalidConfig, resolve_config
from reflow.infra.config.schema import ConfigError, RunConfig
from reflow.infra.ops.preflight import PreflightError, one_line, preflight, warnings_for

USER_ERRORS = (ConfigError, PreflightError)  # a run input to fix: the run fails with its one line


def refused(error: Exception) -> State:
    """The state of a run whose inputs are wrong: FAILED, its message the one-line reason (first, so
    the UI's run list shows it), logged too. A direct call of the flow raises `error` itself."""
    line = one_line(error)
    get_run_logger().error("reflow: %s", line)
    return Failed(message=line, data=error)


def checked_config(config: RunConfig | ExperimentFile | InvalidConfig) -> RunConfig:
    """The resolved config, after the preflight (seconds: a bad deployment parameter fails here, not
    after the cluster started). The CLI has run it already; it is cheap enough to repeat."""
    cfg = resolve_config(config)
    preflight(cfg)
    for line in warnings_for(cfg):
        get_run_logger().warning(line)
    return cfg
