"""CPU a local cluster spends starting its workers: the workers' environment as a job `runtime_env` (env_vars only)
against inherited from the driver's environment while ray.init starts the cluster (ray_connect.inherited_by_workers,
what a run's own cluster does now).

    .venv/bin/python bench/worker_env.py [--workers 8] [--rounds 3]

Each case runs in a fresh child process (a fresh cluster; cases alternate A B A B ...): ray.init with reflow's worker
pool settings, `--workers` actors that each answer one call, then the CPU time of every process of that cluster
(driver, Ray's daemons, the workers; read from /proc before the shutdown). A runtime_env, even of env_vars only,
makes the raylet start every worker through ray/_private/workers/setup_worker.py, which imports Ray's runtime-env
code before it execs the real worker. Prints one line per run and
`worker_env: cpu_s_runtime_env=<a> cpu_s_inherited=<b> saved_per_worker_s=<(a-b)/workers> ratio=<b/a>` (medians)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, os, sys, time
import ray
from reflow.infra.cluster.ray_connect import inherited_by_workers, worker_env
from reflow.infra.cluster.ray_head import private_temp_dir, worker_pool_config

mode, n = sys.argv[1], int(sys.argv[2])
hz = os.sysconf("SC_CLK_TCK")

def tree_cpu() -> float:
    # every process of this session (the child runs in a session of its own): driver, daemons, workers
    sid, total = os.getsid(0), 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if os.getsid(int(d)) != sid:
                continue
            st = open(f"/proc/{d}/stat").read()
        except (OSError, ProcessLookupError):
            continue
        f = st[st.rindex(")") + 2:].split()
        total += int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])  # own and reaped children's user+system
    return total / hz

kw = dict(num_cpus=n, include_dashboard=False, _temp_dir=str(private_temp_dir()), log_to_driver=False,
          _system_config=worker_pool_config(n))
t0 = time.perf_counter()
if mode == "runtime_env":
    ray.init(runtime_env={"env_vars": worker_env()}, **kw)
else:
    with inherited_by_workers(worker_env()):
        ray.init(**kw)

@ray.remote(num_cpus=1)
class Echo:
    def env(self, key):
        return os.environ.get(key)

actors = [Echo.remote() for _ in range(n)]
seen = ray.get([a.env.remote("HF_HUB_DISABLE_PROGRESS_BARS") for a in actors])
wall = time.perf_counter() - t0
time.sleep(1.0)  # the workers' start-up is over; what follows is idle ticking of both alike
print("RESULT", json.dumps({"cpu_s": tree_cpu(), "wall_s": wall, "seen": sorted(set(map(str, seen)))}), flush=True)
ray.shutdown()
"""


def run(mode: str, workers: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    p = subprocess.run([sys.executable, "-c", CHILD, mode, str(workers)], env=env, capture_output=True, text=True,
                       timeout=300, start_new_session=True)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{mode}: no result\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    out = json.loads(line.removeprefix("RESULT "))
    if out["seen"] != ["1"]:
        raise SystemExit(f"{mode}: the workers did not get the worker environment: {out['seen']}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=8, help="actors started per cluster (each in a worker of its own)")
    ap.add_argument("--rounds", type=int, default=3, help="A/B pairs, alternating")
    a = ap.parse_args()
    got: dict[str, list[float]] = {"runtime_env": [], "inherited": []}
    for r in range(a.rounds):
        for mode in ("runtime_env", "inherited") if r % 2 == 0 else ("inherited", "runtime_env"):
            t0 = time.perf_counter()
            res = run(mode, a.workers)
            got[mode].append(res["cpu_s"])
            print(f"round {r} {mode:12s} cpu {res['cpu_s']:6.2f} s  ray.init..all answered {res['wall_s']:5.2f} s  "
                  f"(child {time.perf_counter() - t0:5.1f} s)", flush=True)
    a_s, b_s = statistics.median(got["runtime_env"]), statistics.median(got["inherited"])
    print(f"worker_env: cpu_s_runtime_env={a_s:.2f} cpu_s_inherited={b_s:.2f} "
          f"saved_per_worker_s={(a_s - b_s) / a.workers:.3f} ratio={b_s / a_s:.3f}")


if __name__ == "__main__":
    main()
