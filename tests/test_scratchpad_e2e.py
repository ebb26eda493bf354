"""The scratchpad task's CPU size in the real `train` flow (issue 56 point 5): a tiny policy bootstrapped on worked
traces (reflow.rl.scratchpad_demo), configs/demo-scratchpad.yaml with packing, 2 iterations on the session's Ray
cluster and Prefect server. Asserts the run records responses of scratchpad length, token counts that match their
text, and the task's rewards; the learning itself is the GPU config's to show."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from reflow.infra.config.schema import load_config
from reflow.rl import scratchpad_task as sp
from reflow.rl.scratchpad_demo import bootstrap_scratchpad, write_scratchpad_data

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo-scratchpad.yaml"
# A ~70k-parameter policy and 150 warm-up steps (~5 s): it writes scratchpads of about the right length, mostly
# ending ")=<digits>" then eos, but rarely the right product (the tiny size's ~1M policy reaches the target).
SMALL = {"hidden": 64, "layers": 2, "heads": 2, "mlp": 128, "steps": 150, "batch": 16, "lr": 3e-3,
         "target_accuracy": None}


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scratchpad")
    data = write_scratchpad_data(tmp / "data", seed=0, size="tiny", num_eval=16)
    return bootstrap_scratchpad(tmp / "policy", data, seed=0, size="tiny", progress=False, **SMALL)


def test_bootstrap_writes_the_policy_and_its_report(policy):
    out = Path(policy["path"])
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    report = json.loads((out / "bootstrap.json").read_text())
    assert report["warmup"]["steps"] == 150 and report["warmup"]["loss_last"] < report["warmup"]["loss_first"]
    assert report["heldout_response_tokens"]["max"] <= 97 and 0.0 <= report["eval_accuracy_after"] <= 1.0
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 256


def test_two_iterations_record_scratchpad_responses(ray_cluster, prefect_server, policy, tmp_path):
    from reflow.flows.train import train

    data = policy["data"]
    cfg = load_config(str(CONFIG), [
        "experiment=scratchpad-e2e", f"model.path={policy['path']}", f"data.path={data['train']}",
        f"data.eval_path={data['heldout']}", "num_iterations=2", "eval.before_train=false",
        "rollout.prompts_per_iteration=4", "rollout.n_samples_per_prompt=4", f"storage.root=file://{tmp_path}/runs"])
    summary = train(cfg)
    assert summary["iterations"] == 2 and list(summary["evals"]) == [2]
    assert 0.0 <= summary["evals"][2]["heldout"]["pass@1"] <= 1.0
    base = tmp_path / "runs" / "scratchpad-e2e" / "iterations"
    df = pd.concat([pd.read_parquet(base / f"{i:06d}" / "rollouts.parquet") for i in range(2)])
    assert len(df) == 32
    # one token a character, plus eos when it stopped (a special token sampled mid-way counts but is not in the text)
    text = df.response.str.len() + (df.finish_reason == "stop").astype(int)
    assert (df.response_tokens >= text).all() and (df.response_tokens == text).mean() >= 0.9, df
    assert df.response_tokens.max() <= cfg.rollout.max_new_tokens
    worked = pd.Series([len(sp.trace(*sp.operands(p))) + 1 for p in df.prompt])  # the worked responses' lengths
    assert 0.5 * worked.mean() <= df.response_tokens.mean() <= 2 * worked.mean(), (df.response_tokens, worked)
    assert df.response.str.contains(r"\d[*+]\d\+\d=\d\d").mean() > 0.5  # scratchpad steps, not bare answers
    expected = [sp.reward(p, r, lab)["score"] for p, r, lab in zip(df.prompt, df.response, df.label)]
    assert df.reward.tolist() == expected and set(expected) <= {0.0, 1.0}
    for i in range(2):
        metrics = json.loads((base / f"{i:06d}" / "metrics.json").read_text())
        assert 0.0 <= metrics["reward/trace_exact"] <= 1.0 and metrics["pad_fraction"] < 0.5
