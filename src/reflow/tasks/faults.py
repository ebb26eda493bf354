"""Faults: which task failures are worth a retry (transient ones only: engine health, storage I/O),
and the fault-injection points the crash tests use.

A bad request, a reward function that raises, NaN loss or a corrupt checkpoint fail the same way
on every attempt; retrying them would only hide the error behind minutes of repeats.
"""
from __future__ import annotations

import logging
import os
import signal

import httpx
import ray

from reflow.engines.rollout_client import EngineError
from reflow.infra.store.storage import is_transient

log = logging.getLogger("reflow.faults")


def _root(e: BaseException) -> BaseException:
    """The original exception behind Ray's wrapper (a remote function's error)."""
    while isinstance(e, ray.exceptions.RayTaskError) and getattr(e, "cause", None) is not None:
        e = e.cause
    return e


def is_transient_fault(e: BaseException) -> bool:
    e = _root(e)
    if isinstance(e, EngineError):  # no answer, or the engine is overloaded / restarting
        return e.status is None or e.status in (502, 503, 504)
    if isinstance(e, (httpx.TransportError, ray.exceptions.RayActorError)):
        return True
    return is_transient(e)  # storage: connection errors, timeouts, 5xx; never a missing file


def transient_fault(task, task_run, state) -> bool:
    """Prefect `retry_condition_fn`: retry only when the task failed on a transient fault."""
    try:
        state.result()
    except Exception as e:  # deliberate: the state's own exception is what we classify
        return is_transient_fault(e)
    return False


def fault_point(kind: str, step: int) -> None:
    """Fault injection for tests: REFLOW_FAULT_<kind>=<step> SIGKILLs this process here."""
    if os.environ.get(f"REFLOW_FAULT_{kind}") == str(step):
        log.warning("fault injection: REFLOW_FAULT_%s=%d, killing pid %d", kind, step, os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)


class InjectedFault(OSError):
    """What `fault_raise` raises: an I/O error only the crash tests cause."""


def fault_raise(kind: str, step: int) -> None:
    """Fault injection for tests: REFLOW_FAULT_<kind>=<step> raises an I/O error here."""
    if os.environ.get(f"REFLOW_FAULT_{kind}") == str(step):
        raise InjectedFault(f"fault injection: REFLOW_FAULT_{kind}={step}")
