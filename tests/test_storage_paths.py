"""Every storage path honours storage.endpoint_url (issue 13, point 7), and loading a checkpoint's
model/ folder checks every file against the checkpoint's manifest, with a download cache keyed by
content (point 8).

Each test talks to moto's S3 server on loopback at an endpoint that only the config names: no
AWS_ENDPOINT_URL* variable is set, so a path that ignores the config reaches for AWS (which does
not resolve here) and fails. Data, eval sources, model folders, retrain's new data and disk pushes
each get a test; the slow one at the end runs `reflow train` and `reflow evaluate` with all of them
on the custom endpoint, trainer and engines in Ray actors.
"""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from reflow.engines.hf_io import load_causal_lm, load_tokenizer, resolve_checkpoint
from reflow.infra.config.schema import dump_config, load_config
from reflow.infra.config.settings import push_settings, storage_access
from reflow.infra.store import checkpoint as ckpt
from reflow.infra.store.storage import ChecksumError, ExperimentStore
from reflow.rl.demo_policy import build_model, save_policy
from tests.ckpt_fixtures import REFLOW, REPO, captured, reap, s3_with_bucket

BUCKET = "reflow-paths"
RETRY_LOGGED = "retry 1/"


@pytest.fixture(scope="module")
def s3():
    with s3_with_bucket(BUCKET) as server:
        yield server


@pytest.fixture(autouse=True)
def only_the_config_names_the_endpoint(monkeypatch, tmp_path):
    """No endpoint in the environment, no S3 client cached with one, a model cache of this test's own."""
    import s3fs

    for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("REFLOW_KEYS_DIR", str(tmp_path / "keys"))  # checkpoints signed with a key of this test
    monkeypatch.delenv("REFLOW_CHECKPOINT_KEY", raising=False)
    monkeypatch.setattr("reflow.engines.hf_io.CACHE_DIR", tmp_path / "cache")
    s3fs.S3FileSystem.clear_instance_cache()
    yield
    s3fs.S3FileSystem.clear_instance_cache()


def _fs(s3):
    """The test's own client (explicit endpoint): puts the fixtures in place and reads results back."""
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=s3.url, skip_instance_cache=True)


def _cfg(s3, prefix: str, *overrides: str):
    return load_config(None, [f"experiment={prefix}", f"storage.root=s3://{BUCKET}/{prefix}/runs",
                              f"storage.endpoint_url={s3.url}", "storage.retry_backoff_s=0.2",
                              "storage.outage_budget_s=20", *overrides])


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _parquet(rows, tmp_path: Path) -> bytes:
    pd.DataFrame(rows).to_parquet(tmp_path / "t.parquet")
    return (tmp_path / "t.parquet").read_bytes()


def _rows(prefix: str, n: int) -> list[dict]:
    return [{"prompt": f"{prefix}{a}+1=", "label": str(a + 1)} for a in range(n)]


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def other_policy(tiny_policy, tmp_path_factory) -> Path:
    """tiny_policy's shapes and tokenizer, other weights: a re-written checkpoint."""
    tok = load_tokenizer(str(tiny_policy))
    return save_policy(build_model(tok, hidden=32, layers=2, heads=2, mlp=64, seed=7), tok,
                       tmp_path_factory.mktemp("other_policy"))


# ---------------------------------------------------------------- point 7: every path, the config's endpoint


@pytest.mark.slow  # ~2.5 s of CPU: make test-fast stays under a minute
def test_prompt_files_come_from_the_configured_endpoint(s3, tiny_policy, tmp_path):
    from reflow.infra.inputs.prompts import load_prompts

    fs = _fs(s3)
    fs.pipe(f"{BUCKET}/data/train.jsonl", _jsonl(_rows("1", 6)))
    fs.pipe(f"{BUCKET}/data/held.parquet", _parquet(_rows("2", 3), tmp_path))
    cfg = _cfg(s3, "data", f"model.path={tiny_policy}", "data.task=file", f"data.path=s3://{BUCKET}/data/train.jsonl",
               f"data.eval_path=s3://{BUCKET}/data/held.parquet")
    train, held = load_prompts(cfg, load_tokenizer(str(tiny_policy)))
    assert [p.text for p in train] == [r["prompt"] for r in _rows("1", 6)]
    assert [p.label for p in held] == [r["label"] for r in _rows("2", 3)]


def test_eval_sources_come_from_the_configured_endpoint(s3, tiny_policy, tmp_path):
    from reflow.infra.inputs.eval_sets import load_eval_sets

    fs = _fs(s3)
    fs.pipe(f"{BUCKET}/evalsets/a.jsonl", _jsonl(_rows("3", 4)))
    fs.pipe(f"{BUCKET}/evalsets/b.parquet", _parquet(_rows("4", 5), tmp_path))
    cfg = _cfg(s3, "evalsets", f"model.path={tiny_policy}",
               f"eval.sets=[{{name: a, source: s3://{BUCKET}/evalsets/a.jsonl}}, "
               f"{{name: b, source: s3://{BUCKET}/evalsets/b.parquet}}]")
    a, b = load_eval_sets(cfg, load_tokenizer(str(tiny_policy)), [])
    assert [p.text for p in a.prompts] == [r["prompt"] for r in _rows("3", 4)]
    assert [p.label for p in b.prompts] == [r["label"] for r in _rows("4", 5)]


def test_a_storage_outage_while_reading_an_eval_source_is_retried(s3, tiny_policy):
    """The paths outside the experiment store retry like the store: a read during a short outage is
    logged and completes once the server is back."""
    from reflow.infra.inputs.eval_sets import load_eval_sets

    _fs(s3).pipe(f"{BUCKET}/outage/a.jsonl", _jsonl(_rows("5", 3)))
    cfg = _cfg(s3, "outage", f"model.path={tiny_policy}", f"eval.sets=[{{name: a, source: s3://{BUCKET}/outage/a.jsonl}}]")
    tok = load_tokenizer(str(tiny_policy))
    done = threading.Event()
    with captured("reflow.storage") as warnings:
        def back_after_a_retry() -> None:
            while not done.is_set() and not any(RETRY_LOGGED in w for w in warnings):
                time.sleep(0.05)
            s3.start()

        s3.stop()
        back = threading.Thread(target=back_after_a_retry, daemon=True)
        back.start()
        try:
            (a,) = load_eval_sets(cfg, tok, [])
        finally:
            done.set()  # the server comes back whatever happened, for the tests after this one
            back.join(timeout=30)
    assert [p.text for p in a.prompts] == [r["prompt"] for r in _rows("5", 3)]
    assert any(f"s3://{BUCKET}/outage/a.jsonl" in w and s3.url in w for w in warnings), warnings


def test_a_model_folder_comes_from_the_configured_endpoint_and_is_never_served_stale(s3, tiny_policy, other_policy):
    """A user's own HF folder on S3 (no manifest): loaded through the config's endpoint, by the
    engine as it runs in an actor; re-written at the same URL, the next load gets the new weights."""
    from reflow.engines.embedded.engine import EmbeddedEngine

    fs, url = _fs(s3), f"s3://{BUCKET}/models/policy"
    fs.put(f"{tiny_policy}/", f"{BUCKET}/models/policy/", recursive=True)
    cfg = _cfg(s3, "models", f"model.path={url}")
    engine = EmbeddedEngine(url, "paths-engine", threads=1, storage=storage_access(cfg))
    try:
        assert _same(_weights(engine.generator.model), _weights(load_causal_lm(str(tiny_policy))))
    finally:
        engine.shutdown()
    fs.put(f"{other_policy}/model.safetensors", f"{BUCKET}/models/policy/model.safetensors")
    again = load_causal_lm(url, storage=storage_access(cfg))
    assert _same(_weights(again), _weights(load_causal_lm(str(other_policy)))), "a stale cached copy was loaded"


@pytest.mark.slow  # ~2.5 s of CPU: make test-fast stays under a minute
def test_retrain_new_data_comes_from_the_configured_endpoint(s3, tiny_policy, tmp_path):
    """new_data listed and merged through the config's endpoint; the merged prompts (kept in the
    experiment's storage) are then read back as the run's training data."""
    from reflow.infra.inputs.prompts import load_prompts
    from reflow.infra.store import promotion as pm
    from reflow.tasks.retrain import take_new_data

    fs = _fs(s3)
    fs.pipe(f"{BUCKET}/retrain/incoming/a.jsonl", _jsonl(_rows("6", 4)))
    fs.pipe(f"{BUCKET}/retrain/incoming/b.parquet", _parquet(_rows("7", 3), tmp_path))
    fs.pipe(f"{BUCKET}/retrain/held.jsonl", _jsonl(_rows("8", 2)))
    cfg = _cfg(s3, "retrain", f"model.path={tiny_policy}", f"data.eval_path=s3://{BUCKET}/retrain/held.jsonl",
               f"eval.sets=[{{name: held, source: s3://{BUCKET}/retrain/held.jsonl}}]")
    new_cfg, files = take_new_data.fn(cfg, f"s3://{BUCKET}/retrain/incoming", "run-1")
    assert [f["url"].rsplit("/", 1)[-1] for f in files] == ["a.jsonl", "b.parquet"]
    train, _ = load_prompts(new_cfg, load_tokenizer(str(tiny_policy)))
    assert sorted(p.text for p in train) == sorted(r["prompt"] for r in _rows("6", 4) + _rows("7", 3))
    store = ExperimentStore.from_config(cfg.storage, cfg.experiment)
    pm.append_ledger(store, files, "run-1")
    assert take_new_data.fn(cfg, f"s3://{BUCKET}/retrain/incoming", "run-2") == (None, [])


def test_disk_pushes_go_to_the_configured_endpoint(s3, tiny_policy):
    """mode=disk with disk_dir on S3: the trainer side publishes the folder and the engine reloads it,
    each through the storage access the config's builders give them."""
    from reflow.engines.embedded.engine import EmbeddedEngine
    from reflow.engines.rollout_client import EngineClient
    from reflow.engines.weights.push import publish_weights, push_weights

    cfg = _cfg(s3, "pushes", f"model.path={tiny_policy}", "weight_sync.mode=disk", "weight_sync.verify=full",
               f"weight_sync.disk_dir=s3://{BUCKET}/pushes/run")
    settings = push_settings(cfg)
    tok = load_tokenizer(str(tiny_policy))
    model = build_model(tok, hidden=32, layers=2, heads=2, mlp=64, seed=5)
    named = list(model.state_dict().items())
    pushed = publish_weights(lambda out: save_policy(model, tok, out), settings.disk_dir, "5", settings.storage)
    url = pushed.path
    assert url == f"s3://{BUCKET}/pushes/run/reflow-weight-push/v5" and _fs(s3).exists(f"{url}/model.safetensors")
    engine = EmbeddedEngine(str(tiny_policy), "paths-push", threads=1, storage=storage_access(cfg))
    try:
        engine.ready()
        client = EngineClient(engine.url(), timeout=60, api_key=engine.api_key())
        stats = push_weights([client], named, "5", settings, model_path=url, model_files=pushed.files)
    finally:
        engine.shutdown()
    assert stats["verified_tensors"] == len(named)
    assert stats["disk_files_checked"] == 1  # the download checked against the digests of what was uploaded


# ---------------------------------------------------------------- point 8: checked against the manifest


def _commit_policy(store: ExperimentStore, step: int, policy: Path) -> str:
    """A committed checkpoint whose model/ is `policy` (what a save writes); returns the model/ URL."""
    ck = ckpt.at_step(store, step)
    ckpt.begin(ck)
    files = {f"model/{p.name}": store.put_file(p, ck.rel(f"model/{p.name}")) for p in sorted(policy.iterdir())
             if p.is_file()}
    ckpt.commit(ck, files, ckpt.state_for(step, 4, 0, 1), "experiment: x\n")
    return ck.store.url(ck.rel("model"))


def _corrupt_same_size(store: ExperimentStore, rel: str) -> None:
    data = bytearray(store.read_bytes(rel))
    data[len(data) // 2] ^= 0xFF
    store.write_bytes(rel, bytes(data))


@pytest.mark.parametrize("where", ["s3", "local"])
def test_eval_only_refuses_a_same_size_corrupted_model_file(s3, tiny_policy, tmp_path, where):
    """The eval-only runtime checks every model file against the manifest before any actor starts:
    one flipped byte in model.safetensors (same size, so the manifest's sizes still match) is refused
    with the file and the checkpoint named."""
    from reflow.infra.cluster.runtime import build_eval_runtime

    cfg = _cfg(s3, f"corrupt-{where}", f"model.path={tiny_policy}")
    if where == "local":
        cfg = cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"root": f"file://{tmp_path}/runs"})})
    store = ExperimentStore.from_config(cfg.storage, cfg.experiment)
    url = _commit_policy(store, 3, tiny_policy)
    ck = ckpt.at_step(store, 3)
    ckpt.check(ck, signature=False)  # committed, every size right: only the contents tell
    _corrupt_same_size(store, ck.rel("model/model.safetensors"))
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": url})})
    with pytest.raises(ChecksumError, match=r"model\.safetensors") as e:
        build_eval_runtime(cfg)
    assert ck.url in str(e.value) and "manifest" in str(e.value), str(e.value)


def test_the_download_cache_is_keyed_by_content(s3, tiny_policy, other_policy, tmp_path):
    """A checkpoint re-written at the same URL (a new commit of the same step) is downloaded afresh;
    the cached copy of the first one is kept under its own digest and reused when it comes back."""
    from reflow.engines import hf_io

    cfg = _cfg(s3, "rewrite")
    store = ExperimentStore.from_config(cfg.storage, cfg.experiment)
    access = storage_access(cfg)
    url = _commit_policy(store, 1, tiny_policy)
    first = load_causal_lm(url, storage=access, files=ckpt.model_files(url, store))
    assert _same(_weights(first), _weights(load_causal_lm(str(tiny_policy))))
    _commit_policy(store, 1, other_policy)
    second = load_causal_lm(url, storage=access, files=ckpt.model_files(url, store))
    assert _same(_weights(second), _weights(load_causal_lm(str(other_policy)))), "a stale cached copy was loaded"
    assert len([p for p in hf_io.CACHE_DIR.iterdir() if p.is_dir()]) == 2
    _commit_policy(store, 1, tiny_policy)
    files = ckpt.model_files(url, store)
    s3.stop()  # the first copy's digest again: served from the cache, storage not needed
    try:
        local = resolve_checkpoint(url, storage=access, files=files)
    finally:
        s3.start()
    assert _same(_weights(load_causal_lm(str(local))), _weights(first))


# ---------------------------------------------------------------- end to end, trainer and engines in Ray


def _run(cmd: str, config: Path, env: dict[str, str], timeout: float = 420) -> tuple[int, str]:
    log = config.with_name(f"{config.stem}-{cmd}-{int(time.time() * 1000)}.log")
    with open(log, "w") as out:
        proc = subprocess.Popen([REFLOW, cmd, "-c", str(config)], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(timeout=timeout)
    finally:
        reap(proc)
    return proc.returncode, log.read_text()


@pytest.mark.slow
def test_train_and_eval_only_with_everything_at_the_configured_endpoint(s3, prefect_server, tiny_policy, tmp_path):
    """`reflow train` (model, data, eval source, disk pushes, checkpoints all on the custom endpoint,
    trainer and engine as Ray actors), then `reflow evaluate` of its checkpoint, then the same after
    one byte of the checkpoint's weights changed: refused, naming the file and the checkpoint."""
    from prefect.settings import PREFECT_API_URL

    fs, base = _fs(s3), f"{BUCKET}/endpoint"
    fs.put(f"{tiny_policy}/", f"{base}/policy/", recursive=True)
    fs.pipe(f"{base}/train.jsonl", _jsonl(_rows("1", 16)))
    fs.pipe(f"{base}/held.jsonl", _jsonl(_rows("9", 4)))
    # experiment "endpoint", not "e2e": in one pytest process (make test-random) tests/test_e2e.py reads the session's
    # Prefect server for the runs and artifacts of its experiment "e2e"
    cfg = _cfg(s3, "endpoint", f"model.path=s3://{base}/policy", "data.task=file", f"data.path=s3://{base}/train.jsonl",
               f"data.eval_path=s3://{base}/held.jsonl", "num_iterations=1", "eval.before_train=false",
               "data.reward_fn=tests.ckpt_fixtures:digit_reward", "rollout.prompts_per_iteration=4",
               "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=4", "trainer.micro_batch_size=8",
               "weight_sync.mode=disk", f"weight_sync.disk_dir=s3://{base}/pushes", "weight_sync.verify=full",
               f"eval.sets=[{{name: held, source: s3://{base}/held.jsonl, temperature: 0}}]")
    (config := tmp_path / "run.yaml").write_text(dump_config(cfg))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("AWS_ENDPOINT_URL")}
    env.update(PYTHONPATH=str(REPO), PREFECT_API_URL=PREFECT_API_URL.value(),
               REFLOW_CACHE=str(tmp_path / "model-cache"))
    rc, out = _run("train", config, env)
    assert rc == 0, out[-4000:]
    assert fs.exists(f"{base}/pushes/reflow-weight-push/v1/model.safetensors"), "the disk push did not go to S3"
    rc, out = _run("evaluate", config, env)
    assert rc == 0, out[-4000:]
    assert fs.exists(f"{base}/runs/endpoint/evals/iter_000001/held/summary.json")
    store = ExperimentStore.from_config(cfg.storage, cfg.experiment)
    _corrupt_same_size(store, "checkpoints/iter_000001/model/model.safetensors")
    rc, out = _run("evaluate", config, {**env, "REFLOW_CACHE": str(tmp_path / "fresh-cache")})
    assert rc != 0 and "ChecksumError" in out and "model.safetensors" in out, out[-4000:]
    assert f"s3://{base}/runs/endpoint/checkpoints/iter_000001" in out, out[-4000:]
