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
dead PPO critic rank still fails the run. The loop and the recovery steps are the run session's
(flows/session.py `RunSession.iterate`, `recover`); this module watches the ranks.
"""
from __future__ import annotations

import threading
import time

import ray

from reflow.infra.cluster.runtime import get_runtime
from reflow.infra.config.schema import RunConfig
from reflow.infra.ops.control import ray_record

WATCH_EVERY_S = 1.0
DEATH_RECORD_WAIT_S = 10.0  # a caller may hear of an actor's death before Ray's record of it says DEAD


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


def dead_ranks(watch: RankWatch, error: Exception) -> list[str]:
    """The ranks Ray records DEAD; after an actor-death error, waiting a moment for the record to say so."""
    death = any(isinstance(x, ray.exceptions.RayActorError) for x in (error, getattr(error, "cause", None)))
    deadline = time.monotonic() + (DEATH_RECORD_WAIT_S if death else 0.0)
    while not watch.check() and time.monotonic() < deadline:
        time.sleep(0.2)
    return watch.dead
