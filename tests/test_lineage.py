"""Checkpoint lineage (issue 20, point 3): the chain walk on committed fixture checkpoints (storage
only, no trainer), including ancestors deleted by retention, a changed parent, and promotions.
The e2e checks (after a resume, after a retrain promotion) extend tests/test_resume.py and
tests/test_retrain.py."""
from __future__ import annotations

import hashlib
import http.server
import json
import threading
from pathlib import Path

import pytest

from reflow.flows.cli import main
from reflow.infra.store import checkpoint as ckpt
from reflow.infra.store import lineage, signing
from reflow.infra.store import promotion as pm
from reflow.infra.store.storage import ExperimentStore


def _save(store: ExperimentStore, step: int, parent: lineage.Parent | None, config: str, files=()) -> lineage.Parent:
    """A committed checkpoint (one fake weights file) with its lineage, as tasks/checkpoint.py saves one."""
    ck = ckpt.at_step(store, step)
    blob = f"weights {step}".encode()
    meta = {"model/model.safetensors": {"sha256": "0" * 64, "bytes": len(blob)}}
    store.write_bytes(ck.rel("model/model.safetensors"), blob)
    data = lineage.data_record("file", list(files), 7, parent.step if parent else 0, step, 4)
    doc = lineage.record(parent, "/models/initial", config, data, {"train": f"run-{step}", "iterations": {}})
    ckpt.commit(ck, meta, ckpt.state_for(step, 4, 7, 1), config, lineage=doc)
    return lineage.parent_of(ck, ckpt.check(ck, signature=False))


def _chain_of_three(tmp_path) -> tuple[ExperimentStore, list[lineage.Parent], dict]:
    store = ExperimentStore.open(f"file://{tmp_path}/runs", "exp")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    digest = lineage.file_digest(str(tmp_path / "prompts.jsonl"), store.access)
    p1 = _save(store, 1, None, "a: 1\n", [digest])
    p2 = _save(store, 2, p1, "a: 2\n", [digest])
    p3 = _save(store, 3, p2, "a: 2\n", [digest])
    return store, [p1, p2, p3], digest


def test_chain_walks_back_to_the_initial_model(tmp_path, capsys):
    store, (p1, p2, p3), digest = _chain_of_three(tmp_path)
    nodes = lineage.chain(p3.url, store)
    assert [n.step for n in nodes] == [3, 2, 1] and all(n.live and not n.note for n in nodes)
    assert [n.manifest_sha256 for n in nodes] == [p3.manifest_sha256, p2.manifest_sha256, p1.manifest_sha256]
    assert nodes[0].lineage["parent"] == {"url": p2.url, "step": 2, "manifest_sha256": p2.manifest_sha256}
    assert nodes[-1].lineage["parent"] is None and nodes[-1].lineage["initial_model"] == "/models/initial"
    assert nodes[0].lineage["data"]["cursor"] == {"seed": 7, "from_iteration": 2, "to_iteration": 3,
                                                       "prompts_from": 8, "prompts_to": 12}
    assert digest["sha256"] == hashlib.sha256(b'{"prompt": "1+1=", "label": "2"}\n').hexdigest()
    assert nodes[1].lineage["config_sha256"] != nodes[2].lineage["config_sha256"]
    assert nodes[0].lineage["code"]["package"] == "reflow"
    main(["lineage", p3.url])
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines() if line.startswith(("iter_", "initial"))] == [
        "iter_000003", "iter_000002", "iter_000001", "initial"]
    assert out.count(digest["sha256"]) == 3 and nodes[2].lineage["config_sha256"] in out


def test_deleted_and_changed_ancestors_and_promotion(tmp_path, capsys):
    store, (p1, p2, p3), _ = _chain_of_three(tmp_path)
    decision = pm.Decision(True, "first champion", "heldout/pass@1", 0.5, None, 0.0)
    pm.record_decision(store, "run-a", decision, {"checkpoint": p2.url, "step": 2, "data_files": []})
    pm.record_decision(store, "run-b", pm.Decision(False, "regressed", "heldout/pass@1", 0.1, 0.5, 0.0),
                       {"checkpoint": p3.url, "step": 3})
    ckpt.begin(ckpt.at_step(store, 1))  # retention deleted the oldest
    nodes = lineage.chain(p3.url, store)
    assert [n.step for n in nodes] == [3, 2, 1] and [n.live for n in nodes] == [True, True, False]
    assert nodes[2].manifest_sha256 == p1.manifest_sha256 and nodes[2].lineage["parent"] is None
    assert nodes[2].lineage["config_sha256"] == p1.lineage["config_sha256"], "the deleted one's record survives"
    assert [p["run"] for p in nodes[1].promotions] == ["run-a"] and nodes[0].promotions == []

    ck2 = ckpt.at_step(store, 2)  # rewritten after iter_3 was saved from it: reported, not hidden
    store.write_text(ck2.rel("config.yaml"), "a: 2\n")  # same size; the manifest is rewritten
    doc = json.loads(store.read_bytes(ck2.rel(ckpt.MANIFEST)))
    doc["files"]["extra"] = {"sha256": "1" * 64, "bytes": 0}
    store.write_bytes(ck2.rel("extra"), b"")
    raw = json.dumps(doc).encode()
    store.write_bytes(ck2.rel(ckpt.MANIFEST), raw)
    store.write_text(ck2.rel(ckpt.MARKER), hashlib.sha256(raw).hexdigest())
    nodes = lineage.chain(p3.url, store)
    assert "manifest changed" in nodes[1].note and [n.step for n in nodes] == [3, 2, 1]
    main(["lineage", p3.url])
    out = capsys.readouterr().out
    assert "promoted by retrain run run-a" in out and "deleted or unreadable" in out and "initial model" in out


def test_lineage_of_a_non_checkpoint_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["lineage", f"file://{tmp_path}/runs/exp/checkpoints/iter_000009"])
    assert e.value.code == 2 and "no COMMITTED marker" in capsys.readouterr().err


# ---------------------------------------------------------------- what a bucket writer can put in LINEAGE.json


def _rewrite_lineage(store: ExperimentStore, step: int, **changes) -> None:
    """What a bucket writer can do without the key: rewrite LINEAGE.json, then MANIFEST.json and COMMITTED
    to match it (SIGNATURE is left as it was, now stale)."""
    ck = ckpt.at_step(store, step)
    doc = json.loads(store.read_bytes(ck.rel(lineage.LINEAGE)))
    doc.update(changes)
    data = json.dumps(doc).encode()
    store.write_bytes(ck.rel(lineage.LINEAGE), data)
    manifest = json.loads(store.read_bytes(ck.rel(ckpt.MANIFEST)))
    manifest["files"][lineage.LINEAGE] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    raw = json.dumps(manifest).encode()
    store.write_bytes(ck.rel(ckpt.MANIFEST), raw)
    store.write_text(ck.rel(ckpt.MARKER), hashlib.sha256(raw).hexdigest())


def _link(p: lineage.Parent) -> dict:
    return {"url": p.url, "step": p.step, "manifest_sha256": p.manifest_sha256}


@pytest.mark.timeout(60)
def test_a_parent_loop_ends_the_walk(tmp_path, capsys, monkeypatch):
    """Issue 51, point 4: a LINEAGE.json whose parent is itself (or an ancestor) made `reflow lineage`
    loop forever. Each checkpoint is read once: the chain up to the loop is printed, with why it ends,
    and the rewritten ones are shown as not verified (their SIGNATURE no longer matches). A walk also
    reads at most MAX_CHAIN checkpoints."""
    store, (p1, p2, p3), _ = _chain_of_three(tmp_path)
    with monkeypatch.context() as m:
        m.setattr(lineage, "MAX_CHAIN", 2)
        nodes = lineage.chain(p3.url, store)
    assert [n.step for n in nodes] == [3, 2] and "the chain is 2 checkpoints long" in nodes[-1].stop
    _rewrite_lineage(store, 3, parent=_link(p3))
    nodes = lineage.chain(p3.url, store)
    assert [n.step for n in nodes] == [3] and "already in this chain" in nodes[-1].stop
    assert not nodes[0].verified and "SIGNATURE does not match" in nodes[0].signature

    _rewrite_lineage(store, 3, parent=_link(p2))
    _rewrite_lineage(store, 1, parent=_link(p3))  # 3 -> 2 -> 1 -> 3
    nodes = lineage.chain(p3.url, store)
    assert [n.step for n in nodes] == [3, 2, 1] and [n.verified for n in nodes] == [False, True, False]
    assert p3.url in nodes[-1].stop and "already in this chain" in nodes[-1].stop
    main(["lineage", p3.url])
    out = capsys.readouterr().out
    assert "not followed further" in out and "initial model" not in out
    assert out.count("signature: not verified") == 2 and out.count("signature: verified") == 1


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []

    def _answer(self):
        type(self).seen.append(f"{self.command} {self.path}")
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = _answer

    def log_message(self, *args):  # quiet
        pass


@pytest.mark.timeout(120)
def test_a_parent_outside_the_storage_root_is_not_read(tmp_path, capsys):
    """Issue 51, point 4: the parent URL in LINEAGE.json is chosen by whoever can write the bucket, and the
    walk requested it, whatever it was (here an HTTP server on loopback that records requests; `..`
    segments that leave the root). An unverified link is followed only inside the storage root of the
    checkpoint asked about; elsewhere the chain stops, saying where it leads and how to go on."""
    store, (p1, p2, p3), _ = _chain_of_three(tmp_path)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Recorder.seen = []
    try:
        far = f"http://127.0.0.1:{server.server_address[1]}/bucket/exp/checkpoints/iter_000001"
        _rewrite_lineage(store, 2, parent={"url": far, "step": 1, "manifest_sha256": p1.manifest_sha256})
        nodes = lineage.chain(p3.url, store)
        main(["lineage", p3.url])
    finally:
        server.shutdown()
        server.server_close()
    assert _Recorder.seen == [], "the walk sent requests to a URL a bucket writer chose"
    assert [n.step for n in nodes] == [3, 2] and far in nodes[-1].stop and f"reflow lineage {far}" in nodes[-1].stop
    assert f"{tmp_path}/runs" in nodes[-1].stop and not nodes[-1].verified
    out = capsys.readouterr().out
    assert "not followed further" in out and far in out and "initial model" not in out

    other = ExperimentStore.open(f"file://{tmp_path}/outside", "exp")  # a real checkpoint outside the root
    outside = _save(other, 1, None, "b: 1\n")
    sneaky = f"{store.url(ckpt.ROOT)}/../../../outside/exp/checkpoints/iter_000001"
    assert Path(sneaky.removeprefix("file://")).resolve() == Path(outside.url.removeprefix("file://"))
    _rewrite_lineage(store, 2, parent={"url": sneaky, "step": 1, "manifest_sha256": outside.manifest_sha256})
    nodes = lineage.chain(p3.url, store)
    assert [n.step for n in nodes] == [3, 2] and sneaky in nodes[-1].stop


def test_a_verified_parent_in_another_storage_root_is_followed(tmp_path, monkeypatch, capsys):
    """A run resumed from another bucket's checkpoint records that URL in its signed LINEAGE.json: with
    the key held here it is followed (a run holding the key wrote it, not a bucket writer); a reader
    without the key gets the chain up to it and the command that continues there."""
    base = ExperimentStore.open(f"file://{tmp_path}/archive", "base")
    store = ExperimentStore.open(f"file://{tmp_path}/runs", "exp")
    p1 = _save(base, 1, None, "a: 1\n")
    p2 = _save(store, 2, p1, "a: 2\n")
    nodes = lineage.chain(p2.url, store)
    assert [(n.step, n.url, n.verified) for n in nodes] == [(2, p2.url, True), (1, p1.url, True)]
    assert not nodes[-1].stop and nodes[-1].lineage["initial_model"] == "/models/initial"

    monkeypatch.setenv(signing.KEYS_DIR_ENV, str(tmp_path / "another-machine"))
    nodes = lineage.chain(p2.url, store)
    assert [n.step for n in nodes] == [2] and "which is not held here" in nodes[0].signature
    assert f"reflow lineage {p1.url}" in nodes[0].stop
    main(["lineage", p1.url])  # the reader chose to go on there
    assert "initial model  /models/initial" in capsys.readouterr().out


@pytest.mark.parametrize("changes", [
    {"parent": "s3://not-a-record"}, {"parent": {"url": 5}}, {"parent": {"step": 1}},
    {"ancestors": 7, "code": "x", "data": ["y"], "flow_runs": {"train": 1, "iterations": {"9" * 5000: "r"}}},
    {"data": {"files": ["z", {"url": 1}], "cursor": 3}},
], ids=["parent-string", "parent-url-int", "parent-no-url", "wrong-types", "data-files"])
def test_malformed_lineage_records_are_reported_not_raised(tmp_path, capsys, changes):
    """Any JSON a bucket writer puts in LINEAGE.json prints (as not verified) instead of a traceback."""
    store, (p1, p2, p3), _ = _chain_of_three(tmp_path)
    _rewrite_lineage(store, 3, **changes)
    nodes = lineage.chain(p3.url, store)
    assert nodes[0].step == 3 and not nodes[0].verified
    main(["lineage", p3.url])
    assert capsys.readouterr().out.startswith("iter_000003")
    main(["lineage", "--json", p3.url])
    json.loads(capsys.readouterr().out)
