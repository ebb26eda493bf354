"""Object storage for one experiment, through fsspec (`file://` by default, `s3://` via s3fs).

Layout (see DESIGN.md):
    <root>/<experiment>/config.yaml
    <root>/<experiment>/iterations/000042/{metrics.json, rollouts.parquet}
    <root>/<experiment>/checkpoints/...           (infra/checkpoint.py)

Every operation is retried with exponential backoff on transient errors (connection refused or
reset, timeouts, 5xx) for up to `outage_budget_s` (storage.outage_budget_s, default 60 s) from its
first attempt; the last retry is made when the budget runs out, so storage that is back within it
costs time, not data, and one that is not fails the operation with StorageUnavailable naming the
setting. Every retry is logged, and so is every call slower than `slow_call_warn_s` (while it is
still running, so a hung endpoint shows). Errors that retrying cannot fix (missing object, access
denied, a full disk or quota, a read-only filesystem, a malformed request) are raised at once; the
ones a user must act on become a StorageError saying what to do, worded for the root's scheme.

Credentials are never part of this object: s3fs takes them from the standard AWS chain (env,
~/.aws, instance role). Only the endpoint override is carried, so the store can be pickled into
Ray tasks and its fields logged.
On a local filesystem a file is written under a temporary name and then moved, so a reader never
sees half a file; a failed attempt removes its temporary file (on a full disk it holds the space
the next attempt needs). On S3 one PUT is already atomic and leaves nothing behind (s3fs aborts a
failed multipart upload itself).
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import fsspec

from reflow.infra.guards import check_segment, credential_problem, credentials_message

log = logging.getLogger("reflow.storage")
T = TypeVar("T")
_BACKOFF_CAP_S = 30.0
_PERMANENT = (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError, NotADirectoryError)
# OSError codes a retry cannot fix. Local: a full disk or quota, a file-size limit, a read-only
# filesystem, permission denied. s3fs turns most 4xx answers into EINVAL/EMSGSIZE/ENAMETOOLONG/EPERM.
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}
_DENIED = {errno.EACCES, errno.EPERM}
_PERMANENT_ERRNOS = _DISK_FULL | _DENIED | {errno.EFBIG, errno.EROFS, errno.EINVAL, errno.EMSGSIZE,
                                            errno.ENAMETOOLONG, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR}


class StorageError(RuntimeError):
    """Storage could not be used (unreachable, bad credentials, missing bucket); names the URL."""


class StorageUnavailable(StorageError):
    """Transient errors went on past the outage budget (storage.outage_budget_s) or storage.retries."""


class ChecksumError(StorageError):
    """A downloaded file does not match the sha256 recorded for it."""


def normalize_root(root: str) -> str:
    """`file://./x` or a bare path -> absolute `file:///...`; other URLs unchanged."""
    if (problem := credential_problem(root)) is not None:  # it would end up in logs and saved configs
        raise StorageError(credentials_message("storage root", problem))
    if root.startswith("file://"):
        root = root.removeprefix("file://")
    if "://" not in root:
        return "file://" + str(Path(root).expanduser().resolve())
    return root.rstrip("/")


def is_transient(e: BaseException) -> bool:
    """True for errors a retry may fix: connection refused/reset, timeouts, 5xx, throttling."""
    if isinstance(e, _PERMANENT) or (isinstance(e, OSError) and e.errno in _PERMANENT_ERRNOS):
        return False
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    try:
        import botocore.exceptions as bex
        if isinstance(e, (bex.ConnectionError, bex.HTTPClientError)):
            return True
    except ImportError:  # no s3fs/botocore installed: only local storage is used
        pass
    # s3fs maps other S3 errors (5xx, SlowDown, InternalError) to plain OSError.
    return isinstance(e, OSError)


def with_retries(fn: Callable[[], T], what: str, retries: int, backoff_s: float,
                 budget_s: float | None = None, slow_s: float | None = None) -> T:
    """fn() retried on transient errors, waiting backoff_s, 2*backoff_s, ... (at most 30 s each).

    Gives up with StorageUnavailable after `retries` retries or once `budget_s` seconds have passed
    since the first attempt began, whichever comes first. A wait that would overrun the budget is
    cut short, so the last attempt is made when the budget runs out: an outage shorter than the
    budget is survived. An attempt in flight is not interrupted (`slow_s` makes it visible).
    Permanent errors (not `is_transient`) are raised at once.
    """
    start = time.monotonic()
    for attempt in range(retries + 1):
        try:
            return _timed(fn, what, slow_s)
        except Exception as e:  # deliberate: classified below, re-raised unless transient
            if not is_transient(e):
                raise
            spent = time.monotonic() - start
            wait = min(_BACKOFF_CAP_S, backoff_s * 2 ** attempt)
            budget = "" if budget_s is None else f" ({spent:.1f}s of storage.outage_budget_s={budget_s:g}s spent)"
            if budget_s is not None and budget_s - spent < wait:
                wait = budget_s - spent
            if attempt == retries or wait <= 0:
                limit = f"storage.retries={retries}" if wait > 0 else f"storage.outage_budget_s={budget_s:g}s"
                raise StorageUnavailable(
                    f"storage: {what} still failing after {attempt + 1} attempts over {spent:.1f}s, the limit "
                    f"set by {limit}: {type(e).__name__}: {str(e)[:200]}. Check that the storage is reachable "
                    f"and healthy; to wait out longer outages raise storage.outage_budget_s") from e
            log.warning("storage: %s failed (%s: %s); retry %d/%d in %.1fs%s",
                        what, type(e).__name__, str(e)[:200], attempt + 1, retries, wait, budget)
            time.sleep(wait)
    raise AssertionError("unreachable")


def _timed(fn: Callable[[], T], what: str, slow_s: float | None) -> T:
    """fn(), with a warning once it has run `slow_s` seconds (while it still runs, so a hung endpoint
    shows in the log) and one with its duration when a call that slow ends."""
    if slow_s is None:
        return fn()
    start = time.monotonic()
    timer = threading.Timer(slow_s, log.warning, ("storage: %s still running after %.1fs "
                                                  "(storage.slow_call_warn_s=%g)", what, slow_s, slow_s))
    timer.daemon = True
    timer.start()
    try:
        return fn()
    finally:
        timer.cancel()
        if (took := time.monotonic() - start) >= slow_s:
            log.warning("storage: %s took %.1fs (storage.slow_call_warn_s=%g)", what, took, slow_s)


def _via_temp(fs: fsspec.AbstractFileSystem, path: str, write: Callable[[str], None]) -> None:
    """A local file: `write(tmp)` to a temporary name beside `path`, then move it into place. A failed
    attempt removes its temporary file, so retries on a full disk do not each leave a copy behind."""
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        write(tmp)
        fs.mv(tmp, path)
    except BaseException:  # deliberate: clean up, then re-raise the attempt's own error
        try:
            fs.rm_file(tmp)
        except FileNotFoundError:  # the attempt failed before creating it
            pass
        except OSError as e:  # deliberate: best effort; the write's error is the one to report
            log.warning("storage: could not remove %s after a failed write (%s: %s); delete it by hand",
                        tmp, type(e).__name__, e)
        raise


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class ExperimentStore:
    root: str  # normalised root URL
    experiment: str
    endpoint_url: str | None = None
    retries: int = 10  # defaults: those of StorageConfig (infra/config.py)
    backoff_s: float = 0.5
    outage_budget_s: float | None = 60.0
    slow_call_warn_s: float | None = 10.0

    def __post_init__(self) -> None:
        # The experiment is one folder under the root: `..` or `a/b` would read and write outside it.
        check_segment(self.experiment, "experiment name")

    @classmethod
    def open(cls, root: str, experiment: str, endpoint_url: str | None = None, retries: int = 10,
             backoff_s: float = 0.5, outage_budget_s: float | None = 60.0,
             slow_call_warn_s: float | None = 10.0) -> ExperimentStore:
        return cls(normalize_root(root), experiment, endpoint_url, retries, backoff_s, outage_budget_s,
                   slow_call_warn_s)

    @classmethod
    def from_config(cls, storage_cfg, experiment: str) -> ExperimentStore:
        """`storage_cfg`: reflow.infra.config.StorageConfig."""
        s = storage_cfg
        return cls.open(s.root, experiment, s.endpoint_url, s.retries, s.retry_backoff_s, s.outage_budget_s,
                        s.slow_call_warn_s)

    def _options(self) -> dict:
        if not self.root.startswith("s3://"):
            return {}
        # Listings are not cached: checkpoints are written by other processes (trainer ranks).
        # botocore's own retries are cut to one, so transient failures reach `with_retries`, which
        # logs them and bounds the total wait (botocore's default retries are silent, ~7 s).
        opts: dict[str, Any] = {"use_listings_cache": False,
                                "config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}}}
        if self.endpoint_url:
            opts["endpoint_url"] = self.endpoint_url
        return opts

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return fsspec.core.url_to_fs(self.root, **self._options())[0]

    @property
    def is_local(self) -> bool:
        return self.root.startswith("file://")

    def url(self, *parts: str) -> str:
        return "/".join([self.root, self.experiment, *(p.strip("/") for p in parts if p)])

    def _path(self, *parts: str) -> str:
        return fsspec.core.url_to_fs(self.url(*parts), **self._options())[1]

    def _retry(self, fn: Callable[[], T], what: str, rel: str) -> T:
        """fn() under with_retries and this store's settings; permanent errors a user must act on
        (disk full, read-only, permission denied) become a StorageError that says what to do."""
        url, where = self.url(rel), f" (endpoint {self.endpoint_url})" if self.endpoint_url else ""
        try:
            return with_retries(fn, f"{what} {url}{where}", self.retries, self.backoff_s, self.outage_budget_s,
                                self.slow_call_warn_s)
        except OSError as e:
            if (advice := self._advice(e, what)) is None:
                raise
            raise StorageError(f"cannot {what} {url}{where}: {advice}.") from e

    def _advice(self, e: OSError, what: str) -> str | None:
        """What is wrong and the fix, worded for this root's scheme (no buckets for a folder); None
        for errors that need none (a missing file is the caller's business)."""
        code = errno.EACCES if isinstance(e, PermissionError) and e.errno is None else e.errno  # s3fs: 403
        if not self.is_local:
            bucket = self.root.removeprefix("s3://").split("/", 1)[0]
            return None if code not in _DENIED else (
                f"access denied ({str(e)[:200]}). Check that the AWS credentials in use (AWS_ACCESS_KEY_ID/"
                f"AWS_SECRET_ACCESS_KEY, ~/.aws, an instance role) may {what} objects in bucket {bucket}")
        folder = self.root.removeprefix("file://")
        names = [str(n) for n in (e.filename, e.filename2) if n]
        place = next((n for n in names if n.startswith(folder)), None if names else folder)
        if place is None:  # about a file outside storage (an upload's source): not storage's to explain
            return None
        if code in _DISK_FULL:
            return (f"the filesystem holding {folder} is full ({e.strerror}). Free space there (checkpoint."
                    f"keep_last bounds the checkpoints kept) or point storage.root at a disk with room")
        if code == errno.EFBIG:
            return ("the file is too large for this filesystem or for this process's file-size limit (ulimit "
                    "-f). Raise the limit or point storage.root at a filesystem that takes larger files")
        if code == errno.EROFS:
            return f"{place} is on a read-only filesystem. Point storage.root at a writable folder"
        if code in _DENIED:
            return (f"permission denied on {place} for this process (uid {os.geteuid()}). Let this user write "
                    f"there (chmod/chown) or point storage.root at a folder it owns")
        return None

    # ------------------------------------------------------------ writes

    def write_bytes(self, rel: str, data: bytes) -> str:
        self._retry(lambda: self._write_once(rel, data), "write", rel)
        return self.url(rel)

    def _write_once(self, rel: str, data: bytes) -> None:
        fs, path = self.fs, self._path(rel)
        if self.is_local:
            _via_temp(fs, path, lambda tmp: fs.pipe_file(tmp, data))
        else:
            fs.pipe_file(path, data)

    def write_json(self, rel: str, obj: Any) -> str:
        return self.write_bytes(rel, json.dumps(obj, indent=2, sort_keys=True, default=str).encode())

    def write_text(self, rel: str, text: str) -> str:
        return self.write_bytes(rel, text.encode())

    def write_parquet(self, rel: str, df) -> str:
        buf = io.BytesIO()
        df.to_parquet(buf, index=False)
        return self.write_bytes(rel, buf.getvalue())

    def put_file(self, local: str | Path, rel: str) -> dict:
        """Upload one local file; returns {"sha256", "bytes"} of what was sent (for the manifest)."""
        digest, size = sha256_file(local), os.path.getsize(local)

        def once() -> None:
            fs, path = self.fs, self._path(rel)
            if self.is_local:
                _via_temp(fs, path, lambda tmp: fs.put_file(str(local), tmp))
            else:
                fs.put_file(str(local), path)

        self._retry(once, "upload", rel)
        return {"sha256": digest, "bytes": size}

    # ------------------------------------------------------------ reads

    def read_bytes(self, rel: str) -> bytes:
        return self._retry(lambda: self.fs.cat_file(self._path(rel)), "read", rel)

    def read_json(self, rel: str) -> Any:
        return json.loads(self.read_bytes(rel))

    def read_text(self, rel: str) -> str:
        return self.read_bytes(rel).decode()

    def get_file(self, rel: str, local: str | Path, sha256: str | None = None) -> Path:
        """Download one file; with `sha256`, raise ChecksumError if the bytes differ from it."""
        local = Path(local)
        local.parent.mkdir(parents=True, exist_ok=True)
        self._retry(lambda: self.fs.get_file(self._path(rel), str(local)), "download", rel)
        if sha256 is not None and (got := sha256_file(local)) != sha256:
            raise ChecksumError(f"{self.url(rel)}: sha256 {got[:12]}… does not match the manifest's {sha256[:12]}…")
        return local

    def exists(self, rel: str) -> bool:
        return self._retry(lambda: self.fs.exists(self._path(rel)), "exists", rel)

    def size(self, rel: str) -> int:
        return int(self._retry(lambda: self.fs.size(self._path(rel)), "size", rel))

    def listdir(self, rel: str) -> list[str]:
        """Names (not paths) directly under `rel`; [] if it does not exist."""
        def once() -> list[str]:
            try:
                entries = self.fs.ls(self._path(rel), detail=False)
            except FileNotFoundError:
                return []
            return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)
        return self._retry(once, "list", rel)

    def rm(self, rel: str, recursive: bool = False) -> None:
        def once() -> None:
            try:
                self.fs.rm(self._path(rel), recursive=recursive)
            except FileNotFoundError:  # already gone: removing is idempotent
                pass
        self._retry(once, "delete", rel)

    def iteration_dir(self, iteration: int) -> str:
        return f"iterations/{iteration:06d}"

    # ------------------------------------------------------------ startup check

    def preflight(self) -> None:
        """Write, read back and delete a probe object; StorageError naming the URL if any step fails.

        Run before training, so an unreachable bucket or bad credentials cost seconds, not a run.
        No retries beyond the client's own: a storage that is down at startup is reported now.
        """
        rel = f"_preflight/{uuid.uuid4().hex}"
        payload = uuid.uuid4().bytes
        quick = dataclasses.replace(self, retries=0)
        step = "write"
        try:
            quick.write_bytes(rel, payload)
            step = "read"
            if quick.read_bytes(rel) != payload:
                raise StorageError("the probe object read back differs from what was written")
            step = "delete"
            quick.rm(rel)
        except Exception as e:  # deliberate: any failure becomes one clear message
            err: BaseException = e
            if isinstance(e, StorageUnavailable) and e.__cause__ is not None:
                err = e.__cause__  # with retries=0 the error itself, not "past storage.retries=0"
            if isinstance(err, StorageError) and isinstance(err.__cause__, OSError):
                # from _retry: already names the probe's URL, what is wrong and what to do
                raise StorageError(f"storage preflight failed: {err}") from None
            where = f" (endpoint {self.endpoint_url})" if self.endpoint_url else ""
            if self.is_local:
                detail = (f"{type(err).__name__}: {str(err)[:300]}. Check that this process (uid {os.geteuid()}) "
                          f"can create and write files under {self.root.removeprefix('file://')} and that its "
                          f"disk has room, or point storage.root elsewhere.")
            else:
                detail = (f"{type(err).__name__}: {str(err)[:300]}. Check that the bucket exists, the endpoint is "
                          f"reachable and the AWS credentials (env, ~/.aws, role) may write there.")
            raise StorageError(f"storage preflight failed: cannot {step} a probe object under {self.url()}{where}: "
                               f"{detail}") from None
