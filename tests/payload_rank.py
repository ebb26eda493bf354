"""A long-lived weight receiver running SGLang 0.5.23's own receiving code (for tests/test_payload_receivers.py).

One process plays one SGLang TP rank: it rebuilds the payload of its rank the way
`TpModelWorker.deserialize_own_rank` (MultiprocessingSerializer.deserialize -> SafeUnpickler) and
`WeightUpdater._update_weights_from_flattened_bucket` (FlattenedTensorBucket.reconstruct_tensors)
do, answers a digest of every tensor, and frees what it mapped before the next payload, as a
scheduler that copies into its parameters does. SafeUnpickler lives in sglang/srt/utils/common.py,
which imports triton at the top: the class (and the one helper it names) are compiled from that
file's own source here, nothing of it is copied.
"""
from __future__ import annotations

import ast
import base64
import hashlib
import io
import pickle
from pathlib import Path

import torch

from reflow.engines.sglang import contract as sglang_contract


def sglang_safe_unpickler() -> type:
    """SGLang's SafeUnpickler class, compiled from the installed wheel's srt/utils/common.py."""
    root = sglang_contract.installed_root()
    if root is None:
        raise RuntimeError("sglang==0.5.23 is not installed (make setup installs it --no-deps)")
    path = Path(root) / "srt" / "utils" / "common.py"
    wanted = {"SafeUnpickler", "_safe_load_torch_storage"}
    nodes = [n for n in ast.parse(path.read_text()).body
             if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name in wanted]
    if {n.name for n in nodes} != wanted:
        raise RuntimeError(f"{path} no longer defines {sorted(wanted)}: SGLang's receiving code moved")
    namespace = {"__name__": "sglang.srt.utils.common", "io": io, "pickle": pickle, "torch": torch}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), namespace)
    return namespace["SafeUnpickler"]


def digest(t: torch.Tensor) -> str:
    """Exact identity of a tensor's dtype, shape and bytes."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{t.dtype}{tuple(t.shape)}:{hashlib.sha256(raw).hexdigest()}"


def rebuild(unpickler: type, contract, payload: str) -> dict[str, str]:
    """One rank's load of a flattened_bucket payload through SGLang's code; name -> digest."""
    data = unpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()
    meta = [contract.FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                             end_idx=m.end_idx, numel=m.numel) for m in data["metadata"]]
    bucket = contract.FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=meta)
    return {name: digest(t) for name, t in bucket.reconstruct_tensors()}


def serve_rank(conn) -> None:
    """Process entry: rebuild each payload received on `conn`, answer ("ok", digests) or ("error", text);
    None ends it. Everything a payload mapped is freed before the answer goes out."""
    contract = sglang_contract.load()  # registers the bare sglang package the unpickler imports from
    unpickler = sglang_safe_unpickler()
    while True:
        payload = conn.recv()
        if payload is None:
            return
        try:
            answer = ("ok", rebuild(unpickler, contract, payload))
        except Exception as e:  # deliberate: the failure goes back to the test, which reports it
            answer = ("error", f"{type(e).__name__}: {e}")
        conn.send(answer)
