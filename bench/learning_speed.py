"""Learning per wall-clock second: the demo policy trained by the real `train` flow for a fixed budget
of training seconds under several settings (prompts per iteration, samples per prompt, optimizer
steps per iteration, learning rate), on several seeds; held-out accuracy against seconds.

    .venv/bin/python bench/learning_speed.py                      # every setting x 3 seeds x 300 s: ~2 h
    .venv/bin/python bench/learning_speed.py --budget 30 --settings p4-lr1e-4,p32-lr1e-4 --seeds 1
    # a 16-core machine standing in for eight 2-core ones: runs at once, each on 2 cores of its own
    python3 bench/learning_speed.py --seed-list 0 --parallel 7 --override cluster.num_cpus=4 --save DIR
    python3 bench/learning_speed.py --merge DIR1,DIR2,DIR3 --results-json bench/results/learning_speed.json

Each (setting, seed) runs `reflow.flows.train.train` with configs/demo.yaml in a child process of
its own (fresh Ray and Prefect), starting from the warmed-up demo policy of that seed (the one
`reflow demo --seed N` uses; built once). Seconds count training only: from the first iteration's
start, less the evals, which this script runs itself (the product's `launch_eval` + `collect`: greedy
accuracy on the 200 held-out problems) before training and after the iteration that passes each
multiple of `--eval-every` seconds of training (the table's "t s" column: that eval); the first
iteration to start after the budget is spent evaluates the last policy if not yet done and stops the run.
The best setting is the one with the highest mean accuracy at the budget over the seeds.
With --parallel N, N runs go at once, each pinned (sched_setaffinity, inherited by its Ray workers and
Prefect server) to --cores-per-run cores of its own: only honest where the machine has that many idle
cores; --override cluster.num_cpus=4 then gives each run's Ray the logical CPUs a 2-core machine gets.
It ends with `learning_speed: best=<setting> accuracy=<mean>`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

DEMO_YAML = C.ROOT / "configs" / "demo.yaml"
# name -> overrides of configs/demo.yaml (32 prompts x 8 samples, lr 1e-4); each names its optimizer steps per
# iteration, so that a change of the demo's default (4 since 2026-12-01) does not change what a setting means.
ONE_STEP = ["trainer.minibatches_per_iteration=1", "trainer.micro_batch_size=256"]
SETTINGS = {
    "p32-lr1e-4": ONE_STEP + ["rollout.prompts_per_iteration=32"],
    "p16-lr1e-4": ONE_STEP + ["rollout.prompts_per_iteration=16"],
    "p8-lr1e-4": ONE_STEP + ["rollout.prompts_per_iteration=8"],
    "p4-lr1e-4": ONE_STEP + ["rollout.prompts_per_iteration=4"],
    "p8-s4-lr1e-4": ONE_STEP + ["rollout.prompts_per_iteration=8", "rollout.n_samples_per_prompt=4"],
    "p32-mb4-lr1e-4": ["rollout.prompts_per_iteration=32", "trainer.minibatches_per_iteration=4",
                       "trainer.micro_batch_size=64"],
    "p8-lr2e-4": ONE_STEP + ["rollout.prompts_per_iteration=8", "trainer.lr=2e-4"],
}


class BudgetSpent(Exception):
    """Raised into the train flow at the first iteration after the budget: the run stops there."""


def _flow_module_calling(name: str, ft):
    """The flows module whose loop looks `name` up at call time: flows/session.py, or in older trees
    flows/recovery.py or flows/train.py."""
    import importlib

    for mod in ("reflow.flows.session", "reflow.flows.recovery"):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        if hasattr(m, name):
            return m
    return ft


def run_one(args) -> dict:
    """Child process: one setting, one seed. Returns [(training seconds, policy version, accuracy), ...]."""
    import ray

    import reflow.flows.train as ft
    from reflow.flows.cli import _demo_policy
    from reflow.infra.config.schema import load_config
    from reflow.tasks.evaluate import collect, launch_eval

    base = load_config(str(DEMO_YAML), [])
    policy = _demo_policy(args.seed, base.data.digits, str(C.ROOT / base.model.path))
    work = Path(tempfile.mkdtemp(prefix="reflow-learning-"))
    cfg = load_config(str(DEMO_YAML), SETTINGS[args.setting] + [
        f"model.path={policy}", f"seed={args.seed}", f"data.seed={args.seed}", "num_iterations=100000",
        f"experiment=ls-{args.setting}-s{args.seed}-{os.getpid()}", f"storage.root=file://{work}/runs",
        "eval.before_train=false", "eval.interval=null", "checkpoint.save_every_minutes=null", "resume=never",
        *args.override])
    points: list[tuple[float, int, float]] = []
    clock = {"start": None, "eval": 0.0, "next": args.eval_every}

    def trained() -> float:
        return 0.0 if clock["start"] is None else time.perf_counter() - clock["start"] - clock["eval"]

    def evaluate(config, version: int) -> None:
        t0 = time.perf_counter()
        summary = collect(config, [launch_eval(config, version)], wait=True)[version]
        clock["eval"] += time.perf_counter() - t0
        points.append((trained(), version, float(next(iter(summary.values()))["pass@1"])))

    hooked = _flow_module_calling("run_iteration", ft)  # where the flow looks the name up
    inner = hooked.run_iteration

    def run_iteration(config, i: int):
        if clock["start"] is None:  # the policy before training, then the clock starts
            evaluate(config, i)
            clock["start"], clock["eval"] = time.perf_counter(), 0.0
        if trained() >= args.budget:
            if points[-1][1] != i:
                evaluate(config, i)
            raise BudgetSpent(f"{args.budget} s of training spent after {i} iterations")
        m = inner(config, i)
        if trained() >= clock["next"]:  # the policy just past the next mark (fixed marks: no drift)
            evaluate(config, i + 1)
            while clock["next"] <= trained():
                clock["next"] += args.eval_every
        return m

    hooked.run_iteration = run_iteration  # looked up at call time
    try:
        ft.train(cfg, release_cluster=True)
    except BudgetSpent:
        pass  # deliberate: how this script ends a run at its budget
    ray.shutdown()
    return {"setting": args.setting, "seed": args.seed, "points": points, "overrides": args.override,
            "cores": sorted(os.sched_getaffinity(0))}


def _child(args, setting: str, seed: int, out: Path, cores: list[int] | None) -> dict:
    cmd = [sys.executable, __file__, "--part", "one", "--setting", setting, "--seed", str(seed), "--json", str(out),
           "--budget", str(args.budget), "--eval-every", str(args.eval_every)]
    cmd += [f"--override={o}" for o in args.override]
    env = {**os.environ, **C.BENCH_ENV, "PREFECT_HOME": str(out.parent / f"prefect-{out.stem}"),
           "PREFECT_LOGGING_LEVEL": "WARNING"}
    log = out.with_suffix(".log")
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=C.ROOT, preexec_fn=pin).returncode
    if rc != 0 or not out.is_file():
        sys.stdout.write(log.read_text()[-4000:])
        raise SystemExit(f"{setting} seed {seed} failed (exit {rc}); log above and in {log}")
    res = json.loads(out.read_text())
    print(f"{setting} seed {seed}: {len(res['points'])} evals, last {res['points'][-1]} "
          f"({time.perf_counter() - t0:.0f} s with start-up and evals, cores {cores or 'all'}, "
          f"load {os.getloadavg()[0]:.1f})", flush=True)
    return res


def _run_all(args, runs: list[tuple[str, int]], out: Path) -> list[dict]:
    """Every (setting, seed), --parallel at a time, each on cores of its own."""
    from reflow.flows.cli import _demo_policy
    from reflow.infra.config.schema import load_config

    base = load_config(str(DEMO_YAML), [])
    for seed in sorted({s for _, s in runs}):  # built once per seed, before runs that would race to build it
        _demo_policy(seed, base.data.digits, str(C.ROOT / base.model.path))
    n, k = args.parallel, args.cores_per_run
    if n > 1 and args.first_core + n * k > len(os.sched_getaffinity(0)):
        raise SystemExit(f"--parallel {n} x --cores-per-run {k} from core {args.first_core}: this machine has "
                         f"{len(os.sched_getaffinity(0))} cores")
    free = [list(range(args.first_core + i * k, args.first_core + (i + 1) * k)) for i in range(n)] if n > 1 else [None]
    lock = threading.Lock()

    def one(run: tuple[str, int]) -> dict:
        with lock:
            cores = free.pop()
        try:
            return _child(args, run[0], run[1], out / f"{run[0]}-s{run[1]}.json", cores)
        finally:
            with lock:
                free.append(cores)

    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(one, runs))


def _at(points: list[list[float]], seconds: float) -> float:
    """Accuracy after `seconds` of training: the first eval at or past them (taken after the iteration
    that crossed them), else the last one."""
    return next((acc for t, _, acc in points if t >= seconds - 1e-9), points[-1][2])


def _report(results: dict[str, list[dict]], budget: float, every: float) -> tuple[str, float, list[dict]]:
    grid = [0.0] + [t for t in (every * k for k in range(1, int(budget // every) + 1)) if t < budget]
    print(f"\n## held-out greedy accuracy (mean over seeds) after t seconds of training; budget {budget:.0f} s")
    rows = []
    for name, runs in results.items():
        row: dict[str, object] = {"setting": name}
        for t in grid:
            row[f"{t:.0f}"] = statistics.mean(_at(r["points"], t) for r in runs)
        finals = [r["points"][-1][2] for r in runs]
        row |= {"final": statistics.mean(finals), "sd": statistics.pstdev(finals),
                "iters": statistics.mean(r["points"][-1][1] for r in runs)}
        rows.append(row)
    cols = [("setting", "setting", "")] + [(f"{t:.0f}", f"{t:.0f}s", ".3f") for t in grid]
    print(C.table(rows, cols + [("final", f"{budget:.0f}s", ".3f"), ("sd", "sd", ".3f"), ("iters", "iterations", ".0f")]))
    best = max(rows, key=lambda r: float(r["final"]))  # type: ignore[arg-type]
    return str(best["setting"]), float(best["final"]), rows  # type: ignore[arg-type]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=float, default=300.0, help="seconds of training per run (default %(default)s)")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma list of: " + ", ".join(SETTINGS))
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per setting (default %(default)s)")
    p.add_argument("--eval-every", type=float, default=30.0, help="seconds of training between evals")
    p.add_argument("--seed-list", default=None, help="comma list of seeds instead of 0..N-1 (e.g. one seed per call)")
    p.add_argument("--parallel", type=int, default=1, help="runs at once, each pinned to cores of its own")
    p.add_argument("--cores-per-run", type=int, default=2, help="cores of each run with --parallel (default 2)")
    p.add_argument("--first-core", type=int, default=0, help="the first core --parallel hands out")
    p.add_argument("--override", action="append", default=[], help="a config override for every run (repeatable)")
    p.add_argument("--save", default=None, help="folder that keeps each run's <setting>-s<seed>.json and log")
    p.add_argument("--merge", default=None, help="comma list of --save folders: report their runs, run nothing")
    p.add_argument("--results-json", default=None, help="write the table and every run's evals to this file")
    p.add_argument("--note", default="", help="where and how the runs were measured, stored in --results-json")
    p.add_argument("--part", choices=["all", "one"], default="all", help=argparse.SUPPRESS)
    p.add_argument("--setting", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    C.set_bench_env()
    if args.part == "one":
        Path(args.json).write_text(json.dumps(run_one(args)))
        return
    C.header("learning speed: held-out accuracy per second of training, demo policy, train flow")
    if args.merge:
        done = [json.loads(f.read_text()) for d in args.merge.split(",") for f in sorted(Path(d).glob("*-s*.json"))]
    else:
        work = Path(args.save or tempfile.mkdtemp(prefix="reflow-bench-learning-"))
        work.mkdir(parents=True, exist_ok=True)
        seeds = [int(s) for s in args.seed_list.split(",")] if args.seed_list else list(range(args.seeds))
        print(f"# load at start {os.getloadavg()[0]:.1f}; {args.parallel} at once; overrides {args.override}", flush=True)
        done = _run_all(args, [(name, seed) for seed in seeds for name in args.settings.split(",")], work)
    results: dict[str, list[dict]] = {}
    for name in [n for n in SETTINGS if any(r["setting"] == n for r in done)]:
        results[name] = sorted((r for r in done if r["setting"] == name), key=lambda r: r["seed"])
    best, acc, rows = _report(results, args.budget, args.eval_every)
    if args.results_json:
        Path(args.results_json).write_text(json.dumps({
            "note": args.note, "budget_s": args.budget, "eval_every_s": args.eval_every,
            "settings": {n: SETTINGS[n] for n in results},
            "table": rows, "best": best, "accuracy": acc,
            "runs": [{k: r.get(k) for k in ("setting", "seed", "points", "overrides", "cores")} for r in done]},
            indent=1) + "\n")
    print(f"\nlearning_speed: best={best} accuracy={acc:.3f}")


if __name__ == "__main__":
    main()
