"""Serving an ASGI app from inside a Ray actor, the URL other processes reach it at, and its guard.

The embedded engine and the router both bind their own socket (port 0 lets the OS pick a free
port, so nothing races for one) and run uvicorn in a daemon thread: no signal handlers, and the
actor's own methods stay free while requests are served.

Both apps sit behind `HttpGuard`, one implementation of SGLang 0.5.23's `--api-key` rule
(sglang/srt/utils/auth.py, `decide_request_auth` with only an api key): OPTIONS and the probes
(/health*, /ready*, /metrics*, so /health_generate too) stay open, every other request needs
`Authorization: Bearer <api key>`, compared in constant time, else 401. The guard also caps request
bodies. The key is generated per runtime (infra/cluster/runtime.py) and reaches engines, router and clients
as an argument over Ray; it is never logged or written anywhere.
"""
from __future__ import annotations

import hmac
import json
import secrets
import socket
import threading

WILDCARD_HOSTS = ("0.0.0.0", "", "::")
PROBE_PREFIXES = ("/health", "/ready", "/metrics")  # SGLang's open prefixes (k8s probes, Prometheus)
DEFAULT_MAX_BODY_BYTES = 1 << 30  # far above any /generate batch; weight data travels as handles, not bytes


def node_ip() -> str:
    """This node's IP as Ray sees it; outside Ray, the host's own address."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # deliberate: outside Ray, fall back to the host's own address
        return socket.gethostbyname(socket.gethostname())


def advertised_url(host: str, port: int) -> str:
    """Base URL other processes use; a wildcard bind advertises this node's IP."""
    return f"http://{node_ip() if host in WILDCARD_HOSTS else host}:{port}"


def bounded_h11(max_connections: int, idle_timeout_s: float):
    """uvicorn's h11 protocol, bounded for connections that send nothing: a connection past `max_connections`
    open ones is closed at once, and one that has not begun a request within `idle_timeout_s` is closed (uvicorn
    times out idle keep-alive connections only after a first response, so a peer that connects and stays silent
    held a file descriptor for good: 300 of them took a driver from 10 to 311 open files). A request begun
    in time is served as uvicorn serves it."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.close()
                return
            # uvicorn's own keep-alive timer: data_received cancels it, each response sets it again
            self.timeout_keep_alive_task = self.loop.call_later(idle_timeout_s, self.timeout_keep_alive_handler)

    return BoundedH11Protocol


class ThreadedServer:
    """`app` served by uvicorn in a daemon thread on a socket bound to (host, port), with at most
    `max_connections` connections and silent ones closed after IDLE_TIMEOUT_S (bounded_h11)."""

    MAX_CONNECTIONS = 1024
    IDLE_TIMEOUT_S = 5.0

    def __init__(self, app, host: str, port: int, thread_name: str, max_connections: int = MAX_CONNECTIONS,
                 **uvicorn_kw):
        import uvicorn

        # proto IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets whose proto says TCP;
        # with proto 0 every response with a body stalls 40 ms (Nagle vs delayed ACK).
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(512)
        self.host, self.port = host, self.sock.getsockname()[1]
        # log_config=None: uvicorn's own logging dict would shut down every handler of this process first (the
        # driver's Prefect API log handler among them, flushing its queue: 5.5 s on the H200, bench/RESULTS.md 16);
        # its loggers propagate to the process's handlers instead.
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, log_config=None,
                                                    http=bounded_h11(max_connections, self.IDLE_TIMEOUT_S),
                                                    **uvicorn_kw))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name=thread_name,
                                       daemon=True)
        self.thread.start()

    def url(self) -> str:
        return advertised_url(self.host, self.port)

    def stop(self, timeout: float = 10.0, before_close=None) -> None:
        """Stop serving; `before_close` runs after the server thread ended, before the socket closes."""
        self.server.should_exit = True
        self.thread.join(timeout=timeout)
        if before_close is not None:
            before_close()
        self.sock.close()


# ---------------------------------------------------------------- the API key


def new_api_key() -> str:
    """A fresh random API key (256 bits, URL-safe text), never starting with '-' (see check_api_key)."""
    while (key := secrets.token_urlsafe(32)).startswith("-"):
        pass
    return key


def check_api_key(api_key: object) -> str:
    """`api_key` if usable as a bearer token; an empty key would switch SGLang's check off, and one starting
    with '-' would be read as an option by sglang-router's and SGLang's command lines (`--api-key KEY`)."""
    if not isinstance(api_key, str) or not api_key or not api_key.isascii() or any(c.isspace() for c in api_key):
        raise ValueError("api_key must be a non-empty ASCII string without whitespace (infra/cluster/runtime.py makes one "
                         "per runtime with reflow.engines.http_serve.new_api_key)")
    if api_key.startswith("-"):
        raise ValueError("api_key must not start with '-': the SGLang server's and sglang-router's command lines "
                         "would read it as an option (reflow.engines.http_serve.new_api_key makes none such)")
    return api_key


def bearer(api_key: str | None) -> dict[str, str]:
    """The request header that carries `api_key` (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def auth_refusal(method: str, path: str, authorization: str | None, api_key: str,
                 open_prefixes: tuple[str, ...] = PROBE_PREFIXES) -> str | None:
    """None when SGLang's rule lets the request through, else why not (never echoing what was sent).
    `open_prefixes`: paths served without a key (SGLang's probes; none for reflow's control API)."""
    if method == "OPTIONS" or (open_prefixes and path.startswith(open_prefixes)):
        return None
    if not authorization:
        return "Unauthorized: this endpoint needs an 'Authorization: Bearer <api key>' header; none was sent"
    scheme, sep, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not sep:
        return "Unauthorized: the Authorization header must read 'Bearer <api key>'"
    if not hmac.compare_digest(token.encode("utf-8", "surrogateescape"), api_key.encode()):
        return "Unauthorized: the bearer token does not match this server's API key"
    return None


class HttpGuard:
    """ASGI middleware: the bearer-token check, then a cap on the request body.

    A body whose Content-Length exceeds `max_body_bytes` is refused before it is read (uvicorn
    holds the body to its declared length); a chunked body is read up to the cap, then replayed."""

    def __init__(self, app, api_key: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 open_prefixes: tuple[str, ...] = PROBE_PREFIXES):
        self.app, self.api_key, self.max_body_bytes = app, check_api_key(api_key), int(max_body_bytes)
        self.open_prefixes = tuple(open_prefixes)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers: dict[bytes, bytes] = {}
        for k, v in scope.get("headers", []):
            headers.setdefault(k.lower(), v)  # the first of repeated headers, as Starlette reads them
        authz = headers.get(b"authorization")
        refusal = auth_refusal(scope.get("method", "GET"), scope["path"],
                               None if authz is None else authz.decode("latin-1"), self.api_key, self.open_prefixes)
        if refusal is not None:
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 1008})
            return await _json(send, 401, refusal, [(b"www-authenticate", b"Bearer")])
        if scope["type"] == "http":
            declared = headers.get(b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
                return await _json(send, 413, self._too_large())
            if declared is None and b"chunked" in headers.get(b"transfer-encoding", b"").lower():
                receive = await self._buffered(receive)
                if receive is None:
                    return await _json(send, 413, self._too_large())
        return await self.app(scope, receive, send)

    def _too_large(self) -> str:
        return f"request body is larger than this server's {self.max_body_bytes}-byte limit"

    async def _buffered(self, receive):
        """The whole chunked body as one message, or None once it passes the cap."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left: the app sees that
                return _replay(message, receive)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return None
            more = message.get("more_body", False)
        return _replay({"type": "http.request", "body": b"".join(chunks), "more_body": False}, receive)


def _replay(first: dict, receive):
    """`first`, then the connection's own messages (a later http.disconnect)."""
    pending = [first]

    async def replayed():
        return pending.pop() if pending else await receive()
    return replayed


async def _json(send, status: int, error: str, headers: list | None = None) -> None:
    """SGLang's error shape: {"error": "<message>"}."""
    body = json.dumps({"error": error}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})
