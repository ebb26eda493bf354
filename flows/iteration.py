"""One rollout iteration = one Prefect flow run: generate -> reward -> [PPO: critic values] -> advantages
-> train ([PPO: critic, then] actor) -> push -> report (rollouts) -> metrics (every timing included).
PPO's first `critic.warmup_iterations` train the critic alone.

Colocated mode wraps train + push in the GPU hand-over (engines release memory, trainer reloads; then
trainer offloads, engines resume weights, push, engines resume the rest).

Run by the `train` flow, the iteration takes its scored batch from the run's prefetcher
(flows/async_rollout.py; `time_generate` is then the trainer's wait for it, its update usually submitted
already). Asynchronous mode (rollout.max_staleness >= 1): before its push it waits for the batch the
engines are generating (`time_await_rollouts`); the synchronous loop's prefetcher launches the next batch
right after the push.

The parent flow calls `run_iteration`: it times the flow run from the parent's side (creating the
run and setting its final state are part of the iteration's wall time and of `time_orchestration`),
runs it without Prefect's heartbeat thread, and leaves the iteration's records (rollouts.parquet,
metrics.json, artifacts, summary log line) to the background writer (tasks/report.py)."""
from __future__ import annotations

import contextvars
import threading
import time
from contextlib import contextmanager
from contextvars import ContextVar

from prefect import flow
from prefect.context import FlowRunContext, SettingsContext
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY
from prefect.states import Cancelled

from reflow.flows import async_rollout
from reflow.infra import prefect_retry
from reflow.infra.config import RunConfig
from reflow.infra.control import enter_stage
from reflow.infra.runtime import use_gpus
from reflow.tasks import report
from reflow.tasks.colocate import to_engines, to_trainer
from reflow.tasks.rollout import advantages, generate, reward
from reflow.tasks.train import actor_updates, critic_values, push_weights, train, train_critic


class StageTimer:
    """Wall-clock seconds per stage, reported as `time_<stage>` metrics, from the timer's creation on."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str):
        enter_stage(stage)  # what the control API's /health shows (infra/control.py)
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

# Set in a flow run the parent started (`_Launched`): it waits for the parent, then hands its metrics, timer
# and run back instead of recording them.
_handoff: ContextVar[_Launched | None] = ContextVar("reflow_iteration_handoff", default=None)


@flow(name="iteration", flow_run_name="{config.experiment}-iter-{iteration:04d}", log_prints=True)
def iteration(config: RunConfig, iteration: int) -> dict[str, float]:
    """Rollout iteration `iteration` (0-based); leaves the engines on policy version iteration+1."""
    launched = _handoff.get()  # run by the parent flow (`run_iteration`): it says when to start
    if launched is not None and not launched.at_gate():
        return Cancelled(message=launched.cancelled)  # type: ignore[return-value]  # the run's final state
    timer = StageTimer()
    ahead = async_rollout.current(config)  # batches generated (and updates started) ahead of their flow runs
    batch, waits = None, {}
    if ahead:
        with timer("generate"):  # asynchronous: the trainer's wait for its (scored) batch
            batch, waits = ahead.take(iteration)
    if batch is None:  # no prefetcher (hand-overs, generate_ahead off, on its own), or a batch that failed
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
    if ahead:
        waits |= ahead.pushed(iteration + 1)
    if colocate:
        swap |= to_engines(config, "rest")
    run = FlowRunContext.get().flow_run  # type: ignore[union-attr]  # records name their run explicitly
    with timer("report"):  # rollouts.parquet + sample generations artifact, written in the background
        report.record_rollouts(config, iteration, batch, run.id)
    metrics = {**batch.stats, **train_metrics, **push_metrics, **swap, **waits}
    if launched is not None:  # the parent records it, with Prefect's part of its time (run_iteration)
        launched.hand_back(run, metrics, timer)
        return metrics
    metrics |= timer.totals(metrics)  # a flow run on its own (tests, deployments of it): record, then return
    report.publish_metrics(config, iteration, metrics, run)
    report.RECORDS.wait()
    return metrics


def run_iteration(config: RunConfig, i: int, extra: dict[str, float] | None = None,
                  prestart_next: bool = False) -> dict[str, float]:
    """Iteration `i` as one `iteration` flow run of the calling (parent) flow; returns its metrics.
    `time_iteration` runs from this call to the flow run's end; `flow_run_start_seconds` and
    `flow_run_end_seconds` are Prefect's part of it (creating the run, setting its final state).
    `extra`: the caller's own figures, recorded with the iteration's (the parent's `loop_between_s`).

    prestart_next: iteration i + 1 follows this one (the caller knows the run goes on): with
    `rollout.prestart_flow_runs` (auto: on GPUs) its flow run is created now, while this one computes, and
    waits at its first line (`_Launched`); the next call takes it. Its creation (`flow_run_create_seconds`)
    is then off the loop's critical path, and `flow_run_start_seconds` is the hand-over to a waiting run."""
    t0, busy = time.perf_counter(), prefect_retry.busy_retries()
    ahead = prestart_next and prestart_flow_runs(config)
    # created ahead, or now: in a thread of its own when the next one will be created while it runs, else here
    run = _take_launched(config, i) or _Launched(config, i, thread=ahead)
    run.go()
    if ahead:
        _next[config.experiment] = _Launched(config, i + 1, hold=False)  # off the loop's path: records go on
    flow_run, metrics, timer, body_end = run.result()
    run.wait_final_state()
    metrics |= timer.totals(metrics, since=t0)
    metrics |= {"flow_run_start_seconds": timer.t0 - t0, "flow_run_end_seconds": time.perf_counter() - body_end,
                "flow_run_created_ahead": float(run.created_ahead), "flow_run_create_seconds": run.create_seconds,
                "prefect_busy_retries": float(prefect_retry.busy_retries() - busy),  # this process's, meanwhile
                **(extra or {})}
    report.publish_metrics(config, i, metrics, flow_run)
    return metrics


class _Launched:
    """One `iteration` flow run, called in a thread of its own: Prefect creates it (its task run in the
    parent, the flow run, its states) at once, and its body waits at its first line for `go` (or `cancel`:
    the run then ends Cancelled, naming why). The body hands its run, metrics and timer back (`result`)
    instead of recording them; the thread then sets the final state (`wait_final_state`).

    Records (tasks/report.py) hold back their Prefect calls while its final state is set and, with `hold`,
    while it is being created, as they did when both happened in the parent's thread: one SQLite writer.
    A run created ahead holds nothing while it is created: that is off the loop's path, and records held
    back then, nearly all the time, fell behind by seconds on the H200 (bench/RESULTS.md 23)."""

    def __init__(self, config: RunConfig, i: int, thread: bool = True, hold: bool = True):
        self.config, self.i = config, i
        self._go = threading.Event()
        self.cancelled: str | None = None  # why, once cancelled
        self._handed = threading.Event()  # the body ended (`_out`) or the call raised (`_error`)
        self._out: tuple | None = None
        self._error: BaseException | None = None
        self._holds = int(hold)  # API holds this run took and has not given back
        self.t_launch, self.t_gate = time.perf_counter(), None
        self.created_ahead = False  # set by the taker: created before the parent asked for it
        if hold:
            report.RECORDS.hold_api()
        self.thread: threading.Thread | None = None  # None: called by `go`, in the caller's thread
        if thread:
            ctx = contextvars.copy_context()  # the parent's flow run and settings: this run is its child
            self.thread = threading.Thread(target=ctx.run, args=(self._call,), name=f"reflow-iteration-{i}",
                                           daemon=True)
            self.thread.start()

    @property
    def create_seconds(self) -> float:
        return (self.t_gate or self.t_launch) - self.t_launch

    def _call(self) -> None:
        token = _handoff.set(self)
        try:
            with _without_heartbeat():
                iteration(self.config, self.i)
        except BaseException as e:  # deliberate: handed to the parent's thread (`result`), re-raised there
            self._error = e
        finally:
            _handoff.reset(token)
            self._free(self._holds)
            self._handed.set()

    def _free(self, n: int = 1) -> None:
        for _ in range(min(n, self._holds)):
            self._holds -= 1
            report.RECORDS.free_api()

    # -- the flow run's side
    def at_gate(self) -> bool:
        """Called by the body first: the run exists and is Running. Waits for the parent; False: cancelled."""
        self.t_gate = time.perf_counter()
        self._free()
        self._go.wait()
        return self.cancelled is None

    def hand_back(self, run, metrics: dict[str, float], timer: StageTimer) -> None:
        report.RECORDS.hold_api()  # until the final state is set (`_call` frees it)
        self._holds += 1
        self._out = (run, metrics, timer, time.perf_counter())
        self._handed.set()

    # -- the parent's side
    def go(self) -> None:
        self._go.set()
        if self.thread is None:
            self._call()

    def cancel(self, why: str, timeout: float = 60.0) -> None:
        """The run will not be run: its flow run ends Cancelled with `why`."""
        self.cancelled = why
        self._go.set()
        if self.thread is not None:
            self.thread.join(timeout)

    def result(self) -> tuple:
        while not self._handed.wait(0.5):  # in steps: a signal to the parent's thread is still seen
            pass
        if self._error is not None and self._out is None:
            raise self._error
        return self._out  # type: ignore[return-value]

    def wait_final_state(self) -> None:
        while self.thread is not None and self.thread.is_alive():
            self.thread.join(0.5)
        if self._error is not None:  # the body ended but setting its state failed
            raise self._error


def prestart_flow_runs(cfg: RunConfig) -> bool:
    """`rollout.prestart_flow_runs`, its auto (null) resolved: on where the run uses GPUs."""
    on = cfg.rollout.prestart_flow_runs
    return use_gpus(cfg) if on is None else on


_next: dict[str, _Launched] = {}  # experiment -> the next iteration's flow run, created ahead, waiting


def _take_launched(config: RunConfig, i: int) -> _Launched | None:
    """The flow run created ahead for iteration i, if any; one created for another iteration (a recovery
    re-runs an earlier one) is cancelled."""
    run = _next.pop(config.experiment, None)
    if run is None:
        return None
    if run.i != i or run._handed.is_set():  # another iteration's, or one whose creation failed
        run.cancel(f"not run: the train flow ran iteration {i} next")
        return None
    run.created_ahead = True
    return run


def cancel_next(config: RunConfig, why: str) -> None:
    """The run does not go on to the iteration created ahead (stop, pause, failure, its end): that flow run
    ends Cancelled with `why` (a run resumed later creates the iteration's flow run again)."""
    run = _next.pop(config.experiment, None)
    if run is not None:
        run.cancel(why)


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
