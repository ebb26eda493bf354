"""Pushes through a mapping the engine keeps (`weight_sync.map_once`, reflow's embedded engine only).

SGLang's `update_weights_from_tensor` hands every push a new handle: the sender pickles it (on a GPU a
CUDA IPC handle, an inter-process event and a reference-count slot per share), the engine unpickles it,
opens it, copies, and closes it again, inside five more calls (pause, flush, begin, end, continue). For
a 0.99 GB model on an H200 that was 37 ms against a 0.5 ms copy (bench/RESULTS.md section 7): fixed
per-call cost, not bytes. Here the engine maps the source once (`/reflow/map_weights`) and every later
push is one call (`/reflow/update_weights_from_mapped`) in which the engine pauses generation, copies
from what it mapped into its own weights, sets the weight version and resumes.

What the engine maps:
- the trainer's own tensors (`stable=True`: the live parameters, which stay where they are from one push
  to the next), grouped by the storage they live in (one flattened-bucket payload per storage, of the
  whole storage, with each tensor's byte range in it): on a GPU that is CUDA IPC of the parameters
  themselves, so a push is the engine's one device-to-device copy, nothing packed or staged; on CPU
  only when those storages are already in shared memory;
- otherwise one buffer (on the tensors' GPU, or in host shared memory) that each push packs first.

A mapping is the engine's until it is replaced: the sender keeps, per engine URL, which tensors it
mapped (their storages' addresses, offsets, shapes, dtypes) and maps again when that changes. A mapped
storage cannot be reused for something else meanwhile: torch keeps memory another process has opened
(its CUDA IPC reference count, the file_system strategy's count in the segment) until that process
lets go, which the engine does when the next mapping replaces this one. An engine that does not know
the mapping (restarted at the same URL, or mapped by another trainer since) answers 400 and the push
maps again once. The first push the engine takes while idle lays its weights out as what it mapped
(reflow.engines.embedded.weight_layout): from then on a push of the trainer's one flat storage is one
copy on the engine's side (Llama's shape; Qwen2's q/k/v biases make it 1 + 5 per layer).

Before the update call the sender waits for its device (the optimizer step's writes are done) and
holds its tensors still until the call returns (rank 0 is inside the push; the engine has copied and
synchronized before it answers).
"""
from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from reflow.engines.local_control import LOCAL_CONTROL, LocalControlClient, LocalControlError
from reflow.engines.rollout_client import EngineClient, EngineError
from reflow.engines.weights.buckets import (
    BucketError,
    FlattenedTensorMetadata,
    Payload,
    _dtype_str,
    _dumps,
    _parse_dtype,
    _shared_uint8,
    layout,
    pack_into,
    storage_bytes,
)

CAPABILITY = "reflow_mapped_weights"  # in an engine's /server_info: it serves the two endpoints below
UNKNOWN_MAPPING = "unknown weight mapping"  # in the engine's 400 answer when it holds another (or none)
Named = list[tuple[str, torch.Tensor]]
log = logging.getLogger(__name__)


@dataclass
class _Mapping:
    """What one engine has mapped from this process."""

    id: str
    signature: tuple
    payloads: list[Payload]  # hold the shared buffers (and their handles) while the engine maps them
    buffers: int  # how many (one per storage mapped directly; one packed buffer otherwise)


class LiveViews(list):
    """(name, tensor) pairs whose addresses the caller checked just now, as `key` (DeepSpeedRank._live_views:
    detached views of the live parameters, the same object while none moved). The sender then takes the
    facts it worked out for this very object instead of walking the tensors again (0.18 ms for 290 on this
    VM's host at every push). Any other list is walked."""

    def __init__(self, pairs, key: tuple) -> None:
        super().__init__(pairs)
        self.key = key


def addresses(tensors) -> tuple:
    """Every tensor's data pointer, in order (one C-level loop: the per-push address checks)."""
    return tuple(map(torch.Tensor.data_ptr, tensors))


def storage_groups(named: Named) -> list[tuple[torch.Tensor, list[tuple]]]:
    """The (contiguous) tensors' storages as whole uint8 tensors, each with the metadata tuples (name, shape,
    dtype, start, end, bytes) of the tensors inside it, in first-seen order."""
    groups: dict[tuple[str, int], tuple[torch.Tensor, list[tuple]]] = {}
    for name, t in named:
        st = t.untyped_storage()
        key = (str(t.device), st.data_ptr())
        if key not in groups:
            whole = storage_bytes(t, 0, st.nbytes())  # [S]
            groups[key] = (whole, [])
        start = t.storage_offset() * t.element_size()
        nbytes = t.numel() * t.element_size()
        groups[key][1].append((name, tuple(t.shape), _dtype_str(t.dtype), start, start + nbytes, nbytes))
    return list(groups.values())


def _direct_signature(named: Named) -> tuple:
    """Where each tensor is: a tensor at the same address with the same shape and dtype is in the storage the
    engine mapped (torch cannot hand a mapped storage's memory to anything else while the engine holds it)."""
    return tuple((n, t.device, t.data_ptr(), t.shape, t.dtype) for n, t in named)


def _packed_signature(named: Named) -> tuple:
    return tuple((n, t.device, t.shape, t.dtype) for n, t in named)


def _payload(flat: torch.Tensor, meta: list[tuple]) -> Payload:
    """One flattened-bucket payload of `flat` (SGLang's format: the engine rebuilds it with the same code)."""
    metadata = [FlattenedTensorMetadata(n, torch.Size(s), _parse_dtype(d), a, b, k) for n, s, d, a, b, k in meta]
    return _dumps({"flattened_tensor": flat, "metadata": metadata}, [flat])


def _direct(named: Named) -> bool:
    """Whether an engine can map these tensors where they are: on a GPU (CUDA IPC), or in host shared memory."""
    return all(t.is_cuda or t.is_shared() for _, t in named)


class MappedSender:
    """This process's mappings, one per engine URL, and the packed buffer they share (a trainer's rank 0
    keeps them for its life)."""

    def __init__(self) -> None:
        self.maps: dict[str, _Mapping] = {}
        self.capable: dict[str, bool] = {}  # engine URL -> whether it serves the mapped endpoints
        # layout -> (buffer, metadata): one packed buffer per layout, kept (shared-memory ones are never freed:
        # buckets.BufferPool says why), so pushes of two models alternating from one process each keep theirs
        self.packed: dict[tuple, tuple[torch.Tensor, list]] = {}
        self.lock = threading.Lock()
        self.map_calls = 0  # how many times an engine was (re)mapped: tests and stats read it
        self.local: dict[str, LocalControlClient] = {}  # engine URL -> its local socket, where on this host
        self.local_calls = 0  # updates that went through a local socket (tests and stats read it)
        # (names and addresses, _direct_facts' answer, the LiveViews object they were for) of the last stable push
        self._facts: tuple | None = None

    def supports(self, clients: list[EngineClient]) -> bool:
        """Whether every engine serves the mapped endpoints (asked once per URL; also where its local socket is)."""
        for c in clients:
            if c.url not in self.capable:
                info = c.server_info()
                self.capable[c.url] = bool(info.get(CAPABILITY, False))
                local = info.get(LOCAL_CONTROL)
                if self.capable[c.url] and LocalControlClient.usable(local):
                    with self.lock:
                        self.local[c.url] = LocalControlClient(local, c.api_key, c.timeout)
        return all(self.capable[c.url] for c in clients)

    def _update(self, client: EngineClient, mapping_id: str, version: str, pause_mode: str) -> dict:
        """/reflow/update_weights_from_mapped: through the engine's local socket where it has one on this host
        (~0.03 ms against ~1 ms through HTTP), else, or when the socket fails, through HTTP (and the engine's
        /server_info is asked again at the next push: it may have restarted elsewhere)."""
        with self.lock:
            local = self.local.get(client.url)
        body = {"mapping_id": mapping_id, "weight_version": version, "pause_mode": pause_mode}
        if local is not None:
            try:
                out = local.call("update_weights_from_mapped", body)
                with self.lock:  # pushes to several engines run in threads
                    self.local_calls += 1
                return out
            except LocalControlError as e:  # the engine's own answer: what HTTP would have raised
                raise EngineError(client.url, f"/reflow/update_weights_from_mapped (local socket {local.info['path']})",
                                  e.status, e.message) from e
            except OSError as e:
                log.warning("engine %s: its local socket failed (%s); this push goes through HTTP", client.url, e)
                with self.lock:
                    self.local.pop(client.url, None)
                    self.capable.pop(client.url, None)
        return client.update_weights_from_mapped(mapping_id, version, pause_mode)

    def push(self, clients: list[EngineClient], named: Named, version: str, pause_mode: str = "abort",
             stable: bool = False) -> dict:
        """Every engine gets `named` as `version` through its mapping (made or renewed first when needed).
        `stable`: these are the live tensors, which keep their storage from push to push (the engine may map
        them directly). Returns {"buckets": buffers mapped per engine, "mapped": engines (re)mapped for this push,
        "copies": the copies the engines made, all together, "engine_seconds": the longest an engine took inside
        its call (pause, copies, synchronize, resume)}."""
        direct, signature, nbytes, devices = self._direct_facts(named, stable)
        if direct:
            groups = lambda: storage_groups(named)  # noqa: E731 - built only when an engine maps them
        else:
            flat, metadata = self._buffer(_packed_signature(named), named)
            signature = ("packed", flat.data_ptr(), *_packed_signature(named))  # the buffer the engine maps, too
            pack_into(flat, metadata, named)  # once, whatever the number of engines
            nbytes, devices = sum(m[5] for m in metadata), _cuda_devices(named) | _cuda_devices([("", flat)])
            groups = lambda: [(flat, metadata)]  # noqa: E731
        for index in devices:  # the optimizer step's (and the packing's) writes are done before another process reads
            torch.cuda.synchronize(index)
        if len(clients) == 1:  # the usual colocated case: no thread for one call
            answers = [self._push_one(clients[0], groups, version, pause_mode, signature)]
        else:
            with ThreadPoolExecutor(max_workers=len(clients)) as pool:
                answers = list(pool.map(lambda c: self._push_one(c, groups, version, pause_mode, signature), clients))
        with self.lock:
            buffers = self.maps[clients[0].url].buffers
        # copies: what the engines' copying took, all together (one per run of bytes: embedded/weight_layout.py)
        return {"buckets": buffers, "mapped": sum(r for r, _ in answers), "bytes": nbytes,
                "copies": sum(int(out.get("copies", 0)) for _, out in answers),
                "engine_seconds": max(float(out.get("seconds", 0.0)) for _, out in answers)}

    def _direct_facts(self, named: Named, stable: bool) -> tuple[bool, tuple | None, int | None, set | None]:
        """(whether the engines may map `named` where they are, the mapping's signature if so, their bytes, their
        CUDA devices), worked out once per list of names and addresses: the checks walk every tensor (0.3 ms
        for 290 on the H200 machine's host, more than half the device copy they lead to). A tensor at an
        address the engines mapped is still the tensor they mapped (see _direct_signature)."""
        if not stable:
            return False, None, None, None
        with self.lock:  # the object the caller checked and handed us last time: nothing to walk
            if self._facts is not None and isinstance(named, LiveViews) and self._facts[2] is named:
                return self._facts[1]
        key = (tuple(n for n, _ in named), addresses(t for _, t in named))
        with self.lock:
            if self._facts is not None and self._facts[0] == key:
                self._facts = (key, self._facts[1], named if isinstance(named, LiveViews) else None)
                return self._facts[1]
        direct = _direct(named) and all(t.is_contiguous() for _, t in named)
        facts = (direct, ("direct", *_direct_signature(named)) if direct else None,
                 sum(t.numel() * t.element_size() for _, t in named), _cuda_devices(named))
        with self.lock:
            self._facts = (key, facts, named if isinstance(named, LiveViews) else None)
        return facts

    def _buffer(self, layout_key: tuple, named: Named) -> tuple[torch.Tensor, list]:
        with self.lock:
            if layout_key in self.packed:
                return self.packed[layout_key]
        metadata, nbytes = layout(named)
        device = named[0][1].device
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device) if device.type == "cuda" else _shared_uint8(nbytes)
        with self.lock:
            self.packed[layout_key] = (flat, metadata)
        return flat, metadata

    def _push_one(self, client: EngineClient, groups, version: str, pause_mode: str, signature: tuple) -> bool:
        with self.lock:
            m = self.maps.get(client.url)
        remapped = m is None or m.signature != signature
        if remapped:
            m = self._map(client, groups, signature)
        try:
            out = self._update(client, m.id, version, pause_mode)
        except EngineError as e:
            if e.status != 400 or UNKNOWN_MAPPING not in e.message:
                raise
            m, remapped = self._map(client, groups, signature), True  # the engine lost it: map once more
            out = self._update(client, m.id, version, pause_mode)
        if not out.get("success", False):
            raise BucketError(f"engine {client.url} refused a mapped weight update: {out.get('message')}")
        return remapped, out

    def _map(self, client: EngineClient, groups, signature: tuple) -> _Mapping:
        """Hand the engine one payload per storage of `groups()` (its own pickles: buckets.SharedBucket says why)."""
        payloads = [_payload(flat, meta) for flat, meta in groups()]
        m = _Mapping(uuid.uuid4().hex, signature, payloads, len(payloads))
        out = client.map_weights(m.payloads, m.id)
        if not out.get("success", False):
            raise BucketError(f"engine {client.url} refused to map the trainer's weights: {out.get('message')}")
        with self.lock:
            self.maps[client.url] = m
            self.map_calls += 1
        return m


def _cuda_devices(named: Named) -> set[int]:
    """The CUDA devices these tensors are on (their writes are waited for before an engine copies them)."""
    return {t.device.index for _, t in named if t.is_cuda}


MAPPED = MappedSender()  # this process's (a trainer's rank 0)
