"""The in-process HTTP server every engine, router and the control API run on (engines/http_serve.py)."""
from __future__ import annotations

import logging

import httpx
from fastapi import FastAPI

from reflow.engines.http_serve import ThreadedServer


class _Probe(logging.Handler):
    """A handler of the host process, counting what is done to it."""

    def __init__(self) -> None:
        super().__init__()
        self.flushed = self.closed = 0

    def emit(self, record: logging.LogRecord) -> None:
        pass

    def flush(self) -> None:
        self.flushed += 1

    def close(self) -> None:
        self.closed += 1
        super().close()


def test_starting_a_server_leaves_the_host_process_logging_alone():
    """uvicorn applied its own logging dict, whose first step shuts down every handler of the process: the
    train flow's control API flushed and closed Prefect's API log handler, and the flush waited 5.5 s for
    that handler's queue on the H200 (bench/RESULTS.md 16). A server must leave the host's handlers as they are."""
    probe, root = _Probe(), logging.getLogger()
    root.addHandler(probe)
    try:
        app = FastAPI()
        app.get("/ping")(lambda: {"ok": True})
        server = ThreadedServer(app, "127.0.0.1", 0, "logging-probe")
        try:
            assert httpx.get(f"{server.url()}/ping", timeout=10).json() == {"ok": True}
            assert (probe.flushed, probe.closed) == (0, 0)
            assert probe in root.handlers
        finally:
            server.stop()
    finally:
        root.removeHandler(probe)
