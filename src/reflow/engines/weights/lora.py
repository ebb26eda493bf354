"""LoRA adapters on the wire: their names, their PEFT config, and the merge every side computes.

Wire names are those of peft's saved adapters (adapter_model.safetensors), which SGLang's
`load_lora_adapter_from_tensors` reads too: `base_model.model.<module>.lora_A.weight` and
`…lora_B.weight`, `<module>` being the HF name of the adapted linear (e.g.
`model.layers.0.self_attn.q_proj`). The effective weight of that linear is

    W = W_base + (B @ A) * (alpha / r)            # [out, in] = [out, in] + [out, r] @ [r, in]

which is peft's own merge (LoraLayer.get_delta_weight without fan_in_fan_out; `merge_and_unload`).
The embedded engine, the trainer's verification copy and `reflow export-merged` all use `merge`
below, so their tensors agree bit for bit.

On an engine, the adapter of policy version v is named `adapter_name(v)` (`reflow-v<v>`): every
/generate request of that version names it in `lora_path`, so a request for a version the engine
does not hold fails (SGLang: "never been loaded") instead of sampling another policy.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch at run time only where a tensor is handled: rollout task workers import adapter_name alone
    import torch

PREFIX = "base_model.model."
HALVES = {"lora_A": "A", "lora_B": "B"}
ADAPTER_PREFIX = "reflow-v"  # names reflow gives adapters; it unloads no other


def adapter_name(version: int | str) -> str:
    """The engine-side name (and the requests' `lora_path`) of policy `version`'s adapter."""
    return f"{ADAPTER_PREFIX}{version}"


def checksums(named: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """sha256 of each tensor's bytes, as SGLang 0.5.23's TP workers hash what they received for
    `expected_checksums` (tp_worker.load_lora_adapter_from_tensors: contiguous, flattened, viewed as uint8)."""
    import torch

    return {n: hashlib.sha256(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in named}


def wire_name(param_name: str) -> str | None:
    """The wire name of a PeftModel parameter (`….lora_A.default.weight` -> `….lora_A.weight`), or None
    for a parameter that is not an adapter half."""
    parts = param_name.split(".")
    for i, part in enumerate(parts[:-2]):
        if part in HALVES and parts[-1] == "weight":
            return ".".join(parts[: i + 1] + ["weight"])
    return None


def pairs(named: list[tuple[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    """{module HF name: {"A": [r, in], "B": [out, r]}} of wire-named adapter tensors; a module with one
    half missing, or a name that is not an adapter's, is an error naming it."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in named:
        parts = name.removeprefix(PREFIX).split(".")
        if not name.startswith(PREFIX) or len(parts) < 3 or parts[-2] not in HALVES or parts[-1] != "weight":
            raise KeyError(f"{name!r} is not a LoRA adapter tensor (expected {PREFIX}<module>.lora_A.weight "
                           f"or .lora_B.weight, as peft saves them)")
        out.setdefault(".".join(parts[:-2]), {})[HALVES[parts[-2]]] = t
    if half := [m for m, ab in out.items() if len(ab) != 2]:
        raise KeyError(f"adapter tensors of {half[:3]} lack their lora_A or lora_B half")
    return out


def scaling(config: dict) -> float:
    """alpha / r of a PEFT adapter_config; variants whose merge differs are refused, not mis-merged."""
    for key in ("use_rslora", "use_dora", "fan_in_fan_out"):
        if config.get(key):
            raise ValueError(f"adapter_config {key}=true is not supported (its merge differs from W + B @ A * alpha/r)")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"adapter_config needs r >= 1 and lora_alpha > 0, got r={r!r}, lora_alpha={alpha!r}")
    return float(alpha) / r


def merge(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W_base + (B @ A) * scale, the product taken in fp32 and cast to the base dtype, as peft merges on CPU."""
    delta = (b.float() @ a.float()) * scale  # [out, in]
    return base + delta.to(device=base.device, dtype=base.dtype)


def adapter_config(rank: int, alpha: float, target_modules: list[str] | tuple[str, ...], base_model: str) -> dict:
    """The adapter_config.json fields a PEFT LoRA adapter carries (what SGLang's config_dict expects)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
            "target_modules": sorted(target_modules), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "base_model_name_or_path": base_model}
