"""Calls into user code (reward functions, tools) that the caller waits for at most a deadline.

`asyncio.wait_for` cannot interrupt a coroutine that blocks instead of awaiting, and nothing interrupts
a call made in the caller's own thread; so the call runs in a daemon thread of its own and the caller
waits for its future. Past the deadline the caller goes on (it raises) and never reads the late answer.
Python cannot kill a thread: the abandoned call is asked to stop by raising `Abandoned` in its thread
(CPython's PyThreadState_SetAsyncExc), which ends a call looping in Python at its next bytecode; a call
blocked in C (time.sleep, a socket read) ends when that returns, and its result is dropped. A daemon
thread never holds up the process's exit, so a failed run or `reflow config --check` still ends at once.
"""
from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")


class Terminated(SystemExit):
    """The process was asked to stop (infra/console turns SIGTERM into this) while user code ran in the main
    thread, e.g. a reward module's import: never taken for that code's own failure (which SystemExit is)."""


class Abandoned(BaseException):
    """Raised in a call whose caller stopped waiting for it (a BaseException, so that a user's
    `except Exception` does not swallow it)."""


class Call(Generic[T]):
    """`fn()` running in a daemon thread named `name`; its result, or whatever it raised (SystemExit and
    KeyboardInterrupt too: user code raising them has failed, the caller says so), lands in `future`."""

    def __init__(self, fn: Callable[[], T], name: str) -> None:
        self.future: Future[T] = Future()
        self._lock = threading.Lock()  # abandon() raises in the thread only while fn still runs
        self._running = True
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], T]) -> None:
        if not self.future.set_running_or_notify_cancel():  # cancelled before it began (running: it cannot be)
            self._done()
            return
        try:
            try:
                result = fn()
            except BaseException as e:  # deliberate: handed to the caller through the future
                self._done()
                self.future.set_exception(e)
            else:
                self._done()
                self.future.set_result(result)
        except Abandoned:  # arrived as fn ended: the caller no longer reads the outcome
            pass

    def _done(self) -> None:
        with self._lock:
            self._running = False

    def abandon(self, grace_s: float = 0.0) -> None:
        """The caller stopped waiting: after `grace_s` for the call to end by itself, raise `Abandoned` in it
        if it still runs (never in another thread: the lock keeps the thread alive until the flag is down)."""
        self._thread.join(grace_s)
        with self._lock:
            if self._running and self._thread.ident is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread.ident),
                                                           ctypes.py_object(Abandoned))
