"""Weight payloads for `/update_weights_from_tensor`, wire-compatible with SGLang 0.5.23.

A bucket is many tensors packed into one uint8 buffer plus metadata, as SGLang's
`FlattenedTensorBucket`; one HTTP call then carries one buffer handle instead of one per tensor.
The payload is a ForkingPickler pickle, base64-encoded: torch's reductions turn a CPU tensor into
a shared-memory *handle* (no bytes travel over HTTP; on GPU the same path carries CUDA IPC).

CUDA tensors (a trainer and an engine sharing a GPU, colocated mode): the bucket is packed on the
trainer's GPU and the pickle carries a CUDA IPC handle instead; the engine maps the trainer's memory and
copies from it, device to device, nothing staged in host memory. As SGLang's senders do
(`monkey_patch_torch_reductions`), the device is named by its UUID, not its index: Ray gives each actor
its own CUDA_VISIBLE_DEVICES, so one GPU has different indices in the two processes. The receiver maps
the UUID back to its own index and refuses a GPU it cannot see.

Two details make the handles and the pickle usable by the receiver:
- sharing strategy "file_system": the default "file_descriptor" strategy hands the fd over a
  multiprocessing connection keyed to the parent process, which unrelated processes (two Ray
  actors, a trainer and an HTTP server) do not share. A named /dev/shm file works for any process
  on the host. It lives while the sender holds the tensor, so a payload is a `Payload` (a str
  that also holds its buffers): keep that object alive until the receiving call has returned.
- one pickle per receiver: torch counts references to a file_system segment inside the segment;
  a pickle adds one, a receiver's rebuild takes one, the file is unlinked at zero. So a payload
  pays for exactly one rebuild: `SharedBucket.payloads(k)` pickles one shared buffer k times
  (every engine, and every TP rank of one, gets its own), never the same payload twice.
- metadata entries pickle as `sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`
  (a class on SGLang's unpickling allow-list, read by attribute), written by name so sglang need
  not be installed here. The receiving side below maps that name back to a local stand-in.

In Python the metadata is a list of plain tuples
`(name, shape tuple, dtype str e.g. "torch.float32", start_idx, end_idx, numel)`, with byte
offsets into the buffer (numel counts bytes, as in SGLang). Starts are aligned to 16 bytes so
every slice can be viewed as its dtype.
"""
from __future__ import annotations

import base64
import binascii
import builtins
import copyreg
import io
import pickle
import threading
from collections import ChainMap
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # registers torch's ForkingPickler reductions
import torch.multiprocessing.reductions
import torch.multiprocessing.reductions as red

SGLANG_META = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
# torch's own, taken at import: SGLang's monkey patch (when sglang runs in this process) swaps the module's
# attribute for a version that also takes UUIDs; the receiver maps UUIDs itself and calls this one.
_REBUILD_CUDA = getattr(torch.multiprocessing.reductions, "_rebuild_cuda_tensor_original",
                        torch.multiprocessing.reductions.rebuild_cuda_tensor)
_ALIGN = 16
MetaTuple = tuple  # (name, shape, dtype str, start_idx, end_idx, numel)


class BucketError(ValueError):
    """A weight payload is malformed, unsafe, or cannot be rebuilt in this process."""


class SharedMemoryUnavailable(RuntimeError):
    """This process can no longer allocate shared memory for weight buckets (for good: see
    `_shared_uint8`); a push has to take another way (reflow.engines.train.trainer falls back to disk)."""


@dataclass
class FlattenedTensorMetadata:
    """Local stand-in for SGLang's class of the same name (same fields, same pickled form)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def _dtype_str(dtype: torch.dtype) -> str:
    return str(dtype)  # "torch.float32"


def _parse_dtype(d) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    dt = getattr(torch, str(d).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise BucketError(f"unknown dtype {d!r} in bucket metadata")
    return dt


def layout(named_tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[MetaTuple], int]:
    """Where each tensor goes in a packed buffer: (metadata tuples, buffer bytes); starts 16-byte aligned."""
    if not named_tensors:
        raise BucketError("cannot build an empty tensor bucket")
    metadata, offset = [], 0
    for name, t in named_tensors:
        start = -(-offset // _ALIGN) * _ALIGN
        nbytes = t.numel() * t.element_size()
        metadata.append((name, tuple(t.shape), _dtype_str(t.dtype), start, start + nbytes, nbytes))
        offset = start + nbytes
    return metadata, offset


def flatten(named_tensors: list[tuple[str, torch.Tensor]], shared: bool = False, pool: BufferPool | None = None):
    """Pack tensors into one uint8 buffer. Returns (flat [N] uint8, list of metadata tuples).

    shared=True allocates the buffer in shared memory directly (saves the copy pickling makes, and the
    copy `share_memory_()` of a private buffer would make: together they cost more than the packing).
    `pool`: take the buffer from it (a reused one of this size; give it back with `pool.give`).
    """
    metadata, nbytes = layout(named_tensors)
    device = named_tensors[0][1].device
    if pool is not None:
        flat = pool.take(nbytes, device)  # [N]
    elif device.type == "cuda":  # packed where it is: the pickle carries a CUDA IPC handle (module docstring)
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)  # [N]
    elif shared:  # allocated in shared memory directly: share_memory_() would copy (and page in) it once more
        flat = _shared_uint8(nbytes)  # [N]
    else:
        flat = torch.empty(nbytes, dtype=torch.uint8)  # [N]
    pack_into(flat, metadata, named_tensors)
    return flat, metadata


def pack_into(flat: torch.Tensor, metadata: list[MetaTuple], named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Copy the tensors into `flat` where `metadata` (from `layout` of tensors shaped the same) puts them."""
    device = flat.device
    if device.type == "cuda" and all(t.device == device and t.is_contiguous() for _, t in named_tensors):
        # one multi-tensor copy instead of a launch per tensor (hundreds of parameters)
        torch._foreach_copy_([flat[a:b] for _, _, _, a, b, _ in metadata],
                             [t.detach().reshape(-1).view(torch.uint8) for _, t in named_tensors])
        return
    for (_, _, _, start, end, _), (_, t) in zip(metadata, named_tensors):
        flat[start:end] = t.detach().to(flat.device).contiguous().reshape(-1).view(torch.uint8)


_CUDA_DEVICE_ARG = 6  # rebuild_cuda_tensor's storage_device argument (torch's signature, stable for years)


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _reduce_tensor(t: torch.Tensor):
    """torch's reduction, with a CUDA tensor's device index replaced by the GPU's UUID (module docstring)."""
    fn, args = torch.multiprocessing.reductions.reduce_tensor(t)
    if fn is torch.multiprocessing.reductions.rebuild_cuda_tensor or fn.__name__.startswith("_rebuild_cuda_tensor"):
        dev = args[_CUDA_DEVICE_ARG]
        args = (*args[:_CUDA_DEVICE_ARG], _device_uuid(dev) if isinstance(dev, int) else dev,
                *args[_CUDA_DEVICE_ARG + 1:])
        fn = _REBUILD_CUDA
    return fn, args


def local_cuda_index(device) -> int:
    """This process's index of the GPU a payload names (its UUID, or an index as older senders write)."""
    if not torch.cuda.is_available():
        raise BucketError("the payload holds CUDA IPC handles but this engine has no GPU: push with "
                          "weight_sync.mode=distributed or disk, or run the engine on the trainer's GPU")
    count = torch.cuda.device_count()
    if isinstance(device, bool) or not isinstance(device, (int, str)):
        raise BucketError(f"a CUDA payload names device {device!r}; expected a GPU UUID or index")
    if isinstance(device, int):
        if not 0 <= device < count:
            raise BucketError(f"a CUDA payload names GPU {device}; this engine sees {count}")
        return device
    for i in range(count):
        if _device_uuid(i) == device:
            return i
    raise BucketError(f"the payload's GPU ({device}) is not visible to this engine: CUDA IPC pushes work between "
                      f"processes that see the same GPU (colocated mode); use weight_sync.mode=distributed "
                      f"(nccl) between GPUs")


class BufferPool:
    """Bucket buffers kept for the next push, one per (device, size): a push of the same model packs the
    same bucket sizes every time, so each buffer is made once. Exact sizes, because a receiver maps a
    whole buffer and holds it to its own size cap (the engine's parameters in float32). Reuse is safe
    because each receiver gets its own pickle of the buffer (`SharedBucket`): torch's reference count
    inside a shared segment then never drops below this process's own reference, and a receiver has
    copied the data before its call returns (the engine waits for its GPU copies too). A buffer in use
    is never handed out twice: a second taker gets a fresh one.

    A shared-memory buffer, once made, is never freed while this process lives (one left over from a
    concurrent taker is kept in `retired`): freeing a mapping asks this process's torch_shm_manager, and
    when that helper is gone the C++ error it raises aborts the process (seen in tests/test_trainer.py)."""

    def __init__(self) -> None:
        self.free: dict[tuple[str, int], torch.Tensor] = {}  # (device, bytes) -> idle buffer
        self.retired: list[torch.Tensor] = []
        self.lock = threading.Lock()

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        with self.lock:
            buf = self.free.pop((str(device), nbytes), None)
        if buf is not None:
            return buf
        if device.type == "cuda":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        return _shared_uint8(nbytes)

    def give(self, flat: torch.Tensor) -> None:
        key = (str(flat.device), flat.numel())
        with self.lock:
            if key not in self.free:
                self.free[key] = flat
            elif flat.device.type != "cuda":
                self.retired.append(flat)

    def clear(self) -> None:
        """Forget the idle buffers (CUDA ones are freed; shared-memory ones are retired, see above)."""
        with self.lock:
            self.retired += [b for b in self.free.values() if b.device.type != "cuda"]
            self.free.clear()


BUFFERS = BufferPool()  # this process's (a trainer's rank 0 pushes one bucket at a time)


def storage_bytes(t: torch.Tensor, start: int, nbytes: int) -> torch.Tensor:
    """`nbytes` bytes of `t`'s storage from byte `start`, as a uint8 tensor on its device (a view: nothing copied)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), start, (nbytes,))


def _shared_uint8(nbytes: int) -> torch.Tensor:
    """A fresh uint8 [nbytes] tensor allocated in shared memory (one per bucket, freed by `release`), as a
    named file: allocated under torch's default fd strategy, its first pickle would copy it into a new
    file segment (the pool's buffers went that way: allocated twice, copied once)."""
    _use_file_system_sharing()
    try:
        storage = torch.UntypedStorage._new_shared(nbytes)
    except RuntimeError as e:  # "Broken pipe": the manager is gone; or /dev/shm is full
        raise SharedMemoryUnavailable(
            f"cannot allocate a {nbytes}-byte shared-memory weight bucket ({e}): this process's torch_shm_manager "
            f"is gone (it registers every file_system-shared buffer and is never restarted) or /dev/shm is "
            f"full") from e
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,))


def release(payload: Payload) -> None:
    """Every call that carried `payload` has returned: drop its shared buffers now."""
    payload.buffers = []


def _meta_fields(m) -> tuple:
    if isinstance(m, tuple):
        if len(m) != 6:
            raise BucketError(f"bucket metadata tuple must have 6 fields, got {len(m)}: {m!r}")
        return m
    return (m.name, m.shape, m.dtype, m.start_idx, m.end_idx, m.numel)


def unflatten(flat: torch.Tensor, metadata: list) -> list[tuple[str, torch.Tensor]]:
    """Views into `flat` per metadata entry (tuples, or objects with SGLang's attribute names)."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise BucketError(f"flattened_tensor must be 1-D uint8, got {flat.dtype} {tuple(flat.shape)}")
    out = []
    for m in metadata:
        name, shape, dtype, start, end, _ = _meta_fields(m)
        if not 0 <= start <= end <= flat.numel():
            raise BucketError(f"bucket entry {name!r} spans bytes [{start}, {end}) outside a "
                              f"{flat.numel()}-byte buffer")
        out.append((name, flat[start:end].view(_parse_dtype(dtype)).reshape(tuple(shape))))
    return out


# ---------------------------------------------------------------- sender side


class _WirePickler(pickle._Pickler):
    """ForkingPickler's reductions on the pure-Python pickler, which lets the stand-in metadata
    class be written under SGLang's module path without importing sglang."""

    dispatch_table = ChainMap({torch.Tensor: _reduce_tensor, torch.nn.Parameter: _reduce_tensor},
                              ForkingPickler._extra_reducers, copyreg.dispatch_table)

    def save_global(self, obj, name=None):
        if obj is FlattenedTensorMetadata:
            self.save(SGLANG_META[0])
            self.save(SGLANG_META[1])
            self.write(pickle.STACK_GLOBAL)
            self.memoize(obj)
            return
        super().save_global(obj, name)


class Payload(str):
    """A base64 payload that also holds the shared buffers its handles point to.

    It is a plain `str` to JSON encoders. The handles stay valid while this object lives, so
    keep it until the receiving HTTP call has returned (a copy such as `str(p)` does not count).
    """

    buffers: list


def _use_file_system_sharing() -> None:
    """Before anything is shared: a storage shared by fd cannot be re-shared by file name."""
    if torch.multiprocessing.get_sharing_strategy() != "file_system":
        torch.multiprocessing.set_sharing_strategy("file_system")


def _dumps(obj, buffers: list) -> Payload:
    _use_file_system_sharing()
    buf = io.BytesIO()
    _WirePickler(buf, protocol=4).dump(obj)
    payload = Payload(base64.b64encode(buf.getvalue()).decode("ascii"))
    payload.buffers = buffers
    return payload


class SharedBucket:
    """One bucket packed once into shared memory, handed out as one payload per receiver.

    torch's file_system strategy keeps a reference count inside the segment: each pickle of the
    buffer adds one (`reduce_storage`); a receiver's rebuild maps the segment (its mapping counts
    one, given back when it frees the tensor) and takes the pickle's one back
    (`rebuild_storage_filename`); the file is unlinked when the count reaches zero. One payload sent
    to k receivers takes back k references for the one it added: once two long-lived receivers have
    freed their copy the file is gone, and the third fails with "unable to open shared memory
    object". `payloads(k)` pickles the one buffer k times instead (no copy): the segment then
    outlives every receiver that has not read its payload yet, even this sender's `release()`.
    A payload never unpickled (its call refused before reading it) leaves its reference behind;
    that segment lives until this process's torch_shm_manager exits.
    """

    def __init__(self, named_tensors: list[tuple[str, torch.Tensor]], pool: BufferPool | None = None):
        flat, meta = flatten(named_tensors, shared=True, pool=pool)
        self.pool = pool
        self.flat: torch.Tensor | None = flat  # [N] uint8 in shared memory; None once released
        self.metadata = [FlattenedTensorMetadata(n, torch.Size(s), _parse_dtype(d), a, b, k)
                         for n, s, d, a, b, k in meta]
        self.handed_out: list[Payload] = []

    def payload(self) -> Payload:
        """A payload for ONE receiver (load_format="flattened_bucket"); never send it twice."""
        if self.flat is None:
            raise BucketError("this bucket was released: build a new SharedBucket for another push")
        p = _dumps({"flattened_tensor": self.flat, "metadata": self.metadata}, [self.flat])
        self.handed_out.append(p)
        return p

    def payloads(self, count: int) -> list[Payload]:
        """`count` payloads of the one buffer: what one engine gets, entry i for its TP rank i."""
        if count < 1:
            raise ValueError(f"a bucket goes to at least one receiver, got count={count}")
        return [self.payload() for _ in range(count)]

    def release(self) -> None:
        """Every call that carried a payload of this bucket has returned: the buffer goes back to the pool
        (the next bucket reuses it), or is dropped now when there is none (before the next bucket is
        allocated, so at most one bucket's shared memory is held at a time)."""
        for p in self.handed_out:
            release(p)
        if self.pool is not None and self.flat is not None:
            self.pool.give(self.flat)
        self.flat, self.handed_out = None, []


def serialize_bucket(named_tensors: list[tuple[str, torch.Tensor]]) -> Payload:
    """Payload (a str) for ONE receiver, load_format="flattened_bucket": one shared uint8 buffer +
    metadata. Several receivers: `SharedBucket(named_tensors).payloads(k)`."""
    return SharedBucket(named_tensors).payload()


def serialize_named_tensors(named_tensors: list[tuple[str, torch.Tensor]]) -> Payload:
    """Payload (a str) for ONE receiver, load_format None/"direct": a pickled list of (name, tensor)
    handles (each rebuild takes a reference, as for `SharedBucket`)."""
    _use_file_system_sharing()
    shared = [(n, t.detach().to("cpu").contiguous().clone().share_memory_()) for n, t in named_tensors]
    return _dumps(shared, [t for _, t in shared])


# ---------------------------------------------------------------- receiver side


def _sglang_meta_class():
    """SGLang's own metadata class when sglang is installed (so its bucket code reads it), else ours."""
    from reflow.engines.sglang import contract as sglang_contract

    code = sglang_contract.bucket_code()
    return code.FlattenedTensorMetadata if code is not None else FlattenedTensorMetadata


def rebuild_bucket(flat: torch.Tensor, metadata: list) -> list[tuple[str, torch.Tensor]]:
    """Named tensors of a flattened bucket, rebuilt by SGLang's own FlattenedTensorBucket when
    installed (bounds are checked here first: SGLang trusts its sender), else by `unflatten`."""
    from reflow.engines.sglang import contract as sglang_contract

    views = unflatten(flat, metadata)  # validates dtype, layout and bounds
    code = sglang_contract.bucket_code()
    if code is None:
        return views
    meta = [m if isinstance(m, code.FlattenedTensorMetadata) else
            code.FlattenedTensorMetadata(n, torch.Size(t.shape), t.dtype, *_meta_fields(m)[3:])
            for m, (n, t) in zip(metadata, views)]
    return code.FlattenedTensorBucket(flattened_tensor=flat, metadata=meta).reconstruct_tensors()


def _allowed_globals() -> dict[tuple[str, str], object]:
    """Exactly what torch's CPU shared-memory rebuild needs, plus plain containers."""


    allowed = {("builtins", n): getattr(builtins, n)
               for n in ("dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bool", "bytes")}
    allowed.update({
        ("copyreg", "__newobj__"): copyreg.__newobj__,  # builds the metadata dataclass
        ("torch", "Tensor"): torch.Tensor, ("torch", "Size"): torch.Size,
        ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
        ("torch.storage", "UntypedStorage"): torch.storage.UntypedStorage,
        ("torch", "UntypedStorage"): torch.UntypedStorage,
        ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
        ("torch.multiprocessing.reductions", "rebuild_tensor"): red.rebuild_tensor,
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"): red.rebuild_storage_filename,
        ("torch.multiprocessing.reductions", "rebuild_storage_empty"): red.rebuild_storage_empty,
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"): red.rebuild_typed_storage,
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _REBUILD_CUDA,
        SGLANG_META: _sglang_meta_class(),
        (__name__, "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    })
    dtypes = {n: getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}
    allowed.update({("torch", n): dt for n, dt in dtypes.items()})
    return allowed


_HINTS = {
    "rebuild_storage_fd": "the sender shared memory by file descriptor, which only works between a parent "
                          "and its children: call torch.multiprocessing.set_sharing_strategy('file_system') "
                          "before sharing (reflow.engines.weights.buckets.serialize_bucket does)",
}


class _SafeUnpickler(pickle._Unpickler):
    """Refuses every global outside the allow-list (a pickle can otherwise run any code), and calls
    only the rebuild functions, plain containers and the metadata class: an allowed class such as
    torch.UntypedStorage names the kind of storage to rebuild and is never called (called, it
    allocates what the payload asks: UntypedStorage(8 << 30) is 8 GiB). Shared memory the payload
    maps is capped at `max_bytes`. The pure-Python unpickler: the C one cannot check what REDUCE calls."""

    _allowed: dict | None = None
    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, max_bytes: int | None = None):
        super().__init__(file)
        self.max_bytes, self.left = max_bytes, max_bytes  # None: no cap (a trusted local caller)

    @staticmethod
    def _globals() -> dict:
        if _SafeUnpickler._allowed is None:
            _SafeUnpickler._allowed = _allowed_globals()
        return _SafeUnpickler._allowed

    def find_class(self, module, name):
        if (module, name) in self._globals():
            return self._globals()[(module, name)]
        hint = _HINTS.get(name, "only torch tensors, storages, dtypes and SGLang bucket metadata are allowed")
        raise BucketError(f"refused to unpickle global {module}.{name} in a weight payload: {hint}")

    def _is_metadata_class(self, cls) -> bool:
        return isinstance(cls, type) and cls in (FlattenedTensorMetadata, self._globals()[SGLANG_META])

    def _metadata_class(self, cls) -> type:
        if not self._is_metadata_class(cls):
            raise BucketError(f"a weight payload may only build bucket metadata objects, not {cls!r}")
        return cls

    def _callable(self, func):
        """`func`, or its bounded stand-in; anything else may not be called."""
        if func is torch.multiprocessing.reductions.rebuild_storage_filename:
            return self._rebuild_storage_filename
        if func is _REBUILD_CUDA:
            return self._rebuild_cuda_tensor
        if func is copyreg.__newobj__:
            return lambda cls, *args: self._metadata_class(cls).__new__(cls, *args)
        if func in _CALLABLE or self._is_metadata_class(func):
            return func
        raise BucketError(f"a weight payload may not call {getattr(func, '__qualname__', func)!r}: only torch's "
                          f"rebuild functions, torch.Size, plain containers and bucket metadata may be called")

    def _rebuild_storage_filename(self, cls, manager, handle, size, dtype=None):
        nbytes = size * (1 if dtype is None else torch._utils._element_size(dtype))
        if not isinstance(nbytes, int) or nbytes < 0:
            raise BucketError(f"a shared-memory storage of {size!r} elements makes no sense")
        if self.left is not None:
            if nbytes > self.left:
                raise BucketError(f"the weight payload maps more than the {self.max_bytes}-byte limit of this "
                                  f"engine (its parameters once, in float32)")
            self.left -= nbytes
        return torch.multiprocessing.reductions.rebuild_storage_filename(cls, manager, handle, size, dtype)

    def _rebuild_cuda_tensor(self, *args):
        """torch's rebuild_cuda_tensor after checks: the storage fits the cap, the GPU is one this process
        sees (named by UUID: mapped to the local index), the tensor class is a plain tensor."""
        if len(args) != 15:
            raise BucketError(f"rebuild_cuda_tensor takes 15 arguments, the payload gave {len(args)}")
        nbytes = args[8]
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise BucketError(f"a CUDA storage of {nbytes!r} bytes makes no sense")
        if args[0] not in (torch.Tensor, torch.nn.Parameter) or args[4] not in (
                torch.storage.UntypedStorage, torch.UntypedStorage, torch.storage.TypedStorage):
            raise BucketError("a CUDA payload may only rebuild plain tensors over untyped storages")
        if self.left is not None:
            if nbytes > self.left:
                raise BucketError(f"the weight payload maps more than the {self.max_bytes}-byte limit of this "
                                  f"engine (its parameters once, in float32)")
            self.left -= nbytes
        index = local_cuda_index(args[_CUDA_DEVICE_ARG])
        return _REBUILD_CUDA(*args[:_CUDA_DEVICE_ARG], index, *args[_CUDA_DEVICE_ARG + 1:])

    def load_reduce(self):
        args = self.stack.pop()
        self.stack[-1] = self._callable(self.stack[-1])(*args)

    def load_newobj(self):
        args = self.stack.pop()
        cls = self._metadata_class(self.stack.pop())
        self.append(cls.__new__(cls, *args))

    def load_newobj_ex(self):
        kwargs, args = self.stack.pop(), self.stack.pop()
        cls = self._metadata_class(self.stack.pop())
        self.append(cls.__new__(cls, *args, **kwargs))

    def load_build(self):
        self._metadata_class(type(self.stack[-2]))  # only metadata objects get state set on them
        pickle._Unpickler.load_build(self)

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build


# What REDUCE may call besides the bounded rebuild_storage_filename: none allocates more than its
# arguments (a view of a mapped storage, a Size, a container of what the payload already holds).
_CALLABLE = {torch.Size, dict, list, tuple, set, frozenset, int, float, str, bool,
             torch.multiprocessing.reductions.rebuild_tensor, torch.multiprocessing.reductions.rebuild_typed_storage,
             torch.multiprocessing.reductions.rebuild_storage_empty}


def deserialize_bucket(payload: str | bytes, max_bytes: int | None = None):
    """Unpickle one payload (base64 str or raw pickle bytes) through the allow-list, mapping at most
    `max_bytes` of shared memory."""
    try:
        data = base64.b64decode(payload, validate=True) if isinstance(payload, str) else bytes(payload)
    except (binascii.Error, ValueError) as e:
        raise BucketError(f"weight payload is not valid base64: {e}") from e
    try:
        return _SafeUnpickler(io.BytesIO(data), max_bytes).load()
    except BucketError:
        raise
    except (pickle.UnpicklingError, EOFError, RuntimeError, OSError, TypeError, ValueError, AttributeError,
            IndexError) as e:  # deliberate: whatever a malformed payload raises is the sender's error
        raise BucketError(f"could not rebuild the weight payload ({type(e).__name__}: {e}); the sender must "
                          f"keep its shared buffers alive until this call returns") from e


def load_payload(payload: str | bytes, load_format: str | None,
                 max_bytes: int | None = None) -> list[tuple[str, torch.Tensor]]:
    """Named tensors from a payload of the given load_format (None, "direct", "flattened_bucket");
    `max_bytes` caps the shared memory it may map (the receiving engine's own size)."""
    obj = deserialize_bucket(payload, max_bytes)
    if load_format == "flattened_bucket":
        if not isinstance(obj, dict) or "flattened_tensor" not in obj or "metadata" not in obj:
            raise BucketError("a flattened_bucket payload must be a dict with 'flattened_tensor' and 'metadata'")
        return rebuild_bucket(obj["flattened_tensor"], obj["metadata"])
    if load_format in (None, "direct"):
        ok = isinstance(obj, (list, tuple)) and all(
            isinstance(e, (list, tuple)) and len(e) == 2 and isinstance(e[0], str) and isinstance(e[1], torch.Tensor)
            for e in obj)
        if not ok:
            raise BucketError(f"a load_format={load_format!r} payload must be a list of (name, tensor) pairs")
        return [(n, t) for n, t in obj]
    raise BucketError(f"unknown load_format {load_format!r}: use null, 'direct' or 'flattened_bucket'")


def load_buckets(payloads: list[str], max_bytes: int | None = None) -> list[tuple[str, torch.Tensor]]:
    """Named tensors of several flattened-bucket payloads, mapping at most `max_bytes` in all."""
    named, left = [], max_bytes
    for payload in payloads:
        part = load_payload(payload, "flattened_bucket", left)
        if left is not None:
            left -= part[0][1].untyped_storage().nbytes()
        named += part
    return named

