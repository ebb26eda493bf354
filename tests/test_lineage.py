"""Checkpoint lineage (issue 20, point 3): the chain walk on committed fixture checkpoints (storage
only, no trainer), including ancestors deleted by retention, a changed parent, and promotions.
The e2e checks (after a resume, after a retrain promotion) extend tests/test_resume.py and
tests/test_retrain.py."""
from __future__ import annotations

import hashlib
import json

import pytest

from reflow.flows.cli import main
from reflow.infra import checkpoint as ckpt
from reflow.infra import lineage
from reflow.infra import promotion as pm
from reflow.infra.storage import ExperimentStore


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
