"""What `reflow train` prints (infra/ops/console.py, configs/prefect-logging.yml): by default a progress
bar plus warnings and errors, with every record still in the Prefect UI's logs, and a short summary at the
end (the whole result as JSON only with --json or --result-file); `--verbose` brings
Prefect's per-task state lines back; a temporary Prefect server that does not start ends the
command with one line saying what to do. Each run is a real `reflow train` subprocess."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.ckpt_fixtures import REFLOW, REPO, reap, write_config

pytestmark = pytest.mark.slow
TASK_STATE = "Finished in state Completed()"


def _start(args: list[str], env_extra: dict[str, str], tmp: Path) -> subprocess.Popen:
    """`reflow ARGS` in its own session, its output in tmp/stdout.txt and tmp/stderr.txt."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PREFECT_API_URL")}
    env.update({"PYTHONPATH": str(REPO), **env_extra})
    tmp.mkdir(parents=True, exist_ok=True)
    with open(tmp / "stdout.txt", "w") as o, open(tmp / "stderr.txt", "w") as e:
        return subprocess.Popen([REFLOW, *args], cwd=REPO, env=env, stdout=o, stderr=e, start_new_session=True)


def _finish(proc: subprocess.Popen, tmp: Path, timeout: float = 300) -> tuple[int, str, str]:
    """Wait for a `_start`ed command (what it leaves behind is killed); (returncode, stdout, stderr)."""
    try:
        proc.wait(timeout=timeout)
    finally:
        reap(proc)
    return proc.returncode, (tmp / "stdout.txt").read_text(), (tmp / "stderr.txt").read_text()


def _reflow(args: list[str], env_extra: dict[str, str], tmp: Path, timeout: float = 300) -> tuple[int, str, str]:
    return _finish(_start(args, env_extra, tmp), tmp, timeout)


@pytest.fixture(scope="module")
def server_env(prefect_server) -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    return {"PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_HOME": os.environ["PREFECT_HOME"]}


def test_quiet_by_default_a_bar_and_the_server_it_uses_and_verbose_brings_back_task_states(server_env, tiny_policy,
                                                                                          tmp_path):
    """Two runs at once (their start-up is mostly waiting): quiet by default on the session's server, and
    --verbose on a temporary server of its own (no PREFECT_API_URL: the command starts it beside the
    preflight and Ray beside its start, and the flow's runtime finds Ray up and says so)."""
    cfg = write_config(tmp_path / "quiet.yaml", tiny_policy, f"file://{tmp_path}/runs", "quiet", num_iterations=3)
    loud_cfg = write_config(tmp_path / "loud.yaml", tiny_policy, f"file://{tmp_path}/runs", "loud", num_iterations=1)
    result = tmp_path / "quiet" / "result.json"
    quiet = _start(["train", "--result-file", str(result), "-c", str(cfg)], server_env, tmp_path / "quiet")
    loud = _start(["train", "--verbose", "-c", str(loud_cfg)], {"PREFECT_HOME": str(tmp_path / "loud-prefect")},
                  tmp_path / "loud")
    rc, out, err = _finish(quiet, tmp_path / "quiet")
    assert rc == 0, err[-3000:]
    assert json.loads(result.read_text())["iterations"] == 3
    summary = [line for line in out.splitlines() if line.startswith("reflow: ")]  # after what Ray relays from actors
    assert summary[0].startswith("reflow: trained iterations 0-2 (3 in this run; num_iterations=3)"), out[-3000:]
    assert len(summary) <= 6 and '"history"' not in out, out[-3000:]  # a few lines, no JSON unless asked for
    assert any("checkpoints signed with the key in" in line for line in summary), summary
    assert err.startswith(f"reflow: using the running Prefect server at {server_env['PREFECT_API_URL']}"), err[:500]
    assert TASK_STATE not in err and "Started a local Ray instance" not in err, err[-3000:]
    assert "train: 100%" in err and "3/3" in err and "reward " in err, err[-3000:]  # the bar, ended at 100 %
    # Not a terminal here, so tqdm writes a line per update (on a terminal it redraws one line)
    others = [line for line in err.splitlines() if line.strip() and not line.startswith("train:")]
    assert len(others) <= 1, others  # the server line (the new experiment's signing key is a notice, not a warning)
    assert sum(line.startswith("train:") for line in err.splitlines()) <= 3 + 3, err

    rc, out, err = _finish(loud, tmp_path / "loud")
    assert rc == 0, err[-3000:]
    assert err.count(TASK_STATE) >= 6 and "iteration 0: reward " in err, err[-3000:]
    assert "train:" not in err  # no bar
    assert "reflow: starting Prefect's temporary server" in err, err[-3000:]
    assert "reusing the Ray cluster this process is already connected to (started a local Ray cluster" in err, \
        err[-3000:]


def test_a_temporary_server_that_does_not_start_ends_with_one_line(tiny_policy, tmp_path):
    """A 0 s start-up timeout stands in for a machine too busy to start Prefect's server in time (the
    config passes the preflight, which runs first)."""
    env = {"PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "0"}
    cfg = write_config(tmp_path / "ns.yaml", tiny_policy, f"file://{tmp_path}/runs", "no-server")
    rc, out, err = _reflow(["train", "-c", str(cfg)], env, tmp_path, timeout=120)
    assert rc == 2 and out == "", (rc, out, err[-3000:])  # a user error (flows/cli.py)
    assert "Traceback" not in err, err[-3000:]
    assert err.splitlines()[-1].startswith(
        "reflow: Prefect's temporary server did not answer within 0 s. Raise "
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"), err[-3000:]
    assert "export PREFECT_API_URL=" in err


def test_a_reward_that_fails_during_the_run_ends_it_with_one_line(server_env, tiny_policy, tmp_path):
    """NaN only on real responses: the preflight's empty response scores 0, so the run starts, and its first
    scoring fails. That ended in 229 lines (the same traceback logged by the iteration's flow run, by the train
    flow run, then raised); now one `reflow:` line naming the function, the sample and the value, exit 2. The
    UI's logs keep the tracebacks."""
    cfg = write_config(tmp_path / "nan.yaml", tiny_policy, f"file://{tmp_path}/runs", "nan-reward", num_iterations=1,
                       **{"data.reward_fn": "tests.reward_fixtures:nan_on_answers"})
    rc, out, err = _reflow(["train", "-c", str(cfg)], server_env, tmp_path)
    assert rc == 2 and "{" not in out, (rc, out, err[-3000:])  # no summary: the run failed
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("train:")]
    assert re.fullmatch(r"reflow: reward function tests\.reward_fixtures:nan_on_answers returned nan, expected a finite "
                        r"float for sample \d+ \(prompt='[^']*', response='[^']+'\)", lines[-1]), err[-3000:]
    assert len(lines) <= 2, lines  # the server line, the error
