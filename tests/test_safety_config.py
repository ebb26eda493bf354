"""Config values that become storage paths, get saved, or decide a promotion, are checked before use:
names are one path segment, URLs carry no credentials, the champion gate never promotes on a
number it cannot compare. Fast tier: real config validation, a real file-backed store, no services."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from pydantic import TypeAdapter, ValidationError

from reflow.infra.config.flow_params import FlowConfig, resolve_config
from reflow.infra.config.schema import ConfigError, RunConfig, dump_config, load_config
from reflow.infra.store import promotion as pm
from reflow.infra.store.storage import ExperimentStore, StorageError

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYzEXAMPLEKEY"

# ---------------------------------------------------------------- 5. names are one path segment

BAD_NAMES = ["..", ".", "", "../escape", "a/b", "a\\b", ".hidden", "has space"]


NAME_FIELDS = {"experiment": "experiment='{}'", "eval.sets.0.name": "eval.sets=[{{name: '{}', temperature: 0}}]"}


@pytest.mark.parametrize("field", list(NAME_FIELDS))
@pytest.mark.parametrize("name", BAD_NAMES)
def test_names_are_one_path_segment(field, name):
    with pytest.raises(ConfigError) as e:
        load_config(None, [NAME_FIELDS[field].format(name)])
    msg = str(e.value)
    assert field in msg and "path segment" in msg, msg


@pytest.mark.parametrize("name", ["demo", "demo-s1-20250101-120000", "exp.v2", "a_b", "x..y"])
def test_ordinary_names_still_validate(name):
    cfg = load_config(None, [f"experiment={name}", f"eval.sets=[{{name: {name}, temperature: 0}}]"])
    assert cfg.experiment == name and cfg.eval.sets[0].name == name


def test_store_refuses_a_name_that_escapes_its_root(tmp_path):
    """Defence in depth: a store opened without the config (CLI `runs show`, scripts) must not write
    next to the root: `..` would put config.yaml at tmp_path/config.yaml."""
    root = f"file://{tmp_path}/runs"
    for name in ("..", ".", "a/../..", "", ".hidden"):
        with pytest.raises(ValueError, match="path segment"):
            ExperimentStore.open(root, name).write_text("config.yaml", "x")
    assert not (tmp_path / "config.yaml").exists()
    assert list(tmp_path.iterdir()) == []
    ok = ExperimentStore.open(root, "exp")
    assert ok.write_text("config.yaml", "x").endswith("/runs/exp/config.yaml")


# ---------------------------------------------------------------- 6. no credentials in URL-like fields

LEAKY = [
    f"s3://AKIAIOSFODNN7EXAMPLE:{SECRET}@bucket/x.parquet",
    f"http://user:{SECRET}@127.0.0.1:9000",
    f"s3://AKIAIOSFODNN7EXAMPLE:{SECRET[:10]}/{SECRET[10:]}@bucket/x",  # an AWS secret with a '/'
    f"https://b.s3.amazonaws.com/x.jsonl?X-Amz-Algorithm=AWS4&X-Amz-Credential=AKIA%2F1&X-Amz-Signature={SECRET}",
    f"https://b.s3.amazonaws.com/x.jsonl?AWSAccessKeyId=AKIAIOSFODNN7EXAMPLE&Signature={SECRET}&Expires=1",
    f"https://acct.blob.core.windows.net/c/x.jsonl?sv=2022-11-02&sig={SECRET}",
    f"https://host/data.parquet?token={SECRET}",
    f"s3://bucket/x?access_key={SECRET}",
    f"s3://bucket/x?secret={SECRET}",
]
URL_FIELDS = ["model.path", "model.ref_path", "critic.path", "data.path", "data.eval_path", "weight_sync.disk_dir",
              "checkpoint.sentinel", "storage.root", "storage.endpoint_url", "resume", "cluster.address"]


def _assert_refused(msg: str, field: str) -> None:
    assert SECRET not in msg and SECRET[:10] not in msg and SECRET[10:] not in msg, msg
    assert field in msg and "credentials" in msg, msg
    assert "AWS_ACCESS_KEY_ID" in msg and "~/.aws" in msg, msg


@pytest.mark.parametrize("field", URL_FIELDS)
@pytest.mark.parametrize("url", LEAKY, ids=range(len(LEAKY)))
def test_url_fields_refuse_embedded_credentials(field, url):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{field}={url}"])
    _assert_refused(str(e.value), field)


@pytest.mark.parametrize("url", LEAKY, ids=range(len(LEAKY)))
def test_eval_set_source_refuses_embedded_credentials(url):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"eval.sets=[{{name: gsm, source: '{url}', temperature: 0}}]"])
    _assert_refused(str(e.value), "eval.sets.0.source")


def test_the_secret_is_not_in_pydantics_own_message():
    """Code that validates a RunConfig directly and prints the error must not print the secret either."""
    with pytest.raises(ValidationError) as e:
        RunConfig.model_validate({"storage": {"endpoint_url": LEAKY[1]}})
    assert SECRET not in str(e.value) and "storage.endpoint_url" in str(e.value)


@pytest.mark.parametrize("override", [f"trainer.lr={LEAKY[0]}", f"no_such_field={LEAKY[3]}", LEAKY[0],
                                      f"model.path.sub={LEAKY[1]}"])
def test_other_errors_do_not_echo_a_url_with_credentials(override):
    """A wrongly typed value, an unknown key or a malformed override is reported with its input; not when
    that input holds a key."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert SECRET not in str(e.value), str(e.value)


@pytest.mark.parametrize("url", ["s3://bucket/users/me@example.com/x.jsonl", "http://127.0.0.1:9000",
                                 "http://host:9000/path@v2/x", "s3://bucket/x.parquet?versionId=3",
                                 "/data/a@b/x.jsonl", "file:///tmp/x.jsonl"])
def test_urls_without_credentials_still_validate(url):
    cfg = load_config(None, [f"data.path={url}", f"storage.endpoint_url={url}"])
    assert cfg.data.path == url


def test_store_root_shares_the_rule():
    """storage.normalize_root refuses what the config refuses (one rule), presigned query included."""
    for url in LEAKY:
        with pytest.raises(StorageError, match="embeds credentials") as e:
            ExperimentStore.open(url, "exp")
        assert SECRET not in str(e.value) and "AWS_ACCESS_KEY_ID" in str(e.value)


def test_saved_config_holds_no_credentials(monkeypatch):
    """A valid config with remote storage dumps (config.yaml, checkpoint config) without any key: they
    come from the AWS chain at use time, never into the config."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAIOSFODNN7EXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    cfg = load_config(DEMO, ["storage.root=s3://bucket/runs", "storage.endpoint_url=http://127.0.0.1:9000",
                             "model.path=s3://bucket/models/p", "data.task=file", "data.path=s3://bucket/d.jsonl"])
    saved = dump_config(cfg)
    assert "AKIAIOSFODNN7EXAMPLE" not in saved and SECRET not in saved
    assert RunConfig.model_validate(yaml.safe_load(saved)) == cfg


def _flow_message(value) -> str:
    """What a flow run shows when its `config` parameter fails: the ConfigError its flow fails with
    (flows/train.py `refused`; a parameter error would echo Prefect's formatting of the input)."""
    config = TypeAdapter(FlowConfig).validate_python(value)  # never raises: the run is still named
    assert SECRET not in repr(config) and SECRET not in config.experiment
    with pytest.raises(ConfigError) as e:
        resolve_config(config)
    return str(e.value)


@pytest.mark.parametrize("field", ["storage.endpoint_url", "model.path", "data.eval_path"])
def test_flow_parameter_forms_refuse_credentials(field):
    section, key = field.split(".")
    full = _flow_message({section: {key: LEAKY[0]}})
    short = _flow_message({"file": str(DEMO), "overrides": [f"{field}={LEAKY[3]}"]})
    for msg in (full, short):
        assert SECRET not in msg and field in msg and "AWS_ACCESS_KEY_ID" in msg, msg


def test_retrain_new_data_parameter_refuses_credentials():
    from prefect.exceptions import ParameterTypeError

    from reflow.flows.retrain import retrain

    with pytest.raises(ParameterTypeError) as e:
        retrain.validate_parameters({"config": {"file": str(DEMO)}, "new_data": LEAKY[0]})
    assert SECRET not in str(e.value) and "new_data" in str(e.value) and "AWS_ACCESS_KEY_ID" in str(e.value)


# ---------------------------------------------------------------- 9. the promotion gate


@pytest.mark.parametrize("cand,champ", [(math.nan, 0.9), (0.1, math.nan), (math.nan, None), (math.inf, 0.5),
                                        (0.5, -math.inf), (math.nan, math.nan)])
def test_gate_refuses_non_finite_metrics(cand, champ, caplog):
    with caplog.at_level("WARNING", logger="reflow.promotion"):
        d = pm.decide(cand, champ, 0.0, "heldout/pass@1")
    assert d.promote is False and "not finite" in d.reason, d.reason
    assert "not finite" in caplog.text


@pytest.mark.parametrize("cand,champ,tol,promote", [
    (0.5, None, 0.0, True), (0.5, 0.5, 0.0, True), (0.49, 0.5, 0.0, False), (0.45, 0.5, 0.05, True),
    (0.44, 0.5, 0.05, False), (None, 0.5, 1.0, False),
])
def test_gate_on_finite_metrics_is_unchanged(cand, champ, tol, promote):
    assert pm.decide(cand, champ, tol, "canary/pass@1").promote is promote


def _store_with_champion(tmp_path, metric: str, value: float) -> ExperimentStore:
    store = ExperimentStore.open(f"file://{tmp_path}/runs", "exp")
    first = pm.decide(value, None, 0.0, metric)
    assert first.promote
    pm.write_champion(store, "file:///ck/iter_000001", 1, first, "run-1")
    return store


def test_changing_the_gate_metric_does_not_promote(tmp_path):
    """The champion was chosen on heldout/pass@1; a gate on canary/pass@1 cannot compare with it, so
    the candidate is not promoted (before: the champion counted as absent and anything won)."""
    store = _store_with_champion(tmp_path, "heldout/pass@1", 0.9)
    d = pm.against_champion(0.1, pm.read_champion(store), 0.0, "canary/pass@1")
    assert d.promote is False
    for part in ("heldout/pass@1", "canary/pass@1", "metric='heldout/pass@1'", pm.CHAMPION):
        assert part in d.reason, d.reason
    same = pm.against_champion(0.95, pm.read_champion(store), 0.0, "heldout/pass@1")
    assert same.promote and same.champion == 0.9
    worse = pm.against_champion(0.5, pm.read_champion(store), 0.0, "heldout/pass@1")
    assert not worse.promote and "regressed" in worse.reason
    assert pm.against_champion(0.1, None, 0.0, "canary/pass@1").promote  # no champion yet: the first one wins


def test_a_champion_record_without_a_usable_value_blocks_promotion(tmp_path):
    store = _store_with_champion(tmp_path, "heldout/pass@1", 0.9)
    record = {**pm.read_champion(store), "value": None}
    d = pm.against_champion(0.95, record, 0.0, "heldout/pass@1")
    assert d.promote is False and pm.CHAMPION in d.reason, d.reason
