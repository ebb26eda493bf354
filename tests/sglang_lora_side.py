"""SGLang 0.5.23's LoRA path in tests/sglang_app.py's stand-in server (issue 20), for a server
started with the LoRA flags reflow's launcher passes (--enable-lora, --max-lora-rank, ...).

- Real: the tokenizer manager's `load_lora_adapter_from_tensors` / `unload_lora_adapter` (registry,
  update lock, duplicate-name and pending-unload rules, waiting for requests still using an adapter)
  and its request resolution `_validate_and_resolve_lora` (acquire by name; "never been loaded");
  the TP worker's and model runner's `load_lora_adapter_from_tensors` / `unload_lora_adapter`, compiled
  from tp_worker.py's and model_runner.py's source (those modules import the GPU scheduler, so they
  cannot be imported here): payload decoding, FlattenedTensorBucket rebuild, `expected_checksums`;
  the LoRA manager's load/validate/unload/result methods; LoRAConfig and LoRAAdapter (adapter tensor
  names parsed into layers, q/k/v and gate/up stacked into SGLang's fused layout).
- Stand-in: the LoRA memory pool (GPU buffers: it accepts every adapter and holds no slots) and the
  LoRA kernels: a request naming an adapter runs the HF model with W + B_i @ A_i * scaling for each
  slice i of SGLang's stacked layout (what its kernels add per slice), via torch.func.functional_call.
"""
from __future__ import annotations
import __future__

import ast
import logging
import types
from pathlib import Path

import torch

from reflow.engines.sglang.contract import installed_root

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def wheel_method(rel: str, cls: str, name: str, namespace: dict):
    """Method `cls.name` of the wheel's module file `rel`, compiled from its source in `namespace`
    (the module's own globals that the method uses)."""
    path = Path(installed_root()) / rel
    klass = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name)
    code = compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    ns = dict(namespace)
    exec(code, ns)
    return ns[name]


def _manager(hf, max_loras_per_batch: int):
    """SGLang's LoRAManager without its __init__ (GPU buffers, kernels, the wrapped base model)."""
    from sglang.srt.lora.lora_manager import LoRAManager

    m = object.__new__(LoRAManager)
    pool = types.SimpleNamespace(can_support=lambda config: True, remove_lora=lambda lora_id: None)
    for k, v in dict(base_hf_config=hf.config, load_config=None, lora_backend=None, base_model=None,
                     speculative_algorithm=None, attn_dp_enabled=False, max_loras_per_batch=max_loras_per_batch,
                     configs={}, loras={}, lora_refs={}, num_pinned_loras=0, memory_pool=pool,
                     device=torch.device("cpu")).items():
        setattr(m, k, v)
    return m


def _worker_class():
    from sglang.srt.managers import io_struct
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    tp = {**vars(io_struct), "torch": torch, "get_parallel": get_parallel, "FlattenedTensorBucket": FlattenedTensorBucket,
          "MultiprocessingSerializer": MultiprocessingSerializer, "logger": logging.getLogger("sglang.tp_worker"),
          "monkey_patch_torch_reductions": monkey_patch_torch_reductions}

    class Runner:  # ModelRunner's LoRA methods
        load_lora_adapter = wheel_method("srt/model_executor/model_runner.py", "ModelRunner", "load_lora_adapter", {})
        load_lora_adapter_from_tensors = wheel_method("srt/model_executor/model_runner.py", "ModelRunner",
                                                      "load_lora_adapter_from_tensors", {})
        unload_lora_adapter = wheel_method("srt/model_executor/model_runner.py", "ModelRunner", "unload_lora_adapter", {})

        def __init__(self, manager):
            self.lora_manager = manager

    class Worker:  # TpModelWorker's LoRA methods
        deserialize_own_rank = wheel_method("srt/managers/tp_worker.py", "BaseTpWorker", "deserialize_own_rank", tp)
        load_lora_adapter_from_tensors = wheel_method("srt/managers/tp_worker.py", "BaseTpWorker",
                                                      "load_lora_adapter_from_tensors", tp)
        unload_lora_adapter = wheel_method("srt/managers/tp_worker.py", "BaseTpWorker", "unload_lora_adapter", tp)
        load_lora_adapter = wheel_method("srt/managers/tp_worker.py", "BaseTpWorker", "load_lora_adapter", tp)

        def __init__(self, manager):
            self.model_runner = Runner(manager)

    return Worker


def attach(tm, hf) -> None:
    """Give the stand-in tokenizer manager `tm` SGLang's LoRA path (the server runs with --enable-lora)."""
    from sglang.srt.managers import io_struct
    from sglang.srt.runtime_context import get_lora

    tm.enable_lora = True
    tm.init_lora()  # SGLang's own: registry, update lock, caches
    tm.lora_manager = _manager(hf, get_lora().max_loras_per_batch)
    worker = _worker_class()(tm.lora_manager)

    async def communicate(obj):  # the scheduler's dispatch, one TP rank
        if isinstance(obj, io_struct.LoadLoRAAdapterFromTensorsReqInput):
            return [worker.load_lora_adapter_from_tensors(obj)]
        if isinstance(obj, io_struct.UnloadLoRAAdapterReqInput):
            return [worker.unload_lora_adapter(obj)]
        return [worker.load_lora_adapter(obj)]  # by path (SGLang's implicit reload of an unloaded name, too)

    tm.update_lora_adapter_communicator = communicate


def model_for(tm, lora_id: str | None):
    """What computes a request's logits: the HF model, or it with the adapter `lora_id` applied."""
    if lora_id is None:
        return tm.hf
    params = _effective(tm.hf, tm.lora_manager.loras[lora_id])
    return lambda ids: torch.func.functional_call(tm.hf, params, (ids,))


def _effective(hf, adapter) -> dict[str, torch.Tensor]:
    """HF weight name -> W + B_i @ A_i * scaling for every slice of the adapter's (SGLang-stacked) layers."""
    params, out = dict(hf.named_parameters()), {}
    for layer in adapter.layers:
        for name, a in layer.weights.items():
            if ".lora_A." not in name:
                continue
            b = layer.weights[name.replace(".lora_A.", ".lora_B.")]
            stem, module = name.removeprefix("base_model.model.").split(".lora_A.")[0].rsplit(".", 1)
            parts = FUSED.get(module, (module,))
            outs = [params[f"{stem}.{p}.weight"].shape[0] for p in parts]
            for p, a_i, b_i in zip(parts, a.chunk(len(parts)), b.split(outs)):
                w = params[f"{stem}.{p}.weight"]
                out[f"{stem}.{p}.weight"] = w + ((b_i.float() @ a_i.float()) * adapter.scaling).to(w.dtype)
    return out
