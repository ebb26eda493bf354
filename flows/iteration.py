"""One rollout iteration = one Prefect flow run: generate -> reward -> [PPO: critic values] -> advantages
-> train ([PPO: critic, then] actor) -> push -> report (rollouts) -> metrics (every timing included).
PPO's first `critic.warmup_iterations` train the critic alone.

Colocated mode wraps train + push in the GPU hand-over (engines release memory, trainer reloads; then
trainer offloads, engines resume weights, push, engines resume the rest)."""
from __future__ import annotations

import time
from contextlib import contextmanager

from prefect import flow

from reflow.infra.config import RunConfig
from reflow.tasks.colocate import to_engines, to_trainer
from reflow.tasks.report import publish_metrics, record_rollouts
from reflow.tasks.rollout import advantages, generate, reward
from reflow.tasks.train import actor_updates, critic_values, push_weights, train, train_critic


class StageTimer:
    """Wall-clock seconds per stage, reported as `time_<stage>` metrics, from the timer's creation on."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[f"time_{stage}"] = time.perf_counter() - t0

    def totals(self, metrics: dict[str, float]) -> dict[str, float]:
        """Every stage, `time_iteration` (until now) and `time_orchestration`: what neither a stage nor
        a `time_*` already in `metrics` (colocated hand-overs, timed inside their tasks) accounts for,
        i.e. task start-up and Prefect state hand-offs; so the shares of the whole add up to 100 %."""
        whole = time.perf_counter() - self.t0
        timed = sum(self.seconds.values()) + sum(v for k, v in metrics.items() if k.startswith("time_"))
        return {**self.seconds, "time_orchestration": max(whole - timed, 0.0), "time_iteration": whole}


@flow(name="iteration", flow_run_name="{config.experiment}-iter-{iteration:04d}", log_prints=True)
def iteration(config: RunConfig, iteration: int) -> dict[str, float]:
    """Rollout iteration `iteration` (0-based); leaves the engines on policy version iteration+1."""
    timer = StageTimer()
    with timer("generate"):
        batch = generate(config, iteration)
    with timer("reward"):
        batch = reward(config, batch)
    colocate = config.cluster.colocate  # engines and trainers share GPUs: they take turns (tasks/colocate.py)
    swap = to_trainer(config) if colocate else {}
    critic = config.algorithm.spec.needs_critic  # PPO: a value model trained alongside the policy
    if critic:
        with timer("values"):
            batch = critic_values(config, batch)
    with timer("advantages"):
        batch = advantages(config, batch)
    with timer("train"):
        train_metrics = train_critic(config, batch) if critic else {}
        if actor_updates(config, iteration):
            train_metrics |= train(config, batch)
    if colocate:
        swap |= to_engines(config, "weights")
    with timer("push"):
        push_metrics = push_weights(config, iteration + 1)
    if colocate:
        swap |= to_engines(config, "rest")
    with timer("report"):
        record_rollouts(config, iteration, batch)  # rollouts.parquet + sample generations artifact
    metrics = {**batch.stats, **train_metrics, **push_metrics, **swap}
    metrics |= timer.totals(metrics)
    publish_metrics(config, iteration, metrics)  # metrics.json, metrics + timings tables, log line
    return metrics
