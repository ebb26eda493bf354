"""Evaluation: pass@k against hand-computed values, eval-set loading, and on real Ray + DeepSpeed +
Prefect: a non-blocking run records every eval point, and eval-only runs on its checkpoints
reproduce what the in-training eval recorded at those versions."""
from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from reflow.infra.config.schema import dump_config, load_config
from reflow.rl.data import tokenize_prompts
from reflow.rl.metrics import eval_summary, mean_pass_at_k, pass_at_k
from tests import prefect_reads

# ---------------------------------------------------------------- pass@k, by hand


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 2, 1, 2 / 5),
    (5, 2, 2, 1 - 3 / 10),   # 1 - C(3,2)/C(5,2)
    (5, 2, 3, 1 - 1 / 10),   # 1 - C(3,3)/C(5,3)
    (5, 2, 4, 1.0),          # only 3 wrong: every 4-subset holds a correct one
    (4, 1, 4, 1.0),          # n = k, one correct
    (4, 0, 4, 0.0),          # n = k, none correct
    (10, 0, 3, 0.0),         # c = 0
    (6, 6, 2, 1.0),          # c = n
    (1, 1, 1, 1.0),
    (1000, 1, 10, 0.01),     # 1 - C(999,10)/C(1000,10) = 10/1000
])
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_1_is_c_over_n_and_matches_exact_binomials():
    for n in range(1, 9):
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == pytest.approx(c / n, abs=1e-12)
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(3, 4, 1)


def test_eval_summary_hand_computed():
    # prompt 0: 1 of 2 correct, prompt 1: 0 of 2 -> pass@1 = (1/2 + 0)/2, pass@2 = (1 + 0)/2
    s = eval_summary([0, 0, 1, 1], [1.0, 0.5, 0.0, 0.0], [True, False, False, False], [2, 4, 6, 8],
                     ["stop", "length", "stop", "stop"], [1, 2])
    assert s == {"reward_mean": 0.375, "pass@1": 0.25, "pass@2": 0.5, "response_len_mean": 5.0,
                 "response_len_min": 2.0, "response_len_max": 8.0, "prompts": 2.0, "samples": 4.0,
                 "finish_length": 1.0, "finish_stop": 3.0}
    assert mean_pass_at_k([[True, True, False]], 2) == 1.0


# ---------------------------------------------------------------- eval sets from files


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _sets_config(policy, *sets_and_overrides):
    return load_config(None, [f"model.path={policy}", "data.num_eval=5", *sets_and_overrides])


def test_eval_sets_load_from_jsonl_and_parquet(tiny_policy, tmp_path):
    from reflow.engines.hf_io import load_tokenizer
    from reflow.infra.inputs.eval_sets import load_eval_sets

    rows = [{"question": f"{a}+{a}=", "answer": str(2 * a)} for a in range(10, 16)]
    _write_jsonl(tmp_path / "q.jsonl", rows)
    pd.DataFrame(rows).to_parquet(tmp_path / "q.parquet")
    cfg = _sets_config(tiny_policy, "eval.sets=["
                       "{name: hj, source: " + str(tmp_path / "q.jsonl") + ", prompt_key: question, label_key: answer,"
                       " max_prompts: 4, temperature: 0},"
                       "{name: pq, source: file://" + str(tmp_path / "q.parquet") + ", prompt_key: question,"
                       " label_key: answer, n_samples: 3, k: [1, 3], reward_fn: 'tests.ckpt_fixtures:digit_reward'},"
                       "{name: held, source: heldout, max_prompts: 2}]", "rollout.max_new_tokens=5")
    tok = load_tokenizer(str(tiny_policy))
    heldout = tokenize_prompts([{"prompt": "1+2=", "label": "3"}] * 3, tok, 64)
    hj, pq, held = load_eval_sets(cfg, tok, heldout)
    assert [p.text for p in hj.prompts] == [r["question"] for r in rows[:4]]
    assert [p.label for p in pq.prompts] == [r["answer"] for r in rows]
    assert pq.prompts[2].input_ids == tok("12+12=", add_special_tokens=True)["input_ids"]
    assert (hj.n, hj.temperature, hj.top_k, hj.max_new_tokens, hj.reward_fn.spec) == (1, 0.0, -1, 5, "reflow.rl.demo_task:reward")
    assert (pq.n, pq.temperature, pq.ks, pq.reward_fn.spec) == (3, 1.0, [1, 3], "tests.ckpt_fixtures:digit_reward")
    assert len(held.prompts) == 2 and held.n == cfg.rollout.n_samples_per_prompt
    assert len({hj.seed, pq.seed, held.seed}) == 3  # each set samples from a stream of its own


@pytest.mark.parametrize("lines, match", [
    ([{"prompt": "1+1=", "label": "2"}, {"label": "3"}, {"prompt": 7, "label": "4"}],
     r"eval\.sets\.0 \(bad, .*\): 2 of 3 prompt rows are invalid: row 1: has no prompt.*row 2: prompt is a int"),
    ([{"prompt": "1+1="}, "{not json", {"prompt": "2+2="}], r"line 2 is not valid JSON"),
    ([{"prompt": "1+1="}, "[1, 2]"], r"line 2 is a JSON list, not an object"),
    ([{"text": "1+1="}], r"no column 'prompt' \(eval\.sets\.0\.prompt_key\)"),
])
def test_malformed_eval_rows_are_named(tiny_policy, tmp_path, lines, match):
    from reflow.engines.hf_io import load_tokenizer
    from reflow.infra.inputs.eval_sets import load_eval_sets

    path = _write_jsonl(tmp_path / "bad.jsonl", lines)
    cfg = _sets_config(tiny_policy, "eval.sets=[{name: bad, source: " + str(path) + "}]")
    with pytest.raises(ValueError, match=match):
        load_eval_sets(cfg, load_tokenizer(str(tiny_policy)), [])


def test_bad_eval_reward_fn_is_named(tiny_policy):
    from reflow.engines.hf_io import load_tokenizer
    from reflow.infra.inputs.eval_sets import load_eval_sets

    cfg = _sets_config(tiny_policy, "eval.sets=[{name: h, reward_fn: 'no_such_module:fn'}]")
    with pytest.raises(ValueError, match=r"eval\.sets\.0\.reward_fn \(h\).*no_such_module"):
        load_eval_sets(cfg, load_tokenizer(str(tiny_policy)), [])


# ---------------------------------------------------------------- end to end

N = 3
SETS = ("eval.sets=[{name: heldout, temperature: 0},"
        " {name: sampled, source: %s, n_samples: 4, k: [1, 2, 4], correct_threshold: 0.5,"
        " reward_fn: 'tests.ckpt_fixtures:digit_reward'}]")


@pytest.fixture(scope="module")
def nonblocking_run(ray_cluster, prefect_server, tiny_policy, tmp_path_factory):
    """3 iterations with eval.blocking=false, an eval after every iteration, a checkpoint after each."""
    from reflow.flows.train import train

    tmp = tmp_path_factory.mktemp("evalrun")
    _write_jsonl(tmp / "sampled.jsonl", [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a, b in
                                          [(12, 34), (56, 7), (80, 19), (33, 33), (45, 54), (10, 90)]])
    overrides = [
        "experiment=eval-nb", f"model.path={tiny_policy}", f"num_iterations={N}", "eval.interval=1",
        "eval.blocking=false", SETS % (tmp / "sampled.jsonl"), "data.num_train=64", "data.num_eval=8",
        "data.reward_fn=tests.ckpt_fixtures:digit_reward", "rollout.prompts_per_iteration=4",
        "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=4", "trainer.micro_batch_size=16",
        "trainer.lr=1e-2", "checkpoint.save_interval=1", f"checkpoint.keep_last={N}",
        f"storage.root=file://{tmp}/runs"]
    cfg = load_config(None, overrides)
    summary = train(cfg)
    return cfg, summary, tmp / "runs" / "eval-nb", overrides


def _samples(base, rel):
    return pd.read_parquet(base / rel / "samples.parquet")


@pytest.mark.slow
def test_nonblocking_run_records_every_eval_point(nonblocking_run):
    cfg, summary, base, _ = nonblocking_run
    assert summary["iterations"] == N and sorted(summary["evals"]) == list(range(N + 1))
    assert all("push_eval_wait_seconds" in m for m in summary["history"])
    for v in range(N + 1):
        assert sorted(summary["evals"][v]) == ["heldout", "sampled"]
        for name, prompts, n in (("heldout", 8, 1), ("sampled", 6, 4)):
            d = base / "iterations" / f"{v:06d}" / "eval" / name
            recorded = json.loads((d / "summary.json").read_text())
            assert recorded == summary["evals"][v][name] and recorded["policy_version"] == v
            df = pd.read_parquet(d / "samples.parquet")
            assert {"prompt", "response", "reward", "correct", "finish_reason", "response_len", "sample",
                    "logprob"} <= set(df.columns)
            assert len(df) == prompts * n and set(df.policy_version) == {v}
            assert sorted(df["sample"].unique()) == list(range(n))
            # the summary is what the per-sample records say
            per_prompt = [g["correct"].tolist() for _, g in df.groupby("prompt_index")]
            for k in ([1] if n == 1 else [1, 2, 4]):
                assert recorded[f"pass@{k}"] == pytest.approx(mean_pass_at_k(per_prompt, k), abs=1e-12)
            assert recorded["reward_mean"] == pytest.approx(df.reward.mean())
            assert sum(v_ for k_, v_ in recorded.items() if k_.startswith("finish_")) == len(df)
    assert len(prefect_reads.artifacts("eval-nb-eval")) >= N + 1
    assert (base / "plots" / "curves.png").read_bytes().startswith(b"\x89PNG")
    # the policy changes between eval points, so comparing eval records can tell versions apart
    lp = [_samples(base, f"iterations/{v:06d}/eval/heldout").logprob for v in range(N + 1)]
    assert all((a - b).abs().max() > 1e-4 for a, b in zip(lp, lp[1:]))


def _assert_same_eval(base, in_training: str, eval_only: str, summary_in: dict, summary_out: dict):
    for name in ("heldout", "sampled"):
        a, b = _samples(base, f"{in_training}/{name}"), _samples(base, f"{eval_only}/{name}")
        assert a.response.tolist() == b.response.tolist(), name
        assert a.reward.tolist() == b.reward.tolist() and a.correct.tolist() == b.correct.tolist()
        assert (a.logprob - b.logprob).abs().max() <= 1e-5, name  # co-batching may move the last bits
        assert summary_out[name] == summary_in[name]


@pytest.mark.slow
def test_eval_only_reproduces_in_training_eval(nonblocking_run, tmp_path, capsys):
    from reflow.flows.cli import main
    from reflow.flows.evaluate import evaluate
    from reflow.infra.store import checkpoint as ckpt

    cfg, summary, base, overrides = nonblocking_run
    before = (base / "iterations" / "000002" / "eval" / "heldout" / "summary.json").read_text()
    url = f"file://{base}/checkpoints/{ckpt.name_of(2)}"
    out = evaluate(cfg, checkpoint=url)
    assert out["step"] == 2 and out["checkpoint"] == url
    _assert_same_eval(base, "iterations/000002/eval", "evals/iter_000002", summary["evals"][2], out["evals"])
    assert (base / "iterations" / "000002" / "eval" / "heldout" / "summary.json").read_text() == before

    # `reflow evaluate -c FILE` on the latest checkpoint (policy version N)
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(dump_config(cfg))
    capsys.readouterr()
    main(["evaluate", "-c", str(cfg_file), "--result-file", str(tmp_path / "result.json")])
    printed = json.loads((tmp_path / "result.json").read_text())  # the whole result; stdout has a short summary
    assert printed["step"] == N
    shown = capsys.readouterr().out
    assert f"(policy version {N})" in shown and "heldout pass@1" in shown and printed["records"] in shown, shown
    assert len(shown.splitlines()) <= 5, shown
    _assert_same_eval(base, f"iterations/{N:06d}/eval", f"evals/{ckpt.name_of(N)}", summary["evals"][N],
                      printed["evals"])


@pytest.mark.slow
def test_eval_only_without_checkpoint_is_refused(prefect_server, tiny_policy, tmp_path):
    from reflow.flows.evaluate import evaluate
    from reflow.infra.store.checkpoint import CheckpointInvalid

    cfg = load_config(None, ["experiment=eval-none", f"model.path={tiny_policy}", f"storage.root=file://{tmp_path}"])
    with pytest.raises(CheckpointInvalid, match="no valid committed checkpoint"):
        evaluate(cfg)


@pytest.mark.slow
def test_weight_push_waits_for_eval_generation(ray_cluster, prefect_server, tiny_policy, tmp_path):
    """An eval launched on the engines' weights, then at once a push of other weights: the eval still
    generates with the weights it was launched on (the push waits for its generation)."""
    import ray

    from reflow.infra.cluster.runtime import shutdown_runtime, start_runtime
    from reflow.tasks.evaluate import launch
    from reflow.tasks.train import push_weights

    cfg = load_config(None, ["experiment=eval-gate", f"model.path={tiny_policy}", "data.num_eval=64",
                             "rollout.max_new_tokens=16", "eval.sets=[{name: heldout, temperature: 0}]",
                             "trainer.num_ranks=1", f"storage.root=file://{tmp_path}"])
    rt = start_runtime(cfg)
    try:
        def run(version, out):
            if out == "raced":
                ray.get(rt.trainers.fill_weights(0.01))  # the trainer's weights differ from the engines' now
            p = launch(rt, version, out)
            if out == "raced":
                push_weights.fn(cfg, 1)  # right after the launch: must not overtake the eval's generation
            ray.get(list(p.summaries.values()))
            return _samples(tmp_path / "eval-gate", f"{out}/heldout")

        ref = run(0, "ref")  # engines and trainer both hold tiny_policy
        raced = run(0, "raced")
        after = run(1, "after")
        assert raced.response.tolist() == ref.response.tolist() and (raced.logprob - ref.logprob).abs().max() <= 1e-6
        assert (after.logprob - ref.logprob).abs().max() > 1e-3  # the push did change what the engines generate
    finally:
        shutdown_runtime(cfg.experiment)
