"""The run's control API: an operator's view of a live `train` flow run and a hand on its loop.

    GET  /health   actors (engines: URL and weight version; trainer ranks: Ray's record of them, so a
                   rank busy training still shows), policy version, current iteration and stage
    GET  /metrics  the same and the last iteration's metrics, in Prometheus' text format
    POST /pause    finish the current iteration (its save and eval too), then start no new one
    POST /resume   start iterations again
    POST /save     a checkpoint after the current iteration (at once while paused)
    POST /stop     finish the current iteration, save, end the run: the parent flow run ends COMPLETED

It is served by uvicorn in a thread of the flow's process (engines/http_serve.ThreadedServer) on
`control.host`, loopback by default, behind the engines' guard (HttpGuard) with no open path: every
request needs the run's bearer token. The token is made per run and kept in a file only the run's
user can read; the URL, that file's path and the run's pid are recorded next to the experiment's
lease (infra/cluster/leases.py), `<lease dir>/<experiment>.control.json`, where `reflow ctl` finds them.
Handlers only set flags and read state; the train loop (flows/train.py) acts between iterations.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from reflow.infra.cluster import leases
from reflow.infra.config.guards import check_segment
from reflow.infra.config.schema import RunConfig

log = logging.getLogger("reflow.control")
COMMANDS = ("pause", "resume", "save", "stop")
MAX_CONNECTIONS = 32  # an operator's few clients and a Prometheus scraper; the rest is someone holding sockets open
_stage: list = ["starting", time.monotonic()]  # what this process's train loop does now: [name, since]


def enter_stage(name: str) -> None:
    """Say what the train loop does now (flows/iteration.py's stage timer and flows/train.py call it)."""
    _stage[:] = [name, time.monotonic()]


@dataclass
class RunControl:
    """What the control API shows and the flags it sets; the train loop reads and clears them."""

    cfg: RunConfig
    flow_run_id: str | None
    iteration: int  # running now, or the next to run
    token: str = field(default="", repr=False)
    paused: bool = False
    stopping: bool = False
    save_requested: bool = False
    saved_step: int | None = None
    last_metrics: dict[str, float] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=lambda: {"pauses": 0, "saves": 0, "trainer_recoveries": 0,
                                                               "stack_dumps": 0})
    recoveries: list[dict] = field(default_factory=list)  # flows/recovery.py: one row per trainer recovery
    started_at: float = field(default_factory=time.time)
    server: object = None  # engines/http_serve.ThreadedServer while serving
    dumper: object = None  # infra/stack_dumps.StackDumper when debug.stack_dump_interval_s is set
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)

    # ------------------------------------------------------------ the handlers (server thread)

    def command(self, name: str) -> dict[str, object]:
        with self._cond:
            if name == "pause" and not self.paused:
                self.paused, self.counters["pauses"] = True, self.counters["pauses"] + 1
            elif name == "resume":
                self.paused = False
            elif name == "save":
                self.save_requested = True
            elif name == "stop":
                self.stopping = True
            self._cond.notify_all()
            log.warning("control API: %s requested (iteration %d running or next)", name, self.iteration)
            return {"accepted": name, "iteration": self.iteration, "paused": self.paused, "stopping": self.stopping}

    def health(self) -> dict[str, object]:
        stage, since = _stage
        return {"experiment": self.cfg.experiment, "flow_run_id": self.flow_run_id, "pid": os.getpid(),
                "iteration": self.iteration, "num_iterations": self.cfg.num_iterations,
                "policy_version": self.iteration,  # iteration i trains version i into version i + 1
                "stage": stage, "stage_seconds": round(time.monotonic() - since, 3), "paused": self.paused,
                "stopping": self.stopping, "save_requested": self.save_requested, "last_checkpoint": self.saved_step,
                "uptime_s": round(time.time() - self.started_at, 3), **self.counters, "actors": actor_rows(self.cfg)}

    # ------------------------------------------------------------ the train loop's side

    def take_save(self) -> bool:
        """Whether a checkpoint was asked for since the last call (the request is cleared)."""
        with self._cond:
            asked, self.save_requested = self.save_requested, False
            return asked

    def saved(self, step: int) -> None:
        self.saved_step = step
        self.counters["saves"] += 1

    def finished(self, i: int, metrics: dict[str, float]) -> None:
        self.iteration, self.last_metrics = i + 1, dict(metrics)

    def hold(self, save_now: Callable[[], None]) -> bool:
        """While paused, wait for /resume or /stop, calling `save_now` on /save. True when the run is to
        stop (at once when a stop came already); by then the iterations done are saved."""
        while True:
            with self._cond:
                if self.paused and not (self.stopping or self.save_requested):
                    enter_stage("paused")
                    self._cond.wait_for(lambda: not self.paused or self.stopping or self.save_requested, timeout=5.0)
                stop, resume = self.stopping, not self.paused
            if self.take_save() or (stop and self.saved_step != self.iteration):
                save_now()
            if stop or resume:
                return stop

    def close(self) -> None:
        """Stop serving and dumping; remove the control record and token file (this run wrote them)."""
        if self.dumper is not None:
            self.dumper.stop()  # type: ignore[attr-defined]
        if self.server is not None:
            self.server.stop(timeout=5.0)  # type: ignore[attr-defined]
            record = read_record(self.cfg.experiment)
            if record is not None and record.get("pid") == os.getpid():
                for f in (record_path(self.cfg.experiment), token_path(self.cfg.experiment)):
                    f.unlink(missing_ok=True)


def actor_rows(cfg: RunConfig) -> list[dict[str, object]]:
    """Engines, trainer and critic ranks, router: Ray's record of each (state, pid) and, for engines,
    the weight version their /model_info reports (SGLang's field, so both backends answer it)."""
    from reflow.engines.rollout_client import EngineClient, EngineError
    from reflow.infra.cluster.runtime import get_runtime

    rt = get_runtime(cfg)
    rows = []
    for i, (e, url) in enumerate(zip(rt.engines, rt.engine_urls)):
        row = {"name": f"engine-{i}", "kind": "engine", "url": url, **ray_record(e)}
        try:
            row["weight_version"] = EngineClient(url, timeout=5.0, api_key=rt.api_key).model_info()["weight_version"]
        except (EngineError, httpx.HTTPError, KeyError) as err:  # deliberate: health reports it, not raises
            row["weight_version"] = f"no answer ({type(err).__name__})"
        rows.append(row)
    groups = [("trainer", rt.trainers)] + ([("critic", rt.critic)] if rt.critic is not None else [])
    for kind, group in groups:
        rows += [{"name": f"{group.name_prefix}-trainer-{r}", "kind": kind, **ray_record(a)}
                 for r, a in enumerate(group.actors)]
    if rt.router is not None:
        rows.append({"name": "router", "kind": "router", **ray_record(rt.router)})
    return rows


def ray_record(handle) -> dict[str, object]:
    """{id, state (ALIVE, DEAD, ...), pid, node} from Ray's GCS: no call into the actor, which may be busy.
    (Ray's public state API, ray.util.state, goes through the dashboard, which reflow's clusters do not run.)"""
    from ray._private import state

    from reflow.infra.cluster.actors import actor_id

    aid = actor_id(handle)
    info = state.actors(aid) or {}
    return {"id": aid, "state": info.get("State", "UNKNOWN"), "pid": info.get("Pid"),
            "node": info.get("Address", {}).get("NodeID")}


def prometheus_text(health: dict, last: dict[str, float]) -> bytes:
    """/health as Prometheus gauges and counters, plus the last finished iteration's metrics."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    fams = [GaugeMetricFamily("reflow_run_info", "The run this API controls", labels=["experiment", "flow_run_id"])]
    fams[0].add_metric([health["experiment"], str(health["flow_run_id"])], 1.0)
    for key, text in (("iteration", "Iteration running now, or the next to run"), ("policy_version", "Policy "
                      "version of the trainer"), ("num_iterations", "The run's total iterations"),
                      ("paused", "1 while paused"), ("stopping", "1 once a stop was asked for")):
        fams.append(GaugeMetricFamily(f"reflow_{key}", text, value=float(health[key])))
    for key in ("pauses", "saves", "trainer_recoveries", "stack_dumps"):
        fams.append(CounterMetricFamily(f"reflow_{key}", f"{key.replace('_', ' ').capitalize()} in this run",
                                        value=float(health[key])))
    versions = GaugeMetricFamily("reflow_engine_weight_version", "Weight version each engine reports", labels=["engine"])
    alive = GaugeMetricFamily("reflow_actor_alive", "1 when Ray records the actor ALIVE", labels=["actor", "kind"])
    for row in health["actors"]:
        alive.add_metric([row["name"], row["kind"]], float(row["state"] == "ALIVE"))
        if row["kind"] == "engine" and str(row["weight_version"]).isdigit():
            versions.add_metric([row["name"]], float(row["weight_version"]))
    metric = GaugeMetricFamily("reflow_iteration_metric", "The last finished iteration's metrics (its metrics.json)",
                               labels=["metric"])
    for name, value in last.items():
        if isinstance(value, int | float):
            metric.add_metric([name], float(value))
    reg = CollectorRegistry()
    reg.register(_Families(fams + [versions, alive, metric]))
    return generate_latest(reg)


class _Families:
    """A prometheus_client collector of metric families built for one scrape."""

    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)


# ---------------------------------------------------------------- serving


def build_app(control: RunControl):
    from fastapi import FastAPI, Response
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    from reflow.engines.http_serve import HttpGuard

    app = FastAPI(title="reflow control", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_api_route("/health", control.health, methods=["GET"])

    def metrics() -> Response:
        return Response(prometheus_text(control.health(), control.last_metrics), media_type=CONTENT_TYPE_LATEST)

    app.add_api_route("/metrics", metrics, methods=["GET"])
    for name in COMMANDS:
        app.add_api_route(f"/{name}", lambda name=name: control.command(name), methods=["POST"], name=name)
    return HttpGuard(app, control.token, max_body_bytes=1 << 16, open_prefixes=())


def start_control(cfg: RunConfig, flow_run_id: str | None, iteration: int) -> RunControl:
    """The run's control API (control.enabled) and stack dumper (debug.stack_dump_interval_s)."""
    from reflow.engines.http_serve import ThreadedServer, new_api_key
    from reflow.infra.ops.stack_dumps import StackDumper

    control = RunControl(cfg, flow_run_id, iteration, token=new_api_key())
    if cfg.control.enabled:
        control.server = server = ThreadedServer(build_app(control), cfg.control.host, cfg.control.port,
                                                 "reflow-control", max_connections=MAX_CONNECTIONS)
        _write_record(cfg.experiment, server.url(), control.token, flow_run_id)  # type: ignore[attr-defined]
        log.info("control API at %s (token in %s): `reflow ctl %s health|pause|resume|save|stop`",
                 server.url(), token_path(cfg.experiment), cfg.experiment)  # type: ignore[attr-defined]
    if cfg.debug.stack_dump_interval_s is not None:
        control.dumper = StackDumper(cfg, cfg.debug.stack_dump_interval_s, control).start()
    return control


# ---------------------------------------------------------------- the record `reflow ctl` reads


def record_path(experiment: str) -> Path:
    return leases.lease_dir() / f"{check_segment(experiment, 'experiment')}.control.json"


def token_path(experiment: str) -> Path:
    return leases.lease_dir() / f"{check_segment(experiment, 'experiment')}.control-token"


def _write_record(experiment: str, url: str, token: str, flow_run_id: str | None) -> None:

    tf = token_path(experiment)
    tf.parent.mkdir(parents=True, exist_ok=True)
    tf.unlink(missing_ok=True)  # an earlier run's, of this name: reflow's own file
    fd = os.open(tf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # readable by this user only
    with os.fdopen(fd, "w") as f:
        f.write(token)
    doc = {"experiment": experiment, "url": url, "token_file": str(tf.resolve()), "pid": os.getpid(),
           "pid_started": psutil.Process().create_time(), "flow_run_id": flow_run_id, "started_at": time.time()}
    tmp = record_path(experiment).with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(doc))
    tmp.replace(record_path(experiment))


def read_record(experiment: str) -> dict | None:
    try:
        return json.loads(record_path(experiment).read_text())
    except (FileNotFoundError, ValueError):
        return None


class NoLiveRun(RuntimeError):
    """No run of the experiment serves a control API on this machine."""


def request(experiment: str, command: str, timeout_s: float = 30.0) -> httpx.Response:
    """`command` (health, metrics, or one of COMMANDS) sent to the experiment's live run."""
    where = record_path(experiment)
    record = read_record(experiment)
    if record is None:
        raise NoLiveRun(f"no live run of experiment {experiment!r} on this machine: no control record {where} "
                        f"(start one with `reflow train`; set REFLOW_LEASE_DIR if its runs keep leases elsewhere)")
    if leases.running(record["pid"], record["pid_started"]) is None:
        raise NoLiveRun(f"no live run of experiment {experiment!r}: the run that wrote {where} (pid "
                        f"{record['pid']}, flow run {record.get('flow_run_id')}) is no longer running")
    from reflow.engines.http_serve import bearer

    token = Path(record["token_file"]).read_text().strip()
    method = "GET" if command in ("health", "metrics") else "POST"
    with httpx.Client(timeout=timeout_s) as client:
        return client.request(method, f"{record['url']}/{command}", headers=bearer(token))
