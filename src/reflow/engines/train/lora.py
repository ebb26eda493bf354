"""LoRA on the policy ranks (peft): wrap the model, and split its gathered parameters into what
travels (the adapter) and what the engines end up computing with (the effective weights).

Only the adapter halves require grad, so they alone reach the optimizer (DeepSpeedRank._build_engine
hands it the parameters that require grad) and DeepSpeed's checkpoint (`exclude_frozen_parameters`):
the frozen base comes back from `model.path` at start-up. Names: a PeftModel's parameter
`base_model.model.<module>.lora_A.default.weight` goes on the wire as peft saves it, without the
adapter name (reflow.engines.weights.lora); its frozen `<module>.base_layer.weight` is the HF weight
`<module>.weight`, which the engines hold merged.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from reflow.engines.train.settings import LoraSettings
from reflow.engines.weights import lora

Named = list[tuple[str, torch.Tensor]]
ADAPTER_FILE, CONFIG_FILE = "adapter_model.safetensors", "adapter_config.json"


def wrap(model, settings: LoraSettings):
    """`model` with LoRA adapters on `settings.target_modules`; every other parameter frozen."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=0.0, bias="none",
                     target_modules=list(settings.target_modules), task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


def config(settings: LoraSettings, base_model: str) -> dict:
    """The adapter's PEFT config; a local base path is made absolute, so the record works from any folder."""
    base = base_model if "://" in base_model else os.path.abspath(base_model)
    return lora.adapter_config(settings.rank, settings.alpha, settings.target_modules, base)


def hf_name(param_name: str) -> str:
    """A frozen PeftModel parameter's HF name (`base_model.model.` and `.base_layer` dropped)."""
    return param_name.removeprefix(lora.PREFIX).replace(".base_layer.", ".")


def split(named: Named, settings: LoraSettings) -> tuple[Named, Named]:
    """(adapter tensors by wire name, effective weights by HF name) of a PeftModel's gathered parameters."""
    adapter = [(w, t) for n, t in named if (w := lora.wire_name(n)) is not None]
    halves, scale = lora.pairs(adapter), settings.alpha / settings.rank
    effective = []
    for n, t in named:
        if lora.wire_name(n) is not None:
            continue
        name = hf_name(n)
        module = name.removesuffix(".weight")
        effective.append((name, lora.merge(t, halves[module]["A"], halves[module]["B"], scale)
                          if module in halves and name.endswith(".weight") else t))
    return adapter, effective


def write_adapter(adapter: Named, settings: LoraSettings, base_model: str, out: Path) -> None:
    """A PEFT adapter folder (adapter_model.safetensors + adapter_config.json), loadable by peft and SGLang."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in adapter}, str(out / ADAPTER_FILE))
    (out / CONFIG_FILE).write_text(json.dumps(config(settings, base_model), indent=2, sort_keys=True))
