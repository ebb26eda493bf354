"""The background record writer (tasks/report.py `Recorder`) and the iteration flow run's settings
(flows/iteration.py): jobs run in order off the caller's thread, `wait` returns only when all are done
and raises the first failure once, API calls wait while the loop holds the API, and the iteration's
flow run has no heartbeat thread. No Ray, Prefect server or DeepSpeed starts here."""
from __future__ import annotations

import logging
import threading
import time

import pytest

from reflow.tasks.report import Recorder
from tests import prefect_reads


def test_jobs_run_in_order_off_the_callers_thread_and_wait_returns_when_all_are_done():
    rec, go, done = Recorder(), threading.Event(), []
    rec.submit(lambda: (go.wait(5), done.append(("first", threading.current_thread().name))))
    rec.submit(lambda: done.append(("second", threading.current_thread().name)))
    assert done == []  # submit returned while the first job is still blocked
    go.set()
    rec.wait()
    assert [d[0] for d in done] == ["first", "second"]
    assert all(name.startswith("reflow-records") and name != threading.current_thread().name for _, name in done)


def test_wait_raises_the_first_failure_once_and_later_jobs_still_run():
    rec, done = Recorder(), []

    def fail():
        raise OSError("storage is gone")

    rec.submit(fail)
    rec.submit(lambda: done.append(1))
    with pytest.raises(OSError, match="storage is gone"):
        rec.wait()
    assert done == [1]
    assert rec.wait() < 1.0  # nothing pending, nothing raised again


def test_wait_without_raising_logs_the_failure(caplog):
    rec = Recorder()
    rec.submit(lambda: 1 / 0)
    with caplog.at_level(logging.ERROR, logger="reflow.records"):
        rec.wait(raise_errors=False)
    assert any("ZeroDivisionError" in r.getMessage() for r in caplog.records)


def test_api_calls_wait_while_the_loop_holds_the_api_and_seconds_are_counted():
    rec, posted = Recorder(), threading.Event()
    rec.hold_api()
    rec.submit(lambda: (rec.api_turn(), posted.set()))
    assert not posted.wait(0.3)  # held: the record waits
    rec.free_api()
    assert posted.wait(5)
    rec.wait()
    rec.submit(time.sleep, 0.05)
    rec.wait()
    assert 0.05 <= rec.take_seconds() < 5 and rec.take_seconds() == 0.0


def test_the_iteration_flow_run_has_no_heartbeat_and_the_settings_come_back():
    from prefect.settings import get_current_settings

    from reflow.flows.iteration import _without_heartbeat

    before = get_current_settings()
    assert before.flows.heartbeat_frequency is not None  # Prefect's default: a heartbeat thread per flow run
    with _without_heartbeat():
        inside = get_current_settings()
        assert inside.flows.heartbeat_frequency is None
        assert inside.api.url == before.api.url
    with _without_heartbeat():
        assert get_current_settings() is inside  # built once, not per iteration
    assert get_current_settings() is before


def test_artifacts_of_the_background_writer_share_one_tls_context(prefect_server, monkeypatch):
    """Prefect builds a TLS context (CA bundle loaded: ~17 ms of CPU) for every client it makes; the records'
    clients (one per thread, a new one after a lost connection) share one built once per process."""
    import ssl
    from uuid import uuid4

    from prefect import flow
    from prefect.runtime import flow_run

    from reflow.tasks import report

    @flow(name="records-tls")
    def owner() -> str:
        return flow_run.id

    run_id = owner()
    built = []
    real = ssl.create_default_context
    me = threading.get_ident()  # Prefect's own log and event workers make clients on their threads too

    def counting(*a, **k):
        if threading.get_ident() == me:
            built.append(1)
        return real(*a, **k)

    monkeypatch.setattr(ssl, "create_default_context", counting)
    key = f"records-tls-{uuid4().hex[:8]}"
    for i in range(3):
        report.create_artifact("table", key, [{"i": i}], "three in a row", run_id)
    assert len(built) <= 1  # the first one only, when no earlier artifact of this process built it
    assert report._tls_context() is report._tls_context()
    assert len(prefect_reads.artifacts(key)) == 3


def test_records_keep_one_prefect_client_per_thread_and_replace_a_stale_one(prefect_server, monkeypatch):
    """Each new Prefect client fetched a CSRF token before its first write (31 token requests in a 6-iteration
    run, bench probe of 2026-12-02): the writer keeps its client open. A connection that fails (a restarted
    server) gets one fresh client, and the artifact is still created."""
    from uuid import uuid4

    import httpx
    from prefect import flow
    from prefect.client.base import PrefectHttpxSyncClient
    from prefect.runtime import flow_run

    from reflow.tasks import report

    @flow(name="records-client")
    def owner() -> str:
        return flow_run.id

    run_id = owner()
    paths: list[str] = []
    real_send = PrefectHttpxSyncClient.send

    def counting(self, request, *a, **k):
        if threading.get_ident() == me:
            paths.append(request.url.path)
        return real_send(self, request, *a, **k)

    me = threading.get_ident()
    monkeypatch.setattr(PrefectHttpxSyncClient, "send", counting)
    key = f"records-client-{uuid4().hex[:8]}"
    report._CLIENTS.held = None  # as a fresh thread would start
    for i in range(3):
        report.create_artifact("table", key, [{"i": i}], "three in a row", run_id)
    assert sum(p.endswith("/csrf-token") for p in paths) <= 1, paths
    assert sum(p.endswith("/artifacts/") for p in paths) == 3, paths
    first = report._CLIENTS.held[1]

    failed = []

    def once_broken(self, request, *a, **k):  # the server went away under the open connection, once
        if not failed:
            failed.append(request.url.path)
            raise httpx.ConnectError("connection refused", request=request)
        return real_send(self, request, *a, **k)

    monkeypatch.setattr(PrefectHttpxSyncClient, "send", once_broken)
    report.create_artifact("table", key, [{"i": 3}], "after a lost connection", run_id)
    assert failed and report._CLIENTS.held[1] is not first
    assert len(prefect_reads.artifacts(key)) == 4
