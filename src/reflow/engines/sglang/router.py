"""Several engines behind one /generate URL: sglang-router when installed, else a small proxy of ours.

Only the data plane goes through a router (as with sglang-router); weight pushes, pauses and
memory release still go to each engine directly.

`Router` (ours) is a least-loaded proxy: each /generate goes to the live worker with the fewest
requests in flight from this router. When a worker cannot be reached or drops the connection
(its process died), it is deregistered and the request is sent again to another worker, so a
rollout survives losing an engine (the lost engine's partial work is redone). HTTP errors the
engine itself answers (400 ...) pass through unchanged: retrying a bad request cannot help.

Both routers serve sglang-router 0.3.2's worker API (read from its source and checked against its
binary in tests/test_sglang_router_api.py), so one client (`WorkersClient`) drives either:
`GET /workers` -> {"workers": [{"id", "url", "is_healthy", "load", ...}], "total", "stats"};
`POST /workers {"url", "api_key"}` -> 202 {"status": "accepted", "worker_id", "url", "location", ...};
`GET|DELETE /workers/{worker_id}` (DELETE -> 202; an unknown id -> 404 WORKER_NOT_FOUND).
sglang-router registers and removes workers in a background job, so the client waits until the list
shows the change. Ours does it at once and also lists the workers it dropped as dead ("dead", an
extension). (sglang-router 0.3.x answers 404 on the older /add_worker, /remove_worker, /list_workers.)

Authentication: the router and its workers share the runtime's API key. Every endpoint but
/health needs it as a bearer token (reflow.engines.http_serve.HttpGuard, SGLang's rule), and the
router sends it to the workers on /generate. So a worker joins only when the runtime launched it
(the worker list the router starts with) or someone holding the key adds it: the router actor's
own add_worker over Ray, or POST /workers with the key. (A worker added by URL gets the key with
every request, so adding must never be open.) sglang-router gets the same key as `--api-key`, read
from stdin by reflow.engines.sglang.keyed_router (never on a command line), which it passes to the
workers it was started with; a worker added later gets no key unless the
body names one, so `WorkersClient.add_worker` always sends it. Ours sends its own key to every
worker and refuses a body naming a different one.

Hostable as a Ray actor (url(), ready(), shutdown(), add_worker(), remove_worker(), workers(),
api_key()); ours is served by uvicorn in a thread on a socket bound to port 0, like the embedded engine.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from reflow.engines.http_serve import (
    DEFAULT_MAX_BODY_BYTES,
    HttpGuard,
    ThreadedServer,
    advertised_url,
    bearer,
    check_api_key,
)


class NoWorkerError(RuntimeError):
    """No live engine is registered with the router."""


class RouterError(RuntimeError):
    """A router did not start, or did not register or remove a worker as asked."""


class WorkerPool:
    """Live workers (url -> id, in-flight request count); one event loop touches it."""

    def __init__(self, urls: list[str]):
        self.inflight: dict[str, int] = {}
        self.ids: dict[str, str] = {}
        self.dead: list[str] = []
        for u in urls:
            self.add(u)

    def add(self, url: str) -> str:
        """Register `url` (again: a no-op); returns its worker id."""
        url = url.rstrip("/")
        self.inflight.setdefault(url, 0)
        return self.ids.setdefault(url, str(uuid.uuid4()))

    def url_of(self, worker_id: str) -> str | None:
        return next((u for u, i in self.ids.items() if i == worker_id), None)

    def remove(self, url: str, dead: bool = False) -> bool:
        url = url.rstrip("/")
        found = self.inflight.pop(url, None) is not None
        self.ids.pop(url, None)
        if found and dead:
            self.dead.append(url)
        return found

    def info(self, url: str) -> dict:
        """One worker as sglang-router's GET /workers lists it."""
        return {"id": self.ids[url], "url": url, "worker_type": "regular", "connection_mode": "HTTP",
                "is_healthy": True, "load": self.inflight[url]}

    def pick(self, exclude: set[str]) -> str:
        live = [u for u in self.inflight if u not in exclude]
        if not live:
            raise NoWorkerError(f"no live engine behind the router (dead: {self.dead})")
        return min(live, key=lambda u: self.inflight[u])


async def forward(pool: WorkerPool, client: httpx.AsyncClient, body: bytes) -> httpx.Response:
    """POST /generate to the least-loaded worker; on a dead worker deregister it and try the next.
    `client` carries the workers' API key."""
    tried: set[str] = set()
    while True:
        url = pool.pick(tried)
        tried.add(url)
        pool.inflight[url] += 1
        try:
            return await client.post(f"{url}/generate", content=body, headers={"content-type": "application/json"})
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError):
            pool.remove(url, dead=True)  # deliberate recovery: the request is retried elsewhere
        finally:
            if url in pool.inflight:
                pool.inflight[url] -= 1


class WorkerSpec(BaseModel):
    """POST /workers body: sglang-router's WorkerConfigRequest, of which ours reads url and api_key
    (labels, priority, ... are accepted and ignored)."""

    model_config = ConfigDict(extra="allow")
    url: str
    api_key: str | None = None


def _not_found(worker_id: str) -> JSONResponse:
    return JSONResponse({"error": f"Worker {worker_id} not found", "code": "WORKER_NOT_FOUND"}, status_code=404)


def build_router_app(pool: WorkerPool, timeout: float, api_key: str,
                     max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The router's endpoints behind `api_key`, which it also sends to the workers."""
    app = FastAPI(title="reflow router")
    app.add_middleware(HttpGuard, api_key=api_key, max_body_bytes=max_body_bytes)
    holder: dict = {}

    def http() -> httpx.AsyncClient:  # created lazily inside the serving loop
        if "client" not in holder:
            holder["client"] = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), headers=bearer(api_key))
        return holder["client"]

    @app.post("/generate")
    async def generate(request: Request):
        try:
            r = await forward(pool, http(), await request.body())
        except NoWorkerError as e:
            return JSONResponse({"error": {"message": str(e)}}, status_code=503)
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    @app.get("/workers")
    async def list_workers():
        n = len(pool.inflight)
        return {"workers": [pool.info(u) for u in pool.inflight], "total": n,
                "stats": {"prefill_count": 0, "decode_count": 0, "regular_count": n}, "dead": list(pool.dead)}

    @app.post("/workers")
    async def add_worker(spec: WorkerSpec):
        if spec.api_key is not None and spec.api_key != api_key:
            return JSONResponse({"error": "reflow's router sends its own API key to every worker; add workers that "
                                          "take that key, without an api_key or with the same one",
                                 "code": "BAD_REQUEST"}, status_code=400)
        url = spec.url.rstrip("/")
        wid = pool.add(url)
        return JSONResponse({"status": "accepted", "worker_id": wid, "url": url, "location": f"/workers/{wid}",
                             "message": "Worker added"}, status_code=202)

    @app.get("/workers/{worker_id}")
    async def get_worker(worker_id: str):
        url = pool.url_of(worker_id)
        return _not_found(worker_id) if url is None else pool.info(url)

    @app.delete("/workers/{worker_id}")
    async def remove_worker(worker_id: str):
        url = pool.url_of(worker_id)
        if url is None:
            return _not_found(worker_id)
        pool.remove(url)
        return JSONResponse({"status": "accepted", "worker_id": worker_id, "message": "Worker removed"},
                            status_code=202)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if pool.inflight else 503)

    return app


class WorkersClient:
    """Drives a router's worker API (see the module docstring); shared by `Router` and `SGLangRouter`,
    which set `host`, `port` and `_api_key`."""

    host: str
    port: int
    _api_key: str
    change_timeout_s = 60.0  # how long sglang-router's background job may take to (de)register a worker

    def url(self) -> str:
        """Base URL other processes use; a wildcard bind advertises this node's IP."""
        return advertised_url(self.host, self.port)

    def api_key(self) -> str:
        """The key the router and its workers require (asked over Ray by a later flow run)."""
        return self._api_key

    def _request(self, method: str, path: str, **kw) -> httpx.Response:
        return httpx.request(method, f"{self.url()}{path}", headers=bearer(self._api_key), **kw)

    def _check_alive(self) -> None:
        """Raise when the router can no longer answer (its process exited)."""

    def ready(self, timeout: float = 60.0) -> bool:
        """Block until GET /workers answers 200; raise RouterError on timeout."""
        deadline, last = time.monotonic() + timeout, "no answer"
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                r = self._request("GET", "/workers", timeout=5.0)
                if r.status_code == 200:
                    return True
                last = f"GET /workers answered HTTP {r.status_code}: {r.text[:200]}"
            except httpx.TransportError as e:  # still starting
                last = f"{type(e).__name__}: {e}"
            time.sleep(0.05)
        raise RouterError(f"router at {self.url()} did not serve GET /workers within {timeout:.0f}s ({last})")

    def _listed(self) -> list[dict]:
        r = self._request("GET", "/workers", timeout=10.0)
        r.raise_for_status()
        return r.json()["workers"]

    def workers(self) -> dict:
        """{"urls": registered worker URLs, "dead": those reflow's router dropped, "workers": GET /workers' list}."""
        r = self._request("GET", "/workers", timeout=10.0)
        r.raise_for_status()
        body = r.json()
        return {"urls": [w["url"] for w in body["workers"]], "dead": body.get("dead", []), "workers": body["workers"]}

    def _wait_until(self, url: str, present: bool, worker_id: str, action: str) -> None:
        deadline = time.monotonic() + self.change_timeout_s
        while (url in [w["url"] for w in self._listed()]) != present:
            if time.monotonic() > deadline:
                job = self._request("GET", f"/workers/{worker_id}", timeout=10.0)
                raise RouterError(f"router at {self.url()} accepted {action} {url} but did not finish it within "
                                  f"{self.change_timeout_s:.0f}s (GET /workers/{worker_id}: HTTP {job.status_code} "
                                  f"{job.text[:300]}); is the worker up and answering /health?")
            time.sleep(0.1)

    def add_worker(self, url: str) -> None:
        """Register a worker and wait until it is listed: the trusted path (a Ray call into the router
        actor, or a process holding the key). The body carries the key for the router to send it."""
        url = url.rstrip("/")
        r = self._request("POST", "/workers", json={"url": url, "api_key": self._api_key}, timeout=30.0)
        r.raise_for_status()
        self._wait_until(url, True, r.json()["worker_id"], "adding")

    def remove_worker(self, url: str) -> None:
        """Deregister a worker by URL (the API removes by id) and wait until it is gone."""
        url = url.rstrip("/")
        listed = self._listed()
        ids = [w["id"] for w in listed if w["url"] == url]
        if not ids:
            raise RouterError(f"worker {url} is not registered with the router at {self.url()} "
                              f"(registered: {[w['url'] for w in listed]})")
        self._request("DELETE", f"/workers/{ids[0]}", timeout=30.0).raise_for_status()
        self._wait_until(url, False, ids[0], "removing")


class Router(WorkersClient):
    """Our least-loaded proxy, served in this process (or Ray actor). `api_key`: the workers' key,
    which the router's own endpoints require too."""

    def __init__(self, worker_urls: list[str], *, api_key: str, host: str = "127.0.0.1", port: int = 0,
                 timeout: float = 600.0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.host, self.pool, self._api_key = host, WorkerPool(worker_urls), check_api_key(api_key)
        self.app = build_router_app(self.pool, timeout, self._api_key, max_body_bytes)
        self.http = ThreadedServer(self.app, host, port, "reflow-router")
        self.port = self.http.port

    def shutdown(self) -> None:
        self.http.stop()


def sglang_router_available() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


def sglang_router_command(worker_urls: list[str], host: str, port: int, python: str, metrics_port: int,
                          log_level: str = "warn") -> list[str]:
    """sglang-router's launcher (cache-aware routing over the workers) through reflow.engines.sglang.keyed_router,
    which reads `--api-key` (it guards the router and is what it sends to the workers it starts with) from stdin.
    Its Prometheus metrics listen on the router's own host, at `metrics_port`: by default they took 0.0.0.0:29000,
    every interface of the node, and a second router there failed to start."""
    return [python, "-m", "reflow.engines.sglang.keyed_router", "--worker-urls", *worker_urls, "--host", host,
            "--port", str(port), "--prometheus-host", host, "--prometheus-port", str(metrics_port),
            "--policy", "cache_aware", "--log-level", log_level]


class SGLangRouter(WorkersClient):
    """sglang-router (its Rust binary, launched by its own launcher through keyed_router) in a child
    process of its own session, with the same surface as `Router`. Its output goes to `log_path`."""

    def __init__(self, worker_urls: list[str], *, api_key: str, host: str = "127.0.0.1",
                 python: str = sys.executable, env: dict | None = None):
        from reflow.engines.sglang.launcher import allocate_ports  # node-wide port leases (see there)

        self.host, self._api_key = host, check_api_key(api_key)
        self.port, self.metrics_port = allocate_ports(2, host)
        self._initial = [u.rstrip("/") for u in worker_urls]
        self.cmd = sglang_router_command(worker_urls, host, self.port, python, self.metrics_port)
        self.log_path = Path(tempfile.gettempdir()) / f"reflow-sglang-router-{self.port}.log"
        with open(self.log_path, "w") as log:  # the child keeps its own handle
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=env)
        assert self.proc.stdin is not None
        with self.proc.stdin:  # the key, off the command line (keyed_router)
            self.proc.stdin.write(f"{self._api_key}\n".encode())

    def ready(self, timeout: float = 60.0) -> bool:
        """Block until it serves GET /workers *and* lists the workers it was started with: its start-up job
        registers them after it begins answering, so a busy machine saw an empty list (`total` 0) right after
        the first 200. Raises RouterError naming the workers still missing at the timeout."""
        deadline = time.monotonic() + timeout
        super().ready(timeout)
        while True:
            missing = sorted(set(self._initial) - {w["url"].rstrip("/") for w in self._listed()})
            if not missing:
                return True
            if time.monotonic() > deadline:
                raise RouterError(f"sglang-router at {self.url()} serves GET /workers but has not registered "
                                  f"{missing} within {timeout:.0f}s (are they up and answering /health?); "
                                  f"its log: {self.log_path}")
            self._check_alive()
            time.sleep(0.05)

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])
            raise RouterError(f"sglang-router exited with code {self.proc.returncode} (python -m "
                              f"reflow.engines.sglang.keyed_router, port {self.port}); last log lines:\n{tail}")

    def shutdown(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # it ignored SIGTERM for 30 s
            self.proc.wait(timeout=10)
