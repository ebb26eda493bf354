"""Adapter-only weight pushes (trainer.lora.rank > 0): the LoRA tensors travel, not the model.

    pause -> flush -> load_lora_adapter_from_tensors (one flattened bucket in this host's shared
    memory, one payload per TP rank, as update_weights_from_tensor) -> update_weight_version -> continue
then the usual verification (reflow.engines.weights.verify) against the *effective* weights the
trainer computes (W_base + B @ A * alpha/r for every adapted linear): an engine that merged the
adapter (the embedded one) answers get_weights_by_name with exactly those. SGLang's load needs no
weight session (it is not a weight update), so none is opened.
"""
from __future__ import annotations

import time

from reflow.engines.rollout_client import EngineClient
from reflow.engines.weights.buckets import BUFFERS, SharedBucket
from reflow.engines.weights.push import _tp_size, check_same_host, update_window
from reflow.engines.weights.settings import PushSettings
from reflow.engines.weights.verify import LogprobProbe, Named, WeightSyncError, check_pushed

ADAPTER_NAME = "reflow-policy"  # the one adapter a policy's engines hold


def _nbytes(named: Named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def push_adapter(clients: list[EngineClient], adapter: Named, config: dict, effective: Named, version: str,
                 settings: PushSettings, *, master_address: str = "127.0.0.1",
                 probe: LogprobProbe | None = None) -> dict:
    """Send `adapter` (wire-named LoRA tensors, `config` its PEFT adapter_config) to every engine as
    `version`, then verify against `effective`. Returns the push stats; `bytes` is what travelled,
    `full_bytes` what a whole-model push would have sent."""
    s = settings
    if s.mode != "tensor":
        raise WeightSyncError(f"LoRA pushes go as tensors (load_lora_adapter_from_tensors); weight_sync.mode="
                              f"{s.mode} is not supported with trainer.lora.rank > 0")
    check_same_host(clients, master_address)
    t0 = time.perf_counter()
    with update_window(clients, s.pause_mode, session=False):
        shared = SharedBucket(adapter, pool=BUFFERS)
        try:
            for c in clients:
                out = c.load_lora_adapter_from_tensors(ADAPTER_NAME, config, shared.payloads(_tp_size(c)),
                                                       "flattened_bucket")
                if not out.get("success", False):
                    raise WeightSyncError(f"engine {c.url} refused the LoRA adapter: {out.get('error_message')}")
        finally:
            shared.release()
        for c in clients:
            c.update_weight_version(version, abort_all_requests=False)
    seconds = time.perf_counter() - t0
    checked = check_pushed(clients, effective, version, s, probe)
    return {"mode": "lora", "bytes": _nbytes(adapter), "full_bytes": _nbytes(effective), "seconds": seconds,
            "buckets": 1, "engines": len(clients), **checked, "verify_seconds": time.perf_counter() - t0 - seconds}
