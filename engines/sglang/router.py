"""Several engines behind one /generate URL: sglang-router when installed, else a small proxy of ours.

Only the data plane goes through a router (as with sglang-router); weight pushes, pauses and
memory release still go to each engine directly.

`Router` (ours) is a least-loaded proxy: each /generate goes to the live worker with the fewest
requests in flight from this router. When a worker cannot be reached or drops the connection
(its process died), it is deregistered and the request is sent again to another worker, so a
rollout survives losing an engine (the lost engine's partial work is redone). HTTP errors the
engine itself answers (400 ...) pass through unchanged: retrying a bad request cannot help.
Workers register/deregister with sglang-router's endpoints: POST /add_worker?url=..,
POST /remove_worker?url=.., GET /list_workers.

Authentication: the router and its workers share the runtime's API key. Every endpoint but
/health needs it as a bearer token (reflow.engines.http_serve.HttpGuard, SGLang's rule), and the
router sends it to the workers on /generate. So a worker joins only when the runtime launched it
(the worker list the router starts with) or someone holding the key adds it: the router actor's
own add_worker over Ray, or /add_worker with the key. (A worker added by URL gets the key with
every request, so adding must never be open.) sglang-router gets the same key as `--api-key`,
which it also passes to the workers it was started with.

Hostable as a Ray actor (url(), ready(), shutdown(), add_worker(), remove_worker(), api_key()),
served by uvicorn in a thread on a socket bound to port 0, like the embedded engine.
"""
from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

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


class WorkerPool:
    """Live workers and their in-flight request counts (one event loop touches it)."""

    def __init__(self, urls: list[str]):
        self.inflight: dict[str, int] = {u.rstrip("/"): 0 for u in urls}
        self.dead: list[str] = []

    def add(self, url: str) -> None:
        self.inflight.setdefault(url.rstrip("/"), 0)

    def remove(self, url: str, dead: bool = False) -> bool:
        found = self.inflight.pop(url.rstrip("/"), None) is not None
        if found and dead:
            self.dead.append(url)
        return found

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

    @app.post("/add_worker")
    async def add_worker(url: str):
        pool.add(url)
        return {"status": "ok", "message": f"Successfully added worker: {url}"}

    @app.post("/remove_worker")
    async def remove_worker(url: str):
        if not pool.remove(url):
            return JSONResponse({"error": {"message": f"worker {url} is not registered"}}, status_code=404)
        return {"status": "ok", "message": f"Successfully removed worker: {url}"}

    @app.get("/list_workers")
    async def list_workers():
        return {"urls": list(pool.inflight), "dead": pool.dead, "inflight": dict(pool.inflight)}

    @app.get("/health")
    async def health():
        return Response(status_code=200 if pool.inflight else 503)

    return app


class Router:
    """Our least-loaded proxy, served in this process (or Ray actor). `api_key`: the workers' key,
    which the router's own endpoints require too."""

    def __init__(self, worker_urls: list[str], *, api_key: str, host: str = "127.0.0.1", port: int = 0,
                 timeout: float = 600.0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.host, self.pool, self._api_key = host, WorkerPool(worker_urls), check_api_key(api_key)
        self.app = build_router_app(self.pool, timeout, self._api_key, max_body_bytes)
        self.http = ThreadedServer(self.app, host, port, "reflow-router")
        self.port = self.http.port

    def url(self) -> str:
        """Base URL other processes use; a wildcard bind advertises this node's IP."""
        return advertised_url(self.host, self.port)

    def api_key(self) -> str:
        """The key the router and its workers require (asked over Ray by a later flow run)."""
        return self._api_key

    def _request(self, method: str, path: str, **kw) -> httpx.Response:
        return httpx.request(method, f"{self.url()}{path}", headers=bearer(self._api_key), **kw)

    def ready(self, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self._request("GET", "/list_workers", timeout=5.0).status_code == 200:
                    return True
            except httpx.TransportError:  # still starting
                time.sleep(0.05)
        raise TimeoutError(f"router at {self.url()} did not start within {timeout:.0f}s")

    def add_worker(self, url: str) -> None:
        """Register a worker: the trusted path (a Ray call into the router actor, or a process holding the key)."""
        self._request("POST", "/add_worker", params={"url": url}).raise_for_status()

    def remove_worker(self, url: str) -> None:
        self._request("POST", "/remove_worker", params={"url": url}).raise_for_status()

    def workers(self) -> dict:
        return self._request("GET", "/list_workers").json()

    def shutdown(self) -> None:
        self.http.stop()


def sglang_router_available() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


def sglang_router_command(worker_urls: list[str], host: str, port: int, python: str, api_key: str) -> list[str]:
    """sglang-router's launcher (cache-aware routing over the workers); used when it is installed.
    `--api-key` guards the router and is what it sends to the workers it starts with.
    Untested here: the package is not installed on CPU machines."""
    return [python, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls, "--host", host,
            "--port", str(port), "--policy", "cache_aware", "--api-key", check_api_key(api_key)]


class SGLangRouter:
    """sglang-router in a child process, with the same surface as `Router` (its legacy worker API).
    Untested here: sglang-router is not installed on CPU machines."""

    def __init__(self, worker_urls: list[str], *, api_key: str, host: str = "127.0.0.1",
                 python: str = sys.executable):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            self.port = s.getsockname()[1]
        self.host, self._api_key = host, check_api_key(api_key)
        self.proc = subprocess.Popen(sglang_router_command(worker_urls, host, self.port, python, self._api_key),
                                     start_new_session=True)

    url, api_key, _request, ready, remove_worker, workers = (
        Router.url, Router.api_key, Router._request, Router.ready, Router.remove_worker, Router.workers)

    def add_worker(self, url: str) -> None:
        """sglang-router gives a worker added by URL no key unless told one (`api_key`, its legacy
        endpoint's query parameter; the URL may then reach its request log)."""
        self._request("POST", "/add_worker", params={"url": url, "api_key": self._api_key}).raise_for_status()

    def shutdown(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)

