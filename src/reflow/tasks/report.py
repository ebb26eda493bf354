"""Recording one iteration: storage (rollouts.parquet, metrics.json) and UI artifacts (sample
generations, metrics and timings tables, the one-line summary in the iteration run's log).

These records are written off the loop's critical path: `RECORDS`, one background thread per
process, writes them in submission order while the next iteration runs. They are not Prefect task
runs: an artifact or a log line names its flow run explicitly, so it lands on the iteration's flow
run even when written after that run has finished. `RECORDS.wait()` returns when every record
submitted so far is written (and raises the first failure); the train flow calls it before it
commits a checkpoint and before it returns, so a resume never starts after an iteration whose
records were lost. On the loop's own thread this costs two Ray submissions and a queue put.
"""
from __future__ import annotations

import json
import logging
import math
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from typing import Any
from uuid import UUID

import certifi
import httpx
import ray
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactCreate
from prefect.context import SettingsContext
from prefect.logging.loggers import flow_run_logger
from prefect.settings import (
    PREFECT_API_KEY,
    PREFECT_API_SSL_CERT_FILE,
    PREFECT_API_TLS_INSECURE_SKIP_VERIFY,
    PREFECT_API_URL,
)

from reflow.engines import rollout_stages as ro
from reflow.infra.cluster.runtime import get_runtime
from reflow.infra.config.schema import RunConfig
from reflow.infra.store import metric_views as views
from reflow.tasks.rollout import BatchRef, write_table
from reflow.tasks.state import run_state

log = logging.getLogger("reflow.records")


def artifact_key(experiment: str, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return "".join(c if c.isalnum() else "-" for c in f"{experiment}-{what}".lower())


class Recorder:
    """A one-thread writer of records (see the module docstring). Each job runs under the Prefect
    settings of its submitter (the API it talks to), and its seconds are kept for the next metrics."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reflow-records")
        self._lock = threading.Lock()
        self._pending: list[Future] = []
        self.seconds = 0.0  # busy time of the jobs done since the last `take_seconds`
        self._api_free = threading.Event()  # clear while the loop's own Prefect calls must go first
        self._api_free.set()

    def hold_api(self) -> None:
        """From now until `free_api`, queued records wait before each Prefect API call. The loop holds
        the API while it creates an iteration's flow run and sets its final state: records posted at
        the same moment stalled that by up to ~2 s on the temporary server (SQLite: one writer)."""
        self._api_free.clear()

    def free_api(self) -> None:
        self._api_free.set()

    def api_turn(self) -> None:
        """Called by a record before it talks to the Prefect API (bounded: a stuck loop must not hang it)."""
        self._api_free.wait(timeout=30)

    def submit(self, job: Callable[..., Any], *args: Any) -> Future:
        ctx = SettingsContext.get()
        profile, settings = (ctx.profile, ctx.settings) if ctx is not None else (None, None)
        future = self._pool.submit(self._run, profile, settings, job, *args)
        with self._lock:
            self._pending.append(future)
        return future

    def _run(self, profile, settings, job: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            if settings is None:
                return job(*args)
            with SettingsContext(profile=profile, settings=settings):
                return job(*args)
        finally:
            self.seconds += time.perf_counter() - t0

    def take_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def wait(self, raise_errors: bool = True) -> float:
        """Block until every job submitted so far is done and return the seconds waited. A failed job's
        error is raised (the first one), or only logged with `raise_errors=False`: after a run that
        already fails with its own error, which is the one to see."""
        with self._lock:
            pending, self._pending = self._pending, []
        t0 = time.perf_counter()
        wait_all(pending)
        for f in pending:
            if (error := f.exception()) is not None:
                if raise_errors:
                    raise error
                log.error("an iteration record was not written: %r", error)
        return time.perf_counter() - t0


RECORDS = Recorder()


def record_rollouts(cfg: RunConfig, iteration: int, batch: BatchRef, flow_run_id: UUID) -> None:
    """Start the iteration's rollouts.parquet write (inside Ray: the batch never reaches the driver) and
    queue its sample generations artifact, which waits for it."""
    rt = get_runtime(cfg)
    rows_ref = write_table.remote(batch.ref, rt.store, f"{rt.store.iteration_dir(iteration)}/rollouts.parquet")
    RECORDS.submit(_samples_artifact, cfg.experiment, iteration, flow_run_id, rows_ref,
                   _samples.remote(batch.ref, SAMPLES_SHOWN), batch.saving)


def _samples_artifact(experiment: str, iteration: int, flow_run_id: UUID, rows_ref, samples_ref, saving) -> None:
    rows_url, samples = ray.get([rows_ref, samples_ref])
    ray.get(list(saving))  # the stage records (tasks/stage_cache.py) are complete too
    create_artifact("markdown", artifact_key(experiment, "iteration-samples"),
                    samples_markdown(experiment, iteration, samples, rows_url),
                    f"{experiment} iteration {iteration}: sample generations", flow_run_id)


def publish_metrics(cfg: RunConfig, iteration: int, metrics: dict[str, float], flow_run) -> None:
    """Queue metrics.json (every metric and timing), the metrics table (key metrics first), the timings
    table (shares of the whole iteration) and the one-line summary in the iteration flow run's log."""
    run_state(cfg).iteration_runs[iteration] = str(flow_run.id)  # for the checkpoints' lineage
    RECORDS.submit(_write_metrics, cfg, iteration, dict(metrics), flow_run)


def _write_metrics(cfg: RunConfig, iteration: int, metrics: dict[str, float], flow_run) -> str:
    rt = get_runtime(cfg)
    # What the writer spent on this and earlier iterations' records, off the loop: not a `time_*` stage.
    metrics["records_seconds"] = RECORDS.take_seconds()
    clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}
    url = rt.store.write_json(f"{rt.store.iteration_dir(iteration)}/metrics.json",
                              {"iteration": iteration, **dict(sorted(clean.items()))})  # sorted on disk; tables keep stage order
    create_artifact(
        "table", artifact_key(cfg.experiment, "iteration-metrics"),
        [{"metric": k, "value": (round(v, 6) if isinstance(v, float) and math.isfinite(v) else str(v))}
         for k, v in views.ordered(clean)],
        f"{cfg.experiment} iteration {iteration}: metrics, key ones first (also at {url})", flow_run.id)
    create_artifact("table", artifact_key(cfg.experiment, "iteration-timings"), views.timing_rows(clean),
                    f"{cfg.experiment} iteration {iteration}: seconds per stage, share of the iteration's "
                    f"{clean['time_iteration']:.2f} s", flow_run.id)
    RECORDS.api_turn()
    flow_run_logger(flow_run).info(views.summary_line(iteration, clean))
    return url


def create_artifact(kind: str, key: str, data: str | list[dict], description: str, flow_run_id: UUID | None) -> UUID:
    """An artifact of the flow run `flow_run_id`, created from any thread (Prefect's own helpers take
    the run from the calling thread's context, which a background writer does not have). Returns its id."""

    text = data if isinstance(data, str) else json.dumps(data)  # table cells: finite numbers or text
    RECORDS.api_turn()
    return api_call(lambda client: client.create_artifact(ArtifactCreate(
        type=kind, key=key, data=text, description=description, flow_run_id=flow_run_id)).id)


_CLIENTS = threading.local()  # this thread's open Prefect client: ((API URL, API key settings), client)


def api_call(call: Callable[[Any], Any]) -> Any:
    """`call(client)` with this thread's Prefect client for the current API, kept open between records: a
    new client fetched a CSRF token first (one more request for the server, 5 an iteration) and set up its
    connection. A client whose server went away (a temporary server restarted) is replaced once."""

    try:
        return call(_thread_client())
    except httpx.TransportError:  # deliberate: a stale connection gets one fresh client
        _drop_thread_client()
        return call(_thread_client())


def _thread_client() -> Any:
    """This thread's open client for the current API URL and key (a new one when either changed)."""

    api = (PREFECT_API_URL.value(), PREFECT_API_KEY.value())  # URL None: this process's temporary server
    held = getattr(_CLIENTS, "held", None)
    if held is None or held[0] != api:
        _drop_thread_client()
        client = get_client(sync_client=True, httpx_settings={"verify": _tls_context()})
        _CLIENTS.held = held = (api, client.__enter__())
    return held[1]


def _drop_thread_client() -> None:
    held, _CLIENTS.held = getattr(_CLIENTS, "held", None), None
    if held is not None:
        held[1].__exit__(None, None, None)


_TLS: dict[tuple, ssl.SSLContext] = {}  # (skip verify, CA file) -> the TLS context of this process's API clients


def _tls_context() -> ssl.SSLContext:
    """One TLS context per process for the records' API clients, built as Prefect builds one for each new
    client (PREFECT_API_TLS_INSECURE_SKIP_VERIFY, else PREFECT_API_SSL_CERT_FILE or certifi's bundle): that
    costs ~17 ms of CPU (loading the CA bundle) per client (bench/RESULTS.md 12); `api_call` keeps one client
    per thread and makes a new one after a lost connection, and they all share this context."""

    key = (bool(PREFECT_API_TLS_INSECURE_SKIP_VERIFY.value()), PREFECT_API_SSL_CERT_FILE.value() or certifi.where())
    if key not in _TLS:
        ctx = ssl.create_default_context(cafile=None if key[0] else key[1])
        if key[0]:
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        _TLS[key] = ctx
    return _TLS[key]


SAMPLES_SHOWN = 4


_samples = ray.remote(num_cpus=0)(ro.pick_samples)


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
