"""Checkpoint save / fetch / load for one trainer rank (`TrainerRank` methods delegate here).

A rank writes everything it owns into a local temp folder, then uploads it file by file:
    model/               HF folder (safetensors + config + tokenizer), rank 0 only
    optim/               `engine.save_checkpoint(tmp, tag="optim")`: module + optimizer state and,
                         under ZeRO, this rank's partition files; our LambdaLR state and step
                         count ride along in DeepSpeed's `client_state`
    rng/rank_NNNNN.pt    python / numpy / torch RNG states of this process
Loading is two-phase so a bad checkpoint never touches the live engine: `fetch` downloads and
checks every file against the manifest's sha256 (not collective, may fail per rank), then `load`
calls `engine.load_checkpoint` (collective) on every rank. That unpickles optim/*.pt, so the table
`fetch` takes is the one the driver verified with its SIGNATURE (infra/store/checkpoint.py `check`): a rank
never reads MANIFEST.json from the bucket and downloads only files that table lists.

`store` is duck-typed (`put_file(local, rel) -> {"sha256", "bytes"}`, `download(prefix, name, root,
sha256)`): reflow.infra.store.storage.ExperimentStore, passed in by the caller so engines/ imports no infra/.
Every rank downloads all of `optim/`: DeepSpeed's ZeRO-1/2 load reads every rank's partition file.
"""
from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

DS_TAG = "optim"
# What np.random.get_state() pickles to (an MT19937 uint32 array), for the weights-only unpickler.
_NUMPY_RNG_GLOBALS = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _lora(tr) -> bool:
    """Whether the rank trains LoRA adapters (its checkpoints then hold only the trainable parameters)."""
    return getattr(tr, "lora", None) is not None


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def load_rng_state(path: str | Path) -> None:
    """Restore the RNG states `rng_state()` saved at `path` (torch.save). Loaded with torch's
    weights-only unpickler plus numpy's array reconstruction: a file planted in the bucket cannot
    run code (its sha256 in the manifest would not stop a writer of the bucket)."""
    with torch.serialization.safe_globals(_NUMPY_RNG_GLOBALS):
        set_rng_state(torch.load(path, weights_only=True))


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _upload_tree(store, local_root: Path, prefix: str) -> dict[str, dict]:
    """Upload every file under local_root (a folder of this save's own, removed after) to `prefix/<relative
    path>`; {relative path: sha/bytes}. A local storage root on the same filesystem links the files in."""
    files = {}
    for f in sorted(p for p in local_root.rglob("*") if p.is_file()):
        rel = f.relative_to(local_root).as_posix()
        files[rel] = store.put_file(f, f"{prefix}/{rel}", link=True)
    return files


def save(tr, store, prefix: str) -> dict[str, dict]:
    """Collective: every rank saves its part locally, then uploads it. Returns this rank's files."""
    tmp = Path(tempfile.mkdtemp(prefix=f"reflow-ckpt-save-r{tr.rank}-"))
    try:
        (tmp / "rng").mkdir()
        torch.save(rng_state(), tmp / "rng" / f"rank_{tr.rank:05d}.pt")
        client = {"reflow_scheduler": tr.scheduler.state_dict(), "reflow_trainer_iteration": tr.iteration,
                  "reflow_world_size": tr.world_size}
        # LoRA: the frozen base is left out (it comes back from model.path); only adapters and their optimizer state
        tr.engine.save_checkpoint(str(tmp), tag=DS_TAG, client_state=client, save_latest=False,
                                  exclude_frozen_parameters=_lora(tr))
        tr.save_hf(str(tmp / getattr(tr, "hf_folder", "model")))  # collective gather; rank 0 writes (LoRA: adapter/)
        return _upload_tree(store, tmp, prefix)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _wanted(rel: str, rank: int) -> bool:
    if rel.startswith(f"{DS_TAG}/"):
        return True
    if rel.startswith("rng/"):
        return rel == f"rng/rank_{rank:05d}.pt"
    return rank == 0  # rank 0 also checks the HF folder, so a corrupt model/ is caught too


def fetch(tr, store, prefix: str, manifest: dict[str, dict]) -> str:
    """Download and sha256-check this rank's files into a local folder; raises ChecksumError.
    `manifest`: the driver's verified {relative path: {sha256, bytes}} table, not the bucket's file."""
    if f"rng/rank_{tr.rank:05d}.pt" not in manifest:
        raise FileNotFoundError(f"checkpoint {prefix} has no RNG state for rank {tr.rank}: it was saved "
                                f"with fewer trainer ranks; resume with the same trainer.num_ranks")
    drop_fetched(tr)
    local = Path(tempfile.mkdtemp(prefix=f"reflow-ckpt-load-r{tr.rank}-"))
    tr._fetched_checkpoint = str(local)
    for rel, meta in sorted(manifest.items()):
        if _wanted(rel, tr.rank):
            store.download(prefix, rel, local, sha256=meta["sha256"])
    return str(local)


def drop_fetched(tr) -> None:
    old = getattr(tr, "_fetched_checkpoint", None)
    if old:
        shutil.rmtree(old, ignore_errors=True)
        tr._fetched_checkpoint = None


def load(tr) -> dict:
    """Collective: load the fetched checkpoint into the live engine, scheduler and RNGs."""
    local = getattr(tr, "_fetched_checkpoint", None)
    if not local:
        raise RuntimeError(f"trainer rank {tr.rank}: load_checkpoint called before fetch_checkpoint")
    try:
        path, client = tr.engine.load_checkpoint(local, tag=DS_TAG, load_optimizer_states=True,
                                                 load_lr_scheduler_states=False, load_module_strict=not _lora(tr))
        if path is None:
            raise RuntimeError(f"trainer rank {tr.rank}: DeepSpeed found no checkpoint under {local}/{DS_TAG}")
        tr.scheduler.load_state_dict(client["reflow_scheduler"])
        tr.iteration = int(client["reflow_trainer_iteration"])
        load_rng_state(Path(local) / "rng" / f"rank_{tr.rank:05d}.pt")
        tr.engine.module.eval()  # as after init: dropout off (see TrainerRank._build_engine)
        return {"rank": tr.rank, "iteration": tr.iteration, "lr": tr.scheduler.get_last_lr()[0]}
    finally:
        drop_fetched(tr)
