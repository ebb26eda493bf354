"""Trainer -> engines weight sync over SGLang's HTTP API, then proof that it landed.

Per docs/ENGINE_CONTRACT.md (and slime/miles), every push is pause -> flush -> begin session -> updates ->
end session -> continue (`update_window`; the disk mode needs no session in SGLang; SGLang 0.5.17 has no
sessions at all, and gets the window without them). Modes:
- tensor: one update_weights_from_tensor(load_format="flattened_bucket") per bucket of
  <= bucket_bytes; each bucket is packed once into one shared buffer and pickled once per receiver
  (every engine, and every TP rank of an engine: a handle pays for one rebuild, see
  buckets.SharedBucket); when all those calls have returned the buffer goes back to this process's
  pool and packs the next bucket (and the next push: no fresh shared memory, no page faults). It lives
  in this host's shared memory (/dev/shm), or on the trainer's GPU when the tensors are there (CUDA
  IPC, colocated mode), so every engine must run on this host: `check_same_host` refuses others,
  naming mode=distributed or disk.
- distributed: init_weights_update_group (this process is rank 0), then per bucket
  update_weights_from_distributed + one broadcast of the flattened buffer (on the CUDA device for
  backend=nccl, `group_device`); group destroyed after.
- disk: update_weights_from_disk of an HF folder / storage URL the caller wrote (`publish_weights`: in a
  private folder by default). Engines that advertise DISK_FILES (reflow's embedded engine) get the sha256
  of every file the pusher wrote with the request and load nothing else, at every push.
mode=tensor to reflow's embedded engines (weight_sync.map_once) skips the window and the per-push
handles: each engine maps the trainer's weights once and a push is one call (reflow.engines.weights.mapped).
try/finally makes sure no engine is left paused or inside a session, whatever fails.

Verification (reflow.engines.weights.verify, which says what each mode proves) reads tensors back
through /get_weights_by_name, or, where an engine cannot answer that whole (SGLang's Qwen models,
TP > 1), compares its logprobs of a probe batch with the trainer's; any difference raises
`WeightSyncError`.
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import torch

from reflow.engines.rollout_client import EngineClient, EngineError
from reflow.engines.storage_access import StorageAccess, is_local, sha256_file
from reflow.engines.weights import group as weight_group
from reflow.engines.weights.buckets import BUFFERS, SharedBucket
from reflow.engines.weights.mapped import MAPPED  # noqa: F401 - re-exported (tests read MAPPED through this module)
from reflow.engines.weights.settings import DEFAULT_PUSH, PushSettings
from reflow.engines.weights.verify import (  # noqa: F401 - WeightSyncError, verify_weights: re-exported
    LogprobProbe,
    Named,
    ProbeSource,
    WeightSyncError,
    check_pushed,
    verify_weights,
)

log = logging.getLogger(__name__)
_FLUSH_RETRIES = 20




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


def _check(client: EngineClient, out: dict, what: str) -> None:
    if not out.get("success", False):
        raise WeightSyncError(f"engine {client.url} refused {what}: {out.get('message')}")


def _send_buckets(clients: list[EngineClient], named_tensors: Named, bucket_bytes: int, version: str) -> int:
    """mode=tensor: one update_weights_from_tensor(flattened_bucket) per bucket, each engine getting
    one payload per TP rank (entry i is rank i's, as SGLang's TP workers read it); returns the bucket count."""
    tp = [_tp_size(c) for c in clients]
    buckets = make_buckets(named_tensors, bucket_bytes)
    with ThreadPoolExecutor(max_workers=len(clients)) as pool:
        for bucket in buckets:
            shared = SharedBucket(bucket, pool=BUFFERS)  # one buffer, held until every engine has loaded it
            calls = [pool.submit(c.update_weights_from_tensor, shared.payloads(k), "flattened_bucket", True, version)
                     for c, k in zip(clients, tp)]
            for c, f in zip(clients, calls):
                _check(c, f.result(), "a weight bucket")
            shared.release()  # every engine has copied it: back to the pool, for the next bucket
    return len(buckets)


@dataclass
class _OpenGroup:
    """A weight-update group the engines hold between pushes (this process is rank 0)."""

    group: object  # weight_group.WeightGroup
    name: str
    clients: list[EngineClient]


# (backend, master address) -> the group kept open for the next push: opening one costs a rendezvous with
# every engine (1.2 s per push over NCCL on two H200s, bench/results/gpu-nccl.json), a broadcast ~3 ms.
_GROUPS: dict[tuple[str, str], _OpenGroup] = {}


def _send_distributed(clients: list[EngineClient], named_tensors: Named, bucket_bytes: int, version: str,
                      master_address: str, backend: str, device: torch.device | None = None) -> tuple[int, bool]:
    """mode=distributed: one broadcast per bucket over a weight-update group (this process = rank 0), kept
    open for the next push to the same engines (by URL: a recreated engine has a new one, and gets a new
    group). Returns (bucket count, whether an open group was reused). A push that fails closes the group,
    so the next one starts from a fresh rendezvous."""
    key = (backend, master_address)
    reused = _reusable(key, clients)
    try:
        g = _group_for(key, clients, master_address, backend)
        return _broadcast_buckets(g, named_tensors, bucket_bytes, version, device or group_device(backend)), reused
    except BaseException:
        close_weight_groups(key)
        raise


def _reusable(key: tuple[str, str], clients: list[EngineClient]) -> bool:
    g = _GROUPS.get(key)
    return g is not None and [c.url for c in g.clients] == [c.url for c in clients]


def _group_for(key: tuple[str, str], clients: list[EngineClient], master_address: str, backend: str) -> _OpenGroup:
    if _reusable(key, clients):
        return _GROUPS[key]
    close_weight_groups(key)  # other engines (recreated, a subset): their group goes
    tp = [_tp_size(c) for c in clients]
    offsets = [1 + sum(tp[:i]) for i in range(len(clients))]
    world, port, name = 1 + sum(tp), _free_port(), f"reflow-{uuid.uuid4().hex[:8]}"
    joined: list[EngineClient] = []
    inits = {_in_daemon(c.init_weights_update_group, master_address, port, off, world, name, backend): c
             for c, off in zip(clients, offsets)}
    opening = _in_daemon(weight_group.open_group, master_address, port, 0, world, name, backend)
    try:
        _GROUPS[key] = _OpenGroup(_join(opening, inits, joined), name, list(clients))
    except BaseException:
        _destroy_groups(joined, name)
        raise
    return _GROUPS[key]


def _broadcast_buckets(g: _OpenGroup, named_tensors: Named, bucket_bytes: int, version: str,
                       device: torch.device) -> int:
    buckets = make_buckets(weight_group.bucket_order(named_tensors), bucket_bytes)
    with ThreadPoolExecutor(max_workers=len(g.clients)) as pool:
        for bucket in buckets:
            flat, names, dtypes, shapes = weight_group.pack(bucket, device)
            calls = [pool.submit(c.update_weights_from_distributed, names, dtypes, shapes, g.name, "flattened_bucket",
                                 version) for c in g.clients]
            weight_group.broadcast(g.group, flat)
            for c, f in zip(g.clients, calls):
                _check(c, f.result(), "a distributed weight bucket")
    return len(buckets)


def close_weight_groups(key: tuple[str, str] | None = None) -> None:
    """Tell the engines to drop the kept group(s) (all, or `key`'s); failures are logged (an engine that
    died took its side with it)."""
    for k in [key] if key is not None else list(_GROUPS):
        g = _GROUPS.pop(k, None)
        if g is None:
            continue
        errors = _destroy_groups(g.clients, g.name)
        if errors:
            log.warning("destroying weight-update group %s: %s", g.name, "; ".join(errors))


def _in_daemon(fn, *args) -> Future:
    """Run a rendezvous call in a daemon thread: after a failed join the others stay blocked until
    the group timeout, and must neither block the caller nor keep the process from exiting."""
    fut: Future = Future()

    def run():
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # deliberate: handed to the waiting caller through the future
            fut.set_exception(e)

    threading.Thread(target=run, name="weight-group-join", daemon=True).start()
    return fut


def _join(opening, inits: dict, joined: list) -> object:
    """Wait for the group to form; fail fast when an engine refuses (rank 0 would wait for its timeout)."""
    pending = set(inits) | {opening}
    while pending:
        done, pending = wait(pending, return_when=FIRST_COMPLETED)
        for f in done:
            if f is opening:
                continue
            client = inits[f]
            try:
                _check(client, f.result(), "init_weights_update_group")
            except EngineError as e:
                raise WeightSyncError(f"engine {client.url} could not join the weight-update group: {e}") from e
            joined.append(client)
    return opening.result()


def _destroy_groups(clients: list[EngineClient], name: str) -> list[str]:
    errors = []
    for c in clients:
        try:
            c.destroy_weights_update_group(name)
        except EngineError as e:
            errors.append(str(e))
    return errors


DISK_FILES = "reflow_disk_files"  # in an engine's /server_info: update_weights_from_disk takes `files` (below)


def _send_disk(clients: list[EngineClient], model_path: str, version: str, files: dict | None = None) -> int:
    """mode=disk: every engine reloads the HF folder (or storage URL) the trainer wrote. Engines that
    advertise DISK_FILES get `files` (DiskPush.files) and load the folder only if it holds exactly those
    files with those digests (what is loaded is what was checked: reflow.engines.hf_io.copy_verified);
    returns how many engines checked. Others (SGLang) cannot be told: there the folder's privacy
    (`default_disk_dir`) is what keeps it as written."""
    checked = [files is not None and bool(c.server_info().get(DISK_FILES)) for c in clients]
    with ThreadPoolExecutor(max_workers=len(clients)) as pool:
        calls = [pool.submit(c.update_weights_from_disk, model_path, None, version, files if ok else None)
                 for c, ok in zip(clients, checked)]
        for c, f in zip(clients, calls):
            _check(c, f.result(), f"update_weights_from_disk({model_path!r})")
    return sum(checked)


PUSH_SUBDIR = "reflow-weight-push"  # the only folder of weight_sync.disk_dir that reflow writes into
PUSH_MARKER = ".reflow-push"  # in every version folder reflow wrote: only those are ever deleted
_DEFAULT_DIR: list[Path] = []  # this process's default disk_dir, once made
_DEFAULT_LOCK = threading.Lock()


def default_disk_dir() -> Path:
    """weight_sync.disk_dir when none is set: one folder per process, made at its first disk push by mkdtemp
    (mode 0700, an unpredictable name, created exclusively) and removed when the process exits. A fixed
    name (it was /tmp/reflow-weight-push-<pid>) can be made first by another local user, who then owns the
    folder the engines load weights from and may swap them; and no other user may read the weights either.
    (A process killed outright leaves it behind: it is private, and in the temp dir.)"""
    with _DEFAULT_LOCK:
        if not _DEFAULT_DIR:
            made = Path(tempfile.mkdtemp(prefix="reflow-weight-push-"))
            atexit.register(shutil.rmtree, made, True)
            _DEFAULT_DIR.append(made)
        return _DEFAULT_DIR[0]


@dataclass(frozen=True)
class DiskPush:
    """A published version: what engines load (`path`, a folder or storage URL) and what the pusher wrote
    there, {name: {"sha256", "bytes"}} for every file (reflow.engines.hf_io.Files), for engines to check."""

    path: str
    files: dict[str, dict]


def _written(folder: Path) -> dict[str, dict]:
    return {p.relative_to(folder).as_posix(): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
            for p in sorted(folder.rglob("*")) if p.is_file()}


def publish_weights(write: Callable[[Path], None], disk_dir: str | None, version: str,
                    storage: StorageAccess | None = None) -> DiskPush:
    """mode=disk: have `write(folder)` write HF safetensors as `<disk_dir>/reflow-weight-push/v<version>`
    (disk_dir unset: `default_disk_dir()`); returns what engines load and the digests of what was written.
    A storage URL (s3://...) gets the folder uploaded through `storage` (the run's endpoint and retries;
    default: the environment's), one retried upload per file.

    The folder is written and hashed in a private staging folder (mkdtemp), then moved into place (a
    rename on one file system, as under the default): the digests are of the bytes written, whoever else
    may write `disk_dir`, and no half-written version is ever seen there. Version folders keep the staging
    folder's mode, 0700 (engines run as the trainer's user). Locally, earlier versions are removed (one folder's worth of disk), but only
    folders that carry reflow's marker: anything else in `disk_dir`, or in the subfolder, is never
    touched, and a version folder reflow did not write is refused rather than overwritten."""
    root = disk_dir or str(default_disk_dir())
    name = f"v{version}"
    if not is_local(root):
        with tempfile.TemporaryDirectory(prefix="reflow-push-") as tmp:
            write(Path(tmp))
            files = _written(Path(tmp))
            url = f"{root.rstrip('/')}/{PUSH_SUBDIR}/{name}"
            (storage or StorageAccess()).put_tree(tmp, url)
        return DiskPush(url, files)
    base = Path(root.removeprefix("file://")).expanduser().resolve() / PUSH_SUBDIR
    target = base / name
    ours = (target / PUSH_MARKER).is_file()
    if (target.exists() or target.is_symlink()) and not ours:
        raise FileExistsError(f"{target} exists and was not written by reflow: refusing to overwrite it; "
                              f"point weight_sync.disk_dir at another folder or move it away")
    stage = Path(tempfile.mkdtemp(prefix=f"reflow-push-{name}-", dir=None if disk_dir else root))
    try:
        (stage / PUSH_MARKER).write_text(f"weight push v{version} by pid {os.getpid()}\n")  # reflow's to replace
        write(stage)
        files = _written(stage)
        if ours:
            shutil.rmtree(target)  # a retried push of the same version
        base.mkdir(parents=True, exist_ok=True)
        shutil.move(stage, target)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    for old in base.glob("v*"):  # previous pushes: engines have already reloaded them
        if old != target and not old.is_symlink() and (old / PUSH_MARKER).is_file():
            shutil.rmtree(old, ignore_errors=True)
    return DiskPush(str(target), files)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


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


_SESSIONLESS_TOLD: set[str] = set()  # engines update_window has logged as having no weight-update sessions


@contextmanager
def update_window(clients: list[EngineClient], pause_mode: str = "abort", session: bool = True):
    """pause -> flush -> begin session ... end session -> continue, on every engine, whatever fails. An engine
    without weight-update sessions (SGLang 0.5.17 answers 404) gets none: there the pause alone keeps the update
    whole (a paused 0.5.17 loads each update at once while new requests wait for continue_generation)."""
    paused, opened, failed = [], [], True
    try:
        for c in clients:
            c.pause_generation(pause_mode)
            paused.append(c)
            _flush(c)
            if session and c.open_weight_session():
                opened.append(c)
            elif session and c.url not in _SESSIONLESS_TOLD:  # said once: each push makes new clients
                _SESSIONLESS_TOLD.add(c.url)
                log.info("engine %s serves no weight-update sessions (SGLang 0.5.17): updating inside its pause "
                         "alone", c.url)
        yield
        failed = False
    finally:
        errors = _finish(paused, opened)
        if errors and failed:
            log.error("while unwinding a failed weight push: %s", "; ".join(errors))
        elif errors:
            raise WeightSyncError("weights were sent but closing the update failed: " + "; ".join(errors))


def push_weights(clients: list[EngineClient], named_tensors: Named, version: str,
                 settings: PushSettings = DEFAULT_PUSH, *, model_path: str | None = None,
                 model_files: dict[str, dict] | None = None, master_address: str = "127.0.0.1",
                 probe: ProbeSource = None, stable: bool = False) -> dict:
    """Push `named_tensors` (HF names) to every engine as `version`, then verify. Returns stats.

    settings.mode: "tensor" (buckets in this host's shared memory: engines on this host only),
    "distributed" (a broadcast group with this process as rank 0 at `master_address`, backend
    gloo|nccl) or "disk" (engines reload `model_path`, which the caller has written; SGLang needs
    no session for it; `model_files`: DiskPush.files of it, which engines that can check it check at
    every push, whatever verify_every says: stats' disk_files_checked counts them). `probe`: the trainer's logprobs of the probe batch at these weights, for
    verify=logprobs and for engines whose weights cannot be read back (reflow.engines.weights.verify).
    mode=tensor to engines that advertise it (reflow's embedded engine) with settings.map_once: through
    the mapping each engine keeps (reflow.engines.weights.mapped), one call per engine; `stable`: the
    tensors are the trainer's live ones (the engine may map them where they are).
    One push through the mode's transport as asked, without a fallback (the trainer's pushes go through
    the transport the runtime chose: reflow.engines.weights.transport).
    """
    # transport.py builds on this module's wire work, so it is imported here, not at the top
    from reflow.engines.weights.transport import PushJob, one_step

    return one_step(settings.mode).push(PushJob(clients, named_tensors, version, settings,
                                                master_address=master_address, probe=probe, stable=stable,
                                                model_path=model_path, model_files=model_files))


def group_device(backend: str) -> torch.device:
    """Where mode=distributed packs its buckets: the broadcast runs on `backend`'s device (gloo:
    host memory; nccl: the current CUDA device, the one this trainer rank computes on)."""
    if backend != "nccl":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise WeightSyncError("weight_sync.backend=nccl broadcasts from a CUDA buffer, but this trainer process "
                              "sees no CUDA device: run the trainer on GPUs or set weight_sync.backend=gloo")
    return torch.device("cuda", torch.cuda.current_device())


_LOOPBACK = ("127.", "::1", "localhost")


def check_same_host(clients: list[EngineClient], node_address: str) -> None:
    """mode=tensor hands engines handles to this host's shared memory (/dev/shm), which an engine on
    another node cannot open: refuse, naming the modes that cross nodes. `node_address` is this
    node's IP (the trainer passes Ray's); an engine URL naming it or loopback is local."""
    local = {node_address, socket.gethostname()}
    for c in clients:
        host = urlsplit(c.url).hostname or ""
        if host.startswith(_LOOPBACK) or host in local:
            continue
        try:
            addr = socket.gethostbyname(host)
        except OSError:
            addr = None
        if addr is None or not (addr.startswith("127.") or addr == node_address):
            raise WeightSyncError(f"weight_sync.mode=tensor: engine {c.url} is not on this trainer's host "
                                  f"({node_address}); tensor pushes pass shared-memory handles only a process on the "
                                  f"same host can open. Set weight_sync.mode=distributed (a broadcast group across "
                                  f"nodes) or disk (a folder every engine node can read)")
