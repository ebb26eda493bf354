"""Loading HF checkpoints the way a user's own checkpoint is loaded: a local folder or a URL.

Remote folders (any fsspec URL: s3://, ...) are downloaded through the run's storage access
(reflow.engines.storage_access: its endpoint, retries; default: the environment's) into a local
cache, then loaded with `transformers` like any local folder. Trainer and engines both go through
`resolve_checkpoint`.

`files` is what the folder must hold, {name: {"sha256", "bytes"}}: the manifest entries of a reflow
checkpoint's model/ folder (reflow.infra.store.checkpoint.model_files). With it, exactly those files are
downloaded and each is checked against its sha256 (a local folder is checked in place and may hold
nothing else), and the cached copy is keyed by the digest of the (name, sha256) list, so a checkpoint
re-written at the same URL is never served from the cache of the old one. Without it (a user's own
HF folder), the cache key is the URL plus the folder's listing (every file's name, size and ETag, or
mtime where the store has no ETag): re-writing a file changes its listing, so the next load
downloads afresh, at the cost of one listing per load; downloaded sizes are checked against it.
Cached copies are never deleted here (they are named by content: delete the folder to reclaim space).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from reflow.engines.storage_access import ChecksumError, StorageAccess, is_local, sha256_file

CACHE_DIR = Path(os.environ.get("REFLOW_CACHE", Path.home() / ".cache" / "reflow" / "checkpoints"))
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}
Files = dict[str, dict]  # {name relative to the folder: {"sha256", "bytes"}}


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


def _verify(path: Path, name: str, meta: dict, shown: str) -> None:
    """ChecksumError unless the file at `path` has the size and sha256 `meta` records for `name`."""
    size = path.stat().st_size
    if "bytes" in meta and size != meta["bytes"]:
        raise ChecksumError(f"checkpoint {shown}: {name} is {size} bytes where its manifest records "
                            f"{meta['bytes']}: the file changed after the checkpoint was saved. Refusing to load it; "
                            f"restore the file or use another checkpoint")
    if "sha256" in meta and (got := sha256_file(path)) != meta["sha256"]:
        raise ChecksumError(f"checkpoint {shown}: {name} does not match its manifest (sha256 {got[:12]}…, recorded "
                            f"{meta['sha256'][:12]}…): the file changed after the checkpoint was saved. Refusing to "
                            f"load it; restore the file or use another checkpoint")


def _holds_exactly(local: Path, files: Files, shown: str, record: str) -> None:
    """ChecksumError unless the folder `local` holds every file of `files` and nothing else (anything else would
    be loaded unchecked). `record`: what listed them ("its manifest"), for the message."""
    held = {p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()}
    if missing := sorted(set(files) - held):
        raise ChecksumError(f"{shown}: {', '.join(missing)} listed in {record} but missing")
    if extra := sorted(held - set(files)):
        raise ChecksumError(f"{shown}: holds {', '.join(extra)}, which {record} does not list; refusing to load "
                            f"files nobody recorded. Remove them or use another checkpoint")


def _verify_local(local: Path, files: Files, shown: str) -> None:
    """Every file of `files` in `local` as recorded, and nothing else there."""
    _holds_exactly(local, files, f"checkpoint {shown}", "its manifest")
    for name, meta in sorted(files.items()):
        _verify(local / name, name, meta, shown)


def copy_verified(path_or_url: str, files: Files, dest: Path) -> Path:
    """Copy the local folder `path_or_url` into `dest` (a private folder of the caller's), checking that it
    holds exactly `files` and that each file's bytes have the recorded size and sha256 as they are copied;
    returns `dest`. Load from `dest`, not from the original: what is loaded is then what was checked.
    Checking the original in place and loading it afterwards reads every file twice, and a folder others
    can write to may change between the two reads (a disk weight push's folder: push.publish_weights)."""
    src = Path(path_or_url.removeprefix("file://")).expanduser().resolve()
    _check_folder(src, path_or_url)
    _holds_exactly(src, files, path_or_url, "what its writer recorded")
    for name, meta in sorted(files.items()):  # every name is one found inside `src`: no '..', no absolute
        out = dest / name
        out.parent.mkdir(parents=True, exist_ok=True)
        h, size = hashlib.sha256(), 0
        with open(src / name, "rb") as fin, open(out, "xb") as fout:
            while block := fin.read(1 << 20):
                h.update(block)
                fout.write(block)
                size += len(block)
        if size != meta.get("bytes", size) or h.hexdigest() != meta["sha256"]:
            raise ChecksumError(f"{path_or_url}: {name} does not match what its writer recorded ({size} bytes, sha256 "
                                f"{h.hexdigest()[:12]}…; recorded {meta.get('bytes')} bytes, {meta['sha256'][:12]}…): "
                                f"it changed after it was written. Refusing to load it")
    return _check_folder(dest, path_or_url)


def content_key(files: Files) -> str:
    """The digest a folder with these files is cached under: sha256 of its sorted (name, sha256) list."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(f"{name}\t{files[name]['sha256']}\n".encode())
    return h.hexdigest()


def _listing_key(url: str, listing: dict[str, dict]) -> str:
    """The digest a folder without a manifest is cached under: its URL and every file's name, size, ETag/mtime."""
    h = hashlib.sha256(url.rstrip("/").encode() + b"\n")
    for name, info in sorted(listing.items()):
        tag = info.get("ETag") or info.get("mtime") or info.get("LastModified") or ""
        h.update(f"{name}\t{info.get('size')}\t{tag}\n".encode())
    return h.hexdigest()


def _download(storage: StorageAccess, url: str, want: Files, dest: Path) -> None:
    """Fetch every file of `want` into a fresh folder beside `dest`, check it, then move it into place.
    The folder is unique per call: two engines in one process (or two threads) may fetch the same one at once."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{dest.name}.tmp", dir=dest.parent))
    try:
        for name, meta in sorted(want.items()):
            try:
                storage.download(url, name, tmp)
            except FileNotFoundError:
                raise CheckpointError(f"checkpoint {url}: {name} is listed but missing in storage") from None
            _verify(tmp / name, name, meta, url)
        (tmp / ".complete").write_text(url)
        try:
            tmp.rename(dest)
        except OSError:
            if not (dest / ".complete").exists():
                raise
            # else another process finished the same copy first (same key, same content): keep theirs
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_checkpoint(path_or_url: str, storage: StorageAccess | None = None, files: Files | None = None) -> Path:
    """Local folder for `path_or_url`, downloading a remote one into the cache first (see the module
    docstring for `files` and what the cache is keyed by). `storage`: the run's storage access."""
    if is_local(path_or_url):
        local = _check_folder(Path(path_or_url.removeprefix("file://")).expanduser().resolve(), path_or_url)
        if files is not None:
            _verify_local(local, files, path_or_url)
        return local
    storage = storage or StorageAccess()
    if files is not None:
        key, want = f"sha256-{content_key(files)[:32]}", files
    else:
        listing = storage.files(path_or_url)
        if not listing:
            raise CheckpointError(f"checkpoint {path_or_url!r} does not exist (no such prefix in object storage)")
        key, want = f"url-{_listing_key(path_or_url, listing)[:32]}", {n: {"bytes": i["size"]} for n, i in listing.items()}
    dest = CACHE_DIR / key
    if not (dest / ".complete").exists():
        _download(storage, path_or_url, want, dest)
    return _check_folder(dest, path_or_url)


def model_bytes(folder: str) -> tuple[int, int]:
    """(parameters, bytes of the weights as stored) of an HF folder's safetensors files, from their headers."""
    from safetensors import safe_open

    params = stored = 0
    for f in sorted(Path(folder).glob("*.safetensors")):
        stored += f.stat().st_size
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                n = 1
                for d in st.get_slice(key).get_shape():
                    n *= int(d)
                params += n
    return params, stored


# transformers' from_pretrained switches weight tying off for the whole process while it loads: its
# initialization.no_tie_weights replaces PreTrainedModel.tie_weights with a no-op and puts back what it found. Two
# loads interleaved in threads of one process (an engine's disk pushes arriving together, two engines in one test
# process) put the no-op back for good, and every model made afterwards with tied embeddings got an lm_head of its
# own, random where the checkpoint stores only the tied weight (tests/test_hf_io.py). reflow's loads take turns.
HF_LOAD_LOCK = threading.RLock()


def from_pretrained(cls, *args, **kwargs):
    """`cls.from_pretrained(*args, **kwargs)`, one at a time in this process (HF_LOAD_LOCK)."""
    with HF_LOAD_LOCK:
        return cls.from_pretrained(*args, **kwargs)


def load_causal_lm(path_or_url: str, dtype: str = "fp32", storage: StorageAccess | None = None,
                   files: Files | None = None, attn_implementation: str | None = None):
    """`attn_implementation`: transformers' attention kernel (None: its default, SDPA where available)."""
    from transformers import AutoModelForCausalLM

    local = resolve_checkpoint(path_or_url, storage, files)
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    return from_pretrained(AutoModelForCausalLM, local, dtype=_DTYPES[dtype], **extra)


def set_tf32(on: bool) -> None:
    """Whether float32 matrix products (and convolutions) in this process may run on NVIDIA's TF32 tensor cores:
    inputs rounded to a 10-bit mantissa (bf16 keeps 7), float32 range, sums and everything between the products.
    A process-wide flag, set before any model runs (compiled graphs pick their kernels once); no effect on CPU
    or on bf16 products. torch's default is off ("highest")."""
    torch.set_float32_matmul_precision("high" if on else "highest")
    torch.backends.cudnn.allow_tf32 = on


def fp32_lm_head(model):
    """Make `model`'s LM head (its output embeddings: hidden state -> vocabulary logits) compute in float32
    whatever the model's dtype or an enclosing torch.autocast: its input and weight are upcast for the product
    (the weight as it is at each call, so pushed weights take effect) and the logits come out float32. A model
    in bf16 otherwise computes logits with ~3 significant digits (spaced 0.125 near 20), which every log-prob,
    importance ratio and sampled token inherits. Costs a float32 copy of the head's weight per forward (LoRA
    adapters on the head are not supported: the base layer alone would be upcast). Returns `model`."""

    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"fp32_lm_head needs a torch.nn.Linear output layer, this model has {type(head).__name__}")

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            bias = None if head.bias is None else head.bias.float()
            return F.linear(x.float(), head.weight.float(), bias)

    head.forward = forward  # nn.Module.__call__ (and its hooks: ZeRO-3 gathering) still wrap it
    return model


def load_tokenizer(path_or_url: str, storage: StorageAccess | None = None, files: Files | None = None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_checkpoint(path_or_url, storage, files))


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]
