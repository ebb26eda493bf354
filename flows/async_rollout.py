"""Asynchronous rollout (`rollout.max_staleness` = k >= 1): the engines generate the next batches while
the trainer trains.

When the run starts (v = the step it starts from) and whenever an iteration takes its batch, the
prefetcher launches every batch j <= v + k not launched yet, v being the policy the engines serve; a
background thread generates and scores them one after another by that policy (tasks/rollout.py
generate_batch and score_batch, each persisted to the stage cache). Iteration i's flow run takes
batch i (waiting if it is not done yet: `async_trainer_wait_s`) and trains on it at policy i: its staleness i - v is at most k, and truncated
importance sampling corrects it (infra/settings.tis_cap). Before pushing policy i + 1 the flow waits for
the batch being generated (`async_push_wait_s`): a push never lands mid-batch, so every batch has one
version, and which version generates batch j is max(start, j - k) whatever the timing. With seeded
sampling (seeds keyed by j) a batch is then a function of its prompts and that version: runs are
reproducible, and

  checkpoint s is committed only after the batches generated before it (versions < s: batches
  s..s+k-1) are in the stage cache, so a run resumed from s trains on exactly those and generates the
  later ones by the same versions as the uninterrupted run: resume is exact for every k.

Launching when the trainer starts on a batch rather than right after the push overlaps the generation
with the trainer's compute instead of with the flow-run bookkeeping between iterations: on a shared
CPU that bookkeeping (the driver, Prefect's server, the rollout's own Ray tasks) is what the two would
fight over (bench/RESULTS.md section 11).

The update itself can start before its flow run: after iteration i's flow run, when no checkpoint,
pause or stop comes between, the parent flow takes batch i + 1, computes its advantages and submits its
update to the trainer ranks (`start_next`); iteration i + 1's flow run then finds its batch taken and
its `train` task waits for that update (tasks/train.start_update). The flow-run bookkeeping between two
iterations (the records of one, creating the next run) then overlaps the update instead of leaving the
trainer idle; the data, the order of calls on the ranks and what each checkpoint holds are the same.

A batch that fails in the background (an engine lost mid-request) is generated again by the
iteration's own `generate` task (its retries, its engine recreation) at the iteration's policy.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import ray

from reflow.infra import actors
from reflow.infra.config import RunConfig
from reflow.infra.runtime import get_runtime, use_gpus
from reflow.tasks.rollout import BatchRef, advantages, generate_batch, score_batch
from reflow.tasks.train import drop_started_update, start_update

log = logging.getLogger("reflow.async")
_open: dict[str, Prefetcher] = {}  # experiment -> the prefetcher of its running train flow (one per process)
_lock = threading.Lock()


class Prefetcher:
    """Batches generated ahead of the trainer, by the policy version the engines serve."""

    def __init__(self, cfg: RunConfig, version: int):
        self.cfg, self.k, self.version = cfg, cfg.rollout.max_staleness, version
        self.batches: dict[int, tuple[int, Future[BatchRef]]] = {}  # iteration -> (version, its batch)
        self.next = version  # the first batch not launched yet
        self.idle_since: float | None = None  # when the engines finished the last launched batch
        self.yielded: tuple[list[str], dict[str, float]] = ([], {})  # (engine actor ids, what yield_cpu said)
        self.started: tuple[int, BatchRef | None, dict[str, float]] | None = None  # start_next's iteration
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="reflow-prefetch")
        self.yield_cpu()
        self.launch()

    def yield_cpu(self) -> dict[str, float]:
        """Embedded engines on CPU generate only on idle CPU time (EmbeddedEngine.run_in_background): on a
        shared machine their background batches then fill the cores the trainer and the flow leave idle
        rather than slow those two down, which are the loop's critical path. (A run on GPUs is left alone.)"""
        if self.cfg.rollout.backend == "embedded" and not use_gpus(self.cfg):
            engines = get_runtime(self.cfg).engines
            ids = [actors.actor_id(e) for e in engines]
            if ids == self.yielded[0]:  # asked after every push, which may have recreated an engine
                return self.yielded[1]
            policies = ray.get([e.run_in_background.remote() for e in engines], timeout=30)
            if "idle" not in policies:
                log.warning("engines could not switch to SCHED_IDLE (%s): their background generation "
                            "competes with the trainer for CPU", policies)
            self.yielded = (ids, {"async_engines_sched_idle": float(all(p == "idle" for p in policies))})
            return self.yielded[1]
        return {}

    def launch(self) -> None:
        """Start every batch the engines' version may generate (j <= version + k)."""
        while self.next <= self.version + self.k:
            self.batches[self.next] = (self.version, self.pool.submit(self._make, self.next, self.version))
            self.next += 1

    def _make(self, i: int, version: int) -> BatchRef:
        t0 = time.perf_counter()
        batch = score_batch(self.cfg, generate_batch(self.cfg, i, version, log), log)
        self.idle_since = time.monotonic()
        batch.stats["async_generate_s"] = time.perf_counter() - t0
        return batch

    def start_next(self, i: int) -> bool:
        """Take batch i, compute its advantages and submit its update now, ahead of iteration i's flow
        run (see the module docstring); False when there is no update to start (its batch failed, or a
        critic (PPO) must score it first). The flow run's `take` then returns the batch, advantages done."""
        if self.cfg.algorithm.spec.needs_critic:
            return False
        t0 = time.perf_counter()
        batch, waits = self.take(i)
        if batch is not None:
            try:
                batch = advantages.fn(self.cfg, batch)
                start_update(self.cfg, batch)
            except Exception as e:  # deliberate: the flow run generates the batch again, in its tasks' retries
                log.warning("iteration %d: could not start its update ahead (%s: %s)", i, type(e).__name__, e)
                batch, waits["async_fallback"] = None, 1.0
            else:
                waits |= {"async_update_started_ahead": 1.0, "async_start_ahead_s": time.perf_counter() - t0}
        self.started = (i, batch, waits)
        return batch is not None

    def take(self, i: int) -> tuple[BatchRef | None, dict[str, float]]:
        """Batch i, scored (None when its background generation failed: the caller generates it), how long
        the trainer waited for it, and how long the engines sat idle before the batch launched now.
        After `start_next(i)`: what it took, advantages computed and the update submitted."""
        if self.started is not None and self.started[0] == i:
            _, batch, waits = self.started
            self.started = None
            return batch, waits
        if i not in self.batches:  # a re-run after a recovery starts from its checkpoint: launch from there
            self.restart(i)
        _, fut = self.batches.pop(i)
        idle = {"async_engine_idle_s": time.monotonic() - self.idle_since if self.idle_since is not None else 0.0,
                "async_update_started_ahead": 0.0, "async_start_ahead_s": 0.0}
        self.launch()  # the next batch starts now, as the trainer starts on this one (see the module docstring)
        t0 = time.perf_counter()
        try:
            batch = fut.result()
        except Exception as e:  # deliberate: any failure of the background batch falls back to the generate task
            log.warning("iteration %d: its batch failed in the background (%s: %s); generating it now", i,
                        type(e).__name__, next(iter(str(e).splitlines()), ""))
            return None, {"async_trainer_wait_s": time.perf_counter() - t0, "async_fallback": 1.0, **idle}
        return batch, {"async_trainer_wait_s": time.perf_counter() - t0, "async_fallback": 0.0, **idle}

    def drain(self) -> dict[str, float]:
        """Wait for every launched batch (a push must not land mid-batch); failures wait for `take`."""
        t0 = time.perf_counter()
        for _, fut in self.batches.values():
            try:
                fut.result()
            except Exception:  # deliberate: reported by `take`, which generates the batch again
                pass
        return {"async_push_wait_s": time.perf_counter() - t0}

    def pushed(self, version: int) -> dict[str, float]:
        """The engines serve `version` now (the next `take` launches what it may generate)."""
        self.version = version
        return self.yield_cpu()

    def persisted(self, done: int) -> None:
        """Every batch generated before policy `done` is in the stage cache (checkpoint `done` needs them)."""
        for version, fut in list(self.batches.values()):
            if version < done:
                try:
                    ray.get(list(fut.result().saving))
                except Exception:  # deliberate: a failed batch is generated again after a resume
                    pass

    def restart(self, version: int) -> None:
        """Drop what was launched (after waiting for it: never push under a running batch) and start
        again from `version` (a recovery restored the trainers to it)."""
        self.drain()
        self.batches.clear()
        self.started = None
        drop_started_update(self.cfg)  # submitted to the ranks the recovery replaced
        self.version = self.next = version
        self.launch()

    def close(self) -> None:
        drop_started_update(self.cfg)
        self.drain()
        self.pool.shutdown(wait=True)


def open_prefetcher(cfg: RunConfig, version: int) -> Prefetcher | None:
    """The run's prefetcher (engines serving `version`), or None for the synchronous loop (k = 0)."""
    if not cfg.rollout.max_staleness:
        return None
    with _lock:
        _open[cfg.experiment] = p = Prefetcher(cfg, version)
    return p


def current(cfg: RunConfig) -> Prefetcher | None:
    """The prefetcher of the experiment's running train flow; None when there is none (k = 0, or an
    iteration flow run called on its own)."""
    return _open.get(cfg.experiment)


def start_next(cfg: RunConfig, i: int) -> bool:
    """Iteration i's update submitted ahead of its flow run (Prefetcher.start_next); False for k = 0."""
    p = current(cfg)
    return p is not None and p.start_next(i)


def close_prefetcher(cfg: RunConfig) -> None:
    with _lock:
        p = _open.pop(cfg.experiment, None)
    if p is not None:
        p.close()
