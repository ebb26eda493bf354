"""The CLI's paths agree with the shipped config: `make demo` (seed 0), `reflow bootstrap` and
configs/demo.yaml name one policy folder, so the README's server walkthrough finds what the demo
built; `reflow runs show` given nothing to show ends with one line and exit code 2 (the run-input
errors: tests/test_preflight.py). No Ray, no Prefect."""
from __future__ import annotations

from pathlib import Path

import pytest

from reflow.flows.cli import DEMO_CONFIG, _demo_policy, build_parser, main
from reflow.infra.config import load_config


def test_bootstrap_writes_where_the_demo_config_looks():
    bootstrap_out = build_parser().parse_args(["bootstrap"]).out
    assert load_config(str(DEMO_CONFIG), []).model.path == bootstrap_out


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
    assert (e.value.code, out) == (2, "")
    assert err == "reflow: " + line.format(root=tmp_path) + "\n", err
