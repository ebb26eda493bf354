"""What the tasks of one `train` flow run share while it runs (RunState), found through a context variable.

The parent flow's session (flows/session.py) binds its state for the run; the iteration flow runs, the
tasks (called in the flow's thread, or submitted: Prefect copies the context into their threads) and the
rollout source's threads (tasks/rollout_source.py passes the context on) all see the same one. A task or
an iteration flow run called on its own (tests, a deployment of the iteration flow) gets a state of its
own: nothing ahead, no checkpoint in flight, as in a fresh process.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reflow.infra.config.schema import RunConfig

if TYPE_CHECKING:  # the modules that define these types read the state: imported for annotations only
    from reflow.infra.store import lineage
    from reflow.tasks.checkpoint import SaveInFlight
    from reflow.tasks.rollout_source import RolloutSource


@dataclass(eq=False)
class RunState:
    """One run's shared driver state (each field's writer in brackets)."""

    experiment: str
    # the batches generated (and updates started) ahead of their flow runs [flows/session.py]
    rollouts: RolloutSource | None = None
    # (batch object id, its update's refs): an update submitted before its flow run [tasks/train.start_update]
    update_ahead: tuple[str, list[Any]] | None = None
    # the checkpoint the live trainer weights continue (None: model.path) [tasks/checkpoint restore and saves]
    parent: lineage.Parent | None = None
    # the checkpoint being committed in the background, at most one [tasks/checkpoint.start_save]
    save_in_flight: SaveInFlight | None = None
    # iteration -> its flow run id, for the checkpoints' lineage [tasks/report.publish_metrics]
    iteration_runs: dict[int, str] = field(default_factory=dict)
    # rollout.partial=carry: iteration -> the groups its batch continues (a ray.ObjectRef of a list, or the list),
    # left by the batch before [tasks/rollout.generate_batch] or read from the checkpoint resumed [tasks/checkpoint.restore]
    carry: dict[int, Any] = field(default_factory=dict)


_CURRENT: ContextVar[RunState | None] = ContextVar("reflow_run_state", default=None)


def run_state(cfg: RunConfig) -> RunState:
    """The state of the experiment's running train flow in this context; a fresh one where there is none."""
    state = _CURRENT.get()
    return state if state is not None and state.experiment == cfg.experiment else RunState(cfg.experiment)


@contextmanager
def bound(state: RunState) -> Iterator[RunState]:
    """`state` is the run's for everything called inside (and the threads and tasks started from there)."""
    token = _CURRENT.set(state)
    try:
        yield state
    finally:
        _CURRENT.reset(token)
