"""Reading an experiment's per-iteration records back from storage alone (no Prefect, no Ray).

`reflow runs show` prints `iteration_table`: one row per iterations/NNNNNN/metrics.json, plus
whether the iteration's rollouts.parquet exists and which checkpoint holds it, and (`with_evals`)
the eval pass@1 of the policy each iteration produced.
"""
from __future__ import annotations

import pandas as pd

from reflow.infra.store import checkpoint as ckpt
from reflow.infra.store.storage import ExperimentStore

# Shown by the readable table; --csv writes every metric.
SUMMARY_COLUMNS = ["iteration", "reward_mean", "loss", "kl", "entropy", "grad_norm", "response_len_mean",
                   "time_iteration", "time_generate", "time_train", "time_push", "time_report", "EVALS", "rollouts",
                   "checkpoint"]
EVAL_SUFFIX = " pass@1"  # eval columns: `<set> pass@1`, shown where SUMMARY_COLUMNS says EVALS


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


def with_evals(df: pd.DataFrame, points: dict[str, list[tuple[int, dict]]]) -> pd.DataFrame:
    """`df` plus one `<set> pass@1` column per eval set: the eval of the policy iteration i produced
    (policy version i + 1); NaN where that version was not evaluated. Version 0 (before training)
    has no iteration row: `before_training` gives it."""
    out = df.copy()
    for name, pts in points.items():
        by_version = {v: float(s["pass@1"]) for v, s in pts}
        out[name + EVAL_SUFFIX] = [by_version.get(int(i) + 1, float("nan")) for i in out["iteration"]]
    return out


def before_training(points: dict[str, list[tuple[int, dict]]]) -> dict[str, float]:
    """{eval set: pass@1} of policy version 0, where it was evaluated."""
    return {name: float(s["pass@1"]) for name, pts in points.items() for v, s in pts if v == 0}


def format_table(df: pd.DataFrame) -> str:
    evals = [c for c in df.columns if c.endswith(EVAL_SUFFIX)]
    cols = [x for c in SUMMARY_COLUMNS for x in (evals if c == "EVALS" else [c]) if x in df.columns]
    return df[cols].to_string(index=False, float_format=lambda v: f"{v:.4f}", na_rep="")


def eval_points(store: ExperimentStore) -> dict[str, list[tuple[int, dict]]]:
    """{eval set: [(policy version, summary), ...]} of every in-training eval recorded under
    iterations/*/eval/<set>/summary.json, sorted by version. Records of older runs
    (iterations/*/eval/summary.json with `eval_accuracy`) count as set "heldout" with that pass@1."""
    points: dict[str, list[tuple[int, dict]]] = {}
    for name in store.listdir("iterations"):
        if not name.isdigit():
            continue
        d = f"iterations/{name}/eval"
        for set_name in store.listdir(d):
            if store.exists(f"{d}/{set_name}/summary.json"):
                points.setdefault(set_name, []).append((int(name), store.read_json(f"{d}/{set_name}/summary.json")))
        if store.exists(f"{d}/summary.json"):  # before named eval sets
            acc = float(store.read_json(f"{d}/summary.json")["eval_accuracy"])
            points.setdefault("heldout", []).append((int(name), {"pass@1": acc, "reward_mean": acc}))
    return {k: sorted(v, key=lambda p: p[0]) for k, v in sorted(points.items())}
