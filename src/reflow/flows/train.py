"""The parent `train` flow: the miles/slime `train.py` loop as a Prefect flow.

    check storage -> find a checkpoint to resume from -> start cluster -> restore -> push weights
    -> eval (before training, fresh runs only)
    for each iteration: one `iteration` flow run (the next one's rollout launched as it ends); save at
    `checkpoint.save_interval`, every `checkpoint.save_every_minutes` (default 10), on the sentinel
    file and at the end; eval every `eval.interval` and at the end (eval.blocking=false: an eval
    overlaps the next iteration, its generation gating the next weight push; all are recorded, in
    order, before the flow returns; see tasks/evaluate.py)

`num_iterations` is the run's total: a run resumed after k iterations runs iterations k..n-1.
While it runs, `reflow ctl` reaches its control API (infra/ops/control.py: health, metrics, pause, resume,
save, stop); a trainer rank that dies mid-iteration is rebuilt from the latest checkpoint (flows/recovery.py).
"""
from __future__ import annotations

import time
from functools import partial

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from reflow.engines.gc_freeze import freeze_long_lived, thaw
from reflow.flows import async_rollout
from reflow.flows.inputs import USER_ERRORS, checked_config, refused
from reflow.flows.recovery import run_recovering
from reflow.flows.schedule import eval_due, save_due
from reflow.infra.cluster import leases
from reflow.infra.cluster.runtime import shutdown_runtime
from reflow.infra.config.flow_params import FlowConfig
from reflow.infra.config.schema import RunConfig
from reflow.infra.ops.control import RunControl, enter_stage, start_control
from reflow.infra.store import checkpoint as ckpt
from reflow.tasks.checkpoint import check_storage, find_checkpoints, finish_save, restore, save_pending, start_save
from reflow.tasks.cluster import start_cluster
from reflow.tasks.evaluate import collect, launch_eval
from reflow.tasks.progress import Progress
from reflow.tasks.report import RECORDS
from reflow.tasks.rollout import drop_started_generation, start_generation
from reflow.tasks.train import initial_push


def _save(config: RunConfig, control: RunControl, done: int, wait: bool = True) -> float:
    """Checkpoint `done` iterations: every rank's write is queued now, ahead of any later call to the
    ranks, and the commit runs in the background (tasks/checkpoint.py `start_save`); `wait`: committed
    (and the sentinel file removed, if any) before this returns. Returns when it started."""
    enter_stage("checkpoint")
    RECORDS.wait()  # a checkpoint is committed only after the records of the iterations it holds
    if (ahead := async_rollout.current(config)) is not None:
        ahead.persisted(done)  # and the batches generated before it (flows/async_rollout.py)
    start_save(config, done)
    if wait:
        _settle(config, control)
        if ckpt.sentinel_present(config.checkpoint.sentinel):
            ckpt.remove_sentinel(config.checkpoint.sentinel)
    return time.monotonic()


def _settle(config: RunConfig, control: RunControl, wait: bool = True) -> None:
    """Record the checkpoint committed in the background (its error raised here): `wait` for it, or only
    if it is done already."""
    if not wait and save_pending(config.experiment) is not None:
        return
    if (done := finish_save(config.experiment)) is not None:
        get_run_logger().info("checkpoint: %s", done[1])
        control.saved(done[0])


def _already_done(config: RunConfig, step: int, url: str) -> dict[str, object]:
    msg = (f"experiment {config.experiment!r} already completed {step} of num_iterations={config.num_iterations} "
           f"iterations (checkpoint {url}); nothing to do. num_iterations is the run's total: raise it to "
           f"train further, or use a new experiment name to start over.")
    get_run_logger().warning(msg)
    return {"iterations": 0, "start": step, "already_complete": True, "message": msg, "evals": {}, "history": []}


@flow(name="train", flow_run_name="{config.experiment}", log_prints=True)
def train(config: FlowConfig, release_cluster: bool | None = None) -> dict[str, object]:
    """Run iterations up to `config.num_iterations` in total (stopping early at `debug_exit_after`).

    config: the full run config, or {"file": "configs/X.yaml", "overrides": ["k=v", ...]}.
    release_cluster: kill the experiment's actors at the end (true), keep them for the next flow
    run (false), or (null) keep them only on a long-lived cluster (RAY_ADDRESS, `reflow cluster up`)."""
    try:
        config = checked_config(config)
    except USER_ERRORS as e:
        return refused(e)  # type: ignore[return-value]  # Prefect takes a returned State as the run's
    for line in leases.take(config.experiment, flow_run.id):  # a killed predecessor: its leftovers, its state
        get_run_logger().warning("previous run: %s", line)
    try:
        return _train(config, release_cluster)
    finally:
        leases.release(config.experiment)


def _train(config: RunConfig, release_cluster: bool | None) -> dict[str, object]:
    log = get_run_logger()
    t0 = time.perf_counter()
    log.info("storage: %s", check_storage(config))
    found = find_checkpoints(config)
    if found and found[0][0].step >= config.num_iterations:
        return _already_done(config, found[0][0].step, found[0][0].url)
    progress: Progress | None = None
    control: RunControl | None = None
    try:
        log.info("cluster: %s", start_cluster(config))
        leases.record(config.experiment)
        restored = restore(config, found)
        start = restored["step"]
        control = start_control(config, flow_run.id, start)  # control API (`reflow ctl`), stack dumps
        initial_push(config, start, restored["loaded"])
        last = config.num_iterations if config.debug_exit_after is None else min(
            config.num_iterations, start + config.debug_exit_after)
        # batches generated (and updates started) ahead of their flow runs from here on (flows/async_rollout.py)
        prefetcher = async_rollout.open_prefetcher(config, start, last)
        evals: dict[int, dict[str, dict]] = {}  # policy version -> {eval set: summary}
        pending: list = []  # launched evals not recorded yet
        if config.eval.before_train and start == 0:
            pending.append(launch_eval(config, 0))
            evals |= collect(config, pending, wait=config.eval.blocking)
        history: list[dict[str, float]] = []
        progress = Progress(config, start, config.num_iterations)
        saved_at = time.monotonic()
        if config.cluster.gc_freeze:  # the set-up (Prefect, Ray, the prompts) out of the loop's full collections
            freeze_long_lived(collect=False)
        loop_t0 = between_t0 = time.perf_counter()
        for i in range(start, last):
            enter_stage(f"iteration {i}")
            # loop_between_s: this loop's own bookkeeping since the previous flow run (in no iteration's time)
            between = {"loop_between_s": time.perf_counter() - between_t0} if i > start else {}
            m = run_recovering(config, i, control, between)  # a dead trainer rank: rebuilt, re-run (flows/recovery.py)
            between_t0 = time.perf_counter()
            control.finished(i, m)
            if control.stopping:  # POST /stop: this iteration is the run's last (saved, evaluated)
                last = i + 1
            if eval_due(config, i + 1, last):  # first: its records are written while the engines generate next
                pending.append(launch_eval(config, i + 1))
            if (follows := i + 1 < last and not control.paused) and prefetcher is None:  # hand-overs: the next
                start_generation(config, i + 1)  # rollout runs under the save and the bookkeeping below
            due = save_due(config, i + 1, last, (time.monotonic() - saved_at) / 60)
            if due or control.take_save():
                # committed before the next iteration when it is the last, asked for (sentinel, /save) or
                # when background commits are off; else while the next iteration runs
                wait = (not due or i + 1 == last or not config.checkpoint.background_commit
                        or ckpt.sentinel_present(config.checkpoint.sentinel))
                saved_at = _save(config, control, i + 1, wait)
            # the next update starts now (in the background), under this bookkeeping and the next run's start
            ahead = follows and async_rollout.start_next(config, i + 1)
            RECORDS.submit(leases.record, config.experiment)  # engines recreated meanwhile are new processes
            evals |= collect(config, pending, wait=config.eval.blocking)
            history.append(m)
            progress.update(i + 1, m, evals)  # progress artifact, log line, terminal bar, curves (as evals land)
            _settle(config, control, wait=control.paused or control.stopping)  # a failed background save raises
            if i + 1 == last or (not ahead and control.hold(partial(_save, config, control, i + 1))):  # paused: waits
                last = i + 1  # hold() is True on /stop: the iterations done are saved by now
                break
        # the iterations and the bookkeeping between them, to the last one's end: not the final save and eval
        # after it (a single-process trainer's samples/s stops at its last step too)
        loop_seconds = between_t0 - loop_t0
        loop_ended_at = time.time() - (time.perf_counter() - between_t0)  # wall clock: the policy's final version
        evals |= collect(config, pending, wait=True)  # every launched eval is recorded before the run ends
        RECORDS.wait()  # and every iteration's records
        _settle(config, control)  # and every checkpoint committed
        log.info("curves: %s", progress.finish(evals))
        if control.stopping:
            log.warning("stopped by the control API after %d of %d iterations", last, config.num_iterations)
        elif last < config.num_iterations:
            log.warning("debug_exit_after=%d: stopping after %d of %d iterations",
                        config.debug_exit_after, last, config.num_iterations)
        return {"iterations": last - start, "start": start, "evals": evals, "history": history,
                "seconds": time.perf_counter() - t0, "loop_seconds": loop_seconds, "loop_ended_at": loop_ended_at}
    finally:
        thaw()  # frozen for the loop only (freeze_long_lived above); a no-op when it did not get that far
        async_rollout.close_prefetcher(config)  # waits for batches in flight (their records are whole)
        drop_started_generation(config)  # a stop or a failure after the next generation was launched
        if control is not None:
            control.close()
        if progress is not None:
            progress.abort()  # trackers still open here: the run failed (finish() closed them otherwise)
        RECORDS.wait(raise_errors=False)  # a failed run: the records it queued are still written
        finish_save(config.experiment, raise_errors=False)  # and its checkpoint in flight committed (or not)
        if release_cluster is not False:  # False keeps this process's runtime too (tests inspect it)
            shutdown_runtime(config.experiment, release_cluster)
