"""Scheduler state of the embedded engine: request queue, pause/abort, weight session, memory tags.

Requests queue up; one worker thread takes everything queued and decodes it as one batch
(concurrent requests merge instead of waiting for each other; none can corrupt another).
Between decode steps the worker passes a checkpoint where pauses park it and aborts land.
Weight writes never run during a forward pass (the generator's lock). As in SGLang, a weight
update waits for running requests to finish unless generation is paused.
Departures: pause modes "retract" and "in_place" both park in place; on CPU memory release/resume
only track state (on a GPU the generator frees and restores its cache, graphs and weights).
"""
from __future__ import annotations

import threading
import uuid
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field

from reflow.engines.embedded.generator import Generator, SamplingConfig

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class EngineStateError(Exception):
    """A control-plane call arrived in a state that does not allow it (answered with 400)."""


@dataclass
class _Job:
    """One /generate request: its prompts expanded, and a future for its records."""

    prompts: list[list[int]]
    cfgs: list[SamplingConfig]
    ns: list[int]
    rids: list[str]
    logprob_starts: list[int | None] | None = None  # per prompt: input logprobs from this token (None: none)
    close: tuple[list[int], int] | None = None  # (group per prompt, complete): a closing call (Generator.generate)
    future: Future = field(default_factory=Future)


class EngineState:
    """Everything the endpoints share: queue, pause, aborts, weight session, memory tags."""

    def __init__(self, generator: Generator, server_info: dict, storage=None):
        self.gen, self.info = generator, dict(server_info)
        self.storage = storage  # StorageAccess for update_weights_from_disk of a storage URL (None: defaults)
        self.cond = threading.Condition()
        self.queue: list[_Job] = []
        self.running: list[_Job] = []
        self.paused_mode: str | None = None  # None = not paused
        self.aborted: dict[str, str] = {}  # rid -> abort message, for running jobs
        self.session_open = False
        self.groups: dict = {}  # group_name -> weight-update process group (reflow.engines.weights.group)
        self.mapping: tuple[str, list] | None = None  # (id, named tensors) mapped by /reflow/map_weights
        self.local_control: dict | None = None  # where the local socket is, while the app runs (local_control.py)
        self.mapping_adopted = False  # whether the weights were laid out as the mapping (generator.adopt_layout)
        self.writers = 0  # weight writes in progress
        self.released: set[str] = set()
        self.memory_events: list[tuple[str, list[str]]] = []
        self.counters = {"generate_requests": 0, "sequences": 0}  # /generate work accepted since start
        self._stop = False
        self.worker = threading.Thread(target=self._loop, name="engine-generate", daemon=True)
        self.worker.start()

    # ------------------------------------------------------------ generation

    def submit(self, job: _Job, count: bool = True) -> Future:
        """Queue a job; `count`: tally it in `counters` (health probes are not counted)."""
        with self.cond:
            if not self.worker.is_alive():
                raise RuntimeError("the engine's generation worker thread has died; restart the engine")
            if self.released & {"weights", "kv_cache"}:
                raise EngineStateError(f"engine memory is released ({sorted(self.released)}): "
                                       f"call /resume_memory_occupation before generating")
            self.queue.append(job)
            if count:
                self.counters["generate_requests"] += 1
                self.counters["sequences"] += len(job.rids)
            self.cond.notify_all()
        return job.future

    def _loop(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self._stop or (self.queue and self.paused_mode is None
                                                          and not self.writers))
                if self._stop:
                    return
                # a closing job runs alone (its closing cuts every row of its call); the others merge up to it
                k = next((i for i, j in enumerate(self.queue) if j.close is not None), len(self.queue))
                take = max(k, 1)
                jobs, self.queue = self.queue[:take], self.queue[take:]
                self.running = jobs
            try:
                self._run(jobs)
            finally:
                with self.cond:
                    self.running = []
                    self.aborted.clear()
                    self.cond.notify_all()

    def _run(self, jobs: list[_Job]) -> None:
        prompts = [p for j in jobs for p in j.prompts]
        try:
            recs = self.gen.generate(prompts, [c for j in jobs for c in j.cfgs], [k for j in jobs for k in j.ns],
                                     [r for j in jobs for r in j.rids], checkpoint=self._checkpoint,
                                     close=jobs[0].close if len(jobs) == 1 else None)
        except Exception as e:  # deliberate: every waiting request gets the failure, the worker lives on
            for j in jobs:
                j.future.set_exception(e)
            return
        for j in jobs:
            size = sum(j.ns)
            mine, recs = recs[:size], recs[size:]
            try:
                self._add_input_logprobs(j, mine)
            except Exception as e:  # deliberate: this request gets the failure, the others their records
                j.future.set_exception(e)
                continue
            j.future.set_result(mine)

    def _add_input_logprobs(self, job: _Job, recs: list[dict]) -> None:
        """Teacher-forced logprobs of the prompt (logprob_start_len >= 0), computed here in the worker so
        they see the same weights as the samples; every sample of a prompt carries its prompt's."""
        if not job.logprob_starts:
            return
        k = 0
        for prompt, n, start in zip(job.prompts, job.ns, job.logprob_starts):
            if start is not None and start >= 0:
                values = self.gen.input_logprobs(prompt, start)
                entries = [[v, t, None] for v, t in zip(values, prompt[start:])]
                for rec in recs[k:k + n]:
                    if rec["finish_reason"].get("type") != "abort":
                        rec["input_token_logprobs"] = entries
            k += n

    def _checkpoint(self, rids: list[str]) -> dict[str, str]:
        """Between decode steps: park while paused in place; report the rows to abort."""
        with self.cond:
            self.cond.wait_for(lambda: self.paused_mode in (None, "abort") or self._stop)
            return {r: self.aborted[r] for r in rids if r in self.aborted}

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "Aborted") -> None:
        with self.cond:
            for job in list(self.queue):
                if abort_all or rid in job.rids:
                    self.queue.remove(job)
                    job.future.set_result(self._aborted_records(job, message))
            for job in self.running:
                for r in job.rids:
                    if abort_all or r == rid:
                        self.aborted[r] = message
            self.cond.notify_all()

    @staticmethod
    def _aborted_records(job: _Job, message: str) -> list[dict]:
        return [{"output_ids": [], "text": "", "output_token_logprobs": [], "prompt_tokens": len(p),
                 "completion_tokens": 0, "id": rid if k == 1 else uuid.uuid4().hex,
                 "finish_reason": {"type": "abort", "message": message}}
                for p, k, rid in zip(job.prompts, job.ns, job.rids) for _ in range(k)]

    def load(self) -> dict:
        with self.cond:
            running = sum(sum(j.ns) for j in self.running)
            waiting = sum(sum(j.ns) for j in self.queue)
        return {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
                "max_running_requests": self.gen.max_batch_size}

    def close(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        self.abort(abort_all=True, message="engine shut down")

    # ------------------------------------------------------------ control plane

    def pause(self, mode: str) -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise EngineStateError(f"pause mode must be 'abort', 'retract' or 'in_place', got {mode!r}")
        with self.cond:
            self.paused_mode = mode
        if mode == "abort":
            self.abort(abort_all=True, message="Abort by pause_generation")

    def resume(self) -> None:
        with self.cond:
            self.paused_mode = None
            self.cond.notify_all()

    @contextmanager
    def paused(self, mode: str):
        """Generation paused in `mode` inside; the pause state found before, after (a pause the caller
        had set stays)."""
        with self.cond:
            before = self.paused_mode
        self.pause(mode)
        try:
            yield
        finally:
            with self.cond:
                self.paused_mode = before
                self.cond.notify_all()

    def busy_unpaused(self) -> bool:
        with self.cond:
            return bool(self.running or self.queue) and self.paused_mode is None

    @contextmanager
    def writing(self):
        """Hold while writing weights: waits until nothing runs or generation is paused, and keeps
        new batches from starting meanwhile (no batch sees half-written weights)."""
        with self.cond:
            self.cond.wait_for(lambda: not self.running or self.paused_mode is not None or self._stop)
            if "weights" in self.released:
                raise EngineStateError("weights are released: call /resume_memory_occupation "
                                       "with tags ['weights'] before updating them")
            self.writers += 1
        try:
            yield
        finally:
            with self.cond:
                self.writers -= 1
                self.cond.notify_all()

    def require_session(self, endpoint: str) -> None:
        if not self.session_open:
            raise EngineStateError(f"{endpoint} must run between begin_weight_update() and end_weight_update()")

    def set_session(self, open_: bool) -> None:
        with self.cond:
            if open_ and self.session_open:  # SGLang's texts (scheduler weight updater)
                raise EngineStateError("a weight-update session is already open; call end_weight_update() first")
            if not open_ and not self.session_open:
                raise EngineStateError("no weight-update session is open; call begin_weight_update() first")
            self.session_open = open_

    def release(self, tags: list[str] | None, release: bool) -> None:
        tags = list(MEMORY_TAGS) if tags is None else tags
        unknown = set(tags) - set(MEMORY_TAGS)
        if unknown:
            raise EngineStateError(f"unknown memory tags {sorted(unknown)}; valid tags are {list(MEMORY_TAGS)}")
        with self.cond:
            if release and self.running and self.paused_mode is None:
                raise EngineStateError("cannot release memory while requests run: pause_generation first")
            clash = set(tags) & self.released if release else set(tags) - self.released
            if clash:
                state = "already released" if release else "not released"
                raise EngineStateError(f"memory tags {sorted(clash)} are {state}")
            self.released = self.released | set(tags) if release else self.released - set(tags)
            (self.gen.release_memory if release else self.gen.resume_memory)(set(tags))
            # Kept for tests of colocated mode: the order of releases/resumes is the contract.
            self.memory_events.append(("release" if release else "resume", sorted(tags)))
