"""One live `train` flow run per experiment on this machine, and cleaning up after a killed one.

A run takes the experiment's lease when it starts (`take`) and gives it back when it ends
(`release`). The lease is a small JSON file, `<lease dir>/<experiment>.json` (`$REFLOW_LEASE_DIR`,
default `.reflow/leases`): the flow run id, this process (pid and start time, so a reused pid is
not mistaken for it) and, once the runtime is built, every process this one started (`record`:
with a cluster of its own those are Ray's GCS, raylet, agents and the actor workers).

A run killed with SIGKILL (or a machine that lost power) cannot report anything: its Prefect flow
runs stay RUNNING and some of Ray's processes outlive it (its dashboard and runtime-env agents are
re-parented to init and live on). The next `take` for the experiment finds the lease of a process
that no longer runs, and before anything else
  - ends every recorded process still alive (SIGTERM, then SIGKILL after a grace period), with
    their children, so no worker of the dead run writes into storage the new run uses;
  - marks the dead run's flow run, and its iteration runs still RUNNING/PENDING, CRASHED with a
    message that says who marked them and why.
A lease held by a process that still runs refuses the second run with its flow run id and pid.
Actors on a long-lived cluster (`RAY_ADDRESS`) are not this process's children: they are left
alone (later runs reuse them; `reflow cluster down --experiment` ends them).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from reflow.infra.config.guards import check_segment

log = logging.getLogger("reflow.leases")


class ExperimentBusy(RuntimeError):
    """Another live process holds the experiment's lease."""


@dataclass
class Lease:
    experiment: str
    flow_run_id: str | None
    host: str
    pid: int
    pid_started: float  # psutil create_time of `pid`
    taken_at: float
    processes: list[tuple[int, float, str]] = field(default_factory=list)  # (pid, create_time, name)


def lease_dir() -> Path:
    return Path(os.environ.get("REFLOW_LEASE_DIR") or Path(".reflow") / "leases")


def _path(experiment: str) -> Path:
    return lease_dir() / f"{check_segment(experiment, 'experiment')}.json"


def read(experiment: str) -> Lease | None:
    f = _path(experiment)
    try:
        raw = json.loads(f.read_text())
        return Lease(**{**raw, "processes": [tuple(p) for p in raw.get("processes", [])]})
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as e:  # unreadable: a half-written lease of a killed run
        log.warning("lease %s is unreadable (%s); ignoring it", f, e)
        return None


def _write(lease: Lease) -> None:
    f = _path(lease.experiment)
    f.parent.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(asdict(lease)))
    tmp.replace(f)


def running(pid: int, started: float) -> psutil.Process | None:
    """The process `pid` if it is still the one that started at `started` (pids are reused)."""
    try:
        p = psutil.Process(pid)
        return p if abs(p.create_time() - started) < 0.01 and p.status() != psutil.STATUS_ZOMBIE else None
    except psutil.Error:
        return None


def _me() -> tuple[int, float]:
    return os.getpid(), psutil.Process().create_time()


def take(experiment: str, flow_run_id: str | None) -> list[str]:
    """Take the experiment's lease; clean up after a dead holder first. Returns what was done."""
    done: list[str] = []
    prev = read(experiment)
    if prev is not None and prev.host == socket.gethostname() and (prev.pid, prev.pid_started) != _me():
        if running(prev.pid, prev.pid_started) is not None:
            raise ExperimentBusy(
                f"experiment {experiment!r} is being trained by flow run {prev.flow_run_id} (pid {prev.pid}, "
                f"started {time.ctime(prev.taken_at)}); wait for it, cancel it, or use another experiment name")
        done += end_leftovers(prev)
        done += mark_crashed(prev)
    elif prev is not None and prev.host != socket.gethostname():
        log.warning("lease %s was taken on host %s: its processes cannot be checked from here",
                    _path(experiment), prev.host)
    pid, started = _me()
    _write(Lease(experiment, flow_run_id, socket.gethostname(), pid, started, time.time()))
    for line in done:
        log.warning(line)
    return done


def record(experiment: str) -> None:
    """Add every process this one started (now) to the lease: what a successor ends if this one dies."""
    lease = read(experiment)
    if lease is None or (lease.pid, lease.pid_started) != _me():
        return
    known = {(p, t) for p, t, _ in lease.processes}
    before = len(lease.processes)
    for c in psutil.Process().children(recursive=True):
        try:
            key = (c.pid, c.create_time())
            if key not in known:
                lease.processes.append((*key, c.name()))
                known.add(key)
        except psutil.Error:
            continue
    if len(lease.processes) > before:  # called every iteration: rewrite only when a process is new
        _write(lease)


def release(experiment: str) -> None:
    """Give the lease back (only this process's own)."""
    lease = read(experiment)
    if lease is not None and (lease.pid, lease.pid_started) == _me():
        _path(experiment).unlink(missing_ok=True)


def end_leftovers(lease: Lease, grace_s: float = 5.0) -> list[str]:
    """SIGTERM the dead holder's recorded processes still alive (and their children), SIGKILL
    whatever is left after `grace_s`."""
    alive: dict[int, psutil.Process] = {}
    for pid, started, _ in lease.processes:
        p = running(pid, started)
        if p is None:
            continue
        alive[p.pid] = p
        try:
            alive |= {c.pid: c for c in p.children(recursive=True)}
        except psutil.Error:
            pass
    if not alive:
        return []
    names = sorted(f"{p.pid} {_name(p)}" for p in alive.values())
    for p in alive.values():
        _signal(p, signal.SIGTERM)
    _, left = psutil.wait_procs(list(alive.values()), timeout=grace_s)
    for p in left:
        _signal(p, signal.SIGKILL)
    psutil.wait_procs(left, timeout=grace_s)
    return [f"ended {len(alive)} process(es) left behind by flow run {lease.flow_run_id} (pid {lease.pid}, "
            f"no longer running): {', '.join(names)}"]


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return "?"


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except psutil.Error:
        pass


def mark_crashed(lease: Lease) -> list[str]:
    """Mark the dead holder's flow run and its unfinished child runs CRASHED."""
    if lease.flow_run_id is None:
        return []
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import TERMINAL_STATES
    from prefect.states import Crashed

    message = (f"process {lease.pid} on {lease.host} ended without reporting (killed?); marked CRASHED by the next "
               f"run of experiment {lease.experiment!r}")
    marked = []
    try:
        with get_client(sync_client=True) as client:
            runs = [client.read_flow_run(lease.flow_run_id)]
            # only the unfinished children: a long run has more finished ones than the API's default page
            runs += client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[runs[0].id]),
                state=FlowRunFilterState(type=FlowRunFilterStateType(not_any_=list(TERMINAL_STATES)))))
            for run in runs:
                if run.state is not None and not run.state.is_final():
                    client.set_flow_run_state(run.id, Crashed(message=message), force=True)
                    marked.append(run.name)
    except Exception as e:  # deliberate: another server, a deleted run; the cleanup above still counts
        return [f"could not mark flow run {lease.flow_run_id} CRASHED ({type(e).__name__}: {e})"]
    return [f"marked {len(marked)} flow run(s) of dead process {lease.pid} CRASHED: {', '.join(marked)}"] if marked else []
