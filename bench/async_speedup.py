"""Asynchronous rollout against the synchronous loop: iterations per hour and held-out accuracy after
the same number of iterations, on the demo task with 2 engines on CPU.

    .venv/bin/python bench/async_speedup.py                          # 40 iterations, seeds 0,1: ~16 min
    .venv/bin/python bench/async_speedup.py --iterations 15 --seeds 0   # a quick look

For each seed, the real `train` flow runs twice in child processes of their own (fresh Ray and
Prefect each), from the warmed-up demo policy of that seed (the one `reflow demo --seed N` uses):
configs/demo.yaml with rollout.num_engines=2 and 64 prompts x 16 samples per iteration (--prompts,
--samples: a batch where generation is a real share of the iteration, as in LLM training; at the
demo's 32 x 8 it is ~15 %), once with rollout.max_staleness=0 (the synchronous loop) and once with
max_staleness=--staleness, the same overrides otherwise. Loop seconds run from
the first iteration's start to the last one's end (start-up and the final eval excluded; no save or
eval in between); accuracy is greedy pass@1 on the 200 held-out problems after the last iteration.
The speedup is the ratio of total iterations per hour over the seeds (same script, runs alternating
sync/async per seed). It ends with `async: speedup=<x> accuracy_sync=<a> accuracy_async=<b>`.
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
STAGES = ("generate", "reward", "advantages", "train", "await_rollouts", "push", "report", "orchestration", "iteration")


def run_one(args) -> dict:
    """Child process: one mode, one seed; the loop's timings and the final accuracy."""
    import ray

    import reflow.flows.train as ft
    from reflow.flows.cli import _demo_policy
    from reflow.infra.config.schema import load_config

    base = load_config(str(DEMO_YAML), [])
    policy = _demo_policy(args.seed, base.data.digits, str(C.ROOT / base.model.path))
    work = Path(tempfile.mkdtemp(prefix="reflow-async-"))
    cfg = load_config(str(DEMO_YAML), [
        f"model.path={policy}", f"seed={args.seed}", f"data.seed={args.seed}", f"num_iterations={args.iterations}",
        f"experiment=async-k{args.k}-s{args.seed}-{os.getpid()}", f"storage.root=file://{work}/runs",
        f"rollout.num_engines={args.engines}", f"rollout.max_staleness={args.k}", "eval.before_train=false",
        f"rollout.prompts_per_iteration={args.prompts}", f"rollout.n_samples_per_prompt={args.samples}",
        "eval.interval=null", "checkpoint.save_interval=null", "checkpoint.save_every_minutes=null", "resume=never",
        *args.override])
    marks: list[float] = []
    from reflow.flows.session import RunSession
    inner = RunSession.iterate

    def timed(session, i):  # the loop's clock: the first iteration's start, every iteration's end
        if not marks:
            marks.append(time.perf_counter())
        m = inner(session, i)
        marks.append(time.perf_counter())
        return m

    RunSession.iterate = timed  # type: ignore[method-assign]  # looked up at call time by the flow
    summary = ft.train(cfg, release_cluster=True)
    ray.shutdown()
    history = summary["history"]
    means = {s: statistics.fmean(m.get(f"time_{s}", 0.0) for m in history) for s in STAGES}
    extra = {k: statistics.fmean(m.get(k, 0.0) for m in history)
             for k in ("staleness", "tis_weight_mean", "tis_capped_frac", "async_trainer_wait_s",
                       "async_push_wait_s", "async_engine_idle_s", "reward_mean")}
    accuracy = float(next(iter(summary["evals"][args.iterations].values()))["pass@1"])
    every = {k: statistics.fmean(float(m.get(k, 0.0)) for m in history)  # every numeric metric, for a closer look
             for k in sorted({k for m in history for k, v in m.items() if isinstance(v, (int, float))})}
    return {"k": args.k, "seed": args.seed, "iterations": len(history), "loop_s": marks[-1] - marks[0],
            "accuracy": accuracy, "stage_means": means, **extra, "metric_means": every, "overrides": args.override}


def _child(args, k: int, seed: int, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--part", "one", "--k", str(k), "--seed", str(seed), "--json", str(out),
           "--iterations", str(args.iterations), "--engines", str(args.engines), "--prompts", str(args.prompts),
           "--samples", str(args.samples)]
    cmd += [f"--override={o}" for o in args.override]
    env = {**os.environ, **C.BENCH_ENV, "PREFECT_HOME": str(out.parent / f"prefect-{out.stem}"),
           "PREFECT_LOGGING_LEVEL": "WARNING"}
    log = out.with_suffix(".log")
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=C.ROOT).returncode
    if rc != 0 or not out.is_file():
        sys.stdout.write(log.read_text()[-4000:])
        raise SystemExit(f"max_staleness={k} seed {seed} failed (exit {rc}); log above and in {log}")
    res = json.loads(out.read_text())
    print(f"max_staleness={k} seed {seed}: {res['iterations']} iterations in {res['loop_s']:.1f} s, accuracy "
          f"{res['accuracy']:.3f} ({time.perf_counter() - t0:.0f} s with start-up, load {os.getloadavg()[0]:.1f})",
          flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=40, help="iterations of every run (default 40)")
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds (default 0,1)")
    p.add_argument("--prompts", type=int, default=64, help="rollout.prompts_per_iteration (default 64)")
    p.add_argument("--samples", type=int, default=16, help="rollout.n_samples_per_prompt (default 16)")
    p.add_argument("--staleness", type=int, default=1, help="rollout.max_staleness of the asynchronous runs (default 1)")
    p.add_argument("--engines", type=int, default=2, help="rollout.num_engines of every run (default 2)")
    p.add_argument("--override", action="append", default=[], help="an extra config override for every run (repeatable)")
    p.add_argument("--out", type=Path, default=None, help="folder for the runs' JSON and logs (default: a temp folder)")
    p.add_argument("--results", type=Path, default=None, help="also write the results as JSON here")
    p.add_argument("--part", default="all", help=argparse.SUPPRESS)
    p.add_argument("--k", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.part == "one":
        args.json.write_text(json.dumps(run_one(args)))
        return
    C.set_bench_env()
    C.header("async_speedup: rollout.max_staleness against the synchronous loop")
    out = args.out or Path(tempfile.mkdtemp(prefix="reflow-async-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for k in (0, args.staleness):
            runs.append(_child(args, k, seed, out / f"k{k}-s{seed}.json"))
    rows = [{"mode": "sync" if r["k"] == 0 else f"async k={r['k']}", "seed": r["seed"], "it_per_h": 3600 * r["iterations"] / r["loop_s"],
             "loop_s": r["loop_s"], "acc": r["accuracy"], "stale": r["staleness"], "tis": r["tis_weight_mean"],
             **{s: r["stage_means"][s] for s in ("generate", "train", "await_rollouts", "push", "orchestration", "iteration")},
             "wait": r["async_trainer_wait_s"], "idle": r["async_engine_idle_s"]} for r in runs]
    print(C.table(rows, [("mode", "mode", ""), ("seed", "seed", "d"), ("it_per_h", "it/h", ".0f"), ("loop_s", "loop s", ".1f"),
                         ("acc", "accuracy", ".3f"), ("stale", "staleness", ".2f"), ("tis", "tis w", ".3f"),
                         ("generate", "generate", ".3f"), ("train", "train", ".3f"), ("await_rollouts", "await", ".3f"),
                         ("push", "push", ".3f"), ("orchestration", "orch", ".3f"), ("iteration", "iteration", ".3f"),
                         ("wait", "trainer wait", ".3f"), ("idle", "engine idle", ".3f")]))
    print("stage columns: mean seconds per iteration (metrics.json time_*); generate is the trainer's wait for its "
          "batch when asynchronous")
    sync = [r for r in runs if r["k"] == 0]
    fast = [r for r in runs if r["k"] != 0]
    speedup = (sum(r["iterations"] for r in fast) / sum(r["loop_s"] for r in fast)) / \
              (sum(r["iterations"] for r in sync) / sum(r["loop_s"] for r in sync))
    acc_sync, acc_async = (statistics.fmean(r["accuracy"] for r in rs) for rs in (sync, fast))
    if args.results:
        args.results.write_text(json.dumps({"runs": runs, "speedup": speedup, "accuracy_sync": acc_sync,
                                            "accuracy_async": acc_async, "commit": C.git_commit(),
                                            "machine": C.machine()}, indent=1))
    print(f"async: speedup={speedup:.2f} accuracy_sync={acc_sync:.3f} accuracy_async={acc_async:.3f}")


if __name__ == "__main__":
    main()
