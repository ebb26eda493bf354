"""Names that come from storage never choose where a file is written (issue 51, critical).

An object key is any string: `policy/../../<site-packages>/zz.pth` is a valid S3 key, and a bucket writer
can also list such a name in a checkpoint's MANIFEST.json. Joined to a local folder unchecked, it writes
a `.pth` file into site-packages, which the next Python start runs. These tests plant such keys on moto's
S3 server (loopback) in a model folder's listing and in a checkpoint manifest, and show that every
download refuses them with a clear message and writes nothing outside its folder.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from reflow.engines.hf_io import resolve_checkpoint
from reflow.engines.storage_access import StorageAccess, UnsafeName, local_target
from reflow.infra.store import checkpoint as ckpt
from reflow.infra.store.storage import ExperimentStore
from tests.ckpt_fixtures import REFLOW, REPO, s3_with_bucket

BUCKET = "reflow-names"
BAD_NAMES = ["../zz.pth", "a/../../zz.pth", "/etc/zz.pth", "a//b", "a\\..\\b", "./a", "a/./b", "", "a/", "a\0b"]


@pytest.fixture(scope="module")
def s3():
    with s3_with_bucket(BUCKET) as server:
        yield server


def _fs(s3):
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=s3.url, skip_instance_cache=True)


def _tree(root) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


@pytest.mark.parametrize("name", BAD_NAMES)
def test_only_plain_relative_names_become_local_paths(name, tmp_path):
    with pytest.raises(UnsafeName, match="not a plain relative path"):
        local_target(tmp_path, name, "s3://b/x")
    assert local_target(tmp_path, "model/config.json", "s3://b/x") == tmp_path.resolve() / "model" / "config.json"


def test_a_symlink_inside_the_folder_does_not_lead_out(tmp_path):
    (tmp_path / "inside").mkdir()
    (tmp_path / "inside" / "out").symlink_to(tmp_path.parent)
    with pytest.raises(UnsafeName, match="outside"):
        local_target(tmp_path / "inside", "out/zz.pth", "s3://b/x")


def test_a_listed_dotdot_key_is_refused_and_writes_nothing(s3, tiny_policy, tmp_path, monkeypatch):
    """A user's own model folder on S3 (no manifest: the listing decides what is fetched) holding one
    extra object at `policy/../../escape/zz.pth`."""
    cache = tmp_path / "a" / "b" / "cache"
    monkeypatch.setattr("reflow.engines.hf_io.CACHE_DIR", cache)
    fs = _fs(s3)
    fs.put(str(tiny_policy) + "/", f"{BUCKET}/listed/policy/", recursive=True)
    fs.pipe(f"{BUCKET}/listed/policy/../../escape/zz.pth", b"import os; os.system('touch /tmp/pwned')\n")
    assert "../../escape/zz.pth" in StorageAccess(endpoint_url=s3.url).files(f"s3://{BUCKET}/listed/policy")
    with pytest.raises(UnsafeName, match=r"'\.\./\.\./escape/zz\.pth'.*not a plain relative path"):
        resolve_checkpoint(f"s3://{BUCKET}/listed/policy", StorageAccess(endpoint_url=s3.url))
    assert not any("zz.pth" in p for p in _tree(tmp_path)), _tree(tmp_path)
    assert not (cache.exists() and any(cache.iterdir())), "a half-fetched folder was left in the cache"


def _planted_checkpoint(s3, tmp_path, tiny_policy, name: str) -> str:
    """A committed checkpoint of a step-1 model/ folder whose manifest (rewritten with its COMMITTED digest, as a
    bucket writer can) also lists `name`, with that object present at its literal key."""
    store = ExperimentStore.open(f"s3://{BUCKET}/manifest/runs", "exp", endpoint_url=s3.url)
    ck = ckpt.at_step(store, 1)
    ckpt.begin(ck)
    files = {f"model/{p.name}": store.put_file(p, ck.rel(f"model/{p.name}")) for p in sorted(tiny_policy.iterdir())}
    ckpt.commit(ck, files, ckpt.state_for(1, 4, 0, 1), "experiment: exp\n")
    payload = b"import os; os.system('touch /tmp/pwned')\n"
    _fs(s3).pipe(f"{BUCKET}/manifest/runs/exp/{ck.prefix}/{name}", payload)
    doc = json.loads(store.read_bytes(ck.rel(ckpt.MANIFEST)))
    doc["files"][name] = {"sha256": hashlib.sha256(payload).hexdigest(), "bytes": len(payload)}
    raw = json.dumps(doc).encode()
    store.write_bytes(ck.rel(ckpt.MANIFEST), raw)
    store.write_text(ck.rel(ckpt.MARKER), hashlib.sha256(raw).hexdigest())
    return f"{ck.url}/model"


def test_a_manifest_name_with_dotdot_is_refused_by_every_reader(s3, tiny_policy, tmp_path, monkeypatch):
    cache = tmp_path / "a" / "b" / "cache"
    monkeypatch.setattr("reflow.engines.hf_io.CACHE_DIR", cache)
    url = _planted_checkpoint(s3, tmp_path, tiny_policy, "model/../../../../escape/zz.pth")
    like = ExperimentStore.open(f"s3://{BUCKET}/manifest/runs", "exp", endpoint_url=s3.url)
    with pytest.raises(ckpt.CheckpointInvalid, match=r"model/\.\./\.\./\.\./\.\./escape/zz\.pth.*not a plain relative"):
        ckpt.model_files(url, like)
    # a caller handing such a table straight to the download is refused as well, before anything is fetched
    files = {"../../escape/zz.pth": {"sha256": "0" * 64, "bytes": 1}}
    with pytest.raises(UnsafeName):
        resolve_checkpoint(url, StorageAccess(endpoint_url=s3.url), files=files)
    assert not any("zz.pth" in p for p in _tree(tmp_path)), _tree(tmp_path)


def test_the_trainer_fetch_refuses_such_a_name(tmp_path):
    """A rank's checkpoint fetch (engines/train/checkpoint.fetch) goes through the same check."""
    from reflow.engines.train import checkpoint as train_ckpt

    store = ExperimentStore.open(f"file://{tmp_path}/runs", "exp")

    class Rank:
        rank = 0

    manifest = {"rng/rank_00000.pt": {"sha256": "0" * 64, "bytes": 1},
                "../../../../escape/zz.pth": {"sha256": "0" * 64, "bytes": 1}}
    with pytest.raises(UnsafeName):
        train_ckpt.fetch(Rank(), store, "checkpoints/iter_000001", manifest)
    assert not (tmp_path / "escape").exists()


@pytest.mark.slow
def test_config_check_stops_with_one_reflow_line(s3, tiny_policy, tmp_path):
    """`reflow config --check` (what the issue's proof of concept ran) ends with one `reflow:` line and exit 2,
    and no file appears outside the model cache (REFLOW_CACHE points into tmp_path)."""
    fs = _fs(s3)
    fs.put(str(tiny_policy) + "/", f"{BUCKET}/cli/policy/", recursive=True)
    fs.pipe(f"{BUCKET}/cli/policy/../../../escape/zz.pth", b"import os\n")
    env = {**os.environ, "REFLOW_CACHE": str(tmp_path / "a" / "b" / "cache")}
    r = subprocess.run([REFLOW, "config", "--check", f"model.path=s3://{BUCKET}/cli/policy",
                        f"storage.endpoint_url={s3.url}", f"storage.root=file://{tmp_path}/runs"],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("reflow:")]
    assert len(lines) == 1 and "model.path" in lines[0] and "not a plain relative path" in lines[0], r.stderr
    assert "endpoint_url" not in lines[0], "the advice is about the planted object, not the endpoint"
    assert "Traceback" not in r.stderr
    assert not any("zz.pth" in p for p in _tree(tmp_path)), _tree(tmp_path)


def test_no_python_startup_file_was_planted():
    """Belt and braces: nothing of the above reached site-packages."""
    site = [p for p in sys.path if p.endswith("site-packages")]
    assert site and not any(os.path.exists(os.path.join(s, "zz.pth")) for s in site)
