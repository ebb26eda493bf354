"""One rollout iteration = one Prefect flow run: generate -> reward -> [PPO: critic values] -> advantages
-> train ([PPO: critic, then] actor) -> push -> report (rollouts) -> metrics (every timing included).
PPO's first `critic.warmup_iterations` train the critic alone.

Colocated mode wraps train + push in the GPU hand-over (engines release memory, trainer reloads; then
trainer offloads, engines resume weights, push, engines resume the rest).

Run by the `train` flow, the iteration takes its scored batch from the run's rollout source
(tasks/rollout_source.py; `time_generate` is then the trainer's wait for it, its update submitted already
where rollout.update_ahead asks). Asynchronous mode (rollout.max_staleness >= 1): before its push it waits
for the batch the engines are generating (`time_await_rollouts`); in the synchronous loop the source
launches the next batch once the engines serve the pushed policy.

The parent flow calls `run_iteration`: it times the flow run from the parent's side (creating the
run and setting its final state are part of the iteration's wall time and of `time_orchestration`),
runs it without Prefect's heartbeat thread, and leaves the iteration's records (rollouts.parquet,
metrics.json, artifacts, summary log line) to the background writer (tasks/report.py)."""
from __future__ import annotations

import time
from contextlib import contextmanager
from contextvars import ContextVar

from prefect import flow
from prefect.context import FlowRunContext, SettingsContext
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY

from reflow.infra.config.schema import RunConfig
from reflow.infra.ops import prefect_retry
from reflow.infra.ops.control import enter_stage
from reflow.tasks import report
from reflow.tasks.colocate import to_engines, to_trainer
from reflow.tasks.rollout import advantages, generate, reward
from reflow.tasks.state import bound, run_state
from reflow.tasks.train import actor_updates, critic_values, push_weights, train, train_critic


class StageTimer:
    """Wall-clock seconds per stage, reported as `time_<stage>` metrics, from the timer's creation on."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str):
        enter_stage(stage)  # what the control API's /health shows (infra/ops/control.py)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[f"time_{stage}"] = time.perf_counter() - t0

    def totals(self, metrics: dict[str, float], since: float | None = None) -> dict[str, float]:
        """Every stage, `time_iteration` (from `since`, default the timer's creation, until now) and
        `time_orchestration`: what neither a stage nor a `time_*` already in `metrics` (colocated
        hand-overs, timed inside their tasks) accounts for, i.e. flow and task run start-up and Prefect
        state hand-offs; so the shares of the whole add up to 100 %."""
        whole = time.perf_counter() - (self.t0 if since is None else since)
        timed = sum(self.seconds.values()) + sum(v for k, v in metrics.items()
                                                 if k.startswith("time_") and k not in self.seconds)
        return {**self.seconds, "time_orchestration": max(whole - timed, 0.0), "time_iteration": whole}


prefect_retry.install()  # a flow-run start refused while SQLite is busy: retried in ms, not after 2 s

# Set by `run_iteration`: the flow run hands its metrics, timer and run back instead of recording them.
_handoff: ContextVar[list | None] = ContextVar("reflow_iteration_handoff", default=None)


@flow(name="iteration", flow_run_name="{config.experiment}-iter-{iteration:04d}", log_prints=True)
def iteration(config: RunConfig, iteration: int) -> dict[str, float]:
    """Rollout iteration `iteration` (0-based); leaves the engines on policy version iteration+1."""
    with bound(run_state(config)):  # the parent's run state; a flow run on its own gets one for its tasks
        return _iteration(config, iteration)


def _iteration(config: RunConfig, iteration: int) -> dict[str, float]:
    timer = StageTimer()
    report.RECORDS.free_api()  # the flow run exists: earlier iterations' records may post while this one computes
    ahead = run_state(config).rollouts  # batches generated (and updates started) ahead of their flow runs
    batch, waits = None, {}
    if ahead:
        with timer("generate"):  # the trainer's wait for its (scored) batch
            batch, waits = ahead.take(iteration)
    if batch is None:  # no rollout source (generate_ahead off, a flow run on its own), or a transient fault ahead
        with timer("generate"):
            batch = generate(config, iteration)
        with timer("reward"):  # reward and advantages: one Ray call each, so no task run of their own
            batch = reward.fn(config, batch)
    waits["staleness"] = iteration - batch.stats.get("rollout_policy_version", iteration)
    # engines and trainers share GPUs and take turns (tasks/colocate.py), unless both stay resident
    colocate = config.cluster.colocate and config.cluster.hand_over
    swap = to_trainer(config) if colocate else {}
    critic = config.algorithm.spec.needs_critic  # PPO: a value model trained alongside the policy
    if critic:
        with timer("values"):
            batch = critic_values(config, batch)
    if not waits.get("async_update_started_ahead"):  # else computed, and the update submitted, before this run
        with timer("advantages"):
            batch = advantages.fn(config, batch)
    with timer("train"):
        train_metrics = train_critic(config, batch) if critic else {}
        if actor_updates(config, iteration):
            train_metrics |= train(config, batch)
    if colocate:
        swap |= to_engines(config, "weights")
    if ahead:
        with timer("await_rollouts"):  # the batch the engines are generating: a push never lands mid-batch
            waits |= ahead.drain()
    with timer("push"):
        push_metrics = push_weights(config, iteration + 1)
    if colocate:
        swap |= to_engines(config, "rest")
    if ahead:  # the engines serve the new policy, KV cache and all: the next batch may start
        waits |= ahead.pushed(iteration + 1)
    run = FlowRunContext.get().flow_run  # type: ignore[union-attr]  # records name their run explicitly
    with timer("report"):  # rollouts.parquet + sample generations artifact, written in the background
        report.record_rollouts(config, iteration, batch, run.id)
    metrics = {**batch.stats, **train_metrics, **push_metrics, **swap, **waits}
    if (slot := _handoff.get()) is not None:
        report.RECORDS.hold_api()  # until the parent has this run's final state (run_iteration)
        slot.append((run, metrics, timer, time.perf_counter()))
        return metrics
    metrics |= timer.totals(metrics)  # a flow run on its own (tests, deployments of it): record, then return
    report.publish_metrics(config, iteration, metrics, run)
    report.RECORDS.wait()
    return metrics


def run_iteration(config: RunConfig, i: int, extra: dict[str, float] | None = None) -> dict[str, float]:
    """Iteration `i` as one `iteration` flow run of the calling (parent) flow; returns its metrics.
    `time_iteration` runs from this call to the flow run's end; `flow_run_start_seconds` and
    `flow_run_end_seconds` are Prefect's part of it (creating the run, setting its final state).
    `extra`: the caller's own figures, recorded with the iteration's (the parent's `loop_between_s`)."""
    slot: list[tuple] = []
    t0, busy = time.perf_counter(), prefect_retry.busy_retries()
    token = _handoff.set(slot)
    report.RECORDS.hold_api()  # creating the flow run goes first; the flow frees the API as it starts
    try:
        with _without_heartbeat():
            iteration(config, i)
    finally:
        _handoff.reset(token)
        report.RECORDS.free_api()
    run, metrics, timer, body_end = slot[0]
    metrics |= timer.totals(metrics, since=t0)
    metrics |= {"flow_run_start_seconds": timer.t0 - t0, "flow_run_end_seconds": time.perf_counter() - body_end,
                "prefect_busy_retries": float(prefect_retry.busy_retries() - busy),  # this process's, meanwhile
                **(extra or {})}
    report.publish_metrics(config, i, metrics, run)
    return metrics


_quiet: list = []  # [(settings, the same settings without flow heartbeats)]: built once, ~60 ms each


@contextmanager
def _without_heartbeat():
    """The iteration's flow run without Prefect's heartbeat thread. Its heartbeat would say what the
    parent's already says (this process is alive), and stopping it costs ~0.5 s per flow run: the
    thread sleeps in 1 s steps before it sees the stop (prefect/flow_engine.py `_send_heartbeats`)."""
    ctx = SettingsContext.get()
    if ctx is None or ctx.settings.flows.heartbeat_frequency is None:
        yield
        return
    if not _quiet or _quiet[0][0] is not ctx.settings:
        _quiet[:] = [(ctx.settings, ctx.settings.copy_with_update(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}))]
    with SettingsContext(profile=ctx.profile, settings=_quiet[0][1]):
        yield
