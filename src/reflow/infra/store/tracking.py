"""Experiment trackers besides Prefect's artifacts (the `tracking:` config section): TensorBoard event
files in the run's storage, Weights & Biases (offline by default) and MLflow.

They get what the artifacts show: each iteration's metrics as `train/<metric>` at step = iteration,
each eval's summary as `eval/<set>/<key>` at step = policy version (iterations trained), and the
resolved config once. tasks/progress.py feeds them from the train flow's driver; nothing here runs in
Ray. A resumed run appends: TensorBoard merges the event files of one folder by step; W&B and MLflow
get one run per flow run, named after the experiment.
"""
from __future__ import annotations

import importlib.util
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

import yaml

from reflow.infra.config.schema import RunConfig, TrackingConfig
from reflow.infra.store.storage import ExperimentStore

TB_DIR = "tracking/tensorboard"  # under the experiment, in storage
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # tracker -> module it imports


def missing_packages(t: TrackingConfig) -> list[str]:
    """`tracking.<name>` settings that are on while their package is not installed."""
    return [name for name, module in PACKAGES.items()
            if getattr(t, name) and importlib.util.find_spec(module) is None]


def local_dir(cfg: RunConfig, store: ExperimentStore) -> Path:
    """tracking.local_dir, else the run's storage folder `tracking/` (file://), else .reflow/tracking/<exp>."""
    if cfg.tracking.local_dir:
        return Path(cfg.tracking.local_dir).expanduser()
    if store.is_local:
        return Path(store.access.fs_for(store.url("tracking"))[1])
    return Path(".reflow") / "tracking" / cfg.experiment


def scalars(metrics: dict[str, Any], prefix: str) -> dict[str, float]:
    """The finite numbers of `metrics`, keys prefixed (`train/reward_mean`); bools and text are left out."""
    return {f"{prefix}/{k}": float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}


def _flat(node: Any, where: str = "") -> dict[str, str]:
    """A dumped config as {dotted key: value as text} (MLflow params are flat strings)."""
    if isinstance(node, dict):
        return {k: v for key, sub in node.items() for k, v in _flat(sub, f"{where}.{key}" if where else key).items()}
    return {where: str(node)}


class Tracker(Protocol):
    def log(self, values: dict[str, float], step: int) -> None: ...
    def flush(self) -> None: ...
    def close(self, ok: bool) -> None: ...


class TensorBoard:
    """Event files written by torch's SummaryWriter into the run's storage (a local stage for s3://,
    uploaded on flush)."""

    def __init__(self, cfg: RunConfig, store: ExperimentStore):
        from torch.utils.tensorboard import SummaryWriter

        self.store = store
        folder = Path(store.access.fs_for(store.url(TB_DIR))[1]) if store.is_local else \
            Path(tempfile.mkdtemp(prefix=f"reflow-tb-{cfg.experiment}-"))
        self.folder = folder
        self.writer = SummaryWriter(log_dir=str(folder))
        self.writer.add_text("config", "```yaml\n" + yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
                             + "```", 0)

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def flush(self) -> None:
        self.writer.flush()
        if not self.store.is_local:
            self.store.access.put_tree(self.folder, self.store.url(TB_DIR))

    def close(self, ok: bool) -> None:
        self.flush()
        self.writer.close()


class WandB:
    """One W&B run; train/* plotted against `iteration`, eval/* against `policy_version` (an eval that
    lands after later iterations, eval.blocking=false, would be dropped on W&B's single step axis)."""

    def __init__(self, cfg: RunConfig, folder: Path, name: str):
        import wandb

        folder.mkdir(parents=True, exist_ok=True)
        t = cfg.tracking
        self.run = wandb.init(project=t.wandb_project, name=name, group=cfg.experiment, dir=str(folder),
                              mode=t.wandb_mode, config=cfg.model_dump(mode="json"), reinit="create_new",
                              settings=wandb.Settings(console="off", silent=True))
        for axis, pattern in (("iteration", "train/*"), ("policy_version", "eval/*")):
            self.run.define_metric(axis)
            self.run.define_metric(pattern, step_metric=axis)

    def log(self, values: dict[str, float], step: int) -> None:
        for prefix, axis in (("train/", "iteration"), ("eval/", "policy_version")):
            mine = {k: v for k, v in values.items() if k.startswith(prefix)}
            if mine:
                self.run.log({**mine, axis: step})

    def flush(self) -> None:
        pass  # W&B writes as it goes

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class MLflow:
    def __init__(self, cfg: RunConfig, folder: Path, name: str):
        import mlflow

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # its INFO lines (database set-up) stay off the terminal
        uri = cfg.tracking.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None  # a tracking server's or the URI's own default
        if not uri:  # a local SQLite store, its artifacts beside it (MLflow's default is ./mlruns in the cwd)
            folder.mkdir(parents=True, exist_ok=True)
            uri, artifacts = f"sqlite:///{folder.resolve()}/mlflow.db", (folder / "mlartifacts").resolve().as_uri()
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(cfg.experiment)
        exp_id = found.experiment_id if found else self.client.create_experiment(cfg.experiment, artifacts)
        self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
        config = cfg.model_dump(mode="json")
        params = [mlflow.entities.Param(k, v[:6000]) for k, v in _flat(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.client.log_dict(self.run_id, config, "config.yaml")
        self.uri = uri

    def log(self, values: dict[str, float], step: int) -> None:
        import mlflow

        now = int(time.time() * 1000)  # MLflow metric names allow no '@': pass@1 -> pass_at_1
        metrics = [mlflow.entities.Metric(k.replace("@", "_at_"), v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def flush(self) -> None:
        pass  # every log is a write

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


class Trackers:
    """Every tracker `cfg.tracking` turns on (none: every call is a no-op)."""

    def __init__(self, cfg: RunConfig, store: ExperimentStore, run_name: str | None = None):
        t, name = cfg.tracking, run_name or cfg.experiment
        self.open: list[Tracker] = []
        if t.tensorboard:
            self.open.append(TensorBoard(cfg, store))
        if t.wandb:
            self.open.append(WandB(cfg, local_dir(cfg, store), name))
        if t.mlflow:
            self.open.append(MLflow(cfg, local_dir(cfg, store), name))
        self.evals_logged: set[int] = set()

    def iteration(self, i: int, metrics: dict[str, Any]) -> None:
        """Iteration i's metrics at step i."""
        for tracker in self.open:
            tracker.log(scalars(metrics, "train"), i)

    def evals(self, evals: dict[int, dict[str, dict]]) -> None:
        """Each eval {policy version: {set: summary}} not logged yet, at step = policy version."""
        for version in sorted(set(evals) - self.evals_logged):
            values = {k: v for name, s in evals[version].items() for k, v in scalars(s, f"eval/{name}").items()}
            for tracker in self.open:
                tracker.log(values, version)
            self.evals_logged.add(version)

    def flush(self) -> None:
        for tracker in self.open:
            tracker.flush()

    def close(self, ok: bool = True) -> None:
        while self.open:
            self.open.pop().close(ok)
