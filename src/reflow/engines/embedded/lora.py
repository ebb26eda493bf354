"""LoRA adapters on the embedded engine: SGLang 0.5.23's `/load_lora_adapter_from_tensors` and
`/unload_lora_adapter` (request fields of LoadLoRAAdapterFromTensorsReqInput / UnloadLoRAAdapterReqInput,
answers shaped like LoRAUpdateOutput).

Departure from SGLang, deliberately: the adapter is merged into the engine's weights on receipt
(W = W_base + B @ A * alpha/r, reflow.engines.weights.lora.merge) instead of being applied per request.
RL trains one adapter at a time, so there is nothing to multiplex; merged, the engine's forward, its
KV cache and its CUDA-graph decode stay exactly those of the base model (no extra matmuls per token),
and `get_weights_by_name` answers with the effective weights, which is what push verification
compares. One adapter is merged at a time: loading one replaces the previous. The engine keeps a copy
of the base weights of every adapted linear (taken before the first merge) and merges each push
into that copy: merging into already-merged weights would add every push's update on top of the
last, and subtracting the previous update back out drifts in floating point. A full weight update
(any other endpoint) makes those copies stale; the next adapter then takes fresh ones.
Requests may name the merged adapter in `lora_path` (reflow's rollouts do, as they must on SGLang);
one naming any other adapter is refused as SGLang refuses an adapter it does not hold. Requests
without `lora_path` are served by the merged weights. GET /v1/models lists the base model and the
merged adapter as SGLang does (the pusher reads it), and `expected_checksums` is checked as SGLang's
TP workers check it (sha256 of each received tensor; missing, extra or different ones refused).
"""
from __future__ import annotations

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from reflow.engines.embedded.contract import ContractError
from reflow.engines.embedded.state import EngineState, EngineStateError
from reflow.engines.weights import lora
from reflow.engines.weights.buckets import BucketError, load_payload


class MergedAdapter:
    """The adapter merged into an engine's weights, and the base copies it is merged into."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.base: dict[str, torch.Tensor] = {}  # HF weight name -> the weight before any adapter
        self.writes = -1  # generator.weight_writes right after our last merge (else: base copies are stale)

    def load(self, state: EngineState, name: str, config: dict, named: list[tuple[str, torch.Tensor]]) -> int:
        """Merge `named` (wire-named adapter tensors) into the weights; returns the count of merged linears."""
        scale, halves = lora.scaling(config), lora.pairs(named)
        gen = state.gen
        with state.writing():
            if gen.weight_writes != self.writes:  # first adapter, or full weights arrived since: new base
                self.base = {}
            merged = []
            for module, ab in halves.items():
                weight = f"{module}.weight"
                if weight not in self.base:
                    self.base[weight] = gen.get_weight(weight)  # KeyError names a module the model lacks
                merged.append((weight, lora.merge(self.base[weight], ab["A"], ab["B"], scale)))
            stale = [(w, t) for w, t in self.base.items() if w not in dict(merged)]  # adapted before, not now
            gen.load_named_tensors(merged + stale)
            self.name, self.writes = name, gen.weight_writes
        return len(merged)

    def unload(self, state: EngineState, name: str) -> None:
        if name != self.name:
            raise EngineStateError(f"LoRA adapter {name!r} is not loaded (loaded: {self.name!r})")
        with state.writing():
            if state.gen.weight_writes == self.writes:  # else full weights replaced the merged ones already
                state.gen.load_named_tensors(list(self.base.items()))
            self.name, self.base, self.writes = None, {}, -1


def _lora_name(body: dict) -> str:
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise ContractError("lora_name: field required (a non-empty string)")
    return name


def check_lora_path(state: EngineState, body: dict) -> None:
    """Refuse a /generate body whose `lora_path` names an adapter other than the merged one (a list entry
    null asks for the base model, which a merged engine cannot serve alongside)."""
    paths = body.get("lora_path")
    if paths is None:
        return
    merged = getattr(state, "adapter", None)
    held = merged.name if merged is not None else None
    for path in paths if isinstance(paths, list) else [paths]:
        if path != held:
            raise ContractError(f"lora_path {path!r}: LoRA adapter not loaded on this engine (loaded: {held!r}; the "
                                f"embedded engine merges one adapter and serves every request with it)")


def _check_sums(named: list[tuple[str, torch.Tensor]], expected: dict | None) -> None:
    if expected is None:
        return
    got = lora.checksums(named)
    bad = sorted(n for n in got if n in expected and got[n] != expected[n])
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if bad or missing or extra:
        raise EngineStateError(f"adapter tensors differ from expected_checksums: {len(bad)} value-diff {bad[:5]}, "
                               f"{len(missing)} missing {missing[:5]}, {len(extra)} extra {extra[:5]}")


def _load(adapter: MergedAdapter, state: EngineState, body: dict, max_bytes: int) -> dict:
    name, config, payloads = _lora_name(body), body.get("config_dict"), body.get("serialized_named_tensors")
    if not isinstance(config, dict):
        raise ContractError("config_dict: field required (the adapter's PEFT adapter_config.json as an object)")
    if not isinstance(payloads, list) or not payloads or not isinstance(payloads[0], str):
        raise ContractError("serialized_named_tensors must be a non-empty list of base64 strings (one per TP rank)")
    try:
        named = load_payload(payloads[0], body.get("load_format"), max_bytes)  # TP=1: entry 0 is ours
    except BucketError as e:
        raise EngineStateError(f"adapter payload rejected: {e}") from e
    _check_sums(named, body.get("expected_checksums"))
    count = adapter.load(state, name, config, named)
    return {"loaded_adapters": {name: "__tensor__"}, "merged_modules": count}


def add_routes(app: FastAPI, state: EngineState, max_bytes: int) -> None:
    adapter = MergedAdapter()
    state.adapter = adapter  # type: ignore[attr-defined]  # tests and the verifier read which one is merged

    async def answer(fn, request: Request):
        try:
            body = await request.json()
            out = await run_in_threadpool(fn, body if isinstance(body, dict) else {})
        except (ValueError, KeyError, EngineStateError) as e:  # SGLang: success false + error_message, 400
            message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            return JSONResponse({"success": False, "error_message": str(message), "loaded_adapters": None},
                                status_code=400)
        return {"success": True, "error_message": None, **out}

    @app.post("/load_lora_adapter_from_tensors")
    async def load_from_tensors(request: Request):
        return await answer(lambda body: _load(adapter, state, body, max_bytes), request)

    @app.get("/v1/models")
    async def models():  # SGLang's shape (OpenAI model cards): the base model, then the adapter with its parent
        base = str(state.info.get("model_path"))
        cards = [{"id": base, "object": "model", "root": base, "parent": None}]
        if adapter.name is not None:
            cards.append({"id": adapter.name, "object": "model", "root": "__tensor__", "parent": base})
        return {"object": "list", "data": cards}

    @app.post("/unload_lora_adapter")
    async def unload(request: Request):
        def run(body: dict) -> dict:
            adapter.unload(state, _lora_name(body))
            return {"loaded_adapters": {}}
        return await answer(run, request)
