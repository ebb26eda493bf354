"""Engines and trainer ranks on different Ray nodes (issue 23; docs/scale-out.md).

The slow test builds a two-node cluster on this machine from two separate `ray start` processes with
token auth: a head offering `reflow_engine_node` and a worker offering `reflow_trainer_node`. Ray's
`ray start --address` refuses to add a node while the loopback-only switch is on, and without it Ray
swaps 127.0.0.1 for the machine's own address, so both nodes use this machine's address (what a real
cluster does), guarded by the token. The quick tests check the pieces without Ray.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reflow.engines.ray_nodes import label, offering, unplaced_message
from reflow.infra import ray_head
from reflow.infra.config import ConfigError, load_config
from reflow.infra.placement import bundles, layout_problem
from tests.ckpt_fixtures import REFLOW, REPO, free_port, reap, run_train, write_config

ENGINE_RES, TRAINER_RES = "reflow_engine_node", "reflow_trainer_node"


# ---------------------------------------------------------------- quick: no Ray


def test_tensor_push_across_hosts_is_refused_naming_the_modes_that_work():
    engines = {"engine-0": ("http://10.0.0.2:31000", "10.0.0.2")}
    problem = layout_problem("tensor", None, engines, "10.0.0.1", {"10.0.0.1", "10.0.0.2"})
    assert problem and "engine-0 on 10.0.0.2" in problem and "10.0.0.1" in problem
    assert "weight_sync.mode=distributed" in problem and "disk" in problem
    assert layout_problem("distributed", None, engines, "10.0.0.1", {"10.0.0.1", "10.0.0.2"}) is None
    # Two Ray nodes on one host share /dev/shm: tensor pushes work there.
    same = {"engine-0": ("http://10.0.0.1:31000", "10.0.0.1")}
    assert layout_problem("tensor", None, same, "10.0.0.1", {"10.0.0.1"}) is None


def test_engines_on_loopback_and_disk_pushes_to_a_local_folder_are_refused_across_hosts():
    loop = {"engine-0": ("http://127.0.0.1:31000", "10.0.0.2")}
    problem = layout_problem("distributed", None, loop, "10.0.0.1", {"10.0.0.1", "10.0.0.2"})
    assert problem and "cluster.bind_host=0.0.0.0" in problem and "engine-0" in problem
    assert layout_problem("distributed", None, {"engine-0": ("http://127.0.0.1:1", "127.0.0.1")}, "127.0.0.1",
                          {"127.0.0.1"}) is None  # one host: loopback is right
    away = {"engine-0": ("http://10.0.0.2:31000", "10.0.0.2")}
    problem = layout_problem("disk", None, away, "10.0.0.1", {"10.0.0.1", "10.0.0.2"})
    assert problem and "weight_sync.disk_dir" in problem
    assert layout_problem("disk", "s3://bucket/weights", away, "10.0.0.1", {"10.0.0.1", "10.0.0.2"}) is None


def test_node_resources_config_and_colocated_bundles():
    cfg = load_config(None, [f"rollout.node_resources={{{ENGINE_RES}: 0.01}}", f"trainer.node_resources={{{TRAINER_RES}: 0.5}}"])
    assert cfg.rollout.node_resources == {ENGINE_RES: 0.01} and cfg.trainer.node_resources == {TRAINER_RES: 0.5}
    with pytest.raises(ConfigError, match=r"trainer.node_resources: .*\['GPU'\] are Ray's own resources"):
        load_config(None, ["trainer.node_resources={GPU: 1}"])
    with pytest.raises(ConfigError, match="greater than 0"):
        load_config(None, [f"rollout.node_resources={{{ENGINE_RES}: 0}}"])
    # Colocated: each bundle carries what its actors ask for (two trainer ranks, one engine, a critic each).
    spec = bundles(2, 1, gpu=False, critic=True, rank_resources={TRAINER_RES: 0.5}, engine_resources={ENGINE_RES: 0.25})
    assert spec == [{"CPU": 3.0, TRAINER_RES: 1.0, ENGINE_RES: 0.25}, {"CPU": 2.0, TRAINER_RES: 1.0}]


def test_an_unplaceable_actor_names_what_it_asks_for_and_the_dead_node_that_had_it():
    known = {"a" * 56: {"ip": "10.0.0.1", "alive": True, "resources": {"CPU": 4.0, ENGINE_RES: 1.0}},
             "b" * 56: {"ip": "10.0.0.2", "alive": False, "resources": {"CPU": 2.0, TRAINER_RES: 1.0}},
             "c" * 56: {"ip": "10.0.0.3", "alive": False, "resources": {}}}  # Ray dropped what it offered
    assert offering({"CPU": 1, TRAINER_RES: 0.01}, known) == ([], [label("b" * 56, "10.0.0.2"), label("c" * 56, "10.0.0.3")])
    assert offering({ENGINE_RES: 0.01}, known)[0] == [label("a" * 56, "10.0.0.1")]
    text = unplaced_message("policy-trainer-0", {"CPU": 1, TRAINER_RES: 0.01}, 15, known)
    assert "policy-trainer-0 was not placed" in text and "no live node offers them" in text
    assert "dead nodes that offered them" in text and "bbbbbbbb@10.0.0.2, cccccccc@10.0.0.3" in text
    assert "cluster.placement_timeout_s" in text


def test_cluster_status_text_names_each_actors_node_and_up_takes_resources():
    from reflow.flows.cli import UsageError, _resources_arg, _status_text

    st = {"up": True, "address": "10.0.0.1:6390", "recorded": False,
          "nodes": [{"node": "aaaaaaaa@10.0.0.1", "alive": True, "custom_resources": {ENGINE_RES: 1.0}},
                    {"node": "bbbbbbbb@10.0.0.2", "alive": False, "custom_resources": {}}],
          "actors": [{"namespace": "reflow-x", "actor": "engine-0", "id": "ff", "node": "aaaaaaaa@10.0.0.1"}]}
    text = _status_text(st)
    assert "Ray cluster at 10.0.0.1:6390 (RAY_ADDRESS" in text and "bbbbbbbb@10.0.0.2  DEAD" in text
    assert "actor=engine-0  id=ff  node=aaaaaaaa@10.0.0.1" in text
    assert _resources_arg(f'{{"{ENGINE_RES}": 1}}') == {ENGINE_RES: 1}
    for bad in ("{reflow_engine_node: 1}", '{"x": 0}', "[1]"):
        with pytest.raises(UsageError, match="--resources"):
            _resources_arg(bad)


# ---------------------------------------------------------------- slow: a two-node cluster


def machine_ip() -> str:
    """The address Ray gives a node here (the route out; no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("8.8.8.8", 80))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


# The GCS declares a node dead after health checks fail; Ray's defaults take ~30 s, these ~2 s.
FAST_HEALTH = {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "500",
               "RAY_health_check_timeout_ms": "500", "RAY_health_check_failure_threshold": "3"}


class Worker:
    """A second Ray node (`ray start --address --block` in its own session), killed hard by `kill`."""

    def __init__(self, head: ray_head.HeadInfo, log: Path):
        self.head, self.log, self.proc = head, log, None

    def start(self) -> Worker:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update({k: v for k, v in self.head.env().items() if k != "RAY_ADDRESS"}, RAY_USAGE_STATS_ENABLED="0")
        cmd = [str(Path(sys.executable).with_name("ray")), "start", f"--address={self.head.address}", "--block",
               "--num-cpus=2", f"--resources={json.dumps({TRAINER_RES: 1})}", "--disable-usage-stats",
               f"--dashboard-agent-listen-port={free_port()}"]  # the head's agent holds Ray's default port
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def kill(self) -> None:
        """SIGKILL the node's process group (raylet, agents): a machine that vanished, no goodbye to the GCS."""
        if self.proc is not None:
            reap(self.proc)
            self.proc = None


def status(env: dict[str, str]) -> dict:
    out = subprocess.run([REFLOW, "cluster", "status", "--json"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def wait_for(what: str, check, timeout_s: float, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := check()) is not None:
            return value
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f}s")


@pytest.fixture
def two_nodes(tmp_path, monkeypatch):
    """(head, worker node, env for `reflow` subprocesses); the head and every node stopped afterwards."""
    ip = machine_ip()
    if ip.startswith("127."):
        pytest.skip("this machine has no address but loopback, where `ray start --address` cannot add a node")
    for k in [k for k in os.environ if k.startswith("RAY_")]:  # e.g. an earlier test's loopback switch
        monkeypatch.delenv(k)
    for k, v in FAST_HEALTH.items():  # read by the head's GCS, which `up` starts with this environment
        monkeypatch.setenv(k, v)
    state = tmp_path / "cluster"
    head, _ = ray_head.up(state, port=free_port(), num_cpus=4, host=ip, resources={ENGINE_RES: 1})
    worker = Worker(head, tmp_path / "worker.log")
    try:
        worker.start()
        env = {k: v for k, v in os.environ.items() if not k.startswith("REFLOW_FAULT_")}
        env.update(head.env(), REFLOW_CLUSTER_DIR=str(state), PYTHONPATH=str(REPO))
        yield head, worker, env
    finally:
        worker.kill()
        ray_head.down(state)


def latest(root: Path) -> int | None:
    f = root / "checkpoints" / "latest"
    return int(f.read_text().strip().rpartition("_")[2]) if f.is_file() else None


@pytest.mark.slow
def test_engines_and_trainers_on_two_nodes_lose_a_node_then_resume(two_nodes, prefect_server, tiny_policy, tmp_path):
    from prefect.settings import PREFECT_API_URL

    head, worker, env = two_nodes
    env.update(PREFECT_API_URL=PREFECT_API_URL.value(), PREFECT_HOME=os.environ["PREFECT_HOME"])
    root = tmp_path / "runs" / "twonode"
    layout = {"rollout.node_resources": {ENGINE_RES: 0.01}, "trainer.node_resources": {TRAINER_RES: 0.01},
              "weight_sync.mode": "distributed", "weight_sync.verify": "full", "cluster.bind_host": "0.0.0.0",
              "cluster.placement_timeout_s": 20.0, "fault_tolerance.max_trainer_recoveries": 1}
    cfg = write_config(tmp_path / "run1.yaml", tiny_policy, f"file://{tmp_path}/runs", "twonode", num_iterations=200,
                       **layout)
    run = run_train(cfg, env, background=True)
    try:
        wait_for("a committed checkpoint", lambda: latest(root), 180)  # the worker node joined meanwhile
        st = status(env)  # Ray's node and actor tables, as `reflow cluster status` shows them
        where = {next(iter(n["custom_resources"])): n["node"] for n in st["nodes"] if n["alive"]}
        assert where.keys() == {ENGINE_RES, TRAINER_RES} and where[ENGINE_RES] != where[TRAINER_RES], st["nodes"]
        actors = {row["actor"]: row["node"] for row in st["actors"]}
        assert actors["engine-0"] == where[ENGINE_RES] and actors["policy-trainer-0"] == where[TRAINER_RES], actors
        metrics = json.loads((root / "iterations" / "000000" / "metrics.json").read_text())
        assert metrics["push_verified_tensors"] > 0 and metrics["push_engines"] == 1, metrics
        t_kill = time.monotonic()
        worker.kill()  # the trainer's node vanishes mid-run
        rc = run.wait(timeout=120)
        failed_after = time.monotonic() - t_kill
    finally:
        reap(run)
    out = run.log_path.read_text()
    # Where the node dies decides the path: mid-iteration, the recovery (flows/recovery.py) rebuilds the rank,
    # which no live node can host (ray_nodes.wait_placed names the dead node); in a save or a push, Ray's own
    # actor-death error ends the run (it names the actor and the node). Either way: failed, naming both.
    marker = "Flow run 'twonode' - Finished in state Failed("
    assert rc != 0 and marker in out, out[-4000:]
    final = out[out.rindex(marker):]  # the run's failure and the error the command ended with
    node_id = where[TRAINER_RES].split("@")[0]
    assert "policy-trainer-0" in final and node_id in final, final[-4000:]
    assert failed_after < 90, f"the run took {failed_after:.0f}s to fail after its trainer node died"
    path = "recovery, not placed" if "was not placed on any node" in final else "actor died"
    step = latest(root)
    worker.start()  # the node comes back (the next run's trainer rank waits for it); that run resumes
    cfg2 = write_config(tmp_path / "run2.yaml", tiny_policy, f"file://{tmp_path}/runs", "twonode",
                        num_iterations=step + 1, **layout)
    rc, out = run_train(cfg2, env, timeout=240)
    assert rc == 0, out[-4000:]
    assert f"iter_{step:06d}: {step} iterations done" in out, out[-4000:]  # resumed from it
    assert latest(root) == step + 1, out[-4000:]
    print(f"two-node run failed ({path}) {failed_after:.1f}s after its trainer node died; resumed from step {step}")
