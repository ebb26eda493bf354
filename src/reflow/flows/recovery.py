"""The fault-tolerance controller of the policy's trainer ranks: a rank that dies mid-iteration costs
the iterations since the last checkpoint, not the run.

While an iteration runs, a watcher thread reads Ray's record of every policy rank once a second
(infra/control.ray_record: no call into a rank, which may be busy or stuck in a collective). When one
is DEAD it kills the others: they would wait for the dead one inside a collective until gloo's timeout
(30 minutes), and a group that lost a rank cannot rejoin its process group anyway. The iteration then
fails, and the controller
  1. rebuilds the group (fresh ranks, infra/runtime.recreate_trainers),
  2. restores the latest committed checkpoint into it (the run's starting point when there is none)
     and pushes those weights to the engines,
  3. re-runs the iterations since that checkpoint (none with checkpoint.save_interval=1: it holds the
     data cursor and RNG states, so they repeat exactly) and then the interrupted one.
Each recovery is a warning in the parent flow run's log, a row of its `<experiment>-trainer-recoveries`
table artifact and one more `trainer_recoveries` on the control API (/health, /metrics). After
`fault_tolerance.max_trainer_recoveries` of them, the next dead rank fails the run with a message that
names the setting. Engines that die are recreated by the push (infra/runtime.ensure_engines); a
dead PPO critic rank still fails the run.
"""
from __future__ import annotations

import threading
import time

import ray
from prefect import get_run_logger
from prefect.artifacts import create_table_artifact

from reflow.flows import async_rollout
from reflow.flows.iteration import run_iteration
from reflow.infra.cluster.runtime import get_runtime, recreate_trainers
from reflow.infra.config.schema import RunConfig
from reflow.infra.ops.control import RunControl, enter_stage, ray_record
from reflow.tasks.checkpoint import find_checkpoints, finish_save, restore
from reflow.tasks.report import artifact_key
from reflow.tasks.rollout import drop_started_generation
from reflow.tasks.train import initial_push

WATCH_EVERY_S = 1.0
DEATH_RECORD_WAIT_S = 10.0  # a caller may hear of an actor's death before Ray's record of it says DEAD


class TrainerGroupLost(RuntimeError):
    """A trainer rank died and the run has used up its recoveries."""


class RankWatch:
    """While open: every WATCH_EVERY_S, Ray's record of each policy rank; on a DEAD one, kill the rest."""

    def __init__(self, cfg: RunConfig):
        self.group = get_runtime(cfg).trainers
        self.dead: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="reflow-rank-watch", daemon=True)

    def __enter__(self) -> RankWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def check(self) -> list[str]:
        """Names of the ranks Ray records DEAD (their survivors killed, once)."""
        if not self.dead:
            rows = [ray_record(a) | {"name": f"{self.group.name_prefix}-trainer-{r}"}
                    for r, a in enumerate(self.group.actors)]
            self.dead = [row["name"] for row in rows if row["state"] == "DEAD"]
            if self.dead:
                self.group.kill()  # the survivors would wait in a collective for the dead rank
        return self.dead

    def _loop(self) -> None:
        while not self._stop.wait(WATCH_EVERY_S) and not self.check():
            pass


def run_recovering(cfg: RunConfig, i: int, control: RunControl, extra: dict[str, float] | None = None) -> dict[str, float]:
    """Iteration `i` (flows/iteration.run_iteration, `extra` recorded with it), recovered from dead trainer
    ranks as the module says."""
    j = i
    while True:
        watch, control.iteration = RankWatch(cfg), j
        try:
            with watch:
                m = run_iteration(cfg, j, extra if j == i else None)
        except Exception as e:  # deliberate: only a dead rank is recovered; anything else is raised as it came
            if not _dead_ranks(watch, e):
                raise
            j = _recover(cfg, i, j, watch.dead, control, e)
            continue
        if j == i:
            return m
        j += 1


def _dead_ranks(watch: RankWatch, error: Exception) -> list[str]:
    """The ranks Ray records DEAD; after an actor-death error, waiting a moment for the record to say so."""
    death = any(isinstance(x, ray.exceptions.RayActorError) for x in (error, getattr(error, "cause", None)))
    deadline = time.monotonic() + (DEATH_RECORD_WAIT_S if death else 0.0)
    while not watch.check() and time.monotonic() < deadline:
        time.sleep(0.2)
    return watch.dead


def _recover(cfg: RunConfig, i: int, failed: int, dead: list[str], control: RunControl, error: Exception) -> int:
    """Rebuild the trainer group from the latest committed checkpoint; returns its step (the iteration to
    run next). Past the bound, raises TrainerGroupLost."""
    done, bound = control.counters["trainer_recoveries"], cfg.fault_tolerance.max_trainer_recoveries
    first_line = next(iter(str(error).splitlines()), "")  # Ray's actor-death text runs to a dozen lines
    what = f"trainer rank(s) {', '.join(dead)} died during iteration {failed} ({type(error).__name__}: {first_line})"
    if done >= bound:
        raise TrainerGroupLost(
            f"{what}; this run already recovered {done} time(s) and fault_tolerance.max_trainer_recoveries={bound}, "
            f"so it gives up. Look in the rank's Ray worker log for why it died; a new run of the experiment "
            f"resumes from its latest checkpoint (resume=auto), or raise the bound") from error
    enter_stage("recovering trainers")
    t0 = time.perf_counter()
    ahead = async_rollout.current(cfg)
    if ahead is not None:
        ahead.drain()  # the engines finish the batch they are generating before the restored policy lands
    drop_started_generation(cfg)  # by the policy the restore replaces
    if (saved := finish_save(cfg.experiment, raise_errors=False)) is not None:  # committed in the background
        control.saved(saved[0])  # before the rank died, so the restore below may take it
    recreate_trainers(cfg)
    found = find_checkpoints(cfg.model_copy(update={"resume": "auto"})) or find_checkpoints(cfg)
    restored = restore(cfg, found)
    initial_push(cfg, restored["step"], True)  # the engines serve the restored policy, whatever they held
    if ahead is not None:
        ahead.restart(restored["step"])  # batches from the checkpoint's step on, as a resumed run makes them
    control.counters["trainer_recoveries"] += 1
    seconds = time.perf_counter() - t0
    line = (f"recovery {done + 1}/{bound}: {what}; rebuilt the trainer group from "
            f"{found[0][0].url if found else cfg.model.path} in {seconds:.1f} s; re-running iterations "
            f"{restored['step']}..{i}")
    get_run_logger().warning(line)
    control.recoveries.append({"recovery": done + 1, "iteration": failed, "dead_ranks": ", ".join(dead),
                               "restored_step": restored["step"], "seconds": round(seconds, 2),
                               "error": f"{type(error).__name__}: {first_line}"[:300]})
    create_table_artifact(control.recoveries, key=artifact_key(cfg.experiment, "trainer-recoveries"),
                          description=f"Trainer-rank recoveries of this run (fault_tolerance.max_trainer_recoveries={bound})")
    return restored["step"]
