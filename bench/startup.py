"""A `reflow train` command's start-up, this tree against another, as a user meets it: no PREFECT_API_URL (the
command starts Prefect's temporary server) and no RAY_ADDRESS (it starts a local Ray cluster).

    .venv/bin/python bench/startup.py --baseline /tmp/base        # /tmp/base: git archive <commit> | tar -x -C
    .venv/bin/python bench/startup.py --rounds 3 --config configs/demo.yaml

Each child runs `python -m reflow.flows.cli train --verbose -c CONFIG num_iterations=1 eval.before_train=false`
(the demo's tiny policy by default) with its own storage, and this script stamps its output lines: `first` is
the seconds from launch until the first iteration's record ("iteration 0: reward ...") is printed, `total` the
whole command. The trees run in ABBA rounds (this VM's speed drifts within minutes) after one warm-up run of
each (Prefect's database and Python's bytecode caches then exist for both, as on a machine used before).
`cpu` is the CPU seconds (user + system) of every process the command started, Ray's daemons, workers and actors
included, whatever session they moved to: this script makes itself their subreaper (prctl PR_SET_CHILD_SUBREAPER, so
orphans are reparented here), reaps every one after the command ends and reads its children's rusage. On 2 cores the
test suite is CPU-bound, so this is what each `reflow train` subprocess of it costs.
Ends with `startup: first_ratio=<this/baseline> total_ratio=<this/baseline> cpu_ratio=<this/baseline>` (below 1: this
tree starts sooner / spends less CPU).
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from _trees import importable  # noqa: E402

FIRST_ITERATION = "iteration 0: reward "


PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphaned descendants (Ray's daemons and workers outlive their parents) are reparented to this process, so their
    CPU can be counted. False where the kernel refuses (not Linux)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap_all(timeout_s: float = 60.0) -> int:
    """Wait for every remaining descendant (reparented here); after `timeout_s` the rest are killed. Returns how many
    were killed."""
    deadline, killed = time.monotonic() + timeout_s, 0
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return killed
        if pid:
            continue
        if time.monotonic() > deadline:
            for child in psutil.Process().children():
                with contextlib.suppress(psutil.Error):
                    child.kill()
                    killed += 1
            deadline = time.monotonic() + 10
        time.sleep(0.1)


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_once(config: str, work: Path, tag: str, n: int, code: str | None, iterations: int = 1) -> dict[str, float]:
    """One `reflow train` child; seconds from launch to its first iteration's record and to its end."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PREFECT_API_URL")}
    env.update(C.BENCH_ENV, PREFECT_HOME=str(work / f"prefect-{tag}"), PYTHONUNBUFFERED="1")
    if code:  # the baseline's `reflow` package first, for the command and its Ray workers
        env["PYTHONPATH"] = code
    model = Path(yaml.safe_load((C.ROOT / config).read_text())["model"]["path"])  # relative to the checkout
    cmd = [sys.executable, "-m", "reflow.flows.cli", "train", "--verbose", "-c", str(C.ROOT / config),
           f"num_iterations={iterations}",
           "eval.before_train=false", f"experiment=startup-{tag}-{n}", f"storage.root=file://{work}/runs-{tag}",
           f"model.path={model if model.is_absolute() else C.ROOT / model}"]
    cpu0 = children_cpu()
    t0 = time.perf_counter()
    first = None
    log = work / f"{tag}-{n}.log"
    with open(log, "w") as out:
        # Not from the checkout: `-m` puts the working folder first on sys.path, and the checkout's reflow/
        # folder would then be the package for both trees.
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:  # type: ignore[union-attr]
            out.write(f"[{time.perf_counter() - t0:7.2f}] {line}")
            if first is None and FIRST_ITERATION in line:
                first = time.perf_counter() - t0
        proc.wait()
    total = time.perf_counter() - t0
    killed = reap_all()
    cpu = children_cpu() - cpu0
    if proc.returncode != 0 or first is None:
        raise SystemExit(f"startup: {tag} run {n} failed (exit {proc.returncode}); its output is in {log}")
    if killed:
        print(f"startup: {tag} run {n} left {killed} process(es) running 60 s after it ended: killed", flush=True)
    return {"first": first, "total": total, "cpu": cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="a folder holding another commit's tree (git archive ... | tar -x)")
    p.add_argument("--config", default="configs/demo.yaml", help="the run's config (its model must exist: "
                   "`reflow bootstrap` writes the demo's)")
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds after the warm-up runs")
    p.add_argument("--iterations", type=int, default=1, help="num_iterations of each run (more: the task workers a "
                   "run starts after its first iteration count in `cpu` too)")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    a = p.parse_args()
    C.set_bench_env()
    C.header("reflow train start-up: this tree against --baseline")
    if not become_subreaper():
        print("startup: could not become the subreaper of the runs' processes: cpu counts only those reaped by "
              "their own parents", flush=True)
    work = Path(tempfile.mkdtemp(prefix="reflow-startup-"))
    code = {"this": None, "baseline": str(importable(Path(a.baseline).resolve()))}
    for tag in code:  # warm-up, not counted
        run_once(a.config, work, tag, 0, code[tag], a.iterations)
    times: dict[str, list[dict]] = {"this": [], "baseline": []}
    for r in range(a.rounds):
        order = ("baseline", "this") if r % 2 == 0 else ("this", "baseline")
        for tag in order + order[::-1]:
            times[tag].append(run_once(a.config, work, tag, len(times[tag]) + 1, code[tag], a.iterations))
    keys = ("first", "total", "cpu")
    med = {tag: {k: statistics.median(t[k] for t in runs) for k in keys} for tag, runs in times.items()}
    print(f"{'tree':10s} {'runs':>4s} {'first s (median)':>17s} {'total s (median)':>17s} {'cpu s (median)':>15s}"
          f"  first / cpu, each run")
    for tag, runs in times.items():
        print(f"{tag:10s} {len(runs):4d} {med[tag]['first']:17.2f} {med[tag]['total']:17.2f} {med[tag]['cpu']:15.1f}  "
              + " ".join(f"{t['first']:.1f}/{t['cpu']:.0f}" for t in runs))
    ratios = {k: med["this"][k] / med["baseline"][k] for k in keys}
    print(f"startup: first_ratio={ratios['first']:.2f} total_ratio={ratios['total']:.2f} cpu_ratio={ratios['cpu']:.2f} "
          f"(logs in {work})")
    if a.out:
        Path(a.out).write_text(json.dumps({"commit": C.git_commit(), "machine": C.machine(), "baseline": a.baseline,
                                           "config": a.config, "iterations": a.iterations, "runs": times, "median": med, "ratios": ratios},
                                          indent=2))


if __name__ == "__main__":
    main()
