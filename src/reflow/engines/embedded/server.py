"""SGLang 0.5.23's native HTTP API served over a `Generator` (the embedded engine).

Request and response shapes, status codes and error texts follow docs/ENGINE_CONTRACT.md, so
`EngineClient` drives this server and a real SGLang server the same way. Request validation lives
in reflow.engines.embedded.contract (SGLang's own code when installed), scheduling state in
reflow.engines.embedded.state, the distributed weight-update group in reflow.engines.weights.group.
Every endpoint but the probes needs the API key (reflow.engines.http_serve.HttpGuard, SGLang's
`--api-key` rule). Weight updates are bounded by the model itself: a tensor payload maps at most
the model's size in float32, and a distributed update must declare the parameters' own shapes
before anything is allocated for it.
Departure: flush_cache has no prefix cache to drop.
Extensions (under /reflow/, advertised by /server_info's `reflow_mapped_weights`; never asked of an SGLang
engine): /reflow/map_weights and /reflow/update_weights_from_mapped, the trainer's weights mapped once and
copied at each push in one call (reflow.engines.weights.mapped); the second is served on a private Unix
socket too, for a trainer on the same host (reflow.engines.local_control). And a field:
update_weights_from_disk takes `files`, the sha256 of every file the pusher wrote, and then loads only
a folder that holds exactly those (advertised as `reflow_disk_files`; reflow.engines.weights.push).
"""
from __future__ import annotations

import asyncio
import logging
import tempfile
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import orjson
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from reflow.engines.embedded.contract import (
    ContractError,
    ResponseContractError,
    _unexpected,
    check_responses,
    make_response,
    parse_generate,
)
from reflow.engines.embedded.generator import Generator, SamplingConfig
from reflow.engines.embedded.lora import add_routes as lora_routes
from reflow.engines.embedded.lora import check_lora_path
from reflow.engines.embedded.state import EngineState, EngineStateError, _Job
from reflow.engines.hf_io import copy_verified, load_causal_lm
from reflow.engines.http_serve import DEFAULT_MAX_BODY_BYTES, HttpGuard
from reflow.engines.local_control import LOCAL_CONTROL, LocalControlServer
from reflow.engines.rollout_client import GENERATE_CLOSING
from reflow.engines.storage_access import StorageAccess, StorageError, is_local
from reflow.engines.weights import group as weight_group
from reflow.engines.weights.buckets import BucketError, load_buckets, load_payload
from reflow.engines.weights.mapped import CAPABILITY, UNKNOWN_MAPPING
from reflow.engines.weights.push import DISK_FILES

_DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
HEALTH_TIMEOUT_S = 20.0
log = logging.getLogger(__name__)


# ---------------------------------------------------------------- the app


OOM_FIX = ("Lower rollout.max_batch_size (rows decoded at once) or rollout.kv_mem_fraction (the KV pool's share of "
           "the GPU); with cluster.colocate and cluster.hand_over=false the trainer's weights and optimizer stay on the "
           "same GPU while it generates (hand_over=true offloads them at each hand-over).")


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


def weight_bytes_limit(generator: Generator) -> int:
    """What one weight payload may map: every model tensor once in float32 (a push in the trainer's
    dtype fits), plus the 16-byte alignment of each bucket entry."""
    tensors = generator.model.state_dict().values()
    return sum(4 * t.numel() + 16 for t in tensors)


def build_app(generator: Generator, server_info: dict, api_key: str, *,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_weight_bytes: int | None = None,
              storage: StorageAccess | None = None, local_control: bool = True) -> FastAPI:
    """FastAPI app serving SGLang's native endpoints over `generator`, behind `api_key`.

    server_info: static facts reported by /server_info and /model_info (model_path,
    tokenizer_path, dtype, engine_id, ...). `app.state.engine` is the shared EngineState.
    max_weight_bytes: shared memory one weight payload may map (default `weight_bytes_limit`).
    storage: how update_weights_from_disk reaches a folder in object storage (the run's endpoint, retries).
    local_control: also serve /reflow/update_weights_from_mapped on a private Unix socket while the app runs
    (advertised in /server_info; reflow.engines.local_control).
    """
    state = EngineState(generator, server_info, storage)

    @asynccontextmanager
    async def lifespan(_app):
        # the local socket for a colocated push's one call (reflow.engines.local_control)
        local = LocalControlServer(api_key, {"update_weights_from_mapped": lambda body: _update_from_mapped(state, body)},
                                   errors=(ValueError, KeyError, EngineStateError), describe=_msg) if local_control else None
        state.local_control = local.info() if local else None
        try:
            yield
        finally:
            if local is not None:
                local.close()
            state.close()  # server stopping: abort what runs, stop the worker

    app = FastAPI(title="reflow embedded engine (SGLang API)", lifespan=lifespan)
    app.add_middleware(HttpGuard, api_key=api_key, max_body_bytes=max_body_bytes)
    app.state.engine = state
    _data_plane(app, state)
    _info_routes(app, state)
    _control_routes(app, state)
    limit = weight_bytes_limit(generator) if max_weight_bytes is None else max_weight_bytes
    _weight_routes(app, state, limit)
    lora_routes(app, state, limit)  # LoRA adapters, merged on receipt (engines/embedded/lora.py)
    return app


def _data_plane(app: FastAPI, state: EngineState) -> None:
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        return await _generate(state, request, closing=False)

    @app.post("/reflow/generate_closing")
    async def generate_closing(request: Request):
        """/generate's body plus "close": {"groups": [a group id per prompt], "complete": K}: the call stops once
        K groups have every sample finished, the rest cut with what they generated (finish abort, message
        rollout_client.CLOSED). reflow's partial rollouts on this engine: one call where SGLang takes rounds."""
        return await _generate(state, request, closing=True)

    _probe_routes(app, state)


def _close_of(body: dict) -> tuple[list[int], int]:
    close = body.pop("close", None)
    if not isinstance(close, dict) or not isinstance(close.get("groups"), list) \
            or not all(isinstance(g, int) for g in close["groups"]) or not isinstance(close.get("complete"), int) \
            or close["complete"] < 1:
        raise ContractError('close must be {"groups": [an int per prompt], "complete": an int >= 1}')
    return close["groups"], close["complete"]


async def _generate(state: EngineState, request: Request, closing: bool):
    t0 = time.perf_counter()
    try:
        body = await _body(request)
        close = _close_of(body) if closing and isinstance(body, dict) else None
        check_lora_path(state, body)  # the merged adapter, or none named
        job, single, want_lp = parse_generate(body, state.gen)
        job.close = close  # its groups against the prompts: checked by Generator.generate
        recs = await asyncio.wrap_future(state.submit(job))
    except (ValueError, EngineStateError) as e:
        return _error(e)
    except torch.OutOfMemoryError as e:  # the worker lives on; the caller's error says what to lower. 500, not 503:
        # the same batch would run out again, and callers retry a 503 (tasks/faults.py)
        return _error(RuntimeError(f"generate ran out of memory: {str(e).splitlines()[0]} {OOM_FIX}"), status=500)
    except Exception as e:  # deliberate: the caller gets the failure itself, not a bare "Internal Server Error"
        log.exception("generate failed")
        return _error(RuntimeError(f"generate failed: {type(e).__name__}: {e}"), status=500)
    out = [make_response(r, lp, state.gen.weight_version, time.perf_counter() - t0)
           for r, lp in zip(recs, want_lp)]
    try:
        check_responses(out)
    except ResponseContractError as e:
        return _error(e, status=500)
    # orjson, as SGLang's server answers: a batch's per-token log-prob triples (~400k at the scratchpad shape, 14 MB)
    # encode in ~0.1 s where the json module took ~2 s (bench/RESULTS.md 54); _record refused non-finite log-probs
    return Response(orjson.dumps(out[0] if single else out), media_type="application/json")


def _probe_routes(app: FastAPI, state: EngineState) -> None:
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
            await asyncio.wait_for(asyncio.wrap_future(state.submit(job, count=False)), HEALTH_TIMEOUT_S)
        except Exception as e:  # deliberate: any failure (CUDA out of memory too) is "not healthy", said with its cause
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
        return {**state.info, "dtype": str(state.gen.dtype).removeprefix("torch."), "tp_size": 1, CAPABILITY: True,
                DISK_FILES: True, GENERATE_CLOSING: True,
                "max_running_requests": state.gen.max_batch_size, "context_length": state.gen.context_len,
                "kv_reserve": state.gen.kv_reserve, "kv_moves": dict(state.gen.kv_moves),
                "decode_time": dict(state.gen.decode_time),
                "kv_cache_dtype": state.gen.kv_cache_dtype(),
                "weight_version": state.gen.weight_version, "internal_states": [state.load()],
                "frontend": "reflow-embedded", "memory_released": sorted(state.released),
                "memory_events": state.memory_events, **state.gen.memory_stats(),
                **({LOCAL_CONTROL: state.local_control} if state.local_control else {})}

    # SGLang 0.5.23 still serves the old names (deprecated, with a warning each call): same answers.
    @app.get("/get_model_info")
    async def get_model_info():
        log.warning("Endpoint '/get_model_info' is deprecated; use '/model_info'")
        return await model_info()

    @app.get("/get_server_info")
    async def get_server_info():
        log.warning("Endpoint '/get_server_info' is deprecated; use '/server_info'")
        return await server_info()

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


def _weight_endpoint(state: EngineState, fn):
    async def endpoint(request: Request):
        return await _call(lambda body: fn(state, body), request)
    return endpoint


def _weight_routes(app: FastAPI, state: EngineState, max_weight_bytes: int) -> None:
    # Weight endpoints share one shape: JSON body in, SGLang's {"success", "message"} out.
    for path, fn in (("/update_weights_from_tensor", lambda s, b: _update_from_tensor(s, b, max_weight_bytes)),
                     ("/update_weights_from_disk", _update_from_disk),
                     ("/init_weights_update_group", _init_group),
                     ("/update_weights_from_distributed", _update_from_distributed),
                     ("/destroy_weights_update_group", _destroy_group)):
        app.add_api_route(path, _weight_endpoint(state, fn), methods=["POST"], name=path.strip("/"))
    for path, fn in (("/reflow/map_weights", lambda s, b: _map_weights(s, b, max_weight_bytes)),
                     ("/reflow/update_weights_from_mapped", _update_from_mapped)):
        app.add_api_route(path, _weight_endpoint(state, fn), methods=["POST"], name=path.strip("/"))

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        try:
            version, abort_all = _weight_version_request(await _body(request))
        except ValueError as e:  # a body SGLang's request model refuses: its 400 ErrorResponse shape
            return JSONResponse({"object": "error", "message": str(e), "type": "Bad Request", "param": None,
                                 "code": 400}, status_code=400)
        if abort_all:
            state.abort(abort_all=True, message="Abort by update_weight_version")
        with state.cond:
            state.gen.weight_version = version
        return {"success": True, "message": f"Weight version updated to {version}", "new_version": version}

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request):
        try:
            body = {**request.query_params, **(await _body(request))}
            return JSONResponse(await run_in_threadpool(_weights_by_name, state, body))
        except (ValueError, KeyError) as e:
            return _error(e)


# SGLang 0.5.23's UpdateWeightVersionReqInput (managers/io_struct.py, which needs the GPU runtime to
# import): field -> (type, default); REQUIRED has none. Unknown fields are ignored, as there.
REQUIRED = object()
WEIGHT_VERSION_FIELDS = {"new_version": (str, REQUIRED), "abort_all_requests": (bool, True)}


def _weight_version_request(body: dict) -> tuple[str, bool]:
    """(new_version, abort_all_requests) of an /update_weight_version body, or ContractError."""
    out: dict[str, object] = {}
    for name, (kind, default) in WEIGHT_VERSION_FIELDS.items():
        value = body.get(name, default)
        if value is REQUIRED:
            raise ContractError(f"{name}: field required (UpdateWeightVersionReqInput)")
        if not isinstance(value, kind):
            raise ContractError(f"{name}: expected {kind.__name__}, got {_unexpected(value)}")
        out[name] = value
    return str(out["new_version"]), bool(out["abort_all_requests"])


def _update_from_tensor(state: EngineState, body: dict, max_bytes: int) -> str:
    payloads = body.get("serialized_named_tensors")
    if not isinstance(payloads, list) or not payloads or not isinstance(payloads[0], str):
        raise ContractError("serialized_named_tensors must be a non-empty list of base64 strings (one per TP rank)")
    state.require_session("update_weights_from_tensor")
    if body.get("abort_all_requests"):
        state.abort(abort_all=True, message="Abort by update_weights_from_tensor")
    with state.writing():
        try:
            named = load_payload(payloads[0], body.get("load_format"), max_bytes)  # TP=1: entry 0 is ours
            count = state.gen.load_named_tensors(named)
        except BucketError as e:
            raise EngineStateError(f"weight payload rejected: {e}") from e
        if body.get("weight_version") is not None:
            state.gen.weight_version = str(body["weight_version"])
    return f"Success: loaded {count} tensors"


def _map_weights(state: EngineState, body: dict, max_bytes: int) -> str:
    """Map the sender's buffers (flattened-bucket payloads: one per storage) and keep them as the mapping
    `mapping_id`, replacing any earlier one (whose buffers are let go). Nothing is written yet."""
    payloads, mapping_id = body.get("serialized_buckets"), body.get("mapping_id")
    if not isinstance(payloads, list) or not payloads or not all(isinstance(p, str) for p in payloads):
        raise ContractError("serialized_buckets must be a non-empty list of base64 strings (flattened buckets)")
    if not isinstance(mapping_id, str) or not mapping_id:
        raise ContractError("mapping_id must be a non-empty string")
    with state.cond:
        state.mapping = None  # the earlier mapping's buffers go first (its sender may be waiting for them)
        state.mapping_adopted = False
    state.gen.forget_mapped()
    try:
        named = load_buckets(payloads, max_bytes)
        state.gen.check_named(named)
    except BucketError as e:
        raise EngineStateError(f"weight payload rejected: {e}") from e
    with state.cond:
        state.mapping = (mapping_id, named)
    return f"Success: mapped {len(named)} tensors"


def _update_from_mapped(state: EngineState, body: dict) -> str:
    """One call for a whole push: pause generation (`pause_mode`, as /pause_generation), copy every mapped
    tensor into the model, set the weight version, resume (the pause state it found)."""
    mapping_id, version = body.get("mapping_id"), body.get("weight_version")
    with state.cond:
        current = state.mapping
    if current is None or current[0] != mapping_id:
        held = "none" if current is None else f"{current[0]!r}"
        raise EngineStateError(f"{UNKNOWN_MAPPING} {mapping_id!r} (this engine holds {held}): map the weights "
                               f"with /reflow/map_weights first")
    t0 = time.perf_counter()
    with state.paused(body.get("pause_mode", "abort")), state.writing():
        with state.cond:  # the first push found idle lays the weights out as the mapped source (nothing mid-batch
            adopt = not state.mapping_adopted and not state.running  # may hold the old ones)
            state.mapping_adopted |= adopt
        if adopt:
            state.gen.adopt_layout(current[1])
        copies = state.gen.load_mapped(mapping_id, current[1])
        if version is not None:
            state.gen.weight_version = str(version)
    return {"message": f"Success: loaded {len(current[1])} mapped tensors", "copies": copies,
            "seconds": time.perf_counter() - t0, "arena_bytes": state.gen.arena_bytes()}


def _init_group(state: EngineState, body: dict) -> str:
    """Join the trainer's weight-update group as rank rank_offset (TP=1: one rank per engine)."""
    missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if body.get(k) is None]
    if missing:
        raise ContractError(f"init_weights_update_group needs {missing}")
    name, backend = body.get("group_name") or "weight_update_group", body.get("backend", "nccl")
    if backend not in ("gloo", "nccl") or (backend == "nccl" and state.gen.device.type != "cuda"):
        raise EngineStateError(f"backend {backend!r}: this embedded engine runs on {state.gen.device.type}; "
                               f"use backend 'gloo'" + (" (or 'nccl' with the engine on a GPU)" if backend == "nccl" else ""))
    if name in state.groups:
        raise EngineStateError(f"weight-update group {name!r} already exists: destroy it first")
    try:
        group = weight_group.open_group(body["master_address"], int(body["master_port"]),
                                        int(body["rank_offset"]), int(body["world_size"]), name, backend)
        state.groups[name] = group
        group.device = str(state.gen.device) if backend == "nccl" else "cpu"  # where its buckets arrive
    except (RuntimeError, ValueError) as e:  # rendezvous timeout / refused: SGLang answers 400 too
        raise EngineStateError(f"Failed to initialize custom process group: {e}.") from e
    return "Succeeded to initialize custom process group."


def _update_from_distributed(state: EngineState, body: dict) -> str:
    state.require_session("update_weights_from_distributed")
    names, dtypes, shapes = (list(body.get(k) or []) for k in ("names", "dtypes", "shapes"))
    _check_declared(state.gen, names, dtypes, shapes)  # before the receive buffer is allocated
    name = body.get("group_name") or "weight_update_group"
    if name not in state.groups:
        raise EngineStateError(f"Group {name} not in {list(state.groups)}. "
                               f"Please call `init_weights_update_group` first.")
    group = state.groups[name]
    named = weight_group.receive(group, names, dtypes, shapes, body.get("load_format"), group.device)
    with state.writing():
        state.gen.load_named_tensors(named)
        if body.get("weight_version") is not None:
            state.gen.weight_version = str(body["weight_version"])
    return "Succeeded to update parameter online."


def _check_declared(gen: Generator, names: list, dtypes: list, shapes: list) -> None:
    """A distributed update allocates what it declares: each entry must be one of the model's tensors,
    once, with its shape and a floating-point dtype (so at most 8 bytes an element)."""
    params, seen = gen.model.state_dict(), set()
    for n, d, shape in zip(names, dtypes, shapes):
        if not isinstance(n, str) or n not in params:
            raise KeyError(f"unknown weight name {n!r}: the engine's model has no such tensor "
                           f"(names look like {next(iter(params))!r}); send HF parameter names")
        if n in seen:
            raise ContractError(f"weight {n!r} is named twice in one update")
        seen.add(n)
        if not isinstance(shape, list) or any(type(x) is not int for x in shape) or shape != list(params[n].shape):
            raise ValueError(f"shape mismatch for {n!r}: got {shape!r}, engine has {list(params[n].shape)}")
        dt = getattr(torch, str(d).removeprefix("torch."), None)
        if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
            raise ContractError(f"dtype {d!r} of {n!r} is not a floating-point torch dtype")


def _destroy_group(state: EngineState, body: dict) -> str:
    if state.groups.pop(body.get("group_name") or "weight_update_group", None) is None:
        raise EngineStateError("The group to be destroyed does not exist.")
    return "Succeeded to destroy custom process group."


def _declared_files(files: object) -> dict[str, dict] | None:
    """update_weights_from_disk's `files` (reflow's extension, advertised as DISK_FILES): None, or
    {name: {"sha256": 64 hex digits, "bytes": int}} for every file the folder must hold."""
    if files is None:
        return None
    if not isinstance(files, dict) or not files:
        raise ContractError("files must be a non-empty object {name: {\"sha256\", \"bytes\"}} of the folder's files")
    for name, meta in files.items():
        digest = meta.get("sha256") if isinstance(meta, dict) else None
        if (not isinstance(name, str) or not isinstance(digest, str) or len(digest) != 64
                or any(ch not in "0123456789abcdef" for ch in digest) or type(meta.get("bytes", 0)) is not int):
            raise ContractError(f"files[{name!r}] must be {{\"sha256\": <64 hex digits>, \"bytes\": <int>}}, "
                                f"got {_unexpected(meta)}")
    return files


def _load_disk(state: EngineState, path: str, files: dict[str, dict] | None):
    """The model at `path`; with `files`, only a folder holding exactly those files with those digests: a
    local one is loaded from a private copy made while checking it (hf_io.copy_verified), a storage URL
    from the download checked on arrival (hf_io.resolve_checkpoint)."""
    dtype = _DTYPE_NAMES.get(str(state.gen.dtype), "fp32")
    if files is None or not is_local(path):
        return load_causal_lm(path, dtype=dtype, storage=state.storage, files=files)
    with tempfile.TemporaryDirectory(prefix="reflow-engine-load-") as private:
        return load_causal_lm(str(copy_verified(path, files, Path(private))), dtype=dtype)


def _update_from_disk(state: EngineState, body: dict) -> dict:
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise ContractError("model_path must be a non-empty string (an HF checkpoint folder or URL)")
    files = _declared_files(body.get("files"))
    if body.get("abort_all_requests"):
        state.abort(abort_all=True, message="Abort by update_weights_from_disk")
    try:
        model = _load_disk(state, path, files)
    except (OSError, ValueError, StorageError) as e:  # StorageError: ChecksumError among them
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
    values = state.gen.get_weight(name, rows=size).float().tolist()  # truncated first: an embedding matrix as
    return values if isinstance(values, list) else [values]  # nested lists took ~0.5 s (bench/RESULTS.md 21)
