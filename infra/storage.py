"""Object storage for one experiment, through fsspec (`file://` by default, `s3://` via s3fs).

Layout (see DESIGN.md):
    <root>/<experiment>/config.yaml
    <root>/<experiment>/iterations/000042/{metrics.json, rollouts.parquet}
    <root>/<experiment>/checkpoints/...           (infra/checkpoint.py)

Every operation is retried with exponential backoff on transient errors (connection refused or
reset, timeouts, 5xx), so a storage server that goes away for a few seconds costs time, not data.
Errors that retrying cannot fix (missing object, access denied) are raised at once.

Credentials are never part of this object: s3fs takes them from the standard AWS chain (env,
~/.aws, instance role). Only the endpoint override is carried, so the store can be pickled into
Ray tasks and its fields logged.
On a local filesystem a file is written under a temporary name and then moved, so a reader never
sees half a file; on S3 one PUT is already atomic.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import fsspec

log = logging.getLogger("reflow.storage")
T = TypeVar("T")
_BACKOFF_CAP_S = 30.0
_PERMANENT = (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError, NotADirectoryError)


class StorageError(RuntimeError):
    """Storage could not be used (unreachable, bad credentials, missing bucket); names the URL."""


class ChecksumError(StorageError):
    """A downloaded file does not match the sha256 recorded for it."""


def normalize_root(root: str) -> str:
    """`file://./x` or a bare path -> absolute `file:///...`; other URLs unchanged."""
    if root.startswith("file://"):
        root = root.removeprefix("file://")
    if "://" not in root:
        return "file://" + str(Path(root).expanduser().resolve())
    netloc = root.split("://", 1)[1].split("/", 1)[0]
    if "@" in netloc:  # s3://KEY:SECRET@bucket would end up in logs and saved configs
        raise StorageError(f"storage root {root.split('://')[0]}://***@... embeds credentials; use the AWS "
                           f"credential chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws, a role)")
    return root.rstrip("/")


def is_transient(e: BaseException) -> bool:
    """True for errors a retry may fix: connection refused/reset, timeouts, 5xx, throttling."""
    if isinstance(e, _PERMANENT):
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


def with_retries(fn: Callable[[], T], what: str, retries: int, backoff_s: float) -> T:
    """fn() retried `retries` times on transient errors, waiting backoff_s, 2*backoff_s, ..."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except Exception as e:  # deliberate: classified below, re-raised unless transient
            if attempt == retries or not is_transient(e):
                raise
            wait = min(_BACKOFF_CAP_S, backoff_s * 2 ** attempt)
            log.warning("storage: %s failed (%s: %s); retry %d/%d in %.1fs",
                        what, type(e).__name__, str(e)[:200], attempt + 1, retries, wait)
            time.sleep(wait)
    raise AssertionError("unreachable")


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
    retries: int = 6
    backoff_s: float = 0.5

    @classmethod
    def open(cls, root: str, experiment: str, endpoint_url: str | None = None, retries: int = 6,
             backoff_s: float = 0.5) -> ExperimentStore:
        return cls(normalize_root(root), experiment, endpoint_url, retries, backoff_s)

    @classmethod
    def from_config(cls, storage_cfg, experiment: str) -> ExperimentStore:
        """`storage_cfg`: reflow.infra.config.StorageConfig."""
        s = storage_cfg
        return cls.open(s.root, experiment, s.endpoint_url, s.retries, s.retry_backoff_s)

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
        return with_retries(fn, f"{what} {self.url(rel)}", self.retries, self.backoff_s)

    # ------------------------------------------------------------ writes

    def write_bytes(self, rel: str, data: bytes) -> str:
        self._retry(lambda: self._write_once(rel, data), "write", rel)
        return self.url(rel)

    def _write_once(self, rel: str, data: bytes) -> None:
        fs, path = self.fs, self._path(rel)
        if not self.is_local:
            fs.pipe_file(path, data)
            return
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        with fs.open(tmp, "wb") as f:
            f.write(data)
        fs.mv(tmp, path)

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
                fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
                tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
                fs.put_file(str(local), tmp)
                fs.mv(tmp, path)
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
        quick = ExperimentStore(self.root, self.experiment, self.endpoint_url, retries=0)
        step = "write"
        try:
            quick.write_bytes(rel, payload)
            step = "read"
            if quick.read_bytes(rel) != payload:
                raise StorageError("the probe object read back differs from what was written")
            step = "delete"
            quick.rm(rel)
        except Exception as e:  # deliberate: any failure becomes one clear message
            where = f" (endpoint {self.endpoint_url})" if self.endpoint_url else ""
            raise StorageError(
                f"storage preflight failed: cannot {step} a probe object under {self.url()}{where}: "
                f"{type(e).__name__}: {str(e)[:300]}. Check that the bucket exists, the endpoint is "
                f"reachable and the AWS credentials (env, ~/.aws, role) may write there.") from None
