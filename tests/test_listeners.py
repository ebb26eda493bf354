"""Issue 51, point 1: the sockets a trainer rank listens on stay on the address the run chose.

Two groups are checked, each started through reflow's own code with real torch.distributed (gloo):
  - the weight-update group (`weights.group.open_group`, trainer rank 0 and one engine rank in two
    threads), at 127.0.0.1 and at ::1: its TCPStore and gloo's listeners;
  - then the DeepSpeed group a trainer rank joins (`ds_rank._init_distributed`, one rank): the same.
torch's TCPStore server listens on `::` (every interface) whatever host it is given, and takes no
credentials. gloo's own listener takes the address the machine's hostname resolves to, so the second
test runs in private namespaces (`unshare`) where the hostname resolves to a veth address (nothing
else in that namespace, so nothing leaves it). Each run is a subprocess: a default process group
cannot be undone in the test process. Traffic goes to loopback only.
"""
from __future__ import annotations

import ipaddress
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Runs in a subprocess: starts both groups, prints what this process listens on, as JSON.
_SCRIPT = r"""
import json, socket, sys, threading
import psutil, torch
import torch.distributed as dist

def listening():
    return sorted({(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="inet")
                   if c.status == psutil.CONN_LISTEN})

def free_port(host):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]

out = {"before": listening()}
from reflow.engines.train.ds_rank import _init_distributed
from reflow.engines.weights.group import broadcast, open_group

groups = []  # kept alive: a group's listeners go with it
for host in sys.argv[1:]:
    port, sent = free_port(host), torch.arange(4.0)
    def trainer():
        g = open_group(host, port, 0, 2, "wug", "gloo", timeout_s=60)
        groups.append(g)
        broadcast(g, sent)
    th = threading.Thread(target=trainer)
    th.start()
    engine = open_group(host, port, 1, 2, "wug", "gloo", timeout_s=60)
    groups.append(engine)
    t = torch.zeros(4)
    broadcast(engine, t)
    th.join(60)
    assert torch.equal(t, sent)
    out["wg " + host] = {"address": host, "port": port, "listening": listening()}

# After the weight-update groups: _init_distributed sets GLOO_SOCKET_IFNAME for the rest of the process.
port = free_port("127.0.0.1")
_init_distributed(0, 1, "127.0.0.1", port, "gloo")
t = torch.ones(2)
dist.all_reduce(t)
assert t.tolist() == [1.0, 1.0]
out["ds"] = {"address": "127.0.0.1", "port": port, "listening": listening()}
dist.destroy_process_group()
print("LISTENERS " + json.dumps(out))
"""


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


HOSTS = ["127.0.0.1"] + (["::1"] if _has_ipv6_loopback() else [])


def _run(prefix: list[str], hosts: list[str]) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("GLOO_SOCKET_IFNAME", None)  # gloo's default device, as a run gets it
    proc = subprocess.run([*prefix, sys.executable, "-c", _SCRIPT, *hosts], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("LISTENERS ")]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1].removeprefix("LISTENERS "))


def _check(out: dict) -> None:
    assert out["before"] == [], out["before"]
    everything = set()
    for name, run in out.items():
        if name == "before":
            continue
        on_port = sorted(ip for ip, port in run["listening"] if port == run["port"])
        # the store listens at the chosen address, and only there
        assert on_port == [run["address"]], f"{name}: the TCPStore's port {run['port']} listens on {on_port}"
        everything |= {tuple(x) for x in run["listening"]}
    off = sorted((ip, port) for ip, port in everything if not ipaddress.ip_address(ip).is_loopback)
    assert not off, f"listening off loopback: {off} (all: {sorted(everything)})"


@pytest.mark.slow  # ~6 s of CPU in a child process: make test-fast stays under a minute
def test_group_stores_listen_on_the_chosen_address():
    _check(_run([], HOSTS))


@pytest.mark.slow  # ~5 s of CPU in namespaced children: make test-fast stays under a minute
def test_gloo_stays_on_loopback_where_the_hostname_resolves_elsewhere(tmp_path):
    """In new net/UTS/mount namespaces: the hostname resolves (through a bind-mounted /etc/hosts) to the
    address of a veth end that exists only there, as a host's own name resolves to its LAN address."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs root, unshare and ip (private namespaces)")
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n::1 localhost\n10.201.7.1 reflow-listeners-test\n")
    setup = ("set -e; ip link set lo up; ip link add rl0 type veth peer name rl1; "
             "ip addr add 10.201.7.1/24 dev rl0; ip link set rl0 up; ip link set rl1 up; "
             f"mount --bind {hosts} /etc/hosts; hostname reflow-listeners-test; exec \"$@\"")
    prefix = ["unshare", "--net", "--uts", "--mount", "sh", "-c", setup, "sh"]
    probe = subprocess.run([*prefix, "getent", "hosts", "reflow-listeners-test"], capture_output=True, text=True)
    if probe.returncode != 0 or "10.201.7.1" not in probe.stdout:
        pytest.skip(f"cannot make private namespaces here: {probe.stderr.strip()[-300:]}")
    _check(_run(prefix, HOSTS))
