"""Prefect task that records one iteration: storage (metrics.json, rollouts.parquet) + UI artifact."""
from __future__ import annotations

import math

import ray
from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from infra.config import RunConfig
from infra.plots import curves_png
from infra.records import eval_points, iteration_table
from infra.runtime import get_runtime
from tasks.rollout import BatchRef, write_table


def artifact_key(experiment: str, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return "".join(c if c.isalnum() else "-" for c in f"{experiment}-{what}".lower())


@task(name="report", cache_policy=NO_CACHE)
def report(cfg: RunConfig, iteration: int, batch: BatchRef, metrics: dict[str, float]) -> str:
    rt = get_runtime(cfg)
    d = rt.store.iteration_dir(iteration)
    rows_ref = write_table.remote(batch.ref, rt.store, f"{d}/rollouts.parquet")
    clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in sorted(metrics.items())}
    url = rt.store.write_json(f"{d}/metrics.json", {"iteration": iteration, **clean})
    ray.get(rows_ref)
    create_table_artifact(
        key=artifact_key(cfg.experiment, "iteration-metrics"),
        table=[{"metric": k, "value": (round(v, 6) if isinstance(v, float) and math.isfinite(v) else str(v))}
               for k, v in clean.items()],
        description=f"{cfg.experiment} iteration {iteration}: metrics (also at {url})")
    return url


@task(name="plot-curves", cache_policy=NO_CACHE)
def plot_curves(cfg: RunConfig) -> str:
    """Reward + held-out accuracy curves of the whole experiment (resumed runs included), drawn
    from the records in storage, written as plots/curves.png and linked from a markdown artifact."""
    rt = get_runtime(cfg)
    table, evals = iteration_table(rt.store), eval_points(rt.store)
    url = rt.store.write_bytes("plots/curves.png", curves_png(table, evals, cfg.experiment))
    last = table.iloc[-1] if not table.empty else None
    lines = [f"# {cfg.experiment}: learning curves", "", f"![reward and accuracy curves]({url})", "",
             f"Plot: `{url}`", "", "| policy version | held-out accuracy |", "|---|---|"]
    lines += [f"| {step} | {acc:.3f} |" for step, acc in evals]
    if last is not None:
        lines += ["", f"Last iteration {int(last['iteration'])}: mean rollout reward {last['reward_mean']:.3f}"]
    create_markdown_artifact(key=artifact_key(cfg.experiment, "curves"), markdown="\n".join(lines),
                             description=f"{cfg.experiment}: reward and held-out accuracy curves")
    return url
