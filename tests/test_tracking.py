"""The `tracking:` section's trackers, read back with each tool's own reader: TensorBoard's
EventAccumulator, MLflow's client on its SQLite store, W&B's offline run file (its records, parsed with
W&B's own protobuf classes). Offline, no Ray, no Prefect; S3 on loopback (moto) for the upload of the
event files. The train flow feeding them: tests/test_e2e.py."""
from __future__ import annotations

import glob
import json
import struct

import pytest

from reflow.infra.config.schema import load_config
from reflow.infra.ops.preflight import PreflightError, check_tracking
from reflow.infra.store.storage import ExperimentStore
from reflow.infra.store.tracking import Trackers
from tests.ckpt_fixtures import s3_with_bucket

ALL_ON = ["tracking.tensorboard=true", "tracking.wandb=true", "tracking.mlflow=true"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    for var in ("MLFLOW_TRACKING_URI", "WANDB_MODE", "WANDB_DIR", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


def _feed(trackers: Trackers) -> None:
    """What the train flow hands over: iteration 0, evals of versions 0 and 1, iteration 1; an
    eval already logged is not logged again."""
    evals: dict[int, dict[str, dict]] = {0: {"heldout": {"pass@1": 0.25, "set": "heldout", "prompts": 4}}}
    trackers.evals(evals)
    trackers.iteration(0, {"reward_mean": 0.5, "time_iteration": 1.5, "scored": True, "lost": float("nan")})
    evals[1] = {"heldout": {"pass@1": 0.5, "pass@4": 0.75}}
    trackers.evals(evals)
    trackers.iteration(1, {"reward_mean": 0.75, "time_iteration": 1.25})
    trackers.evals(evals)
    trackers.close()


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


EXPECTED = {"train/reward_mean": [(0, 0.5), (1, 0.75)], "train/time_iteration": [(0, 1.5), (1, 1.25)],
            "eval/heldout/pass@1": [(0, 0.25), (1, 0.5)], "eval/heldout/prompts": [(0, 4.0)],
            "eval/heldout/pass@4": [(1, 0.75)]}


def _wandb_history(folder) -> tuple[list[dict], dict]:
    """(history rows, config) of the one offline run under `folder`: its .wandb file is a LevelDB-style
    log (a 7-byte W&B header, 32 KiB blocks of records with 7-byte headers) of W&B protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(f"{folder}/wandb/offline-run-*/run-*.wandb")
    data, pos, part, rows, config = open(path, "rb").read(), 7, b"", [], {}
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length, kind) == (0, 0):  # block padding
            pos += left
            continue
        part, pos = part + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(part)
            part = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
            if record.WhichOneof("record_type") == "run":
                config = {i.key: json.loads(i.value_json) for i in record.run.config.update}
    return rows, config


@pytest.mark.slow  # wandb starts its wandb-core service process, which may outlive the test by a moment
def test_every_tracker_gets_the_metrics_evals_and_config(tmp_path, monkeypatch):
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # nothing may land in the working directory (MLflow's ./mlruns default)
    cfg = load_config(None, ["experiment=trk", f"storage.root=file://{tmp_path}/runs", *ALL_ON])
    _feed(Trackers(cfg, ExperimentStore.from_config(cfg.storage, cfg.experiment), "trk-run"))
    folder = tmp_path / "runs" / "trk" / "tracking"

    assert _scalars(folder / "tensorboard") == EXPECTED  # bools and NaN left out

    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{folder}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("trk").experiment_id])
    assert (run.info.run_name, run.info.status) == ("trk-run", "FINISHED")
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval/heldout/pass_at_1")] == \
        EXPECTED["eval/heldout/pass@1"]
    assert run.data.params["rollout.temperature"] == "1.0" and run.data.params["tracking.mlflow"] == "True"
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["config.yaml"]
    assert list((folder / "mlartifacts").rglob("config.yaml")) and not list((tmp_path / "cwd").iterdir())

    rows, config = _wandb_history(folder)
    train = [(r["iteration"], r["train/reward_mean"]) for r in rows if "train/reward_mean" in r]
    evals = [(r["policy_version"], r["eval/heldout/pass@1"]) for r in rows if "eval/heldout/pass@1" in r]
    assert (train, evals) == (EXPECTED["train/reward_mean"], EXPECTED["eval/heldout/pass@1"])
    assert config["experiment"] == "trk" and config["rollout"]["max_new_tokens"] == 8


def test_tensorboard_files_reach_remote_storage(tmp_path):
    with s3_with_bucket() as s3:
        cfg = load_config(None, ["experiment=trk-s3", "storage.root=s3://reflow-test/tracking-test",
                                 f"storage.endpoint_url={s3.url}", "tracking.tensorboard=true"])
        store = ExperimentStore.from_config(cfg.storage, cfg.experiment)
        _feed(Trackers(cfg, store, "trk-s3"))
        (name,) = store.listdir("tracking/tensorboard")
        store.download("tracking/tensorboard", name, tmp_path / "tb")
    assert _scalars(tmp_path / "tb") == EXPECTED


def test_preflight_names_a_tracker_whose_package_is_missing(monkeypatch):
    cfg = load_config(None, ALL_ON)
    assert check_tracking(cfg) == "tracking: tensorboard, wandb, mlflow (installed)"
    assert check_tracking(load_config(None, [])) is None
    monkeypatch.setitem(__import__("reflow.infra.store.tracking").infra.store.tracking.PACKAGES, "wandb", "no_such_wandb_module")
    with pytest.raises(PreflightError, match=r"^tracking\.wandb=true but the package 'no_such_wandb_module' is not "
                                             r"installed: pip install no_such_wandb_module"):
        check_tracking(cfg)
