"""Quick first retries of Prefect API calls the server refused with 503 because SQLite was busy.

Prefect's server answers 503 ("Service Unavailable") when its SQLite database reports a lock it does not
wait for: a transaction that read, then writes after another connection committed (SQLITE_BUSY_SNAPSHOT,
e.g. `create_task_run`, which reads the flow run's labels first, beside the server's own event and log
writers). Its client then retries after 2 s (exponential back-off from 2**1 s, prefect/client/base.py).
Such a lock is gone milliseconds later, and the train loop makes ~10 API calls an iteration: on the GPU
demo 35 of 500 iterations' flow-run starts took 2.0-2.6 s instead of 0.12 s (bench/RESULTS.md 20), 77 s
of a 263 s run. `install()` retries a bare 503 a few times within ~0.64 s first (5 ms, doubling to 320 ms)
and only then hands it to Prefect's own back-off, unchanged; a 503 that names a Retry-After, and every
other status, goes straight to Prefect's handling. The same request is sent again, as Prefect's retry
does.

Why the first retry comes after 5 ms: the refusal is not a lock held for a while but a stale snapshot, which
the retry's fresh transaction does not have. With 50 ms first, 64 of 299 flow runs created ahead of their
iteration on the H200 (an experiment since withdrawn) took 0.57 s instead of 0.20, about 50 + 100 + 200 ms
more (bench/RESULTS.md 23). `busy_retries()` counts the quick
retries this process made (the iteration metric `prefect_busy_retries`)."""
from __future__ import annotations

import asyncio
import functools
import threading
import time
from typing import Any

QUICK_DELAYS_S = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32)
_state: dict[str, bool] = {"installed": False}
_retries = [0]
_count_lock = threading.Lock()


def busy_retries() -> int:
    """Quick retries made in this process so far (every thread, every client)."""
    return _retries[0]


def _counted() -> None:
    with _count_lock:
        _retries[0] += 1


def _busy(response: Any) -> bool:
    return response.status_code == 503 and "retry-after" not in response.headers


def _quick_sync(send):
    @functools.wraps(send)
    def quick(request, *args: Any, **kwargs: Any):
        response = send(request, *args, **kwargs)
        for delay in QUICK_DELAYS_S:
            if not _busy(response):
                break
            response.close()
            _counted()
            time.sleep(delay)
            response = send(request, *args, **kwargs)
        return response
    return quick


def _quick_async(send):
    @functools.wraps(send)
    async def quick(request, *args: Any, **kwargs: Any):
        response = await send(request, *args, **kwargs)
        for delay in QUICK_DELAYS_S:
            if not _busy(response):
                break
            await response.aclose()
            _counted()
            await asyncio.sleep(delay)
            response = await send(request, *args, **kwargs)
        return response
    return quick


def install() -> None:
    """Wrap the `send` that Prefect's HTTP clients retry (sync and async) with the quick retries above;
    once per process."""
    if _state["installed"]:
        return
    from prefect.client import base

    for cls, wrap in ((base.PrefectHttpxSyncClient, _quick_sync), (base.PrefectHttpxAsyncClient, _quick_async)):
        original = cls._send_with_retry

        def patched(self, request, send, *args: Any, _original=original, _wrap=wrap, **kwargs: Any):
            return _original(self, request, _wrap(send), *args, **kwargs)

        cls._send_with_retry = patched  # type: ignore[method-assign]
    _state["installed"] = True
