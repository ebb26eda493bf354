"""infra/ops/prefect_retry.py: a Prefect API call the server refused with a bare 503 (SQLite busy) is sent
again within milliseconds, not after Prefect's 2 s back-off; other answers are left to Prefect."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


class _Flaky(BaseHTTPRequestHandler):
    """Answers 503 to the first `busy` requests of each path, then 200 (the server Prefect's client calls)."""
    busy: dict[str, int] = {}
    seen: list[str] = []
    retry_after: str | None = None

    def _answer(self) -> None:
        self.seen.append(self.path)
        left = self.busy.get(self.path, 0)
        if left:
            self.busy[self.path] = left - 1
            body, code = json.dumps({"exception_message": "Service Unavailable"}).encode(), 503
        else:
            body, code = b'{"ok": true}', 200
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        if code == 503 and self.retry_after is not None:
            self.send_header("Retry-After", self.retry_after)
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def flaky():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Flaky.busy, _Flaky.seen, _Flaky.retry_after = {}, [], None
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_busy_503_is_retried_in_milliseconds_sync_and_async(flaky):
    from prefect.client.base import PrefectHttpxAsyncClient, PrefectHttpxSyncClient

    from reflow.infra.ops import prefect_retry

    prefect_retry.install()
    before = prefect_retry.busy_retries()
    _Flaky.busy = {"/flow_runs/": 1, "/task_runs/": 2}
    with PrefectHttpxSyncClient(base_url=flaky, enable_csrf_support=False) as client:
        t0 = time.perf_counter()
        assert client.post("/flow_runs/", json={}).json() == {"ok": True}
        assert time.perf_counter() - t0 < 1.0  # Prefect alone waits 1.6-2.4 s (2**1 s, jitter 0.2)

    async def call() -> float:
        async with PrefectHttpxAsyncClient(base_url=flaky, enable_csrf_support=False) as client:
            t0 = time.perf_counter()
            assert (await client.post("/task_runs/", json={})).json() == {"ok": True}
            return time.perf_counter() - t0
    assert asyncio.run(call()) < 1.0
    assert _Flaky.seen == ["/flow_runs/"] * 2 + ["/task_runs/"] * 3
    assert prefect_retry.busy_retries() - before == 3  # counted (the iteration metric prefect_busy_retries)


def test_a_503_that_outlasts_the_quick_retries_or_names_its_wait_is_prefects_to_handle(flaky):
    from prefect.client.base import PrefectHttpxSyncClient

    from reflow.infra.ops import prefect_retry

    prefect_retry.install()
    quick = len(prefect_retry.QUICK_DELAYS_S)
    _Flaky.busy = {"/long/": quick + 1}  # one more: answered by Prefect's own back-off (~2 s)
    with PrefectHttpxSyncClient(base_url=flaky, enable_csrf_support=False) as client:
        t0 = time.perf_counter()
        assert client.get("/long/").status_code == 200
        assert time.perf_counter() - t0 > 1.5
    assert _Flaky.seen.count("/long/") == quick + 2

    _Flaky.retry_after, _Flaky.busy = "0", {"/named/": 1}  # the server says how long: no quick retry of ours
    with PrefectHttpxSyncClient(base_url=flaky, enable_csrf_support=False) as client:
        assert client.get("/named/").status_code == 200
    assert _Flaky.seen.count("/named/") == 2
