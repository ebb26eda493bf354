"""`reflow export-merged`: a LoRA checkpoint's adapter merged into its base model, as a plain HF folder.

A LoRA run's checkpoints hold the adapter (adapter/: adapter_model.safetensors + adapter_config.json,
peft's format), not the model. This writes base + adapter merged exactly as the engines merge it
(reflow.engines.weights.lora.merge), so `AutoModelForCausalLM.from_pretrained(out)` computes what
the engines computed with that policy version. Only safetensors and JSON are read (no signature
needed: nothing is unpickled); each file is checked against the checkpoint's manifest.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from reflow.engines.hf_io import load_causal_lm, load_tokenizer
from reflow.engines.storage_access import StorageAccess
from reflow.engines.weights import lora
from reflow.infra.store import checkpoint as ckpt
from reflow.infra.store.storage import ExperimentStore
from reflow.rl.imports import mlflow_hidden

ADAPTER = "adapter/"


def _read(ck: ckpt.Checkpoint, files: dict[str, dict], rel: str) -> bytes:
    if rel not in files:
        raise ckpt.CheckpointInvalid(f"{ck.url}: {rel} is not in its manifest")
    data = ck.store.read_bytes(ck.rel(rel))
    if hashlib.sha256(data).hexdigest() != files[rel]["sha256"]:
        raise ckpt.CheckpointInvalid(f"{ck.url}: {rel} does not match its sha256 in the manifest")
    return data


def read_adapter(url: str, like: ExperimentStore) -> tuple[dict, list[tuple[str, torch.Tensor]]]:
    """(adapter_config, wire-named tensors) of the LoRA checkpoint at `url`, checked against its manifest."""
    from safetensors.torch import load

    ck = ckpt.from_url(url, like)
    files = ckpt.check(ck, signature=False)
    if not any(rel.startswith(ADAPTER) for rel in files):
        raise ckpt.CheckpointInvalid(f"{ck.url} holds no {ADAPTER} (a full fine-tuning checkpoint): its model/ "
                                     f"folder is already a complete HF model")
    config = json.loads(_read(ck, files, ADAPTER + "adapter_config.json"))
    tensors = load(_read(ck, files, ADAPTER + "adapter_model.safetensors"))
    return config, sorted(tensors.items())


def export_merged(url: str, out: str | Path, like: ExperimentStore, base: str | None = None,
                  storage: StorageAccess | None = None) -> dict[str, object]:
    """Write base + adapter of the checkpoint at `url` into the new folder `out`; returns what it did.
    `base`: the base model folder or URL (default: the one the adapter records, the run's model.path)."""
    out = Path(out).expanduser().resolve()
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: export-merged writes only into a new or empty folder")
    config, tensors = read_adapter(url, like)
    scale, halves = lora.scaling(config), lora.pairs(tensors)
    base = base or str(config.get("base_model_name_or_path") or "")
    if not base:
        raise ValueError(f"{url}: the adapter names no base model; pass --base <HF folder or URL>")
    model = load_causal_lm(base, dtype="fp32", storage=storage)
    with torch.no_grad():
        for module, ab in halves.items():
            weight = model.get_parameter(f"{module}.weight")  # AttributeError: a module the base lacks
            weight.copy_(lora.merge(weight.detach().clone(), ab["A"], ab["B"], scale))
    out.mkdir(parents=True, exist_ok=True)
    with mlflow_hidden():  # save_pretrained imports DeepSpeed where it is installed, which imports MLflow
        model.save_pretrained(out)
    load_tokenizer(base, storage=storage).save_pretrained(out)
    return {"out": str(out), "base": base, "merged_modules": len(halves), "scale": scale}
