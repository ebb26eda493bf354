"""`cluster.start_early` (auto on GPU machines; set here on CPU): `reflow train` starts its own Ray beside the
preflight and the run's actors as soon as Ray is up (the preflight still running), and the flow takes those actors. A failed
preflight still ends the command with its one line, nothing in storage, and no Ray process left running."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from tests.ckpt_fixtures import REPO, reap, write_config

pytestmark = pytest.mark.slow


def _ray_daemons(session: int) -> set[int]:
    """PIDs of Ray's per-cluster daemons in process session `session`: a driver's local cluster keeps its session id
    (the CLI runs in a session of its own), so another test's or pytest process's clusters are not counted (a run of
    the suite beside this one has its own)."""
    out = set()
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if (p.info["name"] in ("raylet", "gcs_server") or "gcs_server" in cmd.split(" ")[0]) \
                    and os.getsid(p.pid) == session:
                out.add(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
            continue
    return out


def _cli_env(tmp_path) -> dict[str, str]:
    """The CLI's environment: its own Ray, the session's Prefect server (a temporary server of the CLI's own, which
    starts beside the preflight too, is tests/test_preflight_cli.py's subject; here it only cost each run ~6-13 s of
    CPU), this checkout importable, a private lease folder."""
    from prefect.settings import PREFECT_API_URL

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(REPO), REFLOW_LEASE_DIR=str(tmp_path / "leases"), PREFECT_API_URL=PREFECT_API_URL.value())
    return env


# Script lines defining began(cfg): wait (up to 120 s) until the runtime's build for cfg has begun; whether it did.
_BEGAN = ("import time\nfrom reflow.infra.cluster import runtime\n"
          "def began(cfg):\n    end = time.monotonic() + 120\n"
          "    while cfg.experiment not in runtime._AHEAD and time.monotonic() < end:\n        time.sleep(0.1)\n"
          "    return cfg.experiment in runtime._AHEAD\n")


def _run_script(script: str, args: list[str], env: dict[str, str], timeout: float, stderr=subprocess.PIPE,
                no_daemons_left: bool = False):
    """`python -c script args...` in its own session; (returncode, stdout, stderr), what it left reaped. With
    `no_daemons_left`, no Ray daemon of its session may outlive it: checked before the reaping (which kills them)."""
    proc = subprocess.Popen([sys.executable, "-c", script, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=stderr, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        if no_daemons_left:
            _no_daemons_left(proc.pid)
    finally:
        reap(proc)  # what a run that timed out left (Ray's helpers)
    return proc.returncode, out, err


def _no_daemons_left(session: int) -> None:
    deadline = time.monotonic() + 20  # Ray's daemons end on their own once the driver stopped the cluster
    while (left := _ray_daemons(session)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"Ray daemons left running after the failed preflight: {left}"


def test_a_failed_preflight_stops_the_ray_it_started_beside_it(prefect_server, tmp_path, tiny_policy):
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"q": f"{i}+1=", "a": i + 1}) + "\n" for i in range(12)))
    cfg = write_config(tmp_path / "c.yaml", tiny_policy, f"file://{tmp_path}/runs", "early-bad",
                       **{"data.task": "file", "data.path": str(tmp_path / "p.jsonl"), "data.prompt_key": "q",
                          "data.label_key": "answer", "data.num_eval": 4, "cluster.start_early": True})
    env = _cli_env(tmp_path)
    # the CLI in a process that goes on afterwards (a notebook, a wrapper): the cluster must be stopped by then
    script = ("import sys, ray\nfrom reflow.flows.cli import main\ncode = None\ntry:\n    main(sys.argv[1:])\n"
              "except SystemExit as e:\n    code = e.code\nprint(f'RESULT {code} {ray.is_initialized()}')\n")
    code, out, err = _run_script(script, ["train", "-c", str(cfg)], env, timeout=180, no_daemons_left=True)
    assert out == "RESULT 2 False\n", (code, out, err[-3000:])
    assert err.count("\n") == 1 and "data.label_key" in err, err[-3000:]
    assert not (tmp_path / "runs").exists()


def test_a_preflight_failing_while_the_actors_start_stops_them_and_ray(prefect_server, tmp_path, tiny_policy):
    """The actors begin beside the preflight: one that fails while they start (a check the runtime's build does not
    repeat) still ends with its one line, and neither the actors nor a Ray they would call later outlive it (Ray
    starts a new local cluster on any call made without one: the build's next call must fail instead)."""
    cfg = write_config(tmp_path / "c.yaml", tiny_policy, f"file://{tmp_path}/runs", "early-late",
                       **{"num_iterations": 2, "cluster.start_early": True})
    script = (_BEGAN + "import sys, ray\nimport reflow.flows.cli as cli\n"
              "from reflow.infra.ops.preflight import PreflightError\n"
              "def failing(cfg):\n    ok = began(cfg)\n"
              "    time.sleep(3)\n"  # the build is under way: data loaded, actors being created
              "    raise PreflightError(f'a late check failed (began: {ok})')\n"
              "cli._preflight = failing\ncode = None\ntry:\n    cli.main(sys.argv[1:])\n"
              "except SystemExit as e:\n    code = e.code\n"
              "time.sleep(15)\n"  # the build thread's later Ray calls: none may start a cluster
              "print(f'RESULT {code} {ray.is_initialized()} {cli.__name__ in sys.modules}', flush=True)\n")
    _, out, err = _run_script(script, ["train", "-c", str(cfg)], _cli_env(tmp_path), timeout=300,
                              no_daemons_left=True)
    assert "RESULT 2 False True" in out, (out, err[-3000:])
    assert "a late check failed (began: True)" in err, err[-3000:]
    assert not (tmp_path / "runs" / "early-late" / "config.yaml").exists()


def test_the_flow_takes_the_actors_started_beside_the_preflight(prefect_server, tmp_path, tiny_policy):
    """The actors begin while the preflight still runs (once Ray is up), not after it: the preflight here waits
    (up to 120 s) for the runtime's build to begin, and says whether it did."""
    cfg = write_config(tmp_path / "c.yaml", tiny_policy, f"file://{tmp_path}/runs", "early",
                       **{"num_iterations": 2, "cluster.start_early": True, "checkpoint.save_interval": None})
    script = (_BEGAN + "import sys\nimport reflow.flows.cli as cli\n"
              "checked = cli._preflight\n"
              "def waiting(cfg):\n    print(f'BEGAN DURING PREFLIGHT {began(cfg)}', flush=True)\n"
              "    return checked(cfg)\n"
              "cli._preflight = waiting\ncli.main(sys.argv[1:])\n")
    result = tmp_path / "result.json"
    code, log, _ = _run_script(script, ["train", "--verbose", "--result-file", str(result), "-c", str(cfg)],
                               _cli_env(tmp_path), timeout=400, stderr=subprocess.STDOUT)
    assert code == 0, log[-4000:]
    assert "BEGAN DURING PREFLIGHT True" in log, log[-4000:]
    assert "the run's actors began beside the preflight" in log, log[-4000:]
    assert "runtime started ahead of the flow: ready in" in log, log[-4000:]
    assert "building it again" not in log  # the flow's config is the one the actors were started for
    assert (tmp_path / "runs" / "early" / "config.yaml").is_file()  # written by the flow, as before
    summary = json.loads(result.read_text())
    assert summary["iterations"] == 2, summary


def test_a_bad_input_found_while_the_actors_start_stops_them(ray_cluster, tiny_policy, tmp_path):
    """On a cluster of the run's own the runtime reads its inputs while its actors start (not before): a bad one
    still fails with its own error, and the actors just asked for are gone (the shared cluster keeps no CPU taken)."""
    import ray

    from reflow.infra.cluster.runtime import start_runtime
    from reflow.infra.config.schema import load_config

    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"q": f"{i}+1=", "a": i + 1}) + "\n" for i in range(12)))
    cfg = load_config(None, ["experiment=late-input", f"model.path={tiny_policy}", "data.task=file",
                             f"data.path={tmp_path / 'p.jsonl'}", "data.prompt_key=q", "data.label_key=answer",
                             "data.num_eval=4", f"storage.root=file://{tmp_path}/runs"])
    ours = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"].endswith("late-input")}
    assert not ours
    with pytest.raises(Exception, match="label_key"):
        start_runtime(cfg)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"].endswith("late-input")}
        if not left and ray.available_resources().get("CPU", 0) == ray.cluster_resources().get("CPU"):
            break
        time.sleep(0.5)
    assert not left, f"actors left after the bad input: {left}"
    assert ray.available_resources().get("CPU", 0) == ray.cluster_resources().get("CPU")  # none held by one unnamed
