"""Object storage for one experiment, through fsspec (`file://` by default, `s3://` via s3fs).

Layout (see DESIGN.md):
    <root>/<experiment>/config.yaml
    <root>/<experiment>/iterations/000042/{metrics.json, rollouts.parquet}
    <root>/<experiment>/checkpoints/...           (infra/store/checkpoint.py)

Every read and write goes through reflow.engines.storage_access.StorageAccess, the one access path
that the paths outside the store (prompt files, eval sources, model folders, retrain's new data,
disk pushes) use too: the endpoint, retries with an outage budget, slow-call warnings, advice on
permanent errors (worded here for storage.root) and atomic local writes are described there. Its
errors and helpers are importable from here as well.

Credentials are never part of this object: s3fs takes them from the standard AWS chain (env,
~/.aws, instance role). Only the endpoint override is carried, so the store can be pickled into
Ray tasks and its fields logged.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from reflow.engines.storage_access import (  # noqa: F401 (re-exported: this module's API since before)
    ChecksumError,
    StorageAccess,
    StorageError,
    StorageUnavailable,
    is_transient,
    sha256_file,
    with_retries,
)
from reflow.infra.config.guards import check_segment, credential_problem, credentials_message


def normalize_root(root: str) -> str:
    """`file://./x` or a bare path -> absolute `file:///...`; other URLs unchanged."""
    if (problem := credential_problem(root)) is not None:  # it would end up in logs and saved configs
        raise StorageError(credentials_message("storage root", problem))
    if root.startswith("file://"):
        root = root.removeprefix("file://")
    if "://" not in root:
        return "file://" + str(Path(root).expanduser().resolve())
    return root.rstrip("/")


@dataclass(frozen=True)
class ExperimentStore:
    """Paths relative to `<root>/<experiment>`, read and written through `access`."""

    root: str  # normalised root URL
    experiment: str
    endpoint_url: str | None = None
    retries: int = 10  # defaults: those of StorageConfig (infra/config/schema.py)
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
        """`storage_cfg`: reflow.infra.config.schema.StorageConfig."""
        a = StorageAccess.from_config(storage_cfg)
        return cls.open(storage_cfg.root, experiment, a.endpoint_url, a.retries, a.backoff_s, a.outage_budget_s,
                        a.slow_call_warn_s)

    @property
    def access(self) -> StorageAccess:
        """This store's way to storage: its settings, with advice that names storage.root."""
        return StorageAccess(self.endpoint_url, self.retries, self.backoff_s, self.outage_budget_s,
                             self.slow_call_warn_s, scope=self.root, setting="storage.root")

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return self.access.fs_for(self.root)[0]

    @property
    def is_local(self) -> bool:
        return self.root.startswith("file://")

    def url(self, *parts: str) -> str:
        return "/".join([self.root, self.experiment, *(p.strip("/") for p in parts if p)])

    def _path(self, *parts: str) -> str:
        return self.access.fs_for(self.url(*parts))[1]

    # ------------------------------------------------------------ writes

    def write_bytes(self, rel: str, data: bytes) -> str:
        self.access.write_bytes(self.url(rel), data)
        return self.url(rel)

    def write_json(self, rel: str, obj: Any) -> str:
        return self.write_bytes(rel, json.dumps(obj, indent=2, sort_keys=True, default=str).encode())

    def write_text(self, rel: str, text: str) -> str:
        return self.write_bytes(rel, text.encode())

    def write_parquet(self, rel: str, df) -> str:
        buf = io.BytesIO()
        df.to_parquet(buf, index=False)
        return self.write_bytes(rel, buf.getvalue())

    def put_file(self, local: str | Path, rel: str, link: bool = False) -> dict:
        """Upload one local file; returns {"sha256", "bytes"} of what was sent (for the manifest). `link`: see
        reflow.engines.storage_access.StorageAccess.put_file."""
        return self.access.put_file(local, self.url(rel), link=link)

    # ------------------------------------------------------------ reads

    def read_bytes(self, rel: str) -> bytes:
        return self.access.read_bytes(self.url(rel))

    def read_json(self, rel: str) -> Any:
        return json.loads(self.read_bytes(rel))

    def read_text(self, rel: str) -> str:
        return self.read_bytes(rel).decode()

    def download(self, prefix: str, name: str, root: str | Path, sha256: str | None = None) -> Path:
        """Download `prefix/name` of the store to `root/name` (StorageAccess.download: `name` is checked)."""
        return self.access.download(self.url(prefix), name, root, sha256)

    def exists(self, rel: str) -> bool:
        return self.access.exists(self.url(rel))

    def size(self, rel: str) -> int:
        return self.access.size(self.url(rel))

    def listdir(self, rel: str) -> list[str]:
        """Names (not paths) directly under `rel`; [] if it does not exist."""
        return self.access.listdir(self.url(rel))

    def rm(self, rel: str, recursive: bool = False) -> None:
        self.access.rm(self.url(rel), recursive)

    def _missing_local_dirs(self) -> list[Path]:
        """The local folders (root, experiment, _preflight) the probe is about to create, deepest last."""
        if not self.is_local:
            return []  # object stores have no folders to leave behind
        dirs = [Path(self.root.removeprefix("file://")), Path(self._path()), Path(self._path("_preflight"))]
        return [d for d in dirs if not d.exists()]

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
        fresh = self._missing_local_dirs()
        step = "write"
        try:
            quick.write_bytes(rel, payload)
            step = "read"
            if quick.read_bytes(rel) != payload:
                raise StorageError("the probe object read back differs from what was written")
            step = "delete"
            quick.rm(rel)
            _remove_empty(fresh)
        except Exception as e:  # deliberate: any failure becomes one clear message
            err: BaseException = e
            if isinstance(e, StorageUnavailable) and e.__cause__ is not None:
                err = e.__cause__  # with retries=0 the error itself, not "past storage.retries=0"
            if isinstance(err, StorageError) and isinstance(err.__cause__, OSError):
                # from StorageAccess.call: already names the probe's URL, what is wrong and what to do
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


def _remove_empty(dirs: list[Path]) -> None:
    """Remove folders the preflight created, deepest first, so a run that fails later (or never writes)
    leaves no empty `_preflight/` or experiment folder: reflow deletes only what it wrote."""
    for d in reversed(dirs):
        try:
            d.rmdir()
        except OSError:  # deliberate: no longer empty (another run of the storage wrote there): keep it
            return
