"""The one client for rollout engines: the embedded engine and a real SGLang server alike.

Every method is one SGLang native endpoint (see docs/ENGINE_CONTRACT.md); callers never
branch on the backend, except for the two `/reflow/` extensions of the embedded engine, used only
where /server_info advertises them (reflow.engines.weights.mapped). Any non-2xx answer raises
`EngineError` naming URL, endpoint, status and the server's own message. Requests carry `Authorization: Bearer <api_key>` (the runtime's key:
engines and router refuse everything but their probes without it); the key travels when a client
is pickled into a Ray task, and never shows in a repr or an error.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import orjson

from reflow.engines.http_serve import bearer

# The finish message (type "abort") of a sample cut because its closing call closed (EngineClient.generate_closing,
# reflow's embedded engine): a partial rollout continues it in the next iteration
CLOSED = "closed: enough groups complete (partial rollout)"
GENERATE_CLOSING = "reflow_generate_closing"  # in an engine's /server_info: it serves /reflow/generate_closing
# SGLang releases whose own HTTP app the tests drive reflow against (tests/test_sglang_real_app.py: the pinned one;
# tests/test_sglang_0517.py: the GPU machine's, the newest that pins its torch 2.11)
TESTED_SGLANG = ("0.5.23", "0.5.17")


class EngineError(RuntimeError):
    """An engine answered a request with an error status (or not at all)."""

    def __init__(self, url: str, endpoint: str, status: int | None, message: str):
        self.url, self.endpoint, self.status, self.message = url, endpoint, status, message
        super().__init__(f"engine {url} {endpoint} -> {status if status is not None else 'no answer'}: {message}")

    def __reduce__(self):  # picklable with its fields, so it crosses Ray task boundaries as itself
        return type(self), (self.url, self.endpoint, self.status, self.message)


def _server_message(r: httpx.Response) -> str:
    """SGLang puts errors in {"error": str | {"message"}}, {"message"}, {"detail"} or plain text."""
    try:
        body = r.json()
    except ValueError:
        return r.text.strip()[:2000] or r.reason_phrase
    if isinstance(body, dict):
        err = body.get("error", body.get("message", body.get("detail", body)))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:2000]
    return str(body)[:2000]


class EngineClient:
    """HTTP client for one engine (or router). `timeout` bounds each request (generation included);
    `api_key` is sent as a bearer token with every request."""

    def __init__(self, url: str, timeout: float = 600.0, api_key: str | None = None):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._api_key = api_key
        self.weight_sessions: bool | None = None  # whether the engine serves them; None: not asked yet
        # verify=False for plain http only: building the TLS context costs ~40 ms per client (certifi's
        # bundle), paid on every push and rollout that makes one, for a check http never does.
        self._http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout, connect=10.0),
                                  headers=bearer(api_key), verify=not self.url.startswith("http://"))

    @property
    def api_key(self) -> str | None:
        """The key this client sends (for another channel to the same engine: its local socket)."""
        return self._api_key

    def __repr__(self) -> str:  # never the key
        return f"EngineClient({self.url!r})"

    def __reduce__(self):  # picklable (e.g. into a Ray task), key included: reconnects on the other side
        return (EngineClient, (self.url, self.timeout, self._api_key))

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, endpoint: str, body: dict | None = None, parse: str = "json") -> Any:
        try:
            r = self._http.request(method, endpoint, json=body)
        except httpx.HTTPError as e:
            raise EngineError(self.url, endpoint, None, f"{type(e).__name__}: {e}") from e
        if r.status_code >= 300:
            missing = self._served_by() if r.status_code == 404 else ""
            raise EngineError(self.url, endpoint, r.status_code, _server_message(r) + missing)
        if parse == "text" or not r.content:
            return r.text
        return orjson.loads(r.content)  # a batch's per-token log-probs, ~2-3x faster than json (a ValueError as r.json())

    def _served_by(self) -> str:
        """For a 404's message: the SGLang version the server reports, beside the ones reflow is tested against
        (an endpoint missing there means another SGLang release, e.g. 0.5.17 has no weight-update sessions)."""
        try:
            version = self._http.get("/server_info").json().get("version")
        except (httpx.HTTPError, ValueError, AttributeError):  # deliberate: best effort, the 404 is raised anyway
            return ""
        return f" (the server is SGLang {version}; reflow is tested against SGLang {', '.join(TESTED_SGLANG)})"

    # ------------------------------------------------------------ data plane

    def generate(self, input_ids: list[int] | list[list[int]] | None = None,
                 sampling_params: dict | list[dict] | None = None, *, text: str | list[str] | None = None,
                 return_logprob: bool = False, rid: str | list[str] | None = None, **extra: Any) -> Any:
        """Raw POST /generate: one result dict for one prompt (n=1), else a list."""
        body: dict[str, Any] = {"sampling_params": sampling_params or {}, "return_logprob": return_logprob, **extra}
        if input_ids is not None:
            body["input_ids"] = input_ids
        if text is not None:
            body["text"] = text
        if rid is not None:
            body["rid"] = rid
        return self._call("POST", "/generate", body)

    def generate_closing(self, input_ids: list[list[int]], sampling_params: list[dict], groups: list[int],
                         complete: int, **extra: Any) -> list[dict]:
        """reflow's embedded engine only (POST /reflow/generate_closing): a batch /generate that stops once
        `complete` groups (`groups`: an id per prompt) have every sample finished; the samples still running
        come back cut (finish abort, message CLOSED)."""
        body = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": True,
                "close": {"groups": groups, "complete": complete}, **extra}
        return self._call("POST", "/reflow/generate_closing", body)

    def health_generate(self) -> bool:
        self._call("GET", "/health_generate", parse="text")
        return True

    def model_info(self) -> dict:
        return self._call("GET", "/model_info")

    def server_info(self) -> dict:
        return self._call("GET", "/server_info")

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        self._call("POST", "/abort_request", {"rid": rid, "abort_all": abort_all} if rid else {"abort_all": abort_all})

    # ------------------------------------------------------------ control plane

    def flush_cache(self) -> str:
        return self._call("POST", "/flush_cache", parse="text")

    def pause_generation(self, mode: str = "abort") -> dict:
        return self._call("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> dict:
        return self._call("POST", "/continue_generation", {})

    def begin_weight_update(self, selector: str = "all") -> dict:
        return self._call("POST", "/begin_weight_update", {"selector": selector})

    def end_weight_update(self) -> dict:
        return self._call("POST", "/end_weight_update", {})

    def open_weight_session(self) -> bool:
        """begin_weight_update where the engine has weight-update sessions (SGLang 0.5.23 requires one around
        tensor and distributed updates); False where it answers 404: SGLang without them (0.5.17) loads an update
        at once, and a paused engine loads it while its requests wait (the caller pauses first). Known from the
        first answer: later calls on this client send nothing."""
        if self.weight_sessions is False:
            return False
        try:
            self.begin_weight_update()
        except EngineError as e:
            if e.status != 404:
                raise
            self.weight_sessions = False
            return False
        self.weight_sessions = True
        return True

    def update_weights_from_tensor(self, serialized_named_tensors: Sequence[str], load_format: str | None = None,
                                   flush_cache: bool = True, weight_version: str | None = None) -> dict:
        """`serialized_named_tensors`: one payload per TP rank (reflow.engines.weights.buckets makes them)."""
        return self._call("POST", "/update_weights_from_tensor", {
            "serialized_named_tensors": list(serialized_named_tensors), "load_format": load_format,
            "flush_cache": flush_cache, "weight_version": weight_version})

    def map_weights(self, serialized_buckets: Sequence[str], mapping_id: str) -> dict:
        """reflow's embedded engine only: keep these flattened buckets mapped as `mapping_id`
        (reflow.engines.weights.mapped)."""
        return self._call("POST", "/reflow/map_weights", {"serialized_buckets": list(serialized_buckets),
                                                          "mapping_id": mapping_id})

    def update_weights_from_mapped(self, mapping_id: str, weight_version: str | None = None,
                                   pause_mode: str = "abort") -> dict:
        """reflow's embedded engine only: pause, copy from mapping `mapping_id`, set the version, resume."""
        return self._call("POST", "/reflow/update_weights_from_mapped", {
            "mapping_id": mapping_id, "weight_version": weight_version, "pause_mode": pause_mode})

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 weight_version: str | None = None, files: dict[str, dict] | None = None) -> dict:
        """`files` ({name: {"sha256", "bytes"}}: what the folder must hold, exactly): reflow's embedded engine
        only (/server_info's `reflow_disk_files`); never sent when None, so SGLang sees its own request."""
        return self._call("POST", "/update_weights_from_disk", {
            "model_path": model_path, "load_format": load_format, "weight_version": weight_version,
            **({"files": files} if files is not None else {})})

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl") -> dict:
        """Blocks until the whole group has joined (the trainer joins as rank 0 concurrently)."""
        return self._call("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", load_format: str | None = None,
                                        weight_version: str | None = None, flush_cache: bool = True) -> dict:
        """Returns once the engine has received the trainer's broadcast and loaded it."""
        return self._call("POST", "/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "load_format": load_format, "weight_version": weight_version, "flush_cache": flush_cache})

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return self._call("POST", "/destroy_weights_update_group", {"group_name": group_name})

    def load_lora_adapter_from_tensors(self, lora_name: str, config_dict: dict,
                                       serialized_named_tensors: Sequence[str], load_format: str | None = None,
                                       expected_checksums: dict[str, str] | None = None) -> dict:
        """A PEFT adapter's tensors (one payload per TP rank) and its adapter_config, as SGLang 0.5.23 takes them;
        `expected_checksums` (tensor name -> sha256 of its bytes) makes every rank refuse other tensors."""
        return self._call("POST", "/load_lora_adapter_from_tensors", {
            "lora_name": lora_name, "config_dict": config_dict,
            "serialized_named_tensors": list(serialized_named_tensors), "load_format": load_format,
            "expected_checksums": expected_checksums})

    def unload_lora_adapter(self, lora_name: str) -> dict:
        return self._call("POST", "/unload_lora_adapter", {"lora_name": lora_name})

    def lora_adapters(self) -> list[str]:
        """Names of the LoRA adapters the engine holds: the model cards of GET /v1/models that have a parent."""
        return [card["id"] for card in self._call("GET", "/v1/models").get("data", []) if card.get("parent")]

    def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> dict:
        """Relabel the loaded weights (no weights move); SGLang aborts running requests unless told not to."""
        return self._call("POST", "/update_weight_version", {
            "new_version": new_version, "abort_all_requests": abort_all_requests})

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The parameter as float32 nested lists, its first `truncate_size` rows (SGLang's shape)."""
        return self._call("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._call("POST", "/release_memory_occupation", {"tags": tags})

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._call("POST", "/resume_memory_occupation", {"tags": tags})

    def take_over(self, memory_tags: Sequence[str]) -> list[str]:
        """Bring an engine an earlier client left (a flow run killed mid-push, a lost trainer node) back to what a
        fresh one is: generating, no weight-update session open, every tag in `memory_tags` held. Each step is its
        own request; a 400 (the engine is already so: "no weight-update session is open", "not released") skips
        it, and so does a 404 on the session step (an engine without sessions, SGLang 0.5.17). Returns the steps
        that changed something."""
        done = []
        steps: list[tuple[str, str, dict[str, Any]]] = [("end_weight_update", "/end_weight_update", {})]
        steps += [(f"resume {t}", "/resume_memory_occupation", {"tags": [t]}) for t in memory_tags]
        for step, endpoint, body in steps:
            try:
                self._call("POST", endpoint, body)
                done.append(step)
            except EngineError as e:
                if e.status == 404 and endpoint == "/end_weight_update":
                    self.weight_sessions = False
                elif e.status != 400:
                    raise
        self.continue_generation()  # last: what was parked decodes on weights and memory that are back
        return done


def shard_bounds(count: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges, sizes differing by at most one, empty ones dropped."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (i < extra)
        if end > start:
            bounds.append((start, end))
        start = end
    return bounds


def _request(prompts: list[list[int]], sampling_params: dict | list[dict], n: int, seeds: list[int] | None,
             lo: int, hi: int) -> tuple[list[list[int]], dict | list[dict]]:
    """(input_ids, sampling_params) of prompts[lo:hi]. SGLang gives every one of the `n` samples of
    a request the same `sampling_seed`, hence identical samples: seeded requests instead repeat
    each prompt n times with n=1 and one seed per entry (seeds are prompt-major, like results).
    A list of sampling params (n=1, no `seeds`) is one entry per prompt, sent as it is."""
    if isinstance(sampling_params, list):
        return [list(p) for p in prompts[lo:hi]], sampling_params[lo:hi]
    if seeds is None:
        return [list(p) for p in prompts[lo:hi]], {**sampling_params, "n": n}
    ids = [list(p) for p in prompts[lo:hi] for _ in range(n)]
    sps = [{**sampling_params, "n": 1, "sampling_seed": int(s)} for s in seeds[lo * n:hi * n]]
    return ids, sps


def result_logprobs(out: dict[str, Any]) -> list[float]:
    """The per-token log-probs of one `/generate` result (SGLang's (logprob, id, text) triples)."""
    return [lp[0] for lp in out["meta_info"].get("output_token_logprobs", [])]


def lora_fields(lora_path: str | None) -> dict:
    """The /generate fields that name a LoRA adapter (SGLang's `lora_path`); none for the base model."""
    return {} if lora_path is None else {"lora_path": lora_path}


def generate_batch(clients: list[EngineClient], prompts: list[list[int]], sampling_params: dict | list[dict], n: int = 1,
                   return_logprob: bool = True, seeds: list[int] | None = None,
                   lora_path: str | None = None) -> list[dict]:
    """Generate `n` samples per prompt over several engines; results prompt-major.

    Prompts are split into contiguous shards, one per engine, sent concurrently; result
    i*n + j is sample j of prompt i. Each result is SGLang's dict (text, output_ids, meta_info).
    `seeds` (len(prompts) * n, prompt-major) makes every sample reproducible (see `_request`).
    `lora_path`: the LoRA adapter every request names (SGLang's field; reflow.engines.weights.lora.adapter_name).
    """
    extra = lora_fields(lora_path)
    if not clients:
        raise ValueError("generate_batch needs at least one engine client")
    if not prompts:
        return []
    if seeds is not None and len(seeds) != len(prompts) * n:
        raise ValueError(f"generate_batch: {len(seeds)} seeds for {len(prompts)} prompts x n={n}")
    if isinstance(sampling_params, list) and (n != 1 or seeds is not None or len(sampling_params) != len(prompts)):
        raise ValueError(f"generate_batch: {len(sampling_params)} sampling params for {len(prompts)} prompts need n=1 "
                         f"and no seeds (each entry carries its own)")

    def run(client: EngineClient, lo: int, hi: int) -> list[dict]:
        ids, sp = _request(prompts, sampling_params, n, seeds, lo, hi)
        out = client.generate(input_ids=ids, sampling_params=sp, return_logprob=return_logprob, **extra)
        if not isinstance(out, list) or len(out) != (hi - lo) * n:
            got = len(out) if isinstance(out, list) else type(out).__name__
            raise EngineError(client.url, "/generate", 200, f"expected {(hi - lo) * n} results, got {got}")
        return out

    shards = shard_bounds(len(prompts), len(clients))
    with ThreadPoolExecutor(max_workers=len(shards)) as pool:
        futures = [pool.submit(run, clients[i], lo, hi) for i, (lo, hi) in enumerate(shards)]
        return [rec for f in futures for rec in f.result()]


def poll_health(url: str, timeout: float, interval: float, check_alive: Callable[[], None]) -> str | None:
    """Poll `/health_generate` (a real one-token generate) until it answers 200.

    Returns None when healthy, else the last failure seen when `timeout` ran out. `check_alive`
    raises as soon as the server's process or thread is gone, so a crash is not waited out.
    """
    deadline, last = time.monotonic() + timeout, "no answer yet"
    while time.monotonic() < deadline:
        check_alive()
        try:
            r = httpx.get(f"{url}/health_generate", timeout=30.0)
            if r.status_code == 200:
                return None
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.TransportError as e:  # not listening yet: retry until the deadline
            last = repr(e)
        time.sleep(interval)
    return last
