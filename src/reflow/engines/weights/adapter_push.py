"""Adapter-only weight pushes (trainer.lora.rank > 0): the LoRA tensors travel, not the model.

    pause -> flush -> [unload `reflow-v<version>` if the engine holds it already] ->
    load_lora_adapter_from_tensors(`reflow-v<version>`, one flattened bucket in this host's shared
    memory, one payload per TP rank, expected_checksums) -> update_weight_version -> continue
    -> unload the older `reflow-v*` adapters the load answer lists
then the usual verification (reflow.engines.weights.verify).

One name per version (lora.adapter_name), not one name reloaded: the new adapter is loaded before
the old one goes, so no request ever finds the policy missing, and every /generate request names
the version it samples (`lora_path`), so a stale engine fails the request instead of sampling an
older policy. SGLang refuses to load a name it holds (the same version pushed again: a resumed run
onto engines of the previous flow run), hence the unload first; it lists what it holds at GET
/v1/models. Older versions are unloaded after `continue`: SGLang's unload waits for the requests
still using that adapter, which under pause_mode retract/in_place resume only after `continue`.
`expected_checksums` (sha256 per tensor) makes every TP rank of SGLang refuse a payload that does
not hold exactly the adapter's tensors.

Verification against the *effective* weights (W_base + B @ A * alpha/r) the trainer computes: an
engine that merges the adapter (the embedded one) answers get_weights_by_name with exactly those;
one that applies it per request (SGLang, /server_info `enable_lora`) answers base weights there,
so it is checked by the logprob probe, sent with `lora_path` like any rollout request. SGLang's load
needs no weight session (it is not a weight update), so none is opened.
"""
from __future__ import annotations

import time

from reflow.engines.rollout_client import EngineClient
from reflow.engines.weights import lora
from reflow.engines.weights.buckets import BUFFERS, SharedBucket
from reflow.engines.weights.push import _tp_size, check_same_host, update_window
from reflow.engines.weights.settings import PushSettings
from reflow.engines.weights.verify import Named, ProbeSource, WeightSyncError, check_pushed


def _nbytes(named: Named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def _answer(client: EngineClient, out: dict, what: str) -> dict:
    if not out.get("success", False):
        raise WeightSyncError(f"engine {client.url} refused to {what}: {out.get('error_message')}")
    return out


def _load(clients: list[EngineClient], adapter: Named, config: dict, name: str) -> list[list[str]]:
    """Load `adapter` as `name` on every engine (paused); returns, per engine, the older reflow
    adapters its answer lists (loaded_adapters: everything it holds now)."""
    sums = lora.checksums(adapter)
    held = [c.lora_adapters() for c in clients]
    for c, names in zip(clients, held):
        if name in names:  # SGLang refuses a name it holds
            _answer(c, c.unload_lora_adapter(name), f"unload LoRA adapter {name!r} before loading it again")
    shared = SharedBucket(adapter, pool=BUFFERS)
    stale = []
    try:
        for c in clients:
            out = _answer(c, c.load_lora_adapter_from_tensors(name, config, shared.payloads(_tp_size(c)),
                                                              "flattened_bucket", sums), f"load LoRA adapter {name!r}")
            stale.append([n for n in (out.get("loaded_adapters") or {})
                          if n != name and n.startswith(lora.ADAPTER_PREFIX)])
    finally:
        shared.release()
    return stale


def push_adapter(clients: list[EngineClient], adapter: Named, config: dict, effective: Named, version: str,
                 settings: PushSettings, *, master_address: str = "127.0.0.1",
                 probe: ProbeSource = None) -> dict:
    """Send `adapter` (wire-named LoRA tensors, `config` its PEFT adapter_config) to every engine as
    `version` (adapter `lora.adapter_name(version)`), then verify against `effective`. Returns the push
    stats; `bytes` is what travelled, `full_bytes` what a whole-model push would have sent."""
    s = settings
    if s.mode != "tensor":
        raise WeightSyncError(f"LoRA pushes go as tensors (load_lora_adapter_from_tensors); weight_sync.mode="
                              f"{s.mode} is not supported with trainer.lora.rank > 0")
    check_same_host(clients, master_address)
    name = lora.adapter_name(version)
    t0 = time.perf_counter()
    with update_window(clients, s.pause_mode, session=False):
        stale = _load(clients, adapter, config, name)
        for c in clients:
            c.update_weight_version(version, abort_all_requests=False)
    for c, names in zip(clients, stale):  # after continue: see the module docstring
        for old in names:
            _answer(c, c.unload_lora_adapter(old), f"unload the previous LoRA adapter {old!r}")
    seconds = time.perf_counter() - t0
    checked = check_pushed(clients, effective, version, s, probe, lora_path=name)
    return {"mode": "lora", "bytes": _nbytes(adapter), "full_bytes": _nbytes(effective), "seconds": seconds,
            "buckets": 1, "engines": len(clients), "unloaded": sum(map(len, stale)), **checked,
            "verify_seconds": time.perf_counter() - t0 - seconds}
