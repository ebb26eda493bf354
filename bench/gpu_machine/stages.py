"""Per-iteration stage medians of a run's records (metrics.json of each iteration), the first iteration
left out (compilation, graph capture): where an iteration's seconds go, for bench/RESULTS.md.

    python3 bench/gpu_machine/stages.py [RUN_DIR ...]   # default: the newest run under .reflow/runs
"""
from __future__ import annotations

import glob
import json
import os
import statistics
import sys

PREFIXES = ("time_", "flow_run_", "async_", "push_", "generate_", "step_time", "records_seconds", "loop_",
            "prefect_")


def summary(run: str) -> str:
    files = sorted(glob.glob(os.path.join(run, "iterations", "*", "metrics.json")))
    rows = [json.load(open(f)) for f in files][1:]
    if not rows:
        return f"{run}: no iteration records"
    out = [f"{run}: {len(rows)} iterations after the first; median / mean / max seconds"]
    for key in sorted(k for k in rows[0] if k.startswith(PREFIXES)):
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        if vals:
            out.append(f"  {key:34s} {statistics.median(vals):8.4f} {statistics.mean(vals):8.4f} {max(vals):8.3f}")
    total = sum(r.get("time_iteration", 0.0) for r in rows)
    out.append(f"  sum of time_iteration {total:.1f} s")
    return "\n".join(out)


if __name__ == "__main__":
    runs = sys.argv[1:] or sorted(glob.glob(".reflow/runs/*/"), key=os.path.getmtime)[-1:]
    print("\n".join(summary(r.rstrip("/")) for r in runs))
