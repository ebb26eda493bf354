"""Learning per wall-clock second: the demo policy trained by the real `train` flow for a fixed budget
of training seconds under several settings (prompts per iteration, samples per prompt, optimizer
steps per iteration, learning rate), on several seeds; held-out accuracy against seconds.

    .venv/bin/python bench/learning_speed.py                      # every setting x 3 seeds x 300 s: ~100 min
    .venv/bin/python bench/learning_speed.py --budget 30 --settings p4-lr1e-4,p32-lr1e-4 --seeds 1

Each (setting, seed) runs `reflow.flows.train.train` with configs/demo.yaml in a child process of
its own (fresh Ray and Prefect), starting from the warmed-up demo policy of that seed (the one
`reflow demo --seed N` uses; built once). Seconds count training only: from the first iteration's
start, less the evals, which this script runs itself (the product's `launch_eval` + `collect`: greedy
accuracy on the 200 held-out problems) before training and every `--eval-every` seconds of training;
the first iteration to start after the budget is spent evaluates the last policy and stops the run.
The best setting is the one with the highest mean accuracy at the budget over the seeds.
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

DEMO_YAML = C.ROOT / "configs" / "demo.yaml"
# name -> overrides of configs/demo.yaml (its defaults: 32 prompts x 8 samples, 1 step, lr 1e-4)
SETTINGS = {
    "p32-lr1e-4": [],
    "p16-lr1e-4": ["rollout.prompts_per_iteration=16"],
    "p8-lr1e-4": ["rollout.prompts_per_iteration=8"],
    "p4-lr1e-4": ["rollout.prompts_per_iteration=4"],
    "p8-s4-lr1e-4": ["rollout.prompts_per_iteration=8", "rollout.n_samples_per_prompt=4"],
    "p32-mb4-lr1e-4": ["trainer.minibatches_per_iteration=4", "trainer.micro_batch_size=64"],
    "p8-lr2e-4": ["rollout.prompts_per_iteration=8", "trainer.lr=2e-4"],
}


class BudgetSpent(Exception):
    """Raised into the train flow at the first iteration after the budget: the run stops there."""


def run_one(args) -> dict:
    """Child process: one setting, one seed. Returns [(training seconds, policy version, accuracy), ...]."""
    import ray

    import reflow.flows.train as ft
    from reflow.flows.cli import _demo_policy
    from reflow.infra.config import load_config
    from reflow.tasks.evaluate import collect, launch_eval

    base = load_config(str(DEMO_YAML), [])
    policy = _demo_policy(args.seed, base.data.digits, str(C.ROOT / base.model.path))
    work = Path(tempfile.mkdtemp(prefix="reflow-learning-"))
    cfg = load_config(str(DEMO_YAML), SETTINGS[args.setting] + [
        f"model.path={policy}", f"seed={args.seed}", f"data.seed={args.seed}", "num_iterations=100000",
        f"experiment=ls-{args.setting}-s{args.seed}-{os.getpid()}", f"storage.root=file://{work}/runs",
        "eval.before_train=false", "eval.interval=null", "checkpoint.save_every_minutes=null", "resume=never"])
    points: list[tuple[float, int, float]] = []
    clock = {"start": None, "eval": 0.0, "version": 0}

    def trained() -> float:
        return 0.0 if clock["start"] is None else time.perf_counter() - clock["start"] - clock["eval"]

    def evaluate(config, version: int) -> None:
        t0 = time.perf_counter()
        summary = collect(config, [launch_eval(config, version)], wait=True)[version]
        clock["eval"] += time.perf_counter() - t0
        points.append((trained(), version, float(next(iter(summary.values()))["pass@1"])))

    inner = ft.run_iteration

    def run_iteration(config, i: int):
        if clock["start"] is None:  # the policy before training, then the clock starts
            evaluate(config, i)
            clock["start"], clock["eval"] = time.perf_counter(), 0.0
        if trained() >= args.budget:
            if points[-1][1] != i:
                evaluate(config, i)
            raise BudgetSpent(f"{args.budget} s of training spent after {i} iterations")
        m = inner(config, i)
        if trained() - points[-1][0] >= args.eval_every:
            evaluate(config, i + 1)
        return m

    ft.run_iteration = run_iteration  # the flow looks the name up at call time
    try:
        ft.train(cfg, release_cluster=True)
    except BudgetSpent:
        pass  # deliberate: how this script ends a run at its budget
    ray.shutdown()
    return {"points": points}


def _child(args, setting: str, seed: int, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--part", "one", "--setting", setting, "--seed", str(seed), "--json", str(out),
           "--budget", str(args.budget), "--eval-every", str(args.eval_every)]
    env = {**os.environ, **C.BENCH_ENV, "PREFECT_HOME": str(out.parent / f"prefect-{out.stem}"),
           "PREFECT_LOGGING_LEVEL": "WARNING"}
    log = out.with_suffix(".log")
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=C.ROOT).returncode
    if rc != 0 or not out.is_file():
        sys.stdout.write(log.read_text()[-4000:])
        raise SystemExit(f"{setting} seed {seed} failed (exit {rc}); log above and in {log}")
    return json.loads(out.read_text())


def _at(points: list[list[float]], seconds: float) -> float:
    """Accuracy of the last eval at or before `seconds` of training."""
    return [acc for t, _, acc in points if t <= seconds + 1e-9][-1]


def _report(results: dict[str, list[dict]], budget: float, every: float) -> tuple[str, float]:
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
    return str(best["setting"]), float(best["final"])  # type: ignore[arg-type]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=float, default=300.0, help="seconds of training per run (default %(default)s)")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma list of: " + ", ".join(SETTINGS))
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per setting (default %(default)s)")
    p.add_argument("--eval-every", type=float, default=30.0, help="seconds of training between evals")
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
    work = Path(tempfile.mkdtemp(prefix="reflow-bench-learning-"))
    results: dict[str, list[dict]] = {}
    for name in args.settings.split(","):
        for seed in range(args.seeds):
            t0 = time.perf_counter()
            res = _child(args, name, seed, work / f"{name}-s{seed}.json")
            results.setdefault(name, []).append(res)
            print(f"{name} seed {seed}: {len(res['points'])} evals, last {res['points'][-1]} "
                  f"({time.perf_counter() - t0:.0f} s with start-up and evals)", flush=True)
    best, acc = _report(results, args.budget, args.eval_every)
    print(f"\nlearning_speed: best={best} accuracy={acc:.3f}")


if __name__ == "__main__":
    main()
