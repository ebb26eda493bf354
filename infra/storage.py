"""Object storage for one experiment, through fsspec (`file://` by default, `s3://` via s3fs).

Layout (see DESIGN.md):
    <root>/<experiment>/config.yaml
    <root>/<experiment>/iterations/000042/{metrics.json, rollouts.parquet}
Small files are written to a temporary name and then moved, so a reader never sees half a file.
"""
from __future__ import annotations

import io
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec


def normalize_root(root: str) -> str:
    """`file://./x` or a bare path -> absolute `file:///...`; other URLs unchanged."""
    if root.startswith("file://"):
        root = root.removeprefix("file://")
    if "://" not in root:
        return "file://" + str(Path(root).expanduser().resolve())
    return root.rstrip("/")


@dataclass(frozen=True)
class ExperimentStore:
    root: str  # normalised root URL
    experiment: str

    @classmethod
    def open(cls, root: str, experiment: str) -> "ExperimentStore":
        return cls(normalize_root(root), experiment)

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return fsspec.core.url_to_fs(self.root)[0]

    def url(self, *parts: str) -> str:
        return "/".join([self.root, self.experiment, *parts])

    def _path(self, *parts: str) -> str:
        return fsspec.core.url_to_fs(self.url(*parts))[1]

    def write_bytes(self, rel: str, data: bytes) -> str:
        fs, path = self.fs, self._path(rel)
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        with fs.open(tmp, "wb") as f:
            f.write(data)
        fs.mv(tmp, path)
        return self.url(rel)

    def write_json(self, rel: str, obj: Any) -> str:
        return self.write_bytes(rel, json.dumps(obj, indent=2, sort_keys=True, default=str).encode())

    def write_text(self, rel: str, text: str) -> str:
        return self.write_bytes(rel, text.encode())

    def write_parquet(self, rel: str, df) -> str:
        buf = io.BytesIO()
        df.to_parquet(buf, index=False)
        return self.write_bytes(rel, buf.getvalue())

    def read_json(self, rel: str) -> Any:
        with self.fs.open(self._path(rel), "rb") as f:
            return json.load(f)

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self._path(rel))

    def iteration_dir(self, iteration: int) -> str:
        return f"iterations/{iteration:06d}"
