"""The embedded rollout engine: a HF model behind SGLang's HTTP API, hostable as a Ray actor.

A plain class; the caller wraps it, e.g.
    ray.remote(EmbeddedEngine).options(name="engine-0", namespace=ns, num_cpus=1)
       .remote(model_path=..., engine_id="engine-0", threads=1)
then `url()` and `ready()`. The HTTP server runs in a thread of the actor (engines/http_serve.py).
"""
from __future__ import annotations

import torch

from reflow.engines.embedded.generator import Generator
from reflow.engines.embedded.server import build_app
from reflow.engines.hf_io import load_causal_lm, load_tokenizer, resolve_checkpoint
from reflow.engines.http_serve import ThreadedServer
from reflow.engines.rollout_client import poll_health

SGLANG_API_VERSION = "0.5.23"  # the SGLang release whose HTTP contract this engine serves


class EmbeddedEngine:
    """Loads the checkpoint, starts the server, answers where it is and whether it is ready."""

    def __init__(self, model_path: str, engine_id: str, host: str = "127.0.0.1", port: int = 0,
                 threads: int = 1, max_batch_size: int = 256, dtype: str = "fp32"):
        torch.set_num_threads(threads)  # Ray actors default to 1 OMP thread; make it deliberate
        self.engine_id, self.host = engine_id, host
        local = str(resolve_checkpoint(model_path))
        self.generator = Generator(load_causal_lm(model_path, dtype), load_tokenizer(model_path),
                                   max_batch_size=max_batch_size, threads=threads)
        info = {"model_path": model_path, "tokenizer_path": model_path, "local_path": local,
                "engine_id": engine_id, "version": SGLANG_API_VERSION, "threads": threads}
        self.app = build_app(self.generator, info)
        self.http = ThreadedServer(self.app, host, port, f"uvicorn-{engine_id}", timeout_keep_alive=75)
        self.port = self.http.port

    def url(self) -> str:
        """Base URL other processes use to reach this engine."""
        return self.http.url()

    def _check_thread(self) -> None:
        if not self.http.thread.is_alive():
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
        self.http.stop(before_close=self.app.state.engine.close)

