"""The Prefect product surface with real processes on loopback: `reflow cluster up`, a real
`prefect server`, a `process` worker, deployments from prefect.yaml, `prefect deployment run`.

One module-scoped setup; the tests run in order on one experiment and each builds on the last:
first run -> second run reuses the actors -> an engine killed between runs is recreated -> a run
killed mid-train is re-run without generating its rollouts again.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

# The tests tell one story on one experiment (see above), so they keep their order under
# `--random-order` (the module itself is still shuffled among the others).
pytestmark = [pytest.mark.slow, pytest.mark.random_order(disabled=True)]

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
EXP = "dep"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """The processes of the module and the commands the tests run against them."""

    def __init__(self, tmp: Path, policy: Path):
        self.tmp, self.policy = tmp, policy
        self.api = f"http://127.0.0.1:{_free_port()}/api"
        self.ray_port = _free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RAY_"))}
        self.env = {**env, "PREFECT_HOME": str(tmp / "prefect"), "PREFECT_API_URL": self.api,
                    "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_CLI_PROMPT": "false",
                    "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "1",
                    "REFLOW_CLUSTER_DIR": str(tmp / "cluster"), "PWD": str(REPO),
                    "RAY_ADDRESS": f"127.0.0.1:{self.ray_port}",
                    "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        self.procs: list[subprocess.Popen] = []

    def cmd(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run([str(BIN / args[0]), *args[1:]], cwd=REPO, env=self.env, capture_output=True,
                           text=True, timeout=timeout)
        if check and p.returncode:
            raise AssertionError(f"{' '.join(args)} -> {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        return p

    def spawn(self, name: str, *args: str) -> None:
        log = open(self.tmp / f"{name}.log", "w")
        self.procs.append(subprocess.Popen([str(BIN / args[0]), *args[1:]], cwd=REPO, env=self.env, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True))

    def post(self, path: str, body: dict) -> list[dict]:
        r = httpx.post(self.api + path, json=body, timeout=30)
        r.raise_for_status()
        return r.json()

    def flow_runs(self) -> dict[str, dict]:
        return {r["name"]: r for r in self.post("/flow_runs/filter", {"limit": 200})}

    def artifacts_of(self, run_id: str) -> list[dict]:
        return self.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run_id]}}})

    def actors(self) -> dict[str, str]:
        st = json.loads(self.cmd("reflow", "cluster", "status", "--json").stdout)
        return {a["actor"]: a for a in st["actors"] if a["namespace"] == f"reflow-{EXP}"}

    def overrides(self, iterations: int) -> list[str]:
        return [f"experiment={EXP}", f"model.path={self.policy}", f"num_iterations={iterations}",
                "data.num_train=64", "data.num_eval=8", "rollout.prompts_per_iteration=4",
                "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=4", "trainer.micro_batch_size=8",
                "eval.before_train=false", f"storage.root=file://{self.tmp}/runs"]

    def run_train(self, iterations: int, *extra: str) -> dict:
        """`prefect deployment run train/train` with {file, overrides}; returns the parent flow run."""
        params = json.dumps({"config": {"file": "configs/demo.yaml", "overrides": self.overrides(iterations)}})
        out = self.cmd("prefect", "deployment", "run", "train/train", "--params", params, "--watch",
                       "--watch-timeout", "400", *extra, timeout=460, check=False)
        runs = [r for r in self.post("/flow_runs/filter", {"sort": "EXPECTED_START_TIME_DESC", "limit": 50})
                if r["deployment_id"] is not None]
        assert runs, f"no deployment flow run\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
        return runs[0]

    def run_dir(self) -> Path:
        return self.tmp / "runs" / EXP

    def close(self) -> None:
        """SIGTERM the worker and the server, SIGKILL what is left after 10 s (nothing they hold is
        needed any more), then `reflow cluster down`."""
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.cmd("reflow", "cluster", "down", check=False)


def _wait_healthy(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout}s")


@pytest.fixture(scope="module")
def stack(tiny_policy, tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("deploy"), tiny_policy)
    try:
        up = s.cmd("reflow", "cluster", "up", "--port", str(s.ray_port), "--num-cpus", "6")
        assert f"RAY_ADDRESS=127.0.0.1:{s.ray_port}" in up.stdout
        # What the README tells a user to do: export what `up` printed (token file, loopback switch).
        exports = dict(w.removesuffix(";").split("=", 1) for w in up.stdout.split() if "=" in w and w.endswith(";"))
        assert exports.get("RAY_AUTH_TOKEN_PATH") and exports.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0", up.stdout
        s.env.update(exports)
        port = s.api.rsplit(":", 1)[1].split("/")[0]
        s.spawn("server", "prefect", "server", "start", "--host", "127.0.0.1", "--port", port)
        _wait_healthy(s.api + "/health", 180)
        s.cmd("prefect", "work-pool", "create", "reflow", "--type", "process")
        deployed = s.cmd("prefect", "--no-prompt", "deploy", "--all")
        assert "train/train" in deployed.stdout and "retrain/retrain" in deployed.stdout, deployed.stdout
        s.spawn("worker", "prefect", "worker", "start", "--pool", "reflow")
        yield s
    finally:
        s.close()


def test_deployments_and_schedule(stack):
    deps = {d["name"]: d for d in stack.post("/deployments/filter", {})}
    assert {"train", "evaluate", "retrain"} <= set(deps)
    sched = deps["retrain"]["schedules"]
    assert sched and sched[0]["schedule"]["cron"] == "0 3 * * *" and sched[0]["active"] is False


def test_train_deployment_run(stack):
    parent = stack.run_train(2)
    assert parent["state_type"] == "COMPLETED", parent["state"]
    assert parent["name"] == EXP
    runs = stack.flow_runs()
    for i in range(2):
        run = runs[f"{EXP}-iter-{i:04d}"]
        assert run["state_type"] == "COMPLETED" and run["parent_task_run_id"] is not None
        keys = {a["key"] for a in stack.artifacts_of(run["id"])}
        assert {f"{EXP}-iteration-metrics", f"{EXP}-iteration-timings", f"{EXP}-iteration-samples"} <= keys, keys
    parent_keys = {a["key"] for a in stack.artifacts_of(parent["id"])}
    assert {f"{EXP}-progress", f"{EXP}-curves"} <= parent_keys, parent_keys
    samples = [a for a in stack.artifacts_of(runs[f"{EXP}-iter-0001"]["id"]) if a["key"].endswith("samples")][0]
    assert "| prompt | response | reward |" in samples["data"]
    stack.first_actors = stack.actors()
    assert {"engine-0", "policy-trainer-0"} <= set(stack.first_actors)
    # Started through the fork server `reflow cluster up` put beside the head (no GPU here: its auto is on).
    parent = psutil.Process(stack.first_actors["policy-trainer-0"]["pid"]).parent()  # (status has no engine pid)
    assert parent is not None and "--serve" in parent.cmdline(), parent and parent.cmdline()


def test_bad_parameters_fail_validation(stack):
    """Named after the experiment (not Prefect's random name), the one-line reason first."""
    params = json.dumps({"config": {"file": "configs/demo.yaml", "overrides": ["experiment=bad-params",
                                                                              "rollout.top_p=0"]}})
    stack.cmd("prefect", "deployment", "run", "train/train", "--params", params, "--watch", "--watch-timeout", "200",
              timeout=260, check=False)
    run = [r for r in stack.post("/flow_runs/filter", {"sort": "EXPECTED_START_TIME_DESC", "limit": 5})][0]
    assert (run["name"], run["state_type"]) == ("bad-params", "FAILED"), run["state"]
    assert (run["state"]["message"] or "").startswith(
        "invalid configuration (configs/demo.yaml + overrides): rollout.top_p: Input should be greater than 0"), run


def test_a_second_run_recreates_its_killed_engine_reuses_its_trainer_and_continues(stack):
    """The next deployment run of the experiment after its engine died: the engine is made again (with the
    current weights pushed), the trainer rank kept, and the iterations continue where the last run ended."""
    before = stack.first_actors
    code = ("import os, signal, ray; ray.init(address=os.environ['RAY_ADDRESS'], log_to_driver=False); "
            f"e = ray.get_actor('engine-0', namespace='reflow-{EXP}'); "
            "os.kill(ray.get(e.__ray_call__.remote(lambda self: os.getpid())), signal.SIGKILL)")
    subprocess.run([sys.executable, "-c", code], env=stack.env, check=True, timeout=120, capture_output=True)
    parent = stack.run_train(3)
    assert parent["state_type"] == "COMPLETED", parent["state"]
    after = stack.actors()
    assert after["engine-0"]["id"] != before["engine-0"]["id"]
    assert after["policy-trainer-0"]["id"] == before["policy-trainer-0"]["id"], "the trainer was recreated"
    assert after["engine-0"]["weight_version"] == "3"
    names = [r["name"] for r in stack.post("/flow_runs/filter", {"limit": 200})]
    assert names.count(f"{EXP}-iter-0002") == 1 and names.count(f"{EXP}-iter-0000") == 1


def test_rerun_after_crash_in_train_does_not_generate_again(stack):
    """A run killed in its train stage, then run again: the same engine and trainer serve the rerun (a run's
    actors outlive it), and the rollouts it had persisted are trained on, not generated again."""
    stages = stack.run_dir() / "iterations" / "000003" / "stages"
    crashed = stack.run_train(4, "--job-variable", 'env={"REFLOW_FAULT_KILL_DURING_TRAIN": "3"}')
    assert crashed["state_type"] in ("CRASHED", "FAILED"), crashed["state"]
    assert (stages / "scored.json").is_file(), "the rollouts of iteration 3 were not persisted before train"
    mtime = (stages / "scored.batch.json").stat().st_mtime_ns
    before = stack.actors()
    served = int(before["engine-0"]["sequences"])

    parent = stack.run_train(4)
    assert parent["state_type"] == "COMPLETED", parent["state"]
    metrics = json.loads((stack.run_dir() / "iterations" / "000003" / "metrics.json").read_text())
    assert metrics.get("scored_from_storage") == 1.0
    assert (stages / "scored.batch.json").stat().st_mtime_ns == mtime
    after = stack.actors()
    for name in ("engine-0", "policy-trainer-0"):
        assert after[name]["id"] == before[name]["id"], f"{name} was recreated"
    # The engine only served the final eval (8 held-out prompts, greedy): no rollout was regenerated.
    assert int(after["engine-0"]["sequences"]) - served == 8


def test_cluster_down_releases_the_experiment(stack):  # last: releases the actors
    assert stack.actors()
    out = stack.cmd("reflow", "cluster", "down", "--experiment", EXP)
    assert f"reflow-{EXP}/engine-0" in out.stdout and f"reflow-{EXP}/policy-trainer-0" in out.stdout
    assert stack.actors() == {}
    assert json.loads(stack.cmd("reflow", "cluster", "status", "--json").stdout)["up"] is True  # the head stays


# ---------------------------------------------------------------- the README, as written

SETUP = ["reflow cluster up", "export RAY_ADDRESS=127.0.0.1:6390 RAY_AUTH_MODE=token", "prefect server start --host "
         "127.0.0.1 --port 4200 &", "export PREFECT_API_URL=http://127.0.0.1:4200/api",
         "prefect work-pool create reflow --type process", "prefect --no-prompt deploy --all",
         "prefect worker start --pool reflow &"]


def _readme_commands() -> list[str]:
    """The commands of the README's "Run on a Prefect server" block, continuation lines joined,
    comments dropped."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Run on a Prefect server"):]
    start = section.index("```bash\n") + len("```bash\n")
    block = section[start:section.index("```", start)].replace("\\\n", " ")
    return [" ".join(line.split(" #")[0].split()) for line in block.splitlines() if line.strip()]


def _small(args: list[str], stack: Stack, data: dict[str, str]) -> list[str]:
    """A README `prefect deployment run` at test size: the stack's policy, storage and batch sizes added
    to the overrides, the experiment and config file kept; 2 iterations; the demo files from `data`."""
    out = []
    for arg in args:
        if arg.startswith("{"):
            params = json.loads(arg)
            keep = [o for o in params["config"]["overrides"] if o.startswith("experiment=")]
            size = [o for o in stack.overrides(2) if not o.startswith(("experiment=", "num_iterations="))]
            if params["config"]["file"] == "configs/demo-retrain.yaml":
                size.append(f'eval.sets=[{{name: heldout, source: "{data["heldout"]}", temperature: 0.0, '
                            f'max_prompts: 8}}]')
            params["config"]["overrides"] = keep + (["num_iterations=2"] if "num_iterations=40" in arg else []) + size
            arg = json.dumps(params)
        elif arg.startswith("new_data="):
            arg = f"new_data={data['incoming']}"
        elif arg == "iterations=10":
            arg = "iterations=1"
        out.append(arg)
    return out


def test_readme_server_walkthrough_runs_as_written(stack, tmp_path):
    """Last (it ends with `reflow cluster down`): the README's commands after the set-up the stack made
    (the same commands, on its own ports), one by one; each deployment run completes."""
    import shlex

    from reflow.rl.demo_task import write_demo_data

    commands = _readme_commands()
    assert [c[:len(s)] for c, s in zip(commands, SETUP)] == SETUP, commands[:len(SETUP)]
    data = write_demo_data(tmp_path / "demo", num_train=64, num_eval=8, new_rows=16)
    names = []
    for command in commands[len(SETUP):]:
        args = shlex.split(command.replace("$PWD", str(REPO)))
        if args[:3] == ["prefect", "deployment", "run"]:
            out = stack.cmd(*_small(args, stack, data), "--watch-timeout", "300", timeout=360, check=False)
            run = [r for r in stack.post("/flow_runs/filter", {"sort": "EXPECTED_START_TIME_DESC", "limit": 20})
                   if r["deployment_id"] is not None][0]  # the deployment's run, not its subflows
            names.append(run["name"])
            assert run["state_type"] == "COMPLETED", (command, run["state"], out.stdout[-2000:], out.stderr[-2000:])
        else:
            out = stack.cmd(*args)
            if args[:3] == ["prefect", "deployment", "schedule"]:
                assert "0 3 * * *" in out.stdout, out.stdout
            if args[:3] == ["reflow", "cluster", "status"]:
                assert "reflow-nightly" in out.stdout, out.stdout
    assert names == ["nightly", "nightly-eval", "nightly-retrain"], names
    champion = json.loads((stack.tmp / "runs" / "nightly" / "champion.json").read_text())
    assert champion["step"] == 3 and champion["metric"] == "heldout/pass@1", champion
    assert commands[-1] == "reflow cluster down"
    assert json.loads(stack.cmd("reflow", "cluster", "status", "--json").stdout)["up"] is False
