"""The one way to storage for every read and write: local folders and object storage through fsspec
(`file://` or a bare path; `s3://` through s3fs), with the same options, retries and checks everywhere.

`StorageAccess` carries what every call needs: the S3-compatible endpoint (storage.endpoint_url),
the retry settings (storage.retries, retry_backoff_s, outage_budget_s, slow_call_warn_s) and, for
error messages, the location and config field a URL was configured by. The experiment store
(reflow.infra.store.storage.ExperimentStore) goes through it, and so do the paths outside the store:
prompt files, eval sources, model folders, retrain's new data and weight pushes on disk. It lives
in this layer because model folders and disk pushes are read and written inside the Ray actors
(engines, trainer ranks); infra builds it from the config (reflow.infra.config.settings.storage_access)
and passes it down. Left out (None), a caller gets `StorageAccess()`: the defaults, with the endpoint
taken from the environment (AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3), as before.

Every operation is retried with exponential backoff on transient errors (connection refused or
reset, timeouts, 5xx) for up to `outage_budget_s` from its first attempt; the last retry is made
when the budget runs out, so storage that is back within it costs time, not data, and one that is
not fails the operation with StorageUnavailable naming the setting. Every retry is logged, and so
is every call slower than `slow_call_warn_s` (while it is still running, so a hung endpoint shows).
Errors that retrying cannot fix (missing object, access denied, a full disk or quota, a read-only
filesystem, a malformed request) are raised at once; the ones a user must act on become a
StorageError saying what to do, worded for the location's scheme.

Credentials are never part of this object: s3fs takes them from the standard AWS chain (env,
~/.aws, instance role). Only the endpoint override is carried, so the object can be pickled into
Ray actors and its fields logged. On a local filesystem a file is written under a temporary name
and then moved, so a reader never sees half a file; a failed attempt removes its temporary file (on
a full disk it holds the space the next attempt needs). On S3 one PUT is already atomic and leaves
nothing behind (s3fs aborts a failed multipart upload itself).
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import fsspec

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
_READS = {"read", "download", "list", "exists", "size"}  # the `what` of calls that only read


class StorageError(RuntimeError):
    """Storage could not be used (unreachable, bad credentials, missing bucket); names the URL."""


class StorageUnavailable(StorageError):
    """Transient errors went on past the outage budget (storage.outage_budget_s) or storage.retries."""


class ChecksumError(StorageError):
    """A file does not match the sha256 (or size) recorded for it."""


class UnsafeName(ValueError):
    """A file name that came from storage (a listing, a manifest) would not stay inside the folder it is
    written to."""


def check_name(name: str, source: str) -> str:
    """`name` (a relative file name read from storage: an object key under a prefix, a manifest entry) if it
    is a relative path of plain segments: no leading `/`, no `.` or `..`, no empty segment, no backslash
    or NUL. Storage names are any string, and a key like `model/../../site-packages/x.pth` joined to a
    local folder unchecked writes a file Python runs at its next start. `source` names where it came from."""
    if (not name or "\\" in name or "\0" in name or name.startswith("/")
            or any(seg in ("", ".", "..") for seg in name.split("/"))):
        raise UnsafeName(f"{source}: the stored name {name!r} is not a plain relative path (a name from a "
                         f"listing or a manifest may not hold '..', '.', '//', a leading '/' or a backslash); "
                         f"refusing to write it anywhere. Whoever can write that storage planted it: remove the "
                         f"object and check who has write access")
    return name


def local_target(root: str | Path, name: str, source: str) -> Path:
    """The local path of the stored name `name` under the folder `root`: `check_name`, then the resolved
    path (symlinks followed) must lie inside `root` resolved. Every download goes through here
    (StorageAccess.download)."""
    base = Path(root).resolve()
    target = (base / check_name(name, source)).resolve()
    if not target.is_relative_to(base):
        raise UnsafeName(f"{source}: the stored name {name!r} resolves to {target}, outside {base} (a symbolic "
                         f"link on the way); refusing to write there")
    return target


def is_local(url: str) -> bool:
    """A `file://` URL or a plain path."""
    return url.startswith("file://") or "://" not in url


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


def _link_or_copy(fs: fsspec.AbstractFileSystem, src: str, dst: str) -> None:
    """`dst` as a second name of `src` where both are on one filesystem; a copy otherwise (or where the
    filesystem has no hard links)."""
    try:
        os.link(src, dst)
    except OSError:  # deliberate: EXDEV (another filesystem), EPERM/ENOTSUP (no hard links there): copy instead
        fs.put_file(src, dst)


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _advice(e: OSError, what: str, scope: str, setting: str | None) -> str | None:
    """What is wrong and the fix, worded for the scheme of `scope` (the configured location: no
    buckets for a folder) and naming `setting` (the config field that chose it); None for errors
    that need none (a missing file is the caller's business)."""
    code = errno.EACCES if isinstance(e, PermissionError) and e.errno is None else e.errno  # s3fs: 403
    elsewhere = f"point {setting} at" if setting else "use"
    if not is_local(scope):
        bucket = scope.split("://", 1)[1].split("/", 1)[0]
        return None if code not in _DENIED else (
            f"access denied ({str(e)[:200]}). Check that the AWS credentials in use (AWS_ACCESS_KEY_ID/"
            f"AWS_SECRET_ACCESS_KEY, ~/.aws, an instance role) may {what} objects in bucket {bucket}")
    folder = scope.removeprefix("file://")
    names = [str(n) for n in (e.filename, e.filename2) if n]
    place = next((n for n in names if n.startswith(folder)), None if names else folder)
    if place is None:  # about a file outside storage (an upload's source): not storage's to explain
        return None
    if code in _DISK_FULL:
        keep = " (checkpoint.keep_last bounds the checkpoints kept)" if setting == "storage.root" else ""
        return f"the filesystem holding {folder} is full ({e.strerror}). Free space there{keep} or {elsewhere} a disk with room"
    if code == errno.EFBIG:
        return ("the file is too large for this filesystem or for this process's file-size limit (ulimit "
                f"-f). Raise the limit or {elsewhere} a filesystem that takes larger files")
    if code == errno.EROFS:
        return f"{place} is on a read-only filesystem. {elsewhere[0].upper()}{elsewhere[1:]} a writable folder"
    if code in _DENIED:
        verb = "read" if what in _READS else "write"
        return (f"permission denied on {place} for this process (uid {os.geteuid()}). Let this user {verb} "
                f"there (chmod/chown) or {elsewhere} a folder it owns")
    return None


@dataclass(frozen=True)
class StorageAccess:
    """How to reach storage: endpoint and retry settings (defaults: those of StorageConfig, in
    reflow/infra/config/schema.py), plus what error messages name. Methods take full URLs or paths."""

    endpoint_url: str | None = None
    retries: int = 10
    backoff_s: float = 0.5
    outage_budget_s: float | None = 60.0
    slow_call_warn_s: float | None = 10.0
    scope: str | None = None  # the configured location URLs fall under (advice names it); None: the URL itself
    setting: str | None = None  # the config field that configured `scope`, e.g. "storage.root"

    @classmethod
    def from_config(cls, storage_cfg: Any) -> StorageAccess:
        """`storage_cfg`: reflow.infra.config.schema.StorageConfig."""
        s = storage_cfg
        return cls(s.endpoint_url, s.retries, s.retry_backoff_s, s.outage_budget_s, s.slow_call_warn_s)

    def options(self, url: str) -> dict[str, Any]:
        """fsspec options for `url`: for s3://, the endpoint and the retry split below; none otherwise."""
        if not url.startswith("s3://"):
            return {}
        # Listings are not cached: checkpoints are written by other processes (trainer ranks).
        # botocore's own retries are cut to one, so transient failures reach `with_retries`, which
        # logs them and bounds the total wait (botocore's default retries are silent, ~7 s).
        opts: dict[str, Any] = {"use_listings_cache": False,
                                "config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}}}
        if self.endpoint_url:
            opts["endpoint_url"] = self.endpoint_url
        return opts

    def fs_for(self, url: str) -> tuple[fsspec.AbstractFileSystem, str]:
        """(filesystem, path inside it) of `url`, with this access's options."""
        return fsspec.core.url_to_fs(url, **self.options(url))

    def call(self, fn: Callable[[], T], what: str, url: str) -> T:
        """fn() under `with_retries` and these settings; permanent errors a user must act on (disk
        full, read-only, permission denied) become a StorageError that says what to do."""
        where = f" (endpoint {self.endpoint_url})" if self.endpoint_url else ""
        try:
            return with_retries(fn, f"{what} {url}{where}", self.retries, self.backoff_s, self.outage_budget_s,
                                self.slow_call_warn_s)
        except OSError as e:
            if (advice := _advice(e, what, self.scope or url, self.setting)) is None:
                raise
            raise StorageError(f"cannot {what} {url}{where}: {advice}.") from e

    # ------------------------------------------------------------ writes

    def write_bytes(self, url: str, data: bytes) -> None:
        def once() -> None:
            fs, path = self.fs_for(url)
            if is_local(url):
                _via_temp(fs, path, lambda tmp: fs.pipe_file(tmp, data))
            else:
                fs.pipe_file(path, data)

        self.call(once, "write", url)

    def put_file(self, local: str | Path, url: str, link: bool = False) -> dict[str, Any]:
        """Upload one local file; returns {"sha256", "bytes"} of what was sent (for a manifest). `link`: the
        file is the caller's own and nothing writes to it after this call (a checkpoint staged in a temporary
        folder); storage on the same local filesystem then takes it as a hard link, not a copy (a 25M
        policy's checkpoint: 1.5 s of its save on 2 cores, bench/RESULTS.md 12)."""
        digest, size = sha256_file(local), os.path.getsize(local)

        def once() -> None:
            fs, path = self.fs_for(url)
            if is_local(url):
                _via_temp(fs, path, partial(_link_or_copy, fs, str(local)) if link else partial(fs.put_file, str(local)))
            else:
                fs.put_file(str(local), path)

        self.call(once, "upload", url)
        return {"sha256": digest, "bytes": size}

    def put_tree(self, local_dir: str | Path, url: str) -> dict[str, dict[str, Any]]:
        """Upload every file under `local_dir` to `url/<relative path>`, each its own retried upload;
        returns {relative path: {"sha256", "bytes"}}."""
        root = Path(local_dir)
        return {f.relative_to(root).as_posix(): self.put_file(f, f"{url.rstrip('/')}/{f.relative_to(root).as_posix()}")
                for f in sorted(p for p in root.rglob("*") if p.is_file())}

    def rm(self, url: str, recursive: bool = False) -> None:
        def once() -> None:
            fs, path = self.fs_for(url)
            try:
                fs.rm(path, recursive=recursive)
            except FileNotFoundError:  # already gone: removing is idempotent
                pass

        self.call(once, "delete", url)

    # ------------------------------------------------------------ reads

    def read_bytes(self, url: str) -> bytes:
        def once() -> bytes:
            fs, path = self.fs_for(url)
            return fs.cat_file(path)

        return self.call(once, "read", url)

    def download(self, base_url: str, name: str, root: str | Path, sha256: str | None = None) -> Path:
        """Download `base_url/name` to `root/name` and return that path; `name` comes from storage, so it is
        checked first (local_target: a plain relative path that stays inside `root`). With `sha256`, raise
        ChecksumError if the bytes differ from it."""
        url = f"{base_url.rstrip('/')}/{name}"
        local = local_target(root, name, url)
        local.parent.mkdir(parents=True, exist_ok=True)

        def once() -> None:
            fs, path = self.fs_for(url)
            fs.get_file(path, str(local))

        self.call(once, "download", url)
        if sha256 is not None and (got := sha256_file(local)) != sha256:
            raise ChecksumError(f"{url}: sha256 {got[:12]}… does not match the manifest's {sha256[:12]}…")
        return local

    def exists(self, url: str) -> bool:
        def once() -> bool:
            fs, path = self.fs_for(url)
            return fs.exists(path)

        return self.call(once, "exists", url)

    def size(self, url: str) -> int:
        def once() -> int:
            fs, path = self.fs_for(url)
            return int(fs.size(path))

        return self.call(once, "size", url)

    def listdir(self, url: str) -> list[str]:
        """Names (not paths) directly under `url`; [] if it does not exist."""
        def once() -> list[str]:
            fs, path = self.fs_for(url)
            try:
                entries = fs.ls(path, detail=False)
            except FileNotFoundError:
                return []
            return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

        return self.call(once, "list", url)

    def files(self, url: str, maxdepth: int | None = None) -> dict[str, dict[str, Any]]:
        """Every file under the folder or prefix `url` (down to `maxdepth` levels), as {path relative
        to `url`: fsspec's info (size; ETag on S3, mtime locally)}; {} when there is none."""
        def once() -> dict[str, dict[str, Any]]:
            fs, path = self.fs_for(url)
            base = path.rstrip("/") + "/"
            try:
                found = fs.find(base, maxdepth=maxdepth, detail=True)
            except FileNotFoundError:
                return {}
            return {name[len(base):]: info for name, info in sorted(found.items())
                    if name.startswith(base) and info.get("type", "file") == "file"}

        return self.call(once, "list", url)
