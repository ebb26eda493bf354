"""The driver session of one `train` flow run: what the parent flow's loop (flows/train.py) calls.

A RunSession owns the run's runtime (the Ray actors), its shared state (tasks/state.py: the rollout
source, what was launched ahead, the checkpoint in flight and its lineage), its control API, its evals and
its progress. Each step of the loop is one of its methods; the clean-up after the loop (however it ends)
and the recovery from a dead trainer rank are written once, here.

Overlap with the next iteration comes from one place, the rollout source (tasks/rollout_source.py):
batches generated (and updates submitted) ahead of their flow runs; the synchronous loop is its
staleness 0.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from functools import partial

from prefect import get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.runtime import flow_run

from reflow.engines.gc_freeze import freeze_long_lived, thaw
from reflow.flows.iteration import run_iteration
from reflow.flows.recovery import RankWatch, dead_ranks
from reflow.flows.schedule import eval_due, over_budget, save_due
from reflow.infra.cluster import leases
from reflow.infra.cluster.runtime import recreate_trainers, shutdown_runtime
from reflow.infra.config.schema import RunConfig
from reflow.infra.ops.control import RunControl, enter_stage, start_control
from reflow.infra.store import checkpoint as ckpt
from reflow.tasks.checkpoint import find_checkpoints, finish_save, restore, save_pending, start_save
from reflow.tasks.cluster import start_cluster
from reflow.tasks.colocate import hand_back_to_engines
from reflow.tasks.evaluate import PendingEval, collect, launch_eval
from reflow.tasks.progress import Progress
from reflow.tasks.report import RECORDS, artifact_key
from reflow.tasks.rollout_source import open_source
from reflow.tasks.state import RunState, bound
from reflow.tasks.train import initial_push


class TrainerGroupLost(RuntimeError):
    """A trainer rank died and the run has used up its recoveries."""


class RunSession:
    """One train flow run's driver state and steps (see the module docstring)."""

    def __init__(self, config: RunConfig, release_cluster: bool | None) -> None:
        self.cfg, self.release_cluster = config, release_cluster
        self.state = RunState(config.experiment)
        self.control: RunControl | None = None
        self.progress: Progress | None = None
        self.evals: dict[int, dict[str, dict]] = {}  # policy version -> {eval set: summary}
        self.pending: list[PendingEval] = []  # launched evals not recorded yet
        self.history: list[dict[str, float]] = []
        self.start = self.last = 0  # the first iteration of this run; one past its last (shortened by a stop)
        self.t0 = time.perf_counter()
        self.started = self.saved_at = time.monotonic()  # max_train_minutes counts from the session's start
        self.ended_by = ""  # what made the run end before num_iterations: "stop", "budget" (else debug_exit_after)
        self.loop_t0 = self.between_t0 = 0.0  # the loop's start; the end of the latest iteration flow run
        self.ahead = False  # the next iteration's update was submitted ahead of its flow run
        self._stack = ExitStack()

    # ------------------------------------------------------------------ the run's start and end

    def __enter__(self) -> RunSession:
        self._stack.enter_context(bound(self.state))  # what the tasks and iteration flow runs share
        self._stack.callback(self.close)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def begin(self, found: list) -> None:
        """Start the cluster, restore the trainers (`found`: the checkpoints to resume from, newest first),
        open the control API, push the first weights, open the rollout source; eval before training."""
        cfg, log = self.cfg, get_run_logger()
        log.info("cluster: %s", start_cluster(cfg))
        leases.record(cfg.experiment)
        restored = restore(cfg, found)
        self.start = restored["step"]
        self.control = start_control(cfg, flow_run.id, self.start)  # control API (`reflow ctl`), stack dumps
        initial_push(cfg, self.start, restored["loaded"])
        self.last = cfg.num_iterations if cfg.debug_exit_after is None else min(
            cfg.num_iterations, self.start + cfg.debug_exit_after)
        self.state.rollouts = open_source(cfg, self.start, self.last)
        if cfg.eval.before_train and self.start == 0:
            self.pending.append(launch_eval(cfg, 0))
            self.evals |= collect(cfg, self.pending, wait=cfg.eval.blocking)
        self.progress = Progress(cfg, self.start, cfg.num_iterations)
        self.saved_at = time.monotonic()
        if cfg.cluster.gc_freeze:  # the set-up (Prefect, Ray, the prompts) out of the loop's full collections
            freeze_long_lived(collect=False)
        self.loop_t0 = self.between_t0 = time.perf_counter()

    def close(self) -> None:
        """However the run ends: batches in flight finished, the control API closed, records and the
        checkpoint in flight settled, the actors released (or kept for the next flow run)."""
        thaw()  # frozen for the loop only (begin); a no-op when it did not get that far
        if self.state.rollouts is not None:
            self.state.rollouts.close()  # waits for batches in flight (their records are whole)
            self.state.rollouts = None
        if self.control is not None:
            self.control.close()
        if self.progress is not None:
            self.progress.abort()  # trackers still open here: the run failed (finish() closed them otherwise)
        RECORDS.wait(raise_errors=False)  # a failed run: the records it queued are still written
        finish_save(self.cfg, raise_errors=False)  # and its checkpoint in flight committed (or not)
        if self.release_cluster is not False:  # False keeps this process's runtime too (tests inspect it)
            shutdown_runtime(self.cfg.experiment, self.release_cluster)

    def finish(self) -> dict[str, object]:
        """After the loop: every eval, record and checkpoint settled; the run's summary."""
        log, cfg = get_run_logger(), self.cfg
        # the iterations and the bookkeeping between them, to the last one's end: not the final save and eval
        # after it (a single-process trainer's samples/s stops at its last step too)
        loop_seconds = self.between_t0 - self.loop_t0
        loop_ended_at = time.time() - (time.perf_counter() - self.between_t0)  # wall clock: the final policy
        self.evals |= collect(cfg, self.pending, wait=True)  # every launched eval is recorded before the run ends
        RECORDS.wait()  # and every iteration's records
        self.settle()  # and every checkpoint committed
        log.info("curves: %s", self.progress.finish(self.evals))  # type: ignore[union-attr]  # begin() made it
        if self.control.stopping:  # type: ignore[union-attr]
            log.warning("stopped by the control API after %d of %d iterations", self.last, cfg.num_iterations)
        elif self.last < cfg.num_iterations and not self.ended_by:
            log.warning("debug_exit_after=%d: stopping after %d of %d iterations", cfg.debug_exit_after, self.last,
                        cfg.num_iterations)
        return {"iterations": self.last - self.start, "start": self.start, "evals": self.evals,
                "history": self.history, "seconds": time.perf_counter() - self.t0, "loop_seconds": loop_seconds,
                "loop_ended_at": loop_ended_at}

    # ------------------------------------------------------------------ the loop's steps

    def iterations(self) -> Iterator[int]:
        """start, start + 1, ... up to the run's last (which a stop, a pause that ends the run or
        `debug_exit_after` makes earlier)."""
        i = self.start
        while i < self.last:
            yield i
            i += 1

    def iterate(self, i: int) -> dict[str, float]:
        """Iteration `i` as one iteration flow run, re-run after rebuilding a trainer group that lost a rank
        (the iterations since the last checkpoint first); its metrics."""
        enter_stage(f"iteration {i}")
        # loop_between_s: this loop's own bookkeeping since the previous flow run (in no iteration's time)
        between = {"loop_between_s": time.perf_counter() - self.between_t0} if i > self.start else {}
        control, j = self.control, i
        assert control is not None  # begin() opened it
        while True:
            watch, control.iteration = RankWatch(self.cfg), j
            try:
                with watch:
                    m = run_iteration(self.cfg, j, between if j == i else None)
            except Exception as e:  # deliberate: only a dead rank is recovered; anything else is raised as it came
                if not dead_ranks(watch, e):
                    raise
                j = self.recover(i, j, watch.dead, e)
                continue
            if j == i:
                break
            j += 1
        self.between_t0 = time.perf_counter()
        control.finished(i, m)
        if control.stopping:  # POST /stop: this iteration is the run's last (saved, evaluated)
            self.last, self.ended_by = i + 1, "stop"
        elif i + 1 < self.last and over_budget(self.cfg, self.started):  # the time budget, as a stop
            self.last, self.ended_by = i + 1, "budget"
            get_run_logger().warning("max_train_minutes=%g: the time budget ends the run after %d of %d iterations",
                                     self.cfg.max_train_minutes, i + 1, self.cfg.num_iterations)
        return m

    def evaluate_if_due(self, done: int) -> None:
        """Launch the eval of policy `done` when one is due (first: its records are written while the
        engines generate next)."""
        if eval_due(self.cfg, done, self.last):
            self.pending.append(launch_eval(self.cfg, done))

    def follows(self, done: int) -> bool:
        """Whether an iteration follows right away (not the last, not paused)."""
        return done < self.last and not self.control.paused  # type: ignore[union-attr]

    def save_if_due(self, done: int) -> None:
        """Checkpoint `done` iterations when due or asked for (sentinel file, /save): committed before the
        next iteration when it is the last, asked for, or background commits are off; else while the next
        iteration runs."""
        c = self.cfg.checkpoint
        due = save_due(self.cfg, done, self.last, (time.monotonic() - self.saved_at) / 60)
        if due or self.control.take_save():  # type: ignore[union-attr]
            wait = (not due or done == self.last or not c.background_commit or ckpt.sentinel_present(c.sentinel))
            self.saved_at = self.save(done, wait)

    def update_ahead(self, done: int) -> None:
        """The next update starts now (in the background), under this bookkeeping and the next run's start."""
        source = self.state.rollouts
        self.ahead = self.follows(done) and source is not None and source.start_next(done)

    def record(self, i: int, m: dict[str, float]) -> None:
        """The iteration's records queued; evals that finished recorded; the progress shown."""
        RECORDS.submit(leases.record, self.cfg.experiment)  # engines recreated meanwhile are new processes
        self.evals |= collect(self.cfg, self.pending, wait=self.cfg.eval.blocking)
        self.history.append(m)
        self.progress.update(i + 1, m, self.evals)  # type: ignore[union-attr]  # artifact, log line, bar, curves
        control = self.control
        self.settle(wait=control.paused or control.stopping)  # type: ignore[union-attr]  # a failed save raises

    def ends_after(self, done: int) -> bool:
        """Whether the run ends after `done` iterations: its last, or a stop while paused (a pause holds
        here until resumed; its iterations are saved first)."""
        control = self.control
        assert control is not None
        if done == self.last or (not self.ahead and control.hold(partial(self.save, done))):
            self.last = done  # hold() is True on /stop: the iterations done are saved by now
            return True
        return False

    # ------------------------------------------------------------------ checkpoints

    def save(self, done: int, wait: bool = True) -> float:
        """Checkpoint `done` iterations: every rank's write is queued now, ahead of any later call to the
        ranks, and the commit runs in the background (tasks/checkpoint.py `start_save`); `wait`: committed
        (and the sentinel file removed, if any) before this returns. Returns when it started."""
        enter_stage("checkpoint")
        RECORDS.wait()  # a checkpoint is committed only after the records of the iterations it holds
        if self.state.rollouts is not None:
            self.state.rollouts.persisted(done)  # and the batches generated before it
        start_save(self.cfg, done)
        if wait:
            self.settle()
            if ckpt.sentinel_present(self.cfg.checkpoint.sentinel):
                ckpt.remove_sentinel(self.cfg.checkpoint.sentinel)
        return time.monotonic()

    def settle(self, wait: bool = True) -> None:
        """Record the checkpoint committed in the background (its error raised here): `wait` for it, or
        only if it is done already."""
        if not wait and save_pending(self.cfg) is not None:
            return
        if (done := finish_save(self.cfg)) is not None:
            get_run_logger().info("checkpoint: %s", done[1])
            self.control.saved(done[0])  # type: ignore[union-attr]

    # ------------------------------------------------------------------ recovery (flows/recovery.py)

    def recover(self, i: int, failed: int, dead: list[str], error: Exception) -> int:
        """Rebuild the trainer group from the latest committed checkpoint; returns its step (the iteration
        to run next). Past `fault_tolerance.max_trainer_recoveries`, raises TrainerGroupLost."""
        cfg, control = self.cfg, self.control
        assert control is not None
        done, bound_ = control.counters["trainer_recoveries"], cfg.fault_tolerance.max_trainer_recoveries
        first_line = next(iter(str(error).splitlines()), "")  # Ray's actor-death text runs to a dozen lines
        what = f"trainer rank(s) {', '.join(dead)} died during iteration {failed} ({type(error).__name__}: {first_line})"
        if done >= bound_:
            raise TrainerGroupLost(
                f"{what}; this run already recovered {done} time(s) and fault_tolerance.max_trainer_recoveries="
                f"{bound_}, so it gives up. Look in the rank's Ray worker log for why it died; a new run of the "
                f"experiment resumes from its latest checkpoint (resume=auto), or raise the bound") from error
        enter_stage("recovering trainers")
        t0 = time.perf_counter()
        source = self.state.rollouts
        if source is not None:
            source.drain()  # the engines finish the batch they are generating before the restored policy lands
        if (saved := finish_save(cfg, raise_errors=False)) is not None:  # committed in the background
            control.saved(saved[0])  # before the rank died, so the restore below may take it
        recreate_trainers(cfg)
        found = find_checkpoints(cfg.model_copy(update={"resume": "auto"})) or find_checkpoints(cfg)
        restored = restore(cfg, found)
        if cfg.cluster.colocate and cfg.cluster.hand_over:  # the rank may have died with the engines' memory released
            hand_back_to_engines(cfg)
        initial_push(cfg, restored["step"], True)  # the engines serve the restored policy, whatever they held
        if source is not None:
            source.restart(restored["step"])  # batches from the checkpoint's step on, as a resumed run makes them
        control.counters["trainer_recoveries"] += 1
        seconds = time.perf_counter() - t0
        line = (f"recovery {done + 1}/{bound_}: {what}; rebuilt the trainer group from "
                f"{found[0][0].url if found else cfg.model.path} in {seconds:.1f} s; re-running iterations "
                f"{restored['step']}..{i}")
        get_run_logger().warning(line)
        control.recoveries.append({"recovery": done + 1, "iteration": failed, "dead_ranks": ", ".join(dead),
                                   "restored_step": restored["step"], "seconds": round(seconds, 2),
                                   "error": f"{type(error).__name__}: {first_line}"[:300]})
        create_table_artifact(control.recoveries, key=artifact_key(cfg.experiment, "trainer-recoveries"),
                              description="Trainer-rank recoveries of this run "
                                          f"(fault_tolerance.max_trainer_recoveries={bound_})")
        return restored["step"]
