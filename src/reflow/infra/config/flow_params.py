"""A flow's `config` parameter: the full RunConfig (the UI renders every field) or the short form
{"file": "configs/X.yaml", "overrides": ["key=value", ...]} (`prefect deployment run`, the UI's JSON).

A parameter that does not validate is kept as an `InvalidConfig` instead of failing Prefect's own
parameter check, so that the run is still named after its experiment and fails, in the flow, with
the one-line reason first (flows/train.py `refused`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import ConfigDict, Discriminator, Field, Tag, ValidationError, WrapValidator

from reflow.infra.config.guards import check_segment
from reflow.infra.config.schema import ConfigError, RunConfig, apply_overrides, format_errors, load_config
from reflow.rl.algorithms.base import StrictModel


class ExperimentFile(StrictModel):
    """An experiment YAML plus dotted overrides: the short form of a flow's `config` parameter, for
    `prefect deployment run` and the UI. Resolved when the flow run starts (`resolve_config`): a bad
    file or override fails the run before anything starts, with the same message as the CLI, and the
    run is still named after the experiment the file and overrides name."""

    model_config = ConfigDict(hide_input_in_errors=True)  # the overrides may hold a refused URL

    file: str = Field("configs/demo.yaml", min_length=1, description="Experiment YAML, relative to the deployment's working directory (the repository).")
    overrides: list[str] = Field(default_factory=list, description="Dotted key=value overrides, e.g. [\"num_iterations=40\", \"trainer.lr=1e-5\"].")

    def resolve(self) -> RunConfig:
        return load_config(self.file, self.overrides)

    @property
    def experiment(self) -> str:  # for flow_run_name templates: never raises
        try:
            return self.resolve().experiment
        except ConfigError:
            return _experiment_named({"file": self.file, "overrides": self.overrides})


class InvalidConfig:
    """A flow's `config` parameter that did not validate. Kept instead of raised, so that Prefect still
    names the run after its experiment and the flow fails with the reason first (`resolve_config`
    raises it); a parameter error would leave the run with a random name and the message under
    Prefect's own heading."""

    def __init__(self, message: str, experiment: str):
        self.message, self.experiment = message, experiment

    def __repr__(self) -> str:  # never the input: it may hold a refused URL
        return f"InvalidConfig(experiment={self.experiment!r})"


def _experiment_named(raw: Any) -> str:
    """The experiment a raw `config` parameter names (a full config dict, or {file, overrides}) when it
    does not validate: its `experiment` if that is a valid name, else the file's stem, else the default."""
    data: Any = raw
    if isinstance(raw, dict) and ("file" in raw or "overrides" in raw):
        file = str(raw.get("file") or "configs/demo.yaml")
        try:
            data = apply_overrides(yaml.safe_load(Path(file).read_text()) or {}, list(raw.get("overrides") or []))
        except (OSError, yaml.YAMLError, ConfigError, TypeError, AttributeError):
            data = {"experiment": Path(file).stem}
    name = data.get("experiment") if isinstance(data, dict) else None
    default = str(RunConfig.model_fields["experiment"].default)
    try:
        return check_segment(name, "name") if isinstance(name, str) else default
    except ValueError:  # not a valid name: never used as the run's name (it could be anything, a URL too)
        return default


def _config_kind(v: Any) -> str:
    if isinstance(v, dict):
        return "file" if "file" in v or "overrides" in v else "full"
    return "file" if isinstance(v, ExperimentFile) else "full"


def _kept_invalid(value: Any, handler: Any) -> Any:
    """Validate a flow's `config` parameter; an invalid one becomes an `InvalidConfig` (see there)."""
    if isinstance(value, InvalidConfig):
        return value
    try:
        config = handler(value)
    except ValidationError as e:
        source = "the flow's config parameter" + (", full form" if _config_kind(value) == "full" else "")
        return InvalidConfig(format_errors(e, source, strip=1), _experiment_named(value))
    if isinstance(config, ExperimentFile):  # resolved now, so that no object holds overrides it refused
        try:
            config.resolve()
        except ConfigError as e:
            return InvalidConfig(str(e), _experiment_named(value))
    return config


# A flow's `config` parameter: the full RunConfig or {file, overrides} (the UI's run form shows it as JSON).
# The discriminator picks one by its keys, so a bad value gets one error list, not one per variant.
FlowConfig = Annotated[Annotated[RunConfig, Tag("full")] | Annotated[ExperimentFile, Tag("file")],
                       Discriminator(_config_kind), WrapValidator(_kept_invalid)]


def resolve_config(config: RunConfig | ExperimentFile | InvalidConfig) -> RunConfig:
    """The run's config; a ConfigError naming the field when the parameter or its file is invalid."""
    if isinstance(config, InvalidConfig):
        raise ConfigError(config.message)
    return config.resolve() if isinstance(config, ExperimentFile) else config
