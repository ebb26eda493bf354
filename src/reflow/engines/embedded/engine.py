"""The embedded rollout engine: a HF model behind SGLang's HTTP API, hostable as a Ray actor.

A plain class; the caller wraps it, e.g.
    ray.remote(EmbeddedEngine).options(name="engine-0", namespace=ns, num_cpus=1)
       .remote(model_path=..., engine_id="engine-0", threads=1)
then `url()` and `ready()`. The HTTP server runs in a thread of the actor (engines/http_serve.py)
and answers only requests that carry `api_key` (the runtime's; a fresh one when none is given,
which `api_key()` hands back over Ray).
"""
from __future__ import annotations

import os

import torch

from reflow.engines.embedded.generator import Generator
from reflow.engines.embedded.server import build_app
from reflow.engines.hf_io import fp32_lm_head as hf_fp32_lm_head
from reflow.engines.hf_io import load_causal_lm, load_tokenizer, resolve_checkpoint, set_tf32
from reflow.engines.http_serve import DEFAULT_MAX_BODY_BYTES, ThreadedServer, check_api_key, new_api_key
from reflow.engines.rollout_client import poll_health
from reflow.engines.storage_access import StorageAccess

KV_DTYPES = {"auto": None, "bf16": torch.bfloat16}  # rollout.kv_cache_dtype -> the static decoder's K/V dtype
SGLANG_API_VERSION = "0.5.23"  # the SGLang release whose HTTP contract this engine serves


class EmbeddedEngine:
    """Loads the checkpoint, starts the server, answers where it is and whether it is ready."""

    def __init__(self, model_path: str, engine_id: str, host: str = "127.0.0.1", port: int = 0,
                 threads: int = 1, max_batch_size: int = 256, dtype: str = "fp32", api_key: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_weight_bytes: int | None = None,
                 storage: StorageAccess | None = None, model_files: dict | None = None, device: str = "cpu",
                 decoder: str = "auto", fp32_lm_head: bool = False, tf32: bool = False,
                 kv_mem_fraction: float | None = None, decode_fusion: str | None = None, kv_reserve: float = 1.0,
                 kv_cache_dtype: str = "auto"):
        """`storage`: how to reach `model_path` and pushed folders in object storage (the run's endpoint
        and retries); `model_files`: the checkpoint manifest entries `model_path` is checked against
        (reflow.engines.hf_io.resolve_checkpoint); `device`: where the model runs ("cuda" in a Ray actor
        given a GPU); `decoder`: the generator's decoding path (reflow.engines.embedded.generator.Generator:
        "auto" decodes with CUDA graphs on a GPU); `fp32_lm_head`: logits computed in float32 whatever the model's
        dtype (reflow.engines.hf_io.fp32_lm_head; trainer.fp32_lm_head sets it for the trainer and the engines alike);
        `tf32`: this process's float32 products on TF32 tensor cores (reflow.engines.hf_io.set_tf32; trainer.tf32);
        `kv_mem_fraction`: the GPU memory fraction for weights + KV cache (rollout.kv_mem_fraction;
        reflow.engines.embedded.kv_pool), None: room for max_batch_size rows of each call's longest; `kv_reserve`: the
        share of a row's new tokens its region holds when admitted (rollout.kv_reserve; Generator); `kv_cache_dtype`:
        "auto" (the model's) or "bf16", the static decoder's keys and values (rollout.kv_cache_dtype; Generator);
        `decode_fusion`: the torch.compile backend of the static decoder's fused elementwise work (rollout.decode_fusion;
        reflow.engines.embedded.static_decode), None: eager kernels."""
        torch.set_num_threads(threads)  # Ray actors default to 1 OMP thread; make it deliberate
        set_tf32(tf32)  # before the model is loaded and its CUDA graphs captured
        self.engine_id, self.host = engine_id, host
        self._api_key = check_api_key(new_api_key() if api_key is None else api_key)
        local = str(resolve_checkpoint(model_path, storage, model_files))
        model = load_causal_lm(local, dtype).to(device)
        if fp32_lm_head:
            model = hf_fp32_lm_head(model)  # weight reloads and pushes write into this very module
        self.generator = Generator(model, load_tokenizer(local),
                                   max_batch_size=max_batch_size, threads=threads, decoder=decoder,
                                   kv_mem_fraction=kv_mem_fraction, decode_fusion=decode_fusion,
                                   kv_reserve=kv_reserve, kv_dtype=KV_DTYPES[kv_cache_dtype])
        info = {"model_path": model_path, "tokenizer_path": model_path, "local_path": local,
                "engine_id": engine_id, "version": SGLANG_API_VERSION, "threads": threads, "device": device,
                "decoder": decoder, "decode_fusion": decode_fusion,
                "matmul_precision": torch.get_float32_matmul_precision()}
        self.app = build_app(self.generator, info, self._api_key, max_body_bytes=max_body_bytes,
                             max_weight_bytes=max_weight_bytes, storage=storage)
        self.http = ThreadedServer(self.app, host, port, f"uvicorn-{engine_id}", timeout_keep_alive=75)
        self.port = self.http.port

    def url(self) -> str:
        """Base URL other processes use to reach this engine."""
        return self.http.url()

    def api_key(self) -> str:
        """The key every request but the probes must carry (asked over Ray by a later flow run)."""
        return self._api_key

    def _check_thread(self) -> None:
        if not self.http.thread.is_alive():
            raise RuntimeError(f"engine {self.engine_id}: the HTTP server thread died (see the actor log)")

    def ready(self, timeout: float = 120.0) -> bool:
        """Block until /health_generate answers 200 (a real one-token generate); raise on timeout."""
        last = poll_health(self.url(), timeout, 0.05, self._check_thread)
        if last is None:
            return True
        raise TimeoutError(f"engine {self.engine_id} at {self.url()} not ready after {timeout:.0f}s ({last})")

    def run_in_background(self) -> str:
        """Run every thread of this process (and those it starts later, which inherit it) under Linux's
        SCHED_IDLE policy: the engine then computes only on CPU time nothing else wants. An asynchronous
        run on CPU asks for it, so that background generation fills the cores the trainer and the flow
        leave idle rather than slowing those two, the loop's critical path (Ray runs every worker at
        niceness 15, so a niceness alone would not put the engine behind the trainer). Any process may
        lower its own policy this way. Returns the policy now in force ("idle", or "other" where the
        platform has no SCHED_IDLE)."""
        policy = getattr(os, "SCHED_IDLE", None)
        if policy is None:
            return "other"
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setscheduler(int(tid), policy, os.sched_param(0))
            except ProcessLookupError:  # deliberate: the thread ended meanwhile
                pass
        return "idle" if os.sched_getscheduler(0) == policy else "other"

    def stats(self) -> dict:
        """Requests and sequences this engine has accepted since it started, and its weight version."""
        state = self.app.state.engine
        with state.cond:
            return {**state.counters, "weight_version": state.gen.weight_version}

    def shutdown(self) -> None:
        """Stop serving; pending requests are aborted."""
        self.http.stop(before_close=self.app.state.engine.close)

