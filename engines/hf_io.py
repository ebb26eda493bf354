"""Loading HF checkpoints the way a user's own checkpoint is loaded: a local folder or a URL.

Remote checkpoints (any fsspec URL: s3://, file://, ...) are copied once into a local cache
folder keyed by the URL, then loaded with `transformers` like any local folder. Trainer and
engines both go through `resolve_checkpoint`.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import torch

CACHE_DIR = Path(os.environ.get("REFLOW_CACHE", Path.home() / ".cache" / "reflow" / "checkpoints"))
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


class CheckpointError(FileNotFoundError):
    """A checkpoint location is missing or is not an HF checkpoint folder."""


def _check_folder(local: Path, shown: str) -> Path:
    if not local.is_dir():
        raise CheckpointError(
            f"checkpoint folder {shown!r} does not exist. Point model.path at an HF checkpoint folder "
            f"(config.json + *.safetensors + tokenizer files), or run `reflow bootstrap` to build the demo policy.")
    if not (local / "config.json").is_file():
        raise CheckpointError(f"checkpoint folder {shown!r} has no config.json: not an HF checkpoint folder")
    if not any(local.glob("*.safetensors")) and not any(local.glob("*.bin")):
        raise CheckpointError(f"checkpoint folder {shown!r} has no weights (*.safetensors)")
    return local


def resolve_checkpoint(path_or_url: str) -> Path:
    """Local folder for `path_or_url`, downloading a remote checkpoint into the cache first."""
    if "://" not in path_or_url or path_or_url.startswith("file://"):
        local = Path(path_or_url.removeprefix("file://")).expanduser()
        return _check_folder(local.resolve(), path_or_url)
    import fsspec

    fs, root = fsspec.core.url_to_fs(path_or_url)
    if not fs.isdir(root):
        raise CheckpointError(f"checkpoint {path_or_url!r} does not exist (no such prefix in object storage)")
    key = hashlib.sha256(path_or_url.encode()).hexdigest()[:16]
    dest = CACHE_DIR / key
    done = dest / ".complete"
    if not done.exists():
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        # Unique per call: two engines in one process (or two threads) may fetch the same URL at once.
        tmp = Path(tempfile.mkdtemp(prefix=f"{key}.tmp", dir=CACHE_DIR))
        fs.get(root.rstrip("/") + "/", str(tmp), recursive=True)
        (tmp / ".complete").write_text(path_or_url)
        if dest.exists():  # another process won the race; keep theirs
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.rename(dest)
    return _check_folder(dest, path_or_url)


def load_causal_lm(path_or_url: str, dtype: str = "fp32"):
    from transformers import AutoModelForCausalLM

    local = resolve_checkpoint(path_or_url)
    model = AutoModelForCausalLM.from_pretrained(local, dtype=_DTYPES[dtype])
    return model


def load_tokenizer(path_or_url: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_checkpoint(path_or_url))


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]
