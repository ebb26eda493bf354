"""Engines and trainer ranks on different Ray nodes (issue 23; docs/scale-out.md).

The slow test builds a two-node cluster from two hosts of its own: two network namespaces joined by a
veth pair (`reflow-test-<pid>-<tag>-a` and `-b`, addresses .1 and .2 of a private 10.x.y.0/24 that no
route of this machine covers), so its nodes have non-loopback addresses (`ray start --address` refuses a
node on loopback) while every packet stays inside what the test made (tests may talk to loopback or to
namespaces they create, never to this machine's own address). Host A runs the head (`reflow cluster up
--host <A> --resources '{"reflow_engine_node": 1}'`, token auth), a Prefect server on A's own loopback and
the `reflow` commands; host B a second `ray start --address` offering `reflow_trainer_node`. It needs root
(`ip netns add`) and is skipped, saying why, where namespaces cannot be made. The quick tests check the
pieces without Ray.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reflow.engines.ray_nodes import label, offering, unplaced_message
from reflow.infra.cluster import ray_head
from reflow.infra.cluster.placement import bundles, layout_problem
from reflow.infra.config.schema import ConfigError, load_config
from tests.ckpt_fixtures import REFLOW, REPO, reap, write_config

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


# ---------------------------------------------------------------- slow: a two-node cluster in namespaces of its own


IFACE = "reflow0"  # both ends of the veth pair carry this name, each in its own namespace
PREFECT_PORT = 4200  # in namespace A's own loopback, so no other server can hold it


def ip_cmd(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def private_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.100.0.0-10.199.255.0 that no route or address of this machine's own namespace covers
    (picked by pid, so parallel runs differ): the test's addresses never name anything outside it."""
    routes = json.loads(ip_cmd("-4", "-j", "route", "show", "table", "all").stdout or "[]")
    taken = [ipaddress.ip_network(r["dst"], strict=False) for r in routes if r.get("dst", "default") != "default"]
    start = os.getpid() % 25000
    for i in range(25000):
        k = (start + i) % 25000
        net = ipaddress.ip_network(f"10.{100 + k // 250}.{k % 250}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise AssertionError("no /24 in 10.100.0.0-10.199.249.0 is free of this machine's routes")


class TwoHosts:
    """Two network namespaces joined by one veth pair: host A (`<name>-a`, `.ip_a`) and host B (`<name>-b`,
    `.ip_b`). Each has its loopback and the veth end, no other interface and no default route, so a process
    started in them (`ip netns exec`) reaches the other host and its own loopback, nothing else. The
    filesystem and process table are shared (file:// storage, a token file, killing by PID work as usual)."""

    def __init__(self) -> None:
        tag = f"{os.getpid()}-{secrets.token_hex(2)}"  # unique per test run
        self.a, self.b = f"reflow-test-{tag}-a", f"reflow-test-{tag}-b"
        net = private_subnet()
        self.ip_a, self.ip_b, self.prefix = str(net[1]), str(net[2]), net.prefixlen
        self.made: list[str] = []

    def create(self) -> TwoHosts:
        for ns in (self.a, self.b):
            ip_cmd("netns", "add", ns)
            self.made.append(ns)
        ip_cmd("link", "add", IFACE, "netns", self.a, "type", "veth", "peer", "name", IFACE, "netns", self.b)
        for ns, addr in ((self.a, self.ip_a), (self.b, self.ip_b)):
            ip_cmd("-n", ns, "link", "set", "lo", "up")
            ip_cmd("-n", ns, "addr", "add", f"{addr}/{self.prefix}", "dev", IFACE)
            ip_cmd("-n", ns, "link", "set", IFACE, "up")
        return self

    @staticmethod
    def run_in(ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    @staticmethod
    def kill_all(ns: str) -> None:
        """SIGKILL every process in `ns`: a machine that vanished."""
        for _ in range(20):  # a dying parent may still start a child: until none is left
            pids = [int(p) for p in ip_cmd("netns", "pids", ns, check=False).stdout.split()]
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    def remove(self) -> None:
        for ns in self.made:
            self.kill_all(ns)
            ip_cmd("netns", "del", ns, check=False)  # takes the veth pair with it
        self.made.clear()


def remove_stale_namespaces() -> None:
    """Namespaces a killed earlier test run (its finally never ran) left behind: its pid is gone."""
    for ns in ip_cmd("netns", "list", check=False).stdout.split():
        if (m := re.fullmatch(r"reflow-test-(\d+)-[0-9a-f]{4}-[ab]", ns)) and not Path(f"/proc/{m[1]}").exists():
            TwoHosts.kill_all(ns)
            ip_cmd("netns", "del", ns, check=False)


@pytest.fixture
def two_hosts():
    """A TwoHosts made for this test and removed afterwards (its processes killed first); skipped where this
    machine cannot make network namespaces (not root, no `ip`, or no permission, e.g. in a container)."""
    if os.geteuid() != 0:
        pytest.skip("the two-node test makes network namespaces of its own (ip netns add): that needs root")
    if shutil.which("ip") is None:
        pytest.skip("the two-node test makes network namespaces with `ip netns` (iproute2), not installed here")
    remove_stale_namespaces()
    hosts = None
    try:
        try:
            hosts = TwoHosts()  # picks the subnet (`ip route`)
            hosts.create()
        except subprocess.CalledProcessError as e:
            pytest.skip(f"cannot make network namespaces here ({' '.join(e.cmd)}: {e.stderr.strip()})")
        yield hosts
    finally:
        if hosts is not None:
            hosts.remove()


# The GCS declares a node dead after health checks fail; Ray's defaults take ~30 s, these ~2 s.
FAST_HEALTH = {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "500",
               "RAY_health_check_timeout_ms": "500", "RAY_health_check_failure_threshold": "3"}


def node_env(hosts: TwoHosts) -> dict[str, str]:
    """This process's environment without Ray's variables (e.g. an earlier test's loopback switch), for Ray
    processes of the two hosts. gloo (the weight-update group) takes the address the hostname resolves to,
    loopback here, which the other host cannot reach: GLOO_SOCKET_IFNAME names the veth end instead."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "REFLOW_FAULT_"))}
    return {**env, "RAY_USAGE_STATS_ENABLED": "0", "GLOO_SOCKET_IFNAME": IFACE}


STARTED = b"Ray runtime started."  # what `ray start` logs once its node has registered with the GCS
NODE_ATTEMPTS = 3


def tail(log: Path, n: int = 3000) -> str:
    return log.read_text(errors="replace")[-n:] if log.is_file() else f"({log} is missing)"


def node_up(log: Path, offset: int, alive, what: str, timeout_s: float = 120) -> bool:
    """Whether `ray start` (logging to `log` from byte `offset`) brought its node up (True) or ended first
    (False, the caller starts it again). Its raylet gives the node's agents 15 s to write their ports (Ray's
    own limit, not a setting) and aborts after; on a loaded 2-core machine their imports took longer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log.is_file() and STARTED in log.read_bytes()[offset:]:
            return True
        if not alive():
            print(f"{what} ended while starting; starting it again: {tail(log, 300)}")
            return False
        time.sleep(0.2)
    raise AssertionError(f"{what}: not up within {timeout_s:.0f}s: {tail(log)}")


def start_head(hosts: TwoHosts, state: Path, env: dict[str, str]) -> ray_head.HeadInfo:
    """`reflow cluster up` on host A, with the engine resource; started again (what it left killed) when its
    node ends while starting."""
    log, what = state / "head.log", f"the head node on {hosts.a}"
    for _ in range(NODE_ATTEMPTS):
        offset = log.stat().st_size if log.is_file() else 0  # `up` appends to its log
        up = in_a(hosts, [REFLOW, "cluster", "up", "--state-dir", str(state), "--host", hosts.ip_a, "--num-cpus", "4",
                          "--resources", json.dumps({ENGINE_RES: 1})], env, timeout=120)
        head = ray_head.read_head(state)
        assert up.returncode == 0 and head is not None, up.stdout + up.stderr
        if node_up(log, offset, lambda: ray_head.read_head(state) is not None, what):
            return head
        hosts.kill_all(hosts.a)
    raise AssertionError(f"{what} ended while starting, {NODE_ATTEMPTS} times: {tail(log)}")


class Worker:
    """The second Ray node, host B: `ray start --address --block` in its own session; `kill` ends every
    process of host B (no goodbye to the GCS). Each start logs to a file of its own (`worker-<n>.log`)."""

    def __init__(self, hosts: TwoHosts, head: ray_head.HeadInfo, logs: Path):
        self.hosts, self.head, self.logs, self.proc, self.starts = hosts, head, logs, None, 0

    @property
    def log(self) -> Path:
        return self.logs / f"worker-{self.starts}.log"

    def start(self) -> Worker:
        self.starts += 1
        env = {**node_env(self.hosts), **{k: v for k, v in self.head.env().items() if k != "RAY_ADDRESS"},
               "RAY_worker_niceness": "0"}  # as docs/scale-out.md starts a worker node
        cmd = [*self.hosts.run_in(self.hosts.b), str(Path(sys.executable).with_name("ray")), "start",
               f"--address={self.head.address}", f"--node-ip-address={self.hosts.ip_b}", "--block",
               "--num-cpus=2", f"--resources={json.dumps({TRAINER_RES: 1})}", "--disable-usage-stats"]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait_started(self) -> Worker:
        """Until the node is up; started again (what it left killed) when it ends while starting."""
        what = f"the worker node on {self.hosts.b}"
        for attempt in range(1, NODE_ATTEMPTS + 1):
            if node_up(self.log, 0, lambda: self.proc is not None and self.proc.poll() is None, what):
                return self
            if attempt < NODE_ATTEMPTS:
                self.kill()
                self.start()
        raise AssertionError(f"{what} ended while starting, {NODE_ATTEMPTS} times: {tail(self.log)}")

    def kill(self) -> None:
        """SIGKILL the node (raylet, agents, the trainer's worker process): a machine that vanished."""
        if self.proc is not None:
            reap(self.proc)
            self.proc = None
        self.hosts.kill_all(self.hosts.b)


def in_a(hosts: TwoHosts, args: list[str], env: dict[str, str], log: Path | None = None, **kw):
    """`args` run on host A: a finished CompletedProcess, or (with `log`) a started Popen in its own
    session writing to `log` (its `.log_path`); end it with `reap`."""
    cmd = [*hosts.run_in(hosts.a), *args]
    if log is None:
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, **kw)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log_path = log
    return proc


def train(hosts: TwoHosts, config: Path, env: dict[str, str]) -> subprocess.Popen:
    """`reflow train` on host A in its own session, as tests.ckpt_fixtures.run_train starts it (output in
    `<config>.log`, `.log_path`); end it with `reap`."""
    return in_a(hosts, [REFLOW, "train", "--verbose", "-c", str(config)], env, log=config.with_suffix(".log"))


def wait_for_prefect(hosts: TwoHosts, server: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until the Prefect server on host A's loopback answers /api/health (asked from host A)."""
    poll = ("import sys, time, urllib.request\n"
            f"deadline = time.monotonic() + {timeout_s}\n"
            "while time.monotonic() < deadline:\n"
            "    try:\n"
            f"        urllib.request.urlopen('http://127.0.0.1:{PREFECT_PORT}/api/health', timeout=2); sys.exit(0)\n"
            "    except OSError:\n"
            "        time.sleep(0.3)\n"
            "sys.exit(1)\n")
    out = in_a(hosts, [sys.executable, "-c", poll], {"PATH": os.environ.get("PATH", "")}, timeout=timeout_s + 30)
    assert out.returncode == 0 and server.poll() is None, \
        f"the Prefect server on host A did not come up: {server.log_path.read_text()[-2000:]}"


@pytest.fixture
def two_nodes(two_hosts, tmp_path):
    """(hosts, head, worker node, env for `reflow` on host A). Host A runs the Ray head (with the engine
    resource), a Prefect server on its own loopback (a driver there cannot reach the session's server) and
    the runs' drivers; host B the worker node (the trainer resource), started but not waited for. Everything
    is SIGKILLed afterwards."""
    hosts = two_hosts
    state = tmp_path / "cluster"
    base = {**node_env(hosts), "PYTHONPATH": str(REPO)}
    prefect_env = {k: v for k, v in base.items() if not k.startswith("PREFECT_")}
    prefect_env.update(PREFECT_HOME=str(tmp_path / "prefect_home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
                       PREFECT_SERVER_UI_API_URL=f"http://127.0.0.1:{PREFECT_PORT}/api")
    server = worker = None
    try:
        # The head first, alone (its agents must start within 15 s: node_up). Its GCS reads FAST_HEALTH from
        # the environment `reflow cluster up` gives it.
        head = start_head(hosts, state, {**base, **FAST_HEALTH})
        server = in_a(hosts, [str(Path(sys.executable).with_name("prefect")), "server", "start", "--host",
                              "127.0.0.1", "--port", str(PREFECT_PORT), "--no-ui", "--no-services", "--analytics-off"],
                      prefect_env, log=tmp_path / "prefect.log")
        worker = Worker(hosts, head, tmp_path).start()  # the test waits for it while its first run starts
        wait_for_prefect(hosts, server)
        env = {**prefect_env, **head.env(), "REFLOW_CLUSTER_DIR": str(state),
               "PREFECT_API_URL": f"http://127.0.0.1:{PREFECT_PORT}/api"}
        yield hosts, head, worker, env
    finally:  # no `reflow cluster down` (a graceful stop, seconds): every process of the hosts is killed
        if worker is not None:
            worker.kill()
        hosts.kill_all(hosts.a)
        if server is not None:
            reap(server)


def status(hosts: TwoHosts, env: dict[str, str]) -> dict:
    out = in_a(hosts, [REFLOW, "cluster", "status", "--json"], env, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def wait_for(what: str, check, timeout_s: float, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := check()) is not None:
            return value
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f}s")


def latest(root: Path) -> int | None:
    f = root / "checkpoints" / "latest"
    return int(f.read_text().strip().rpartition("_")[2]) if f.is_file() else None


@pytest.mark.slow
def test_engines_and_trainers_on_two_nodes_lose_a_node_then_resume(two_nodes, tiny_policy, tmp_path):
    hosts, head, worker, env = two_nodes
    root = tmp_path / "runs" / "twonode"
    layout = {"rollout.node_resources": {ENGINE_RES: 0.01}, "trainer.node_resources": {TRAINER_RES: 0.01},
              "weight_sync.mode": "distributed", "weight_sync.verify": "full", "cluster.bind_host": "0.0.0.0",
              "cluster.placement_timeout_s": 20.0, "fault_tolerance.max_trainer_recoveries": 1}
    cfg = write_config(tmp_path / "run1.yaml", tiny_policy, f"file://{tmp_path}/runs", "twonode", num_iterations=200,
                       **layout)
    run = train(hosts, cfg, env)
    try:
        worker.wait_started()  # while the run starts (its trainer rank waits cluster.placement_timeout_s for it)
        wait_for("a committed checkpoint", lambda: latest(root), 180)
        st = status(hosts, env)  # Ray's node and actor tables, as `reflow cluster status` shows them
        where = {next(iter(n["custom_resources"])): n["node"] for n in st["nodes"] if n["alive"]}
        assert where.keys() == {ENGINE_RES, TRAINER_RES} and where[ENGINE_RES] != where[TRAINER_RES], st["nodes"]
        assert where[ENGINE_RES].endswith(f"@{hosts.ip_a}") and where[TRAINER_RES].endswith(f"@{hosts.ip_b}"), where
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
    worker.start()  # the node comes back while the next run starts; that run resumes
    cfg2 = write_config(tmp_path / "run2.yaml", tiny_policy, f"file://{tmp_path}/runs", "twonode",
                        num_iterations=step + 1, **layout)
    run = train(hosts, cfg2, env)
    try:
        worker.wait_started()
        rc = run.wait(timeout=240)
    finally:
        reap(run)
    out = run.log_path.read_text()
    assert rc == 0, out[-4000:]
    assert f"iter_{step:06d}: {step} iterations done" in out, out[-4000:]  # resumed from it
    assert latest(root) == step + 1, out[-4000:]
    print(f"two-node run failed ({path}) {failed_after:.1f}s after its trainer node died; resumed from step {step}")
