"""Prefect tasks that record one iteration: storage (rollouts.parquet, metrics.json) + UI artifacts."""
from __future__ import annotations

import math

import ray
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from reflow.infra import metric_views as views
from reflow.infra.config import RunConfig
from reflow.infra.runtime import get_runtime
from reflow.rl.types import RolloutBatch
from reflow.tasks.rollout import BatchRef, write_table


def artifact_key(experiment: str, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return "".join(c if c.isalnum() else "-" for c in f"{experiment}-{what}".lower())


@task(name="report", cache_policy=NO_CACHE)
def record_rollouts(cfg: RunConfig, iteration: int, batch: BatchRef) -> str:
    """The iteration's rollouts.parquet (written from inside Ray) and its sample generations artifact."""
    rt = get_runtime(cfg)
    d = rt.store.iteration_dir(iteration)
    rows_ref = write_table.remote(batch.ref, rt.store, f"{d}/rollouts.parquet")
    rows_url, samples = ray.get([rows_ref, _samples.remote(batch.ref, SAMPLES_SHOWN)])
    create_markdown_artifact(key=artifact_key(cfg.experiment, "iteration-samples"),
                             markdown=samples_markdown(cfg.experiment, iteration, samples, rows_url),
                             description=f"{cfg.experiment} iteration {iteration}: sample generations")
    return rows_url


@task(name="metrics", cache_policy=NO_CACHE)
def publish_metrics(cfg: RunConfig, iteration: int, metrics: dict[str, float]) -> str:
    """metrics.json (every metric and timing), the metrics table (key metrics first), the timings table
    (shares of the whole iteration) and the one-line summary in the iteration flow run's log. Its own
    few milliseconds come after `time_iteration` was taken, so they are the one thing not counted."""
    rt = get_runtime(cfg)
    clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}
    url = rt.store.write_json(f"{rt.store.iteration_dir(iteration)}/metrics.json",
                              {"iteration": iteration, **dict(sorted(clean.items()))})  # sorted on disk; tables keep stage order
    create_table_artifact(
        key=artifact_key(cfg.experiment, "iteration-metrics"),
        table=[{"metric": k, "value": (round(v, 6) if isinstance(v, float) and math.isfinite(v) else str(v))}
               for k, v in views.ordered(clean)],
        description=f"{cfg.experiment} iteration {iteration}: metrics, key ones first (also at {url})")
    create_table_artifact(key=artifact_key(cfg.experiment, "iteration-timings"), table=views.timing_rows(clean),
                          description=f"{cfg.experiment} iteration {iteration}: seconds per stage, share of the "
                                      f"iteration's {clean['time_iteration']:.2f} s")
    get_run_logger().info(views.summary_line(iteration, clean))
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
