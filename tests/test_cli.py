"""The CLI's paths agree with the shipped config: `make demo` (seed 0), `reflow bootstrap` and
configs/demo.yaml name one policy folder, so the README's server walkthrough finds what the demo
built; `reflow runs show` given nothing to show ends with one line and exit code 2 (the run-input
errors: tests/test_preflight.py). No Ray, no Prefect."""
from __future__ import annotations

from pathlib import Path

import pytest

from reflow.flows.cli import DEMO_CONFIG, _demo_policy, bootstrap_folders, build_parser, main
from reflow.infra.config.schema import load_config
from tests.streams import without_ray_lines


@pytest.mark.parametrize("argv, config", [([], "demo.yaml"), (["--task", "scratchpad"], "demo-scratchpad.yaml"),
                                          (["--task", "scratchpad", "--size", "gpu"], "gpu-scratchpad.yaml")])
def test_bootstrap_writes_where_the_demo_config_looks(argv, config):
    out, data = bootstrap_folders(build_parser().parse_args(["bootstrap", *argv]))
    cfg = load_config(str(DEMO_CONFIG.with_name(config)), [])
    assert cfg.model.path == out
    if cfg.data.task == "file":  # the scratchpad task's files, written beside the policy
        assert (cfg.data.path, cfg.data.eval_path) == (f"{data}/train.jsonl", f"{data}/heldout.jsonl")


def test_demo_seed_0_uses_the_configs_folder_and_other_seeds_their_own(tmp_path):
    named = tmp_path / "demo-policy"
    for folder in (named, tmp_path / "demo-policy-d2-s3"):  # already built: nothing is bootstrapped
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    assert _demo_policy(0, 2, str(named)) == named
    assert _demo_policy(3, 2, str(named)) == Path(f"{named}-d2-s3")


@pytest.mark.parametrize("experiment,line", [
    ("gone", "no iteration records under file://{root}/gone/iterations; check --storage and --experiment (the "
             "run's storage.root and experiment)"),
    ("../up", "experiment name '../up' must be a single path segment (it names a storage folder), but it contains "
              "a path separator; use letters, digits, '_', '.', '-', not starting with '.' (e.g. 'my-run-1')")])
def test_runs_show_with_nothing_to_show_ends_with_one_line(capsys, tmp_path, experiment, line):
    with pytest.raises(SystemExit) as e:
        main(["runs", "show", "--storage", str(tmp_path), "--experiment", experiment])
    out, err = capsys.readouterr()
    err = without_ray_lines(err)
    assert (e.value.code, out) == (2, "")
    assert err == "reflow: " + line.format(root=tmp_path) + "\n", err


def test_runs_show_prints_timings_and_eval_columns(capsys, tmp_path):
    """From storage alone: per-iteration timings, and each set's pass@1 on the row of the iteration
    that produced the evaluated policy (version 0's on a line of its own)."""
    import json

    root = tmp_path / "exp" / "iterations"
    for i in range(3):
        (root / f"{i:06d}").mkdir(parents=True)
        (root / f"{i:06d}" / "metrics.json").write_text(json.dumps(
            {"reward_mean": 0.1 * i, "loss": 0.5, "time_iteration": 2.0 + i, "time_generate": 0.25, "time_train": 0.5,
             "time_push": 0.125, "time_report": 0.0625, "grad_norm": 1.0}))
    for version, acc in ((0, 0.25), (2, 0.75)):
        (root / f"{version:06d}" / "eval" / "heldout").mkdir(parents=True)
        (root / f"{version:06d}" / "eval" / "heldout" / "summary.json").write_text(json.dumps({"pass@1": acc}))
    main(["runs", "show", "--storage", str(tmp_path), "--experiment", "exp"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "before training (policy version 0): heldout pass@1 0.2500"
    header = lines[2].split()
    assert header[:3] == ["iteration", "reward_mean", "loss"]
    assert header[header.index("time_iteration"):header.index("rollouts")] == [
        "time_iteration", "time_generate", "time_train", "time_push", "time_report", "heldout", "pass@1"]
    rows = [line.split() for line in lines[3:]]
    assert [r[0] for r in rows] == ["0", "1", "2"]
    assert rows[1][header.index("time_report")] == "0.0625" and rows[1][header.index("heldout")] == "0.7500"
    assert len(rows[0]) == len(rows[1]) - 1  # no eval of versions 1 and 3: an empty cell


def test_demo_data_is_what_demo_retrain_yaml_names_and_demo_yaml_holds_out(tmp_path):
    """`make demo` / `reflow bootstrap` write the fixed eval file configs/demo-retrain.yaml reads: the same
    200 problems as configs/demo.yaml's held-out split, and new problems of neither split."""
    import json

    from reflow.flows.cli import DEMO_DATA, _demo_data
    from reflow.rl.demo_task import make_problems

    retrain_cfg = load_config(str(DEMO_CONFIG.with_name("demo-retrain.yaml")), [])
    assert [s.source for s in retrain_cfg.eval.sets] == [f"{DEMO_DATA}/heldout.jsonl"]
    assert bootstrap_folders(build_parser().parse_args(["bootstrap"]))[1] == DEMO_DATA
    files = _demo_data(str(tmp_path / "demo"), 0, 2)
    d = load_config(str(DEMO_CONFIG), []).data
    train, heldout = make_problems(d.seed, d.num_train, d.num_eval, d.digits)
    def rows(path) -> list[dict]:
        return [json.loads(line) for line in Path(path).read_text().splitlines()]

    incoming = rows(Path(files["incoming"]) / "batch-000.jsonl")
    assert rows(files["heldout"]) == heldout and len(incoming) == 256
    assert not {r["prompt"] for r in incoming} & {r["prompt"] for r in train + heldout}
    assert _demo_data(str(tmp_path / "demo"), 0, 2)["heldout"] == files["heldout"]  # written once, then found


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_gpu_demo_without_a_gpu_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--gpu"])
    out, err = capsys.readouterr()
    assert (e.value.code, out) == (2, "")
    assert err.startswith("reflow: reflow demo --gpu trains on a GPU, and torch sees none here") and err.count("\n") == 1


def test_stage_line_reports_means_and_throughput():
    from reflow.flows.cli import _stage_line

    history = [{"time_generate": 1.0, "time_train": 2.0, "time_push": 0.5, "response_tokens": 300, "samples": 64,
                "time_iteration": 4.0},
               {"time_generate": 3.0, "time_train": 2.0, "time_push": 0.5, "response_tokens": 500, "samples": 64,
                "time_iteration": 6.0}]
    assert _stage_line(history) == ("demo: per-iteration generate=2.00s train=2.00s push=0.50s between=0.00s "
                                    "tokens_per_s=200 samples_per_s=12.8")
    # samples/s over the loop's wall time: the bookkeeping between flow runs counts, as in a plain trainer's
    history[1]["loop_between_s"] = 2.0
    assert _stage_line(history).endswith("between=1.00s tokens_per_s=200 samples_per_s=10.7")
    assert _stage_line(history, loop_seconds=16.0).endswith("samples_per_s=8.0")
    # generation run ahead (asynchronous rollout, or launched before the flow run): `generate` waited for
    # almost none of it, so throughput counts the engines' own seconds (a GPU run printed 2.8e9 tokens/s)
    for m, engine_s in zip(history, (2.0, 2.0)):
        m.update(time_generate=0.001, generate_engine_s=engine_s)
    assert "generate=0.00s train=2.00s push=0.50s between=1.00s tokens_per_s=200 " in _stage_line(history)


def test_train_ends_with_a_short_summary_and_the_whole_result_on_request(tmp_path, capsys, monkeypatch):
    """`reflow train` prints a few lines (iterations, last reward and eval, where checkpoints, records and the
    signing key are, wall time); --json prints the whole result instead, --result-file writes it as well. The
    flags are in --help."""
    import json

    from reflow.flows.cli import _emit, _train_lines
    from reflow.infra.store import signing

    monkeypatch.setenv(signing.KEYS_DIR_ENV, str(tmp_path / "keys"))
    cfg = load_config(None, [f"storage.root=file://{tmp_path}/runs", "experiment=sum", "num_iterations=3"])
    result = {"iterations": 3, "start": 0, "seconds": 9.0, "history": [{"reward_mean": 0.25}] * 2 + [{"reward_mean": 0.5}],
              "evals": {0: {"heldout": {"pass@1": 0.4}}, 3: {"heldout": {"pass@1": 0.625}}}}
    lines = _train_lines(cfg, result, 12.3)
    assert lines[:3] == ["reflow: trained iterations 0-2 (3 in this run; num_iterations=3) in 12 s",
                         "reflow: last iteration's reward_mean 0.500",
                         "reflow: eval of policy version 3: heldout pass@1 0.625 (policy version 0: heldout pass@1 0.400)"]
    assert f"checkpoints: file://{tmp_path}/runs/sum/checkpoints;" in lines[3]
    assert f"signed with the key in {tmp_path / 'keys' / 'sum.key'}" in lines[3] and len(lines) == 5

    for flags, shown_json in (([], False), (["--json"], True)):
        args = build_parser().parse_args(["train", "-c", "x.yaml", *flags, "--result-file", str(tmp_path / "r" / "a.json")])
        _emit(args, result, lines)
        out = capsys.readouterr().out
        assert (json.loads(out) if shown_json else out.splitlines()) == (json.loads(json.dumps(result)) if shown_json
                                                                         else lines)
        assert json.loads((tmp_path / "r" / "a.json").read_text())["evals"]["3"]["heldout"]["pass@1"] == 0.625
    for command in ("train", "demo", "evaluate"):
        text = build_parser()._subparsers._group_actions[0].choices[command].format_help()
        assert "--json" in text and "--result-file PATH" in text and "whole result as JSON" in text, text
