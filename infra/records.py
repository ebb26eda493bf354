"""Reading an experiment's per-iteration records back from storage alone (no Prefect, no Ray).

`reflow runs show` prints `iteration_table`: one row per iterations/NNNNNN/metrics.json, plus
whether the iteration's rollouts.parquet exists and which checkpoint holds it.
"""
from __future__ import annotations

import pandas as pd

from infra import checkpoint as ckpt
from infra.storage import ExperimentStore

# Shown by the readable table; --csv writes every metric.
SUMMARY_COLUMNS = ["iteration", "reward_mean", "loss", "kl", "entropy", "grad_norm", "response_len_mean",
                   "time_iteration", "rollouts", "checkpoint"]


def iteration_table(store: ExperimentStore) -> pd.DataFrame:
    """Every iteration's metrics, sorted by iteration; empty if the experiment has none."""
    rows = []
    for name in store.listdir("iterations"):
        if not name.isdigit():
            continue
        d = f"iterations/{name}"
        if not store.exists(f"{d}/metrics.json"):
            continue
        row = store.read_json(f"{d}/metrics.json")
        row["iteration"] = int(name)
        row["rollouts"] = store.exists(f"{d}/rollouts.parquet")
        rows.append(row)
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    committed = {ck.step for ck in ckpt.committed(store)}
    # checkpoint iter_(i+1) holds the policy after iteration i
    df["checkpoint"] = [ckpt.name_of(i + 1) if i + 1 in committed else "" for i in df["iteration"]]
    front = [c for c in ("iteration",) if c in df.columns]
    return df[front + [c for c in df.columns if c not in front]].sort_values("iteration").reset_index(drop=True)


def format_table(df: pd.DataFrame) -> str:
    cols = [c for c in SUMMARY_COLUMNS if c in df.columns]
    return df[cols].to_string(index=False, float_format=lambda v: f"{v:.4f}")


def eval_points(store: ExperimentStore) -> list[tuple[int, float]]:
    """(policy version, held-out accuracy) of every eval point recorded under iterations/*/eval/."""
    points = []
    for name in store.listdir("iterations"):
        rel = f"iterations/{name}/eval/summary.json"
        if name.isdigit() and store.exists(rel):
            points.append((int(name), float(store.read_json(rel)["eval_accuracy"])))
    return sorted(points)
