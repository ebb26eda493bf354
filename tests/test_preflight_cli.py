"""The CLI as a user runs it (a subprocess): `reflow train` runs the preflight before Prefect or Ray
start, so a bad input ends it with one line, exit code 2 and nothing written to storage; `--debug`
shows the traceback instead. No Ray starts; Prefect's temporary server may begin to start beside the
preflight, and is stopped when it fails."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.ckpt_fixtures import REFLOW, REPO, write_config

# `reflow` subprocesses, two of them with Prefect's temporary server: 52 s of the quick tier's 170 s (issue 52)
pytestmark = pytest.mark.slow


def _reflow(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PREFECT_API_URL")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([REFLOW, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _config(tmp_path: Path, policy: Path, **extra) -> Path:
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"q": f"{i}+1=", "a": i + 1}) + "\n" for i in range(12)))
    return write_config(tmp_path / "c.yaml", policy, f"file://{tmp_path}/runs", "cli",
                        **{"data.task": "file", "data.path": str(tmp_path / "p.jsonl"), "data.prompt_key": "q",
                           "data.label_key": "answer", "data.num_eval": 4, **extra})


def test_train_stops_at_the_preflight_with_one_line(tmp_path, tiny_policy):
    r = _reflow("train", "-c", str(_config(tmp_path, tiny_policy)))
    assert (r.returncode, r.stdout) == (2, ""), (r.returncode, r.stdout, r.stderr[-3000:])
    # Only the line: no "starting Prefect's temporary server" (said once the preflight passed), no Ray
    # start-up, no traceback.
    assert r.stderr == (f"reflow: '{tmp_path}/p.jsonl' has no column 'answer' (data.label_key); its columns are "
                        f"['q', 'a']: set data.label_key to the one holding the ground truth\n"), r.stderr[-3000:]
    assert not (tmp_path / "runs").exists()  # nothing in storage


def test_config_check_catches_it_too_and_debug_shows_the_traceback(tmp_path, tiny_policy):
    cfg = str(_config(tmp_path, tiny_policy))
    r = _reflow("config", "-c", cfg, "--check")
    assert (r.returncode, r.stdout) == (2, "") and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert r.stderr.startswith(f"reflow: '{tmp_path}/p.jsonl' has no column 'answer' (data.label_key)")
    r = _reflow("config", "-c", cfg, "--check", "--debug")
    assert r.returncode == 1 and "Traceback (most recent call last)" in r.stderr, r.stderr[-3000:]
    assert "reflow.infra.ops.preflight.PreflightError: " in r.stderr, r.stderr[-3000:]
    r = _reflow("config", "-c", cfg, "--check", "data.label_key=a")
    assert r.returncode == 0 and r.stdout.startswith("experiment: cli\n"), r.stderr[-3000:]
    assert r.stderr.startswith("reflow: preflight passed in ") and "Traceback" not in r.stderr, r.stderr


def _servers_of(prefect_home: Path) -> list[int]:
    """Processes whose environment names this PREFECT_HOME (a temporary Prefect server left running)."""
    import psutil

    pids = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("PREFECT_HOME") == str(prefect_home):
                pids.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return pids


def _reward_after_server_db(path: Path, prefect_home: Path, then: str) -> None:
    """A reward module whose import (the preflight does it) waits up to 90 s for the temporary server's
    database under `prefect_home` (`db`, its path), then runs the source `then`."""
    path.write_text("import os, pathlib, time\n"
                    f"db = {str(prefect_home / 'prefect.db')!r}\n"
                    "deadline = time.time() + 90\n"
                    "while not os.path.exists(db) and time.time() < deadline:\n"
                    "    time.sleep(0.2)\n" + then)


def test_prefects_server_starts_beside_the_preflight_and_a_failure_stops_it(tmp_path, tiny_policy):
    """Without PREFECT_API_URL, the temporary server begins to start while the preflight runs (on the GPU
    machine they took ~10 and ~19 s one after the other). Here the reward module's import, which the
    preflight does, waits until that server has created its database, then fails: the command still ends
    with its one line, and no server is left running."""
    home = tmp_path / "prefect"
    _reward_after_server_db(tmp_path / "slow_reward.py", home,
                            "raise ImportError('slow_reward: the scorer is not installed (the server database exists: '"
                            " + str(os.path.exists(db)) + ')')\n")
    cfg = _config(tmp_path, tiny_policy, **{"data.label_key": "a", "data.reward_fn": "slow_reward:reward"})
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PREFECT_API_URL")}
    env.update(PYTHONPATH=f"{REPO}:{tmp_path}", PREFECT_HOME=str(home))
    r = subprocess.run([REFLOW, "train", "-c", str(cfg)], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=240)
    assert (r.returncode, r.stdout) == (2, ""), (r.returncode, r.stdout, r.stderr[-3000:])
    assert r.stderr.count("\n") == 1 and "slow_reward" in r.stderr, r.stderr[-3000:]
    assert "the server database exists: True" in r.stderr, r.stderr[-3000:]  # it was starting during the preflight
    assert _servers_of(home) == []  # and it was stopped
    assert not (tmp_path / "runs").exists()


def test_sigterm_while_the_server_starts_stops_it_too(tmp_path, tiny_policy):
    """`kill PID` (SIGTERM) while the temporary server starts and the preflight runs: the command ends
    with 128 + 15 and leaves no server behind (Python's default action ended it at once, leaving its
    server child running)."""
    home, waiting = tmp_path / "prefect", tmp_path / "waiting"
    _reward_after_server_db(tmp_path / "stuck_reward.py", home,
                            f"pathlib.Path({str(waiting)!r}).write_text(str(os.path.exists(db)))\n"
                            "time.sleep(300)\n")
    cfg = _config(tmp_path, tiny_policy, **{"data.label_key": "a", "data.reward_fn": "stuck_reward:reward"})
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PREFECT_API_URL")}
    env.update(PYTHONPATH=f"{REPO}:{tmp_path}", PREFECT_HOME=str(home))
    proc = subprocess.Popen([REFLOW, "train", "-c", str(cfg)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not waiting.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert waiting.exists() and waiting.read_text() == "True", proc.poll()  # the server was starting
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err[-3000:])
        assert _servers_of(home) == [], err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for pid in _servers_of(home):  # what a failing run left: not for the next tests to find
            os.kill(pid, signal.SIGKILL)
