"""The embedded rollout engine: a HF model behind SGLang's HTTP API, hostable as a Ray actor.

A plain class; the caller wraps it, e.g.
    ray.remote(EmbeddedEngine).options(name="engine-0", namespace=ns, num_cpus=1)
       .remote(model_path=..., engine_id="engine-0", threads=1)
then `url()` and `ready()`. The HTTP server binds its own socket (port 0 lets the OS pick a free
port, so engines never race for one) and runs uvicorn in a background thread: no signal
handlers, and the actor's own methods stay free while requests are served.
"""
from __future__ import annotations

import socket
import threading

import torch

from engines.engine_server import build_app
from engines.generator import Generator
from engines.hf_io import load_causal_lm, load_tokenizer, resolve_checkpoint
from engines.rollout_client import poll_health

SGLANG_API_VERSION = "0.5.23"  # the SGLang release whose HTTP contract this engine serves


class EmbeddedEngine:
    """Loads the checkpoint, starts the server, answers where it is and whether it is ready."""

    def __init__(self, model_path: str, engine_id: str, host: str = "127.0.0.1", port: int = 0,
                 threads: int = 1, max_batch_size: int = 256, dtype: str = "fp32"):
        import uvicorn

        torch.set_num_threads(threads)  # Ray actors default to 1 OMP thread; make it deliberate
        self.engine_id, self.host = engine_id, host
        local = str(resolve_checkpoint(model_path))
        self.generator = Generator(load_causal_lm(model_path, dtype), load_tokenizer(model_path),
                                   max_batch_size=max_batch_size, threads=threads)
        info = {"model_path": model_path, "tokenizer_path": model_path, "local_path": local,
                "engine_id": engine_id, "version": SGLANG_API_VERSION, "threads": threads}
        self.app = build_app(self.generator, info)
        # proto IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets whose proto says TCP;
        # with proto 0 every response with a body stalls 40 ms (Nagle vs delayed ACK).
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(512)
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, timeout_keep_alive=75)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name=f"uvicorn-{engine_id}", daemon=True)
        self._thread.start()

    def url(self) -> str:
        """Base URL other processes use to reach this engine."""
        host = self.host
        if host in ("0.0.0.0", "", "::"):
            host = _node_ip()
        return f"http://{host}:{self.port}"

    def _check_thread(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError(f"engine {self.engine_id}: the HTTP server thread died (see the actor log)")

    def ready(self, timeout: float = 120.0) -> bool:
        """Block until /health_generate answers 200 (a real one-token generate); raise on timeout."""
        last = poll_health(self.url(), timeout, 0.05, self._check_thread)
        if last is None:
            return True
        raise TimeoutError(f"engine {self.engine_id} at {self.url()} not ready after {timeout:.0f}s ({last})")

    def stats(self) -> dict:
        """Requests and sequences this engine has accepted since it started, and its weight version."""
        state = self.app.state.engine
        with state.cond:
            return {**state.counters, "weight_version": state.gen.weight_version}

    def shutdown(self) -> None:
        """Stop serving; pending requests are aborted."""
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self.app.state.engine.close()
        self._sock.close()


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # deliberate: outside Ray, fall back to the host's own address
        return socket.gethostbyname(socket.gethostname())
