"""Prefect task that records one iteration: storage (metrics.json, rollouts.parquet) + UI artifact."""
from __future__ import annotations

import math

import ray
from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from reflow.infra.config import RunConfig
from reflow.infra.plots import curves_png
from reflow.infra.records import eval_points, iteration_table
from reflow.infra.runtime import get_runtime
from reflow.rl.types import RolloutBatch
from reflow.tasks.rollout import BatchRef, write_table


def artifact_key(experiment: str, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return "".join(c if c.isalnum() else "-" for c in f"{experiment}-{what}".lower())


@task(name="report", cache_policy=NO_CACHE)
def report(cfg: RunConfig, iteration: int, batch: BatchRef, metrics: dict[str, float]) -> str:
    rt = get_runtime(cfg)
    d = rt.store.iteration_dir(iteration)
    rows_ref = write_table.remote(batch.ref, rt.store, f"{d}/rollouts.parquet")
    samples_ref = _samples.remote(batch.ref, SAMPLES_SHOWN)
    clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in sorted(metrics.items())}
    url = rt.store.write_json(f"{d}/metrics.json", {"iteration": iteration, **clean})
    rows_url, samples = ray.get([rows_ref, samples_ref])
    create_table_artifact(
        key=artifact_key(cfg.experiment, "iteration-metrics"),
        table=[{"metric": k, "value": (round(v, 6) if isinstance(v, float) and math.isfinite(v) else str(v))}
               for k, v in clean.items() if not k.startswith("time_")],
        description=f"{cfg.experiment} iteration {iteration}: metrics (also at {url})")
    timings = {k[5:]: float(v) for k, v in clean.items() if k.startswith("time_") and k != "time_iteration"}
    create_table_artifact(
        key=artifact_key(cfg.experiment, "iteration-timings"),
        table=[{"stage": k, "seconds": round(v, 3), "share": f"{v / max(clean.get('time_iteration', 0.0), 1e-9):.0%}"}
               for k, v in timings.items()],
        description=f"{cfg.experiment} iteration {iteration}: seconds per stage")
    create_markdown_artifact(key=artifact_key(cfg.experiment, "iteration-samples"),
                             markdown=samples_markdown(cfg.experiment, iteration, samples, rows_url),
                             description=f"{cfg.experiment} iteration {iteration}: sample generations")
    return url


SAMPLES_SHOWN = 4


@ray.remote(num_cpus=0)
def _samples(batch: RolloutBatch, k: int) -> list[dict]:
    """A few samples for the UI: the best and the worst rewarded of the batch, then the first ones."""
    rewards = batch.rewards or [0.0] * len(batch)
    order = sorted(range(len(batch)), key=lambda i: -rewards[i])
    picked = list(dict.fromkeys(order[: k // 2] + order[-(k - k // 2):]))[:k] if order else []
    return [{"prompt": batch.prompt_text[i], "response": batch.response_text[i],
             "reward": None if batch.rewards is None else batch.rewards[i],
             "advantage": None if batch.advantages is None else batch.advantages[i],
             "finish": batch.finish_reason[i]} for i in picked]


def _cell(text: str, limit: int = 300) -> str:
    text = text if len(text) <= limit else text[:limit] + "…"
    return text.replace("|", "\\|").replace("\n", "⏎")


def samples_markdown(experiment: str, iteration: int, samples: list[dict], rows_url: str) -> str:
    fmt = lambda x: "" if x is None else f"{x:.3f}"  # noqa: E731
    lines = [f"# {experiment}: iteration {iteration}, sample generations", "",
             "| prompt | response | reward | advantage | finish |", "|---|---|---|---|---|"]
    lines += [f"| `{_cell(s['prompt'])}` | `{_cell(s['response'])}` | {fmt(s['reward'])} | {fmt(s['advantage'])} "
              f"| {s['finish']} |" for s in samples]
    return "\n".join(lines + ["", f"Every sample: `{rows_url}`"])


@task(name="plot-curves", cache_policy=NO_CACHE)
def plot_curves(cfg: RunConfig) -> str:
    """Reward + eval curves (one per eval set) of the whole experiment (resumed runs included), drawn
    from the records in storage, written as plots/curves.png and linked from a markdown artifact."""
    rt = get_runtime(cfg)
    table, evals = iteration_table(rt.store), eval_points(rt.store)
    curves = {name: [(v, float(s["pass@1"])) for v, s in points] for name, points in evals.items()}
    url = rt.store.write_bytes("plots/curves.png", curves_png(table, curves, cfg.experiment))
    last = table.iloc[-1] if not table.empty else None
    names = sorted(curves)
    by_version: dict[int, dict[str, float]] = {}
    for name, points in curves.items():
        for v, acc in points:
            by_version.setdefault(v, {})[name] = acc
    lines = [f"# {cfg.experiment}: learning curves", "", f"![reward and eval curves]({url})", "",
             f"Plot: `{url}`", "", "| policy version | " + " | ".join(f"{n} pass@1" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    lines += [f"| {v} | " + " | ".join(f"{row[n]:.3f}" if n in row else "" for n in names) + " |"
              for v, row in sorted(by_version.items())]
    if last is not None:
        lines += ["", f"Last iteration {int(last['iteration'])}: mean rollout reward {last['reward_mean']:.3f}"]
    create_markdown_artifact(key=artifact_key(cfg.experiment, "curves"), markdown="\n".join(lines),
                             description=f"{cfg.experiment}: reward and eval curves")
    return url


def start_progress(cfg: RunConfig, done: int, total: int):
    """A progress artifact on the parent `train` run (percent of `num_iterations` done); its id."""
    from prefect.artifacts import create_progress_artifact

    return create_progress_artifact(progress=100.0 * done / max(total, 1), key=artifact_key(cfg.experiment, "progress"),
                                    description=f"{cfg.experiment}: iterations done of num_iterations={total}")


def update_progress(artifact_id, done: int, total: int) -> None:
    from prefect.artifacts import update_progress_artifact

    if artifact_id is not None:
        update_progress_artifact(artifact_id=artifact_id, progress=100.0 * done / max(total, 1))
