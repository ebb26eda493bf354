"""Python's full garbage collections inside an engine's rollouts, with and without `gc.freeze` after set-up
(engines/gc_freeze.py): child processes of one script, taking turns (plain, frozen, plain, frozen...).

    python bench/gc_pauses.py                       # 2 rounds x 20 rollouts per child
    python bench/gc_pauses.py --rounds 3 --rollouts 40 --json bench/results/gc_pauses.json

Each child builds the embedded engine's `Generator` on the demo policy (the GPU demo's shape on a GPU, the tiny one
on CPU), warms up, freezes (or not), then runs the GPU demo's rollout call (128 prompts x 8 seeded samples, 6 new
tokens, the rollout's records of the last 3 rollouts kept alive as a driver keeps them) while `gc.callbacks` times
every collection. Reported per child: the objects it holds, full (generation 2) collections and the seconds they
took, and the rollouts' median / mean / max seconds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args) -> dict:
    import gc

    from rollout_generate import demo_rollout

    from reflow.engines.gc_freeze import freeze_long_lived

    rollout, cuda = demo_rollout(args, cpu_threads=1)
    kept = [rollout(v) for v in range(2)]  # warm-up: graph capture, allocator growth
    if args.freeze:
        freeze_long_lived()
    pauses: list[tuple[int, float]] = []
    started: list[float] = []

    def timer(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append((info["generation"], time.perf_counter() - started.pop()))

    gc.callbacks.append(timer)
    secs = []
    for v in range(args.rollouts):
        t0 = time.perf_counter()
        kept.append(rollout(v + 2))
        del kept[:-3]
        secs.append(time.perf_counter() - t0)
    gc.callbacks.remove(timer)
    full = [d for g, d in pauses if g == 2]
    return {"frozen": args.freeze, "device": "cuda" if cuda else "cpu", "objects": len(gc.get_objects()),
            "frozen_objects": gc.get_freeze_count(), "full_collections": len(full), "full_seconds": sum(full),
            "full_max_s": max(full, default=0.0), "young_seconds": sum(d for g, d in pauses if g < 2),
            "median_s": statistics.median(secs), "mean_s": statistics.mean(secs), "max_s": max(secs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="children per setting, taking turns")
    p.add_argument("--rollouts", type=int, default=20, help="timed rollouts per child")
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--n", type=int, default=8, help="samples per prompt (each its own seeded request)")
    p.add_argument("--batch", type=int, default=512, help="the engine's max_batch_size")
    p.add_argument("--cpu", action="store_true", help="stay on the CPU even where a GPU is")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--freeze", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    runs: dict[str, list[dict]] = {"plain": [], "frozen": []}
    for r in range(args.rounds):
        for name in ("plain", "frozen"):
            cmd = [sys.executable, __file__, "--child", "--rollouts", str(args.rollouts), "--prompts", str(args.prompts),
                   "--n", str(args.n), "--batch", str(args.batch)] + (["--freeze"] if name == "frozen" else []) + (["--cpu"] if args.cpu else [])
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True).stdout
            res = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
            runs[name].append(res)
            print(f"  {name:6s} round {r + 1}: {res['objects']:>7d} objects ({res['frozen_objects']} frozen); "
                  f"{res['full_collections']} full collections, {res['full_seconds']:.3f} s (max {res['full_max_s']:.3f}); "
                  f"rollout median {res['median_s']:.3f} s, mean {res['mean_s']:.3f}, max {res['max_s']:.3f}", flush=True)
    summary = {k: {"full_seconds_per_rollout": statistics.mean(r["full_seconds"] for r in v) / args.rollouts,
                   "mean_s": statistics.mean(r["mean_s"] for r in v), "max_s": max(r["max_s"] for r in v)}
               for k, v in runs.items()}
    ratio = summary["plain"]["mean_s"] / summary["frozen"]["mean_s"]
    print(f"gc_pauses: full collections {summary['plain']['full_seconds_per_rollout'] * 1e3:.1f} ms a rollout plain, "
          f"{summary['frozen']['full_seconds_per_rollout'] * 1e3:.1f} ms frozen; mean rollout plain/frozen {ratio:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary, "mean_ratio": ratio}, indent=1) + "\n")


if __name__ == "__main__":
    main()
