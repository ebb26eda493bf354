"""Scheduled retraining: data ledger and the promotion gate, on real Ray + DeepSpeed + Prefect.

The eval metric is forced up or down through the real eval path: a canary eval set whose
verifier returns the row's label, and the test rewrites the labels between runs.
"""
from __future__ import annotations

import json

import pytest

from reflow.infra.config.schema import load_config
from reflow.infra.store.promotion import decide

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("cand,champ,tol,promote", [
    (0.5, None, 0.0, True),     # first champion
    (0.5, 0.5, 0.0, True),      # equal is not a regression
    (0.49, 0.5, 0.0, False),    # any drop with zero tolerance
    (0.45, 0.5, 0.05, True),    # within tolerance
    (0.44, 0.5, 0.05, False),   # beyond tolerance
    (None, 0.5, 1.0, False),    # no metric, no promotion
])
def test_decide(cand, champ, tol, promote):
    d = decide(cand, champ, tol, "canary/pass@1")
    assert d.promote is promote, d.reason


def _rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _canary(path, score: float):
    _rows(path, [{"prompt": f"{a}+1=", "label": score} for a in range(4)])


def test_retrain_gate_and_ledger(ray_cluster, prefect_server, tiny_policy, tmp_path):
    from reflow.flows.retrain import retrain

    data, canary, heldout = tmp_path / "incoming", tmp_path / "canary.jsonl", tmp_path / "heldout.jsonl"
    data.mkdir()
    _rows(heldout, [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": "4"}])
    for k in range(2):
        _rows(data / f"batch{k}.jsonl", [{"prompt": f"{k}{a}+1=", "label": str(int(f'{k}{a}') + 1)} for a in range(8)])
    cfg = load_config(None, [
        "experiment=retrain", f"model.path={tiny_policy}", "data.task=file", f"data.eval_path={heldout}",
        "rollout.prompts_per_iteration=4", "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=4",
        "trainer.micro_batch_size=8", "eval.before_train=false", f"storage.root=file://{tmp_path}/runs",
        f'eval.sets=[{{name: canary, source: "{canary}", reward_fn: "tests.reward_fixtures:label_as_reward", '
        f'temperature: 0.0}}]'])
    store = tmp_path / "runs" / "retrain"
    champion = lambda: json.loads((store / "champion.json").read_text())  # noqa: E731
    kw = dict(iterations=1, new_data=str(data), metric="canary/pass@1", tolerance=0.1)

    _canary(canary, 1.0)
    first = retrain(cfg, **kw)
    assert first["promoted"] and first["step"] == 1, first
    assert champion()["step"] == 1 and champion()["value"] == 1.0
    ledger = json.loads((store / "retrain" / "ledger.json").read_text())
    assert sorted(f["url"].rsplit("/", 1)[-1] for f in ledger) == ["batch0.jsonl", "batch1.jsonl"]
    prompts = (store / "retrain" / "runs" / first["run"] / "prompts.jsonl").read_text().splitlines()
    assert len(prompts) == 16

    nothing = retrain(cfg, **kw)  # no new file: nothing trained, champion untouched
    assert nothing["skipped"] and not nothing["promoted"]
    assert "no new data" in nothing["reason"] and champion()["step"] == 1
    again = retrain(cfg, **kw)  # usually within the same second: still a record of its own
    runs = {first["run"], nothing["run"], again["run"]}
    assert len(runs) == 3 and all((store / "retrain" / "runs" / r / "decision.json").is_file() for r in runs), runs

    _rows(data / "batch2.jsonl", [{"prompt": f"9{a}+1=", "label": str(91 + a)} for a in range(4)])
    _canary(canary, 0.0)  # the evaluation regresses by 1.0 > tolerance
    worse = retrain(cfg, **kw)
    assert worse["step"] == 2 and not worse["promoted"], worse
    assert "regressed by 1.0000" in worse["reason"]
    assert champion()["step"] == 1, "a regressed checkpoint must not become champion"
    decision = json.loads((store / "retrain" / "runs" / worse["run"] / "decision.json").read_text())
    assert decision["promote"] is False and decision["candidate"] == 0.0 and decision["champion"] == 1.0
    assert len(json.loads((store / "retrain" / "ledger.json").read_text())) == 3

    _rows(data / "batch3.jsonl", [{"prompt": f"8{a}+1=", "label": str(81 + a)} for a in range(4)])
    _canary(canary, 1.0)
    better = retrain(cfg, **kw)
    assert better["promoted"] and better["step"] == 3, better
    assert champion()["step"] == 3 and champion()["checkpoint"].endswith("iter_000003")
    _assert_champion_lineage(champion()["checkpoint"], [first, worse, better], tiny_policy)


def _assert_champion_lineage(url: str, runs: list[dict], initial) -> None:
    """`reflow lineage` of the champion: 3 <- 2 <- 1 <- initial model, each trained on its retrain run's
    prompts file (digest recorded), 3 and 1 naming the retrain decision that promoted them."""
    import hashlib
    from pathlib import Path

    from reflow.infra.store import lineage

    nodes = lineage.walk(url)
    assert [n.step for n in nodes] == [3, 2, 1] and nodes[-1].lineage["initial_model"] == str(initial)
    assert [[p["run"] for p in n.promotions] for n in nodes] == [[runs[2]["run"]], [], [runs[0]["run"]]]
    for node, run in zip(nodes, reversed(runs)):
        (f,) = node.lineage["data"]["files"]
        assert f["url"].endswith(f"retrain/runs/{run['run']}/prompts.jsonl"), f
        assert f["sha256"] == hashlib.sha256(Path(f["url"].removeprefix("file://")).read_bytes()).hexdigest()
    assert len({n.lineage["config_sha256"] for n in nodes}) == 3  # each run's data.path differs
