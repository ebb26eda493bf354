"""SGLang 0.5.23's native HTTP API served over a `Generator` (the embedded engine).

Request and response shapes, status codes and error texts follow /work/shared/SGLANG_API.md, so
`EngineClient` drives this server and a real SGLang server the same way.

Scheduling: requests queue up; one worker thread takes everything queued and decodes it as one
batch (concurrent requests merge instead of waiting for each other; none can corrupt another).
Between decode steps the worker passes a checkpoint where pauses park it and aborts land.
Weight writes never run during a forward pass (the generator's lock). As in SGLang, a weight
update waits for running requests to finish unless generation is paused.
Departures: pause modes "retract" and "in_place" both park in place (no KV memory to give
back on CPU); memory release/resume only track state; flush_cache has no prefix cache to drop.
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from concurrent.futures import Future
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from engines.generator import Generator, SamplingConfig
from engines.hf_io import load_causal_lm
from engines.tensor_bucket import BucketError, load_payload

_DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
HEALTH_TIMEOUT_S = 20.0


class EngineStateError(Exception):
    """A control-plane call arrived in a state that does not allow it (answered with 400)."""


@dataclass
class _Job:
    """One /generate request: its prompts expanded, and a future for its records."""

    prompts: list[list[int]]
    cfgs: list[SamplingConfig]
    ns: list[int]
    rids: list[str]
    future: Future = field(default_factory=Future)


class EngineState:
    """Everything the endpoints share: queue, pause, aborts, weight session, memory tags."""

    def __init__(self, generator: Generator, server_info: dict):
        self.gen, self.info = generator, dict(server_info)
        self.cond = threading.Condition()
        self.queue: list[_Job] = []
        self.running: list[_Job] = []
        self.paused_mode: str | None = None  # None = not paused
        self.aborted: dict[str, str] = {}  # rid -> abort message, for running jobs
        self.session_open = False
        self.writers = 0  # weight writes in progress
        self.released: set[str] = set()
        self._stop = False
        self.worker = threading.Thread(target=self._loop, name="engine-generate", daemon=True)
        self.worker.start()

    # ------------------------------------------------------------ generation

    def submit(self, job: _Job) -> Future:
        with self.cond:
            if not self.worker.is_alive():
                raise RuntimeError("the engine's generation worker thread has died; restart the engine")
            if self.released & {"weights", "kv_cache"}:
                raise EngineStateError(f"engine memory is released ({sorted(self.released)}): "
                                       f"call /resume_memory_occupation before generating")
            self.queue.append(job)
            self.cond.notify_all()
        return job.future

    def _loop(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self._stop or (self.queue and self.paused_mode is None
                                                          and not self.writers))
                if self._stop:
                    return
                jobs, self.queue, self.running = self.queue, [], self.queue
            try:
                self._run(jobs)
            finally:
                with self.cond:
                    self.running = []
                    self.aborted.clear()
                    self.cond.notify_all()

    def _run(self, jobs: list[_Job]) -> None:
        prompts = [p for j in jobs for p in j.prompts]
        try:
            recs = self.gen.generate(prompts, [c for j in jobs for c in j.cfgs], [k for j in jobs for k in j.ns],
                                     [r for j in jobs for r in j.rids], checkpoint=self._checkpoint)
        except Exception as e:  # deliberate: every waiting request gets the failure, the worker lives on
            for j in jobs:
                j.future.set_exception(e)
            return
        for j in jobs:
            size = sum(j.ns)
            j.future.set_result(recs[:size])
            recs = recs[size:]

    def _checkpoint(self, rids: list[str]) -> dict[str, str]:
        """Between decode steps: park while paused in place; report the rows to abort."""
        with self.cond:
            self.cond.wait_for(lambda: self.paused_mode in (None, "abort") or self._stop)
            return {r: self.aborted[r] for r in rids if r in self.aborted}

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "Aborted") -> None:
        with self.cond:
            for job in list(self.queue):
                if abort_all or rid in job.rids:
                    self.queue.remove(job)
                    job.future.set_result(self._aborted_records(job, message))
            for job in self.running:
                for r in job.rids:
                    if abort_all or r == rid:
                        self.aborted[r] = message
            self.cond.notify_all()

    @staticmethod
    def _aborted_records(job: _Job, message: str) -> list[dict]:
        return [{"output_ids": [], "text": "", "output_token_logprobs": [], "prompt_tokens": len(p),
                 "completion_tokens": 0, "id": rid if k == 1 else uuid.uuid4().hex,
                 "finish_reason": {"type": "abort", "message": message}}
                for p, k, rid in zip(job.prompts, job.ns, job.rids) for _ in range(k)]

    def load(self) -> dict:
        with self.cond:
            running = sum(sum(j.ns) for j in self.running)
            waiting = sum(sum(j.ns) for j in self.queue)
        return {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
                "max_running_requests": self.gen.max_batch_size}

    def close(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        self.abort(abort_all=True, message="engine shut down")

    # ------------------------------------------------------------ control plane

    def pause(self, mode: str) -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise EngineStateError(f"pause mode must be 'abort', 'retract' or 'in_place', got {mode!r}")
        with self.cond:
            self.paused_mode = mode
        if mode == "abort":
            self.abort(abort_all=True, message="Abort by pause_generation")

    def resume(self) -> None:
        with self.cond:
            self.paused_mode = None
            self.cond.notify_all()

    def busy_unpaused(self) -> bool:
        with self.cond:
            return bool(self.running or self.queue) and self.paused_mode is None

    @contextmanager
    def writing(self):
        """Hold while writing weights: waits until nothing runs or generation is paused, and keeps
        new batches from starting meanwhile (no batch sees half-written weights)."""
        with self.cond:
            self.cond.wait_for(lambda: not self.running or self.paused_mode is not None or self._stop)
            if "weights" in self.released:
                raise EngineStateError("weights are released: call /resume_memory_occupation "
                                       "with tags ['weights'] before updating them")
            self.writers += 1
        try:
            yield
        finally:
            with self.cond:
                self.writers -= 1
                self.cond.notify_all()

    def set_session(self, open_: bool) -> None:
        with self.cond:
            if open_ and self.session_open:
                raise EngineStateError("a weight-update session is already open: call /end_weight_update first")
            if not open_ and not self.session_open:
                raise EngineStateError("no weight-update session is open: call /begin_weight_update first")
            self.session_open = open_

    def release(self, tags: list[str] | None, release: bool) -> None:
        tags = list(MEMORY_TAGS) if tags is None else tags
        unknown = set(tags) - set(MEMORY_TAGS)
        if unknown:
            raise EngineStateError(f"unknown memory tags {sorted(unknown)}; valid tags are {list(MEMORY_TAGS)}")
        with self.cond:
            if release and self.running and self.paused_mode is None:
                raise EngineStateError("cannot release memory while requests run: pause_generation first")
            clash = set(tags) & self.released if release else set(tags) - self.released
            if clash:
                state = "already released" if release else "not released"
                raise EngineStateError(f"memory tags {sorted(clash)} are {state}")
            self.released = self.released | set(tags) if release else self.released - set(tags)


# ---------------------------------------------------------------- /generate contract
# SGLang's JSON contract (sglang.api.v1.api_types): unknown sampling keys and wrong types are a
# 400 whose text matches serde's; range checks are SamplingConfig.verify. Keys SGLang accepts but
# this engine does not implement are refused unless they hold their neutral value.

class ContractError(ValueError):
    """The request body breaks the /generate JSON contract (answered with 400)."""


_INT, _NUM, _BOOL, _STR, _ANY = "i64", "f64", "a boolean", "a string", "any"
_SAMPLING_TYPES = {
    "max_new_tokens": _INT, "stop": "str_or_list", "stop_token_ids": "int_list", "stop_regex": "str_or_list",
    "temperature": _NUM, "top_p": _NUM, "top_k": _INT, "min_p": _NUM, "frequency_penalty": _NUM,
    "presence_penalty": _NUM, "repetition_penalty": _NUM, "min_new_tokens": _INT, "n": _INT,
    "json_schema": _STR, "regex": _STR, "ebnf": _STR, "structural_tag": _STR, "ignore_eos": _BOOL,
    "skip_special_tokens": _BOOL, "spaces_between_special_tokens": _BOOL, "no_stop_trim": _BOOL,
    "stream_interval": _INT, "logit_bias": "map", "sampling_seed": _INT, "custom_params": _ANY,
    "beam_width": _INT, "watermark": "map", "choice": "str_list",
}
_NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": {},
            "choice": [], "beam_width": 1, "stop_regex": [], "json_schema": "", "regex": "", "ebnf": "",
            "structural_tag": "", "watermark": {}}
_NOT_CONFIG = {"n", "stream_interval", "custom_params"} | set(_NEUTRAL)  # custom_params: ignored


def _unexpected(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{str(v).lower()}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return "sequence" if isinstance(v, list) else "map"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _type_ok(kind: str, v) -> bool:
    return {
        _INT: lambda: _is_int(v), _NUM: lambda: _is_int(v) or isinstance(v, float),
        _BOOL: lambda: isinstance(v, bool), _STR: lambda: isinstance(v, str), _ANY: lambda: True,
        "map": lambda: isinstance(v, dict),
        "str_or_list": lambda: isinstance(v, str) or (isinstance(v, list) and all(isinstance(e, str) for e in v)),
        "int_list": lambda: isinstance(v, list) and all(_is_int(e) for e in v),
        "str_list": lambda: isinstance(v, list) and all(isinstance(e, str) for e in v),
    }[kind]()


def check_sampling_params(sp) -> dict:
    """Contract check of one sampling_params object; returns it without null values."""
    if not isinstance(sp, dict):
        raise ContractError(f"invalid type: {_unexpected(sp)}, expected struct SamplingParams")
    for key, v in sp.items():
        kind = _SAMPLING_TYPES.get(key)
        if kind is None:
            listed = ", ".join(f"`{k}`" for k in _SAMPLING_TYPES)
            raise ContractError(f"unknown field `{key}`, expected one of {listed}")
        if v is not None and not _type_ok(kind, v):
            raise ContractError(f"invalid type: {_unexpected(v)}, expected {kind} (sampling_params.{key})")
        if key in _NEUTRAL and v is not None and v != _NEUTRAL[key]:
            raise ContractError(f"sampling_params.{key}={v!r} is not supported by the embedded engine "
                                f"(it implements temperature/top_p/top_k/min_p/stop/min_new_tokens/seed); "
                                f"use the sglang backend for it")
    return {k: v for k, v in sp.items() if v is not None}


def _prompts_of(body: dict, tokenizer) -> tuple[list[list[int]], bool]:
    """(prompts, is_batch) from input_ids or text."""
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise ContractError("Either text or input_ids should be provided (exactly one of them).")
    if text is not None:
        if isinstance(text, str):
            return [tokenizer.encode(text)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [tokenizer.encode(t) for t in text], True
        raise ContractError(f"invalid type: {_unexpected(text)}, expected a string or a list of strings (text)")
    if isinstance(ids, list) and ids and all(_is_int(t) for t in ids):
        return [ids], False
    if isinstance(ids, list) and ids and all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in ids):
        return ids, True
    raise ContractError("input_ids must be a non-empty list of token ids or a non-empty list of such lists")


def _per_prompt(value, n_prompts: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n_prompts:
            raise ContractError(f"{name} has {len(value)} entries for {n_prompts} prompts")
        return value
    return [value] * n_prompts


def parse_generate(body, gen: Generator) -> tuple[_Job, bool, list[bool]]:
    """Validate a /generate body into a job; returns (job, is_single, return_logprob per prompt)."""
    if not isinstance(body, dict):
        raise ContractError(f"invalid type: {_unexpected(body)}, expected struct GenerateRequest")
    if body.get("stream"):
        raise ContractError("stream=true is not supported by the embedded engine; send stream=false")
    for key in ("top_logprobs_num", "token_ids_logprob", "return_hidden_states", "image_data", "lora_path"):
        if body.get(key):
            raise ContractError(f"{key} is not supported by the embedded engine")
    prompts, batch = _prompts_of(body, gen.tokenizer)
    for p in prompts:
        gen.check_prompt(p)  # here, so one bad prompt cannot fail a merged batch
    sps = [check_sampling_params(sp) for sp in _per_prompt(body.get("sampling_params") or {}, len(prompts),
                                                              "sampling_params")]
    lps = [bool(x) for x in _per_prompt(body.get("return_logprob") or False, len(prompts), "return_logprob")]
    starts = _per_prompt(body.get("logprob_start_len", -1), len(prompts), "logprob_start_len")
    if any(lp and s is not None and s >= 0 for lp, s in zip(lps, starts)):
        raise ContractError("input token logprobs (logprob_start_len >= 0) are not supported by the embedded "
                            "engine; use logprob_start_len=-1 (output logprobs only)")
    rid = body.get("rid")
    if batch and isinstance(rid, str):
        raise ContractError("rid must be a list with one id per prompt for a batch request")
    rids = [r if r is not None else uuid.uuid4().hex for r in _per_prompt(rid, len(prompts), "rid")]
    ns = [sp.get("n", 1) for sp in sps]
    if any(k < 1 for k in ns):
        raise ContractError("sampling_params.n must be at least 1")
    if len(set(ns)) > 1:  # SGLang's rules for parallel sampling, kept so callers see one behaviour
        raise ValueError("The parallel_sample_num should be the same for all samples in sample params.")
    if ns[0] > 1 and isinstance(body.get("return_logprob"), list):
        raise ValueError("Cannot use list return_logprob with parallel_sample_num > 1")
    cfgs = [SamplingConfig.from_dict({k: v for k, v in sp.items() if k not in _NOT_CONFIG}) for sp in sps]
    job = _Job(prompts=prompts, cfgs=cfgs, ns=ns, rids=rids)
    return job, not batch and ns[0] == 1, [lp for lp, k in zip(lps, ns) for _ in range(k)]


def _response(rec: dict, with_logprobs: bool, version: str, latency: float) -> dict:
    meta = {"id": rec["id"], "finish_reason": rec["finish_reason"], "prompt_tokens": rec["prompt_tokens"],
            "completion_tokens": rec["completion_tokens"], "cached_tokens": 0, "weight_version": version,
            "e2e_latency": latency}
    if with_logprobs:
        meta["output_token_logprobs"] = rec["output_token_logprobs"]
    return {"text": rec["text"], "output_ids": rec["output_ids"], "meta_info": meta}


# ---------------------------------------------------------------- the app


def _error(e: Exception, status: int = 400) -> JSONResponse:
    """SGLang's error bodies: contract errors carry a string, the others {"message": ...}."""
    if isinstance(e, ContractError):
        return JSONResponse({"error": str(e)}, status_code=status)
    return JSONResponse({"error": {"message": _msg(e)}}, status_code=status)


def _msg(e: Exception) -> str:
    return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)  # KeyError's str() adds quotes


async def _body(request: Request) -> dict:
    raw = await request.body()
    if not raw:
        return {}
    body = await request.json()
    if not isinstance(body, dict):
        raise ContractError(f"invalid type: {_unexpected(body)}, expected a JSON object")
    return body


def build_app(generator: Generator, server_info: dict) -> FastAPI:
    """FastAPI app serving SGLang's native endpoints over `generator`.

    server_info: static facts reported by /server_info and /model_info (model_path,
    tokenizer_path, dtype, engine_id, ...). `app.state.engine` is the shared EngineState.
    """
    state = EngineState(generator, server_info)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        state.close()  # server stopping: abort what runs, stop the worker

    app = FastAPI(title="reflow embedded engine (SGLang API)", lifespan=lifespan)
    app.state.engine = state
    _data_plane(app, state)
    _info_routes(app, state)
    _control_routes(app, state)
    _weight_routes(app, state)
    return app


def _data_plane(app: FastAPI, state: EngineState) -> None:
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        t0 = time.perf_counter()
        try:
            job, single, want_lp = parse_generate(await _body(request), state.gen)
            recs = await asyncio.wrap_future(state.submit(job))
        except (ValueError, EngineStateError) as e:
            return _error(e)
        out = [_response(r, lp, state.gen.weight_version, time.perf_counter() - t0) for r, lp in zip(recs, want_lp)]
        return JSONResponse(out[0] if single else out)  # direct: FastAPI's encoder walks every float

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        if state.paused_mode is not None or state.released:
            return Response("paused or memory released: cannot run a health generate", status_code=503)
        if state.running:
            return Response(status_code=200)  # decoding right now is proof enough, as in SGLang
        job = _Job(prompts=[[0]], cfgs=[SamplingConfig(max_new_tokens=1, temperature=0.0)], ns=[1],
                   rids=[f"HEALTH_CHECK_{uuid.uuid4().hex}"])
        try:
            await asyncio.wait_for(asyncio.wrap_future(state.submit(job)), HEALTH_TIMEOUT_S)
        except (asyncio.TimeoutError, EngineStateError, ValueError) as e:
            return Response(f"health generate failed: {e!r}", status_code=503)
        return Response(status_code=200)

    @app.api_route("/abort_request", methods=["POST"])
    async def abort_request(request: Request):
        body = await _body(request)
        state.abort(rid=body.get("rid"), abort_all=bool(body.get("abort_all")),
                    message=body.get("abort_message") or "Abort by abort_request")
        return Response(status_code=200)


def _info_routes(app: FastAPI, state: EngineState) -> None:
    @app.get("/model_info")
    async def model_info():
        cfg = state.gen.model.config
        return {"model_path": state.info.get("model_path"), "served_model_name": state.info.get("model_path"),
                "tokenizer_path": state.info.get("tokenizer_path", state.info.get("model_path")),
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": state.gen.weight_version, "load_format": state.info.get("load_format"),
                "model_type": getattr(cfg, "model_type", None), "architectures": getattr(cfg, "architectures", None)}

    @app.get("/server_info")
    async def server_info():
        return {**state.info, "dtype": str(state.gen.dtype).removeprefix("torch."), "tp_size": 1,
                "max_running_requests": state.gen.max_batch_size, "context_length": state.gen.context_len,
                "weight_version": state.gen.weight_version, "internal_states": [state.load()],
                "frontend": "reflow-embedded"}

    @app.get("/v1/loads")
    async def loads():
        return {"timestamp": time.time(), "version": state.info.get("version"), "accelerator": None,
                "num_accelerators": 0, "loads": [state.load()]}


def _control_routes(app: FastAPI, state: EngineState) -> None:
    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        if state.busy_unpaused():
            return Response("Flush cache failed: requests are running; pause_generation first or retry when idle.\n",
                            status_code=400)
        return Response("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                        "waiting requests, the operation will not be performed.)\n", status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        try:
            state.pause((await _body(request)).get("mode", "abort"))
        except (ValueError, EngineStateError) as e:
            return _error(e)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation():
        state.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory(request: Request):
        return await _call(lambda b: state.release(b.get("tags"), release=True), request, null_ok=True)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory(request: Request):
        return await _call(lambda b: state.release(b.get("tags"), release=False), request, null_ok=True)

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request):
        return await _call(lambda b: _begin(state, b), request)

    @app.post("/end_weight_update")
    async def end_weight_update(request: Request):
        return await _call(lambda b: state.set_session(False), request)


def _begin(state: EngineState, body: dict) -> None:
    if body.get("selector", "all") not in ("all", "target"):
        raise EngineStateError(f"selector {body.get('selector')!r}: the embedded engine has no draft model; use 'all'")
    state.set_session(True)


async def _call(fn, request: Request, null_ok: bool = False):
    """Run a blocking control call off the event loop; success -> {"success","message"} (or null)."""
    try:
        body = await _body(request)
        out = await run_in_threadpool(fn, body)
    except (ValueError, KeyError, EngineStateError) as e:
        return _error(e) if null_ok else JSONResponse({"success": False, "message": _msg(e)}, status_code=400)
    if null_ok:
        return None
    return {"success": True, **(out if isinstance(out, dict) else {"message": out or "Success"})}


def _weight_routes(app: FastAPI, state: EngineState) -> None:
    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        return await _call(lambda b: _update_from_tensor(state, b), request)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        return await _call(lambda b: _update_from_disk(state, b), request)

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request):
        try:
            body = {**request.query_params, **(await _body(request))}
            return JSONResponse(await run_in_threadpool(_weights_by_name, state, body))
        except (ValueError, KeyError) as e:
            return _error(e)


def _update_from_tensor(state: EngineState, body: dict) -> str:
    payloads = body.get("serialized_named_tensors")
    if not isinstance(payloads, list) or not payloads or not isinstance(payloads[0], str):
        raise ContractError("serialized_named_tensors must be a non-empty list of base64 strings (one per TP rank)")
    if not state.session_open:
        raise EngineStateError("update_weights_from_tensor outside a weight-update session: "
                               "call POST /begin_weight_update first (and /end_weight_update after)")
    if body.get("abort_all_requests"):
        state.abort(abort_all=True, message="Abort by update_weights_from_tensor")
    with state.writing():
        try:
            named = load_payload(payloads[0], body.get("load_format"))  # TP=1: entry 0 is ours
            count = state.gen.load_named_tensors(named)
        except BucketError as e:
            raise EngineStateError(f"weight payload rejected: {e}") from e
        if body.get("weight_version") is not None:
            state.gen.weight_version = str(body["weight_version"])
    return f"Success: loaded {count} tensors"


def _update_from_disk(state: EngineState, body: dict) -> dict:
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise ContractError("model_path must be a non-empty string (an HF checkpoint folder or URL)")
    if body.get("abort_all_requests"):
        state.abort(abort_all=True, message="Abort by update_weights_from_disk")
    try:
        model = load_causal_lm(path, dtype=_DTYPE_NAMES.get(str(state.gen.dtype), "fp32"))
    except (OSError, ValueError) as e:
        raise EngineStateError(f"could not load weights from {path!r}: {e}") from e
    with state.writing():
        count = state.gen.load_named_tensors(list(model.state_dict().items()))
        state.info["model_path"] = path
        if body.get("weight_version") is not None:
            state.gen.weight_version = str(body["weight_version"])
    return {"message": f"Succeeded to update model weights ({count} tensors from {path}).", "num_paused_requests": 0}


def _weights_by_name(state: EngineState, body: dict) -> list:
    """SGLang's answer: the tensor as float32 nested lists, truncated along dim 0."""
    name, size = body.get("name"), int(body.get("truncate_size", 100))
    if not isinstance(name, str):
        raise ContractError("name must be a string (an HF parameter name)")
    values = state.gen.get_weight(name).float().tolist()
    return values[:size] if isinstance(values, list) else [values]
