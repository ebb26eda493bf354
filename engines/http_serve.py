"""Serving an ASGI app from inside a Ray actor, and the URL other processes reach it at.

The embedded engine and the router both bind their own socket (port 0 lets the OS pick a free
port, so nothing races for one) and run uvicorn in a daemon thread: no signal handlers, and the
actor's own methods stay free while requests are served.
"""
from __future__ import annotations

import socket
import threading

WILDCARD_HOSTS = ("0.0.0.0", "", "::")


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


class ThreadedServer:
    """`app` served by uvicorn in a daemon thread on a socket bound to (host, port)."""

    def __init__(self, app, host: str, port: int, thread_name: str, **uvicorn_kw):
        import uvicorn

        # proto IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets whose proto says TCP;
        # with proto 0 every response with a body stalls 40 ms (Nagle vs delayed ACK).
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(512)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, **uvicorn_kw))
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
