"""Trainer -> engines weight sync over SGLang's HTTP API, then proof that it landed.

Per SGLANG_API.md (and slime/miles): pause -> flush -> begin session -> one
update_weights_from_tensor(load_format="flattened_bucket") per bucket of <= bucket_bytes ->
end session -> continue. Each bucket is serialized once (a shared-memory handle) and sent to
every engine; its buffer stays alive until all those calls have returned. try/finally makes sure
no engine is left paused or inside a session, whatever fails.

Verification reads tensors back through /get_weights_by_name and compares them with the pushed
copy cast to the engine's dtype. Any difference raises `WeightSyncError`: a silent mismatch would
make every later importance ratio wrong.
"""
from __future__ import annotations

import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from engines.rollout_client import EngineClient, EngineError
from engines.tensor_bucket import serialize_bucket

log = logging.getLogger(__name__)
_FLUSH_RETRIES = 20


class WeightSyncError(RuntimeError):
    """Weights on an engine are not the weights that were pushed (or the push failed)."""


Named = list[tuple[str, torch.Tensor]]


def make_buckets(named_tensors: Named, bucket_bytes: int) -> list[Named]:
    """Consecutive groups of at most bucket_bytes each (a larger tensor travels alone)."""
    buckets, cur, size = [], [], 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append((name, t))
        size += nbytes
    if cur:
        buckets.append(cur)
    return buckets


def _flush(client: EngineClient) -> None:
    """SGLang refuses a flush while requests are still draining; retry briefly, as slime does."""
    for attempt in range(_FLUSH_RETRIES):
        try:
            client.flush_cache()
            return
        except EngineError as e:
            if e.status != 400 or attempt == _FLUSH_RETRIES - 1:
                raise
            time.sleep(0.1)


def _tp_size(client: EngineClient) -> int:
    return int(client.server_info().get("tp_size", 1) or 1)


def _send_buckets(clients: list[EngineClient], buckets, version: str, tp: list[int]) -> None:
    with ThreadPoolExecutor(max_workers=len(clients)) as pool:
        for bucket in buckets:
            payload = serialize_bucket(bucket)  # holds the shared buffer until we drop it below
            calls = [pool.submit(c.update_weights_from_tensor, [payload] * k, "flattened_bucket", True, version)
                     for c, k in zip(clients, tp)]
            for c, f in zip(clients, calls):
                out = f.result()
                if not out.get("success", False):
                    raise WeightSyncError(f"engine {c.url} refused a weight bucket: {out.get('message')}")
            del payload


def _finish(paused: list[EngineClient], opened: list[EngineClient]) -> list[str]:
    """End sessions and resume generation on every engine we touched; return what failed."""
    errors = []
    for c in opened:
        try:
            c.end_weight_update()
        except EngineError as e:
            errors.append(str(e))
    for c in paused:
        try:
            c.continue_generation()
        except EngineError as e:
            errors.append(str(e))
    return errors


def push_weights(clients: list[EngineClient], named_tensors: list[tuple[str, torch.Tensor]], version: str,
                 bucket_bytes: int = 512 << 20, verify: str = "full", verify_sample: int = 4,
                 pause_mode: str = "abort") -> dict:
    """Push `named_tensors` (HF names) to every engine as `version`, then verify. Returns stats."""
    if verify not in ("full", "sample", "off"):
        raise ValueError(f"verify must be 'full', 'sample' or 'off', got {verify!r}")
    t0 = time.perf_counter()
    buckets = make_buckets(named_tensors, bucket_bytes)
    paused, opened, failed = [], [], True
    try:
        tp = [_tp_size(c) for c in clients]
        for c in clients:
            c.pause_generation(pause_mode)
            paused.append(c)
            _flush(c)
            c.begin_weight_update()
            opened.append(c)
        _send_buckets(clients, buckets, version, tp)
        failed = False
    finally:
        errors = _finish(paused, opened)
        if errors and failed:
            log.error("while unwinding a failed weight push: %s", "; ".join(errors))
        elif errors:
            raise WeightSyncError("weights were sent but closing the update failed: " + "; ".join(errors))
    seconds = time.perf_counter() - t0
    verified = verify_weights(clients, named_tensors, version, verify, verify_sample)
    return {"bytes": sum(t.numel() * t.element_size() for _, t in named_tensors), "seconds": seconds,
            "buckets": len(buckets), "engines": len(clients), "verified_tensors": verified,
            "verify_seconds": time.perf_counter() - t0 - seconds}


def _engine_dtype(client: EngineClient) -> torch.dtype | None:
    """The dtype the engine stores weights in; None for SGLang's "auto" (then the pushed dtype)."""
    name = str(client.server_info().get("dtype", "auto")).removeprefix("torch.")
    dt = getattr(torch, name, None) if name != "auto" else None
    return dt if isinstance(dt, torch.dtype) else None


def verify_weights(clients: list[EngineClient], named_tensors: list[tuple[str, torch.Tensor]], version: str,
                   mode: str = "full", sample: int = 4) -> int:
    """Check version and tensor values on every engine; returns how many tensors were compared."""
    if mode == "off":
        return 0
    names = [n for n, _ in named_tensors]
    if mode == "sample":  # deterministic per version, so a rerun checks the same tensors
        names = sorted(random.Random(version).sample(sorted(names), min(sample, len(names))))
    pushed = dict(named_tensors)
    count = 0
    for c in clients:
        got_version = c.model_info().get("weight_version")
        if str(got_version) != str(version):
            raise WeightSyncError(f"engine {c.url} reports weight_version {got_version!r}, expected {version!r}")
        dtype = _engine_dtype(c)
        for name in names:
            _compare(c, name, pushed[name], dtype)
            count += 1
    return count


def _compare(client: EngineClient, name: str, pushed: torch.Tensor, dtype: torch.dtype | None) -> None:
    want = pushed.detach().to("cpu").to(dtype or pushed.dtype).float()  # what the engine must hold
    rows = want.shape[0] if want.dim() else 1
    got = torch.tensor(client.get_weights_by_name(name, truncate_size=max(rows, want.numel())), dtype=torch.float32)
    want = want.reshape(1) if want.dim() == 0 else want
    if tuple(got.shape) != tuple(want.shape):
        raise WeightSyncError(f"engine {client.url} tensor {name!r}: shape {tuple(got.shape)} "
                              f"!= pushed {tuple(want.shape)}")
    if not torch.equal(got, want):  # exact: same values cast the same way (NaN never passes)
        diff = (got - want).abs().max().item()
        raise WeightSyncError(f"engine {client.url} tensor {name!r} differs from the pushed weights: "
                              f"max abs diff {diff:.3g}")
