"""SGLang 0.5.17's real HTTP server on CPU (the GPU machine's SGLang, issue 57), beside tests/sglang_app.py's 0.5.23.

Run as `python -m tests.sglang_app_0517 --serve '[<launch flags>]' ...` with 0.5.17 first on PYTHONPATH
(tests/sglang_0517.py installs it into .cache/sglang-0.5.17). What is real and what stands in is as in
tests/sglang_app.py (its stand-in tokenizer manager, model and generation are reused), except the scheduler side,
built here from 0.5.17's own classes, which differ from 0.5.23's:
- `SchedulerWeightUpdaterManager` (0.5.17: no weight-update sessions; a tensor update picks the draft worker unless
  `disable_draft_model`), constructed as its dataclass;
- `TpModelWorker`'s own methods (its module imports here under the stand-ins): `_deserialize_own_rank`
  (MultiprocessingSerializer + SafeUnpickler), `update_weights_from_tensor` / `_distributed` / `_disk`, the group
  calls, `get_weights_by_name`;
- the model runner's `WeightUpdater` and `WeightExporter`, real instances of 0.5.17's dataclasses over the stand-in
  model (its distributed receive builds `FlattenedTensorBucket(named_tensors=<empty tensors>)`: no `.empty`).
Two more stand-ins, for this process only: 0.5.17's configs register model types with transformers'
AutoConfig that the installed transformers (newer than the 5.12.1 it pins) already has, which raises ValueError
at import; here a clash keeps transformers' own class. (The GPU machine's transformers 5.17.0 clashes on
"qwen3_asr": bench/gpu_machine/sglang_carry.md.) The memory saver is tests/sglang_app.py's recorder.
"""
from __future__ import annotations

import argparse
import copy
import json
import types

from tests import sglang_app
from tests.sglang_stand_ins import load_http_server


def _tolerate_known_model_types() -> None:
    """AutoConfig.register that keeps transformers' class where the model type exists (see the module docstring)."""
    from transformers import AutoConfig

    register = AutoConfig.register

    def register_new(model_type, config, exist_ok=False):
        return register(model_type, config, exist_ok=True)

    AutoConfig.register = staticmethod(register_new)


def _model_class_by_module(architectures: list[str]):
    """SGLang's own class for the architecture, imported from its module (sglang.srt.models.llama, .qwen2) instead
    of through ModelRegistry, which imports every model module first (7 s of CPU here): the same class."""
    import importlib

    modules = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
    arch = next(a for a in architectures if a in modules)
    return getattr(importlib.import_module(f"sglang.srt.models.{modules[arch]}"), arch)


def _load():
    _tolerate_known_model_types()
    sglang_app.sglang_model_class = _model_class_by_module  # read by the stand-in model and serve_many
    return load_http_server()


def _scheduler_side(model, model_config):
    """0.5.17's scheduler-side weight code over one stand-in runner (module docstring)."""
    import torch.distributed as dist
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.model_executor.model_runner_components.weight_exporter import WeightExporter
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.runtime_context import get_server_args

    runner = types.SimpleNamespace(server_args=get_server_args(), model=model)
    runner.weight_updater = WeightUpdater(
        tp_rank=0, device="cpu", gpu_id=0, model_config=model_config, custom_weight_loaders={},
        get_model=lambda: model, update_model_fields=lambda *a, **kw: None, recapture_cuda_graph=lambda: None,
        get_model_runner=lambda: runner)
    runner.weight_exporter = WeightExporter(tp_rank=0, tp_size=1, gpu_id=0, get_model_path=lambda: model_config.model_path,
                                            get_model=lambda: model)
    worker_methods = ("_deserialize_own_rank", "update_weights_from_tensor", "update_weights_from_distributed",
                      "update_weights_from_disk", "init_weights_update_group", "destroy_weights_update_group",
                      "get_weights_by_name")
    worker = type("Worker", (), {m: getattr(TpModelWorker, m) for m in worker_methods})()
    worker.model_runner, worker.ps = runner, types.SimpleNamespace(tp_rank=0)
    scheduler = types.SimpleNamespace(disaggregation_mode=DisaggregationMode.NULL)
    saver = sglang_app.MemorySaver()
    return SchedulerWeightUpdaterManager(tp_worker=worker, draft_worker=None, tp_cpu_group=dist.group.WORLD,
                                         memory_saver_adapter=saver, flush_cache=lambda empty_cache=False: True,
                                         is_fully_idle=lambda **kw: True, scheduler=scheduler)


def serve(hs, argv: list[str]) -> None:
    """tests/sglang_app.serve for 0.5.17: its publish() takes no ranks; its manager keeps config updates."""
    import tempfile

    import torch
    import torch.distributed as dist
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.parser.template_manager import TemplateManager
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import prepare_server_args
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    server_args = prepare_server_args([*argv, "--device", "cpu"])
    publish(server_args, role="tokenizer")
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp(prefix='sglang_app_')}", rank=0,
                            world_size=1)
    model_config = ModelConfig.from_server_args(server_args)
    path = server_args.model_path
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=model_config.dtype).eval()

    class StandInTokenizerManager(sglang_app._tokenizer_manager_class(_scheduler_side)):
        def __init__(self, *args):
            self._config_updates: list = []  # 0.5.17's record of control-plane updates (weight_version, ...)
            super().__init__(*args)

        def _generate_all(self, obj):
            """0.5.17 keeps one rid per prompt (0.5.23 expands them n times): as its _handle_batch_request,
            prompt i's n samples are children of obj[i], each with a rid regenerated from the prompt's."""
            if obj.is_single:
                return super()._generate_all(obj)
            out = []
            for i in range(obj.batch_size):
                sub = obj[i]
                for _ in range(obj.parallel_sample_num):
                    rid = copy.copy(sub).regenerate_rid(prefix=sub.rid)
                    out.append(self._sample(sub.input_ids, sub.text, sub.sampling_params, sub.return_logprob, rid,
                                            sub.logprob_start_len, sub.lora_id))
            return out

    tm = StandInTokenizerManager(server_args, model_config, hf, AutoTokenizer.from_pretrained(path), path)
    print(f"sglang_app_0517 {path}: dtype {model_config.dtype}", flush=True)
    hs._setup_and_run_http_server(server_args, tm, TemplateManager(), None, [{"max_total_num_tokens": 4096,
                                                                           "max_req_input_len": 2048}], None)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", action="append", required=True, metavar="JSON",
                    help="one SGLang server: its launch flags as a JSON list (repeatable)")
    sglang_app.serve_many([json.loads(spec) for spec in ap.parse_args().serve], serve, _load)
