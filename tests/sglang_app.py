"""SGLang 0.5.23's real HTTP server, run on CPU over a tiny HF model (issue 14's contract harness).

Run as `python -m tests.sglang_app --serve '["--model-path", DIR, "--port", P, ...]' [--serve ...]`
(each the flags reflow's launcher gives `sglang.launch_server`): one forked process per server,
each serving `sglang.srt.entrypoints.http_server.app` through SGLang's own start-up code
(`prepare_server_args`, `publish`, `_setup_and_run_http_server`: uvicorn, its api-key
middleware, its lifespan). What is SGLang's and what stands in:

- Real: the FastAPI app and every route handler, the request structs (`io_struct`, parsed by
  FastAPI from the body), the /generate schema gate, `SamplingParams` normalize/verify,
  /server_info (`build_server_info`), /model_info; weight sessions and tensor updates run through
  the scheduler's `SchedulerWeightUpdaterManager` (session checks, messages, weight-version
  record) and the model runner's `WeightUpdater.update_weights_from_tensor` (flattened-bucket
  rebuild with `FlattenedTensorBucket`), payloads unpickled as `TpModelWorker.deserialize_own_rank`
  does (`MultiprocessingSerializer` + `SafeUnpickler`; that module imports the scheduler, so its
  two lines are restated over the same calls); `get_weights_by_name` goes through the runner's
  `WeightExporter.get_weights_by_name`, which calls the model's method where it has one.
  Distributed updates: `WeightUpdater.init_weights_update_group` (`init_custom_process_group`,
  gloo here), `receive_weights_from_distributed`, `load_weights_from_distributed`,
  `destroy_weights_update_group`. Disk updates: the tokenizer manager's own request/answer path
  and `WeightUpdater.update_weights_from_disk` (SGLang's `DefaultModelLoader` reading the
  safetensors). Release/resume: the manager's `release_memory_occupation` /
  `resume_memory_occupation` (tags, buffer stash, barriers). Input logprobs: the scheduler's
  `SchedulerLogprobResultProcessor` post-processing and the manager's formatting.
- Stand-in, and why: the tokenizer manager (`StandInTokenizerManager`: the real one talks to
  scheduler processes over ZMQ, which need the GPU runtime) runs generation with transformers on
  the HF model, and computes the per-position logprobs the GPU logits processor would; the model
  object (`StandInModel`: SGLang's model classes need its GPU layers) loads HF-named tensors and
  has `get_weights_by_name` exactly when SGLang's own model class for the architecture has it
  (resolved through SGLang's ModelRegistry: the model modules import on CPU under the stand-ins,
  only running them needs the GPU layers); the memory saver (`MemorySaver`: torch_memory_saver
  unmaps CUDA memory) records what it is asked to release and resume.
- LoRA (a server launched with reflow's LoRA flags): tests/sglang_lora_side.py says what is real.
- Stand-in modules (tests/sglang_stand_ins.py): third-party packages the import graph of
  http_server reaches but that are GPU-only (triton, tvm_ffi) or not installed by `pip install
  --no-deps sglang` here. Each is used only when the real package is not importable.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
import types

from tests.sglang_stand_ins import StandInFinder, load_http_server


def sglang_model_class(architectures: list[str]):
    """SGLang's own model class for an HF config's architectures (its registry, as its loader
    resolves it). Its modules import here, but instantiating it needs the GPU runtime."""
    from sglang.srt.models.registry import ModelRegistry

    return ModelRegistry.resolve_model_cls(architectures)[0]


def _model_class():
    import torch

    class StandInModel(torch.nn.Module):
        """The served model as SGLang's runner sees it: an nn.Module with `load_weights(named)` and,
        only where SGLang's own class for the architecture has one, `get_weights_by_name` (SGLang's
        Llama has it; its Qwen2 does not: issue 14 point 1)."""

        def __init__(self, hf_model):
            super().__init__()
            self.hf = hf_model
            self.config = hf_model.config
            self.sglang_class = sglang_model_class(hf_model.config.architectures)
            if hasattr(self.sglang_class, "get_weights_by_name"):
                self.get_weights_by_name = self._get_weights_by_name

        def load_weights(self, named_tensors):
            params = dict(self.hf.named_parameters())
            with torch.no_grad():
                for name, tensor in named_tensors:
                    params[name].copy_(tensor)

        def _get_weights_by_name(self, name: str, truncate_size: int = 100, tp_size: int = 1):
            # SGLang's Llama answers float32 lists of the first truncate_size rows (llama.py).
            param = dict(self.hf.named_parameters())[name]
            return param.detach().to(torch.float32).numpy().tolist()[:truncate_size]

    return StandInModel


class MemorySaver:
    """What SGLang's TorchMemorySaverAdapter is asked to do (it is GPU-only: torch_memory_saver
    unmaps CUDA memory); the events are reported in /server_info's internal_states."""

    def __init__(self):
        self.events: list[tuple[str, str]] = []

    def pause(self, tag):
        self.events.append(("release", tag))

    def resume(self, tag):
        self.events.append(("resume", tag))


def _scheduler_side(model, model_config):
    """SGLang's scheduler-side weight code over one stand-in runner: the real
    SchedulerWeightUpdaterManager (sessions), TpModelWorker payload decoding, the model runner's
    WeightUpdater/WeightExporter methods. Only the objects holding them are stand-ins."""
    import torch.distributed as dist
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.model_executor.model_runner_components.weight_exporter import WeightExporter
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    class RunnerWeights:  # ModelRunner.weight_updater
        update_weights_from_tensor = WeightUpdater.update_weights_from_tensor
        _update_weights_from_flattened_bucket = WeightUpdater._update_weights_from_flattened_bucket
        _assert_weight_cache_inactive = WeightUpdater._assert_weight_cache_inactive
        init_weights_update_group = WeightUpdater.init_weights_update_group  # init_custom_process_group
        destroy_weights_update_group = WeightUpdater.destroy_weights_update_group
        receive_weights_from_distributed = WeightUpdater.receive_weights_from_distributed
        _receive_bucketed_weights_from_distributed = WeightUpdater._receive_bucketed_weights_from_distributed
        load_weights_from_distributed = WeightUpdater.load_weights_from_distributed
        update_weights_from_disk = WeightUpdater.update_weights_from_disk  # SGLang's DefaultModelLoader
        custom_weight_loaders: list = []
        tp_rank, device, gpu_id = 0, "cpu", 0

        @property
        def model_config(self):
            return model_config

        def __init__(self):
            self._model_update_group = {}

        def get_model(self):
            return model

        def update_model_fields(self, model, **fields):  # the runner's bookkeeping of the loaded path
            pass

        def begin_weight_update(self):  # real: unpacks in-place-quantized GPU weights; none here
            pass

        def end_weight_update(self, run_post_load: bool = False):
            pass

    class RunnerExport:  # ModelRunner.weight_exporter
        get_weights_by_name = WeightExporter.get_weights_by_name
        _weight_export_unsupported_reason = WeightExporter._weight_export_unsupported_reason
        tp_size = 1

        def get_model(self):
            return model

    class Runner:
        weight_updater, weight_exporter = RunnerWeights(), RunnerExport()

        @property
        def model(self):  # release/resume stash and restore its buffers
            return model

    class Worker:  # TpModelWorker; its module imports the scheduler (CUDA kernels), so its two
        model_runner = Runner()  # one-line methods are restated over the same SGLang calls

        def deserialize_own_rank(self, serialized_named_tensors):  # tp_worker.py: deserialize_own_rank
            monkey_patch_torch_reductions()
            return MultiprocessingSerializer.deserialize(serialized_named_tensors[get_parallel().tp_rank])

        def get_weights_by_name(self, recv_req):
            return self.model_runner.weight_exporter.get_weights_by_name(recv_req.name, recv_req.truncate_size)

        def init_weights_update_group(self, recv_req):  # tp_worker.py, same calls
            return self.model_runner.weight_updater.init_weights_update_group(
                recv_req.master_address, recv_req.master_port, recv_req.rank_offset, recv_req.world_size,
                recv_req.group_name, recv_req.backend)

        def destroy_weights_update_group(self, recv_req):
            return self.model_runner.weight_updater.destroy_weights_update_group(recv_req.group_name)

        def weight_update_runners(self):
            return [("target", self.model_runner)]

    class Scheduler:
        _engine_paused, disaggregation_mode = False, DisaggregationMode.NULL

        def record_weight_version_change(self, new_version=None):  # the scheduler's metrics only
            pass

    mgr = object.__new__(SchedulerWeightUpdaterManager)  # __post_init__ reads the GPU TP group
    for k, v in dict(tp_worker=Worker(), draft_worker=None, memory_saver_adapter=MemorySaver(), scheduler=Scheduler(),
                     metrics_collector=None, offload_tags=set(), stashed_model_static_state=None, _session=None,
                     tp_cpu_group=dist.group.WORLD, flush_cache=lambda empty_cache=False: True,
                     is_fully_idle=lambda **kw: True).items():
        setattr(mgr, k, v)
    return mgr


def _generate_one(hf, input_ids: list[int], sp, eos: int | None, return_logprob: bool, seed: int | None):
    """Token-by-token generation on the HF model; logprobs are log_softmax(logits / T) of the
    chosen token, before top-p/top-k (SGLang's semantics; greedy: plain logprobs). A minimal
    sampler (temperature and top-k only; SGLang's normalize() turns temperature 0 into top_k=1):
    sampler numerics are not the contract under test and CPU could not prove them anyway."""
    import torch

    gen = torch.Generator().manual_seed(seed if seed is not None else int(time.time_ns() % (1 << 31)))
    ids, out, lps, finish = list(input_ids), [], [], None
    for _ in range(sp.max_new_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        greedy = sp.temperature < 1e-6
        logp = torch.log_softmax(logits if greedy else logits / sp.temperature, -1)
        if greedy:
            tok = int(logits.argmax())
        else:
            probs = logp.exp()
            if sp.top_k not in (-1, None) and sp.top_k < probs.numel():
                probs[probs < probs.topk(sp.top_k).values[-1]] = 0
            tok = int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
        ids.append(tok)
        out.append(tok)
        lps.append([float(logp[tok]), tok, None])
        stops = set(sp.stop_token_ids or ())
        if (tok == eos and not sp.ignore_eos) or tok in stops:
            finish = {"type": "stop", "matched": tok}
            break
    if finish is None:
        finish = {"type": "length", "length": len(out)}
    return out, lps if return_logprob else None, finish


def _tokenizer_manager_class(scheduler_side=_scheduler_side):
    """The stand-in tokenizer manager: SGLang's TokenizerManager with its ZMQ transport replaced.

    It subclasses the real class, so the control-plane methods the routes call are SGLang's own
    (pause/continue, begin/end_weight_update, update_weights_from_tensor, get_weights_by_name,
    flush_cache, get_internal_state, config_value, the weight-version record). Its communicators
    call the scheduler-side code in-process (`_scheduler_side`) instead of sending over ZMQ;
    generate_request runs the HF model (the scheduler and its CUDA kernels do not exist on CPU)."""
    from sglang.srt.managers import io_struct
    from sglang.srt.managers.tokenizer_manager import ServerStatus, TokenizerManager
    from sglang.srt.runtime_context import get_lora
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.utils.aio_rwlock import RWLock

    from tests import sglang_lora_side

    class StandInTokenizerManager(TokenizerManager):
        def __init__(self, server_args, model_config, hf, tokenizer, model_path: str):  # no super(): it opens ZMQ
            self.server_args, self.model_config, self.hf, self.tokenizer = server_args, model_config, hf, tokenizer
            self.model_path = self.served_model_name = model_path
            self.is_generation, self.gracefully_exit = True, False
            self.server_status, self.startup_time = ServerStatus.Up, time.time()
            self.last_receive_tstamp, self.rid_to_state = 0.0, {}
            self.is_pause, self.is_pause_cond = False, asyncio.Condition()
            self.model_update_lock = RWLock()
            self.event_loop = object()  # auto_create_handle_loop: no ZMQ handle loop to start
            self.mm_processor, self.enable_metrics = None, False
            self.enable_lora = False
            if get_lora().enable_lora:  # launched with reflow's LoRA flags: SGLang's LoRA path (tests/sglang_lora_side.py)
                sglang_lora_side.attach(self, hf)
            self.scheduler = scheduler_side(_model_class()(hf), model_config)
            s = self.scheduler
            self.update_weights_from_tensor_communicator = self._direct(s.update_weights_from_tensor)
            if hasattr(s, "begin_weight_update"):  # weight sessions (0.5.23; tests/sglang_app_0517.py has none)
                self.begin_weight_update_communicator = self._direct(s.begin_weight_update)
                self.end_weight_update_communicator = self._direct(s.end_weight_update)
            self.get_weights_by_name_communicator = self._direct(s.get_weights_by_name)
            # Blocking on the trainer (rendezvous, broadcast): run off the event loop, as the real
            # scheduler runs in another process.
            self.init_weights_update_group_communicator = self._direct(s.init_weights_update_group, thread=True)
            self.update_weights_from_distributed_communicator = self._direct(s.update_weights_from_distributed,
                                                                             thread=True)
            self.destroy_weights_update_group_communicator = self._direct(s.destroy_weights_update_group, thread=True)
            self.release_memory_occupation_communicator = self._direct(s.release_memory_occupation)
            self.resume_memory_occupation_communicator = self._direct(s.resume_memory_occupation)
            self.elastic_worker_count = 1  # one scheduler answers update_weights_from_disk
            self.flush_cache_communicator = self._direct(lambda req: io_struct.FlushCacheReqOutput(success=True))
            self.update_weight_version_communicator = self._direct(lambda req: None)  # scheduler: metrics only
            self.get_internal_state_communicator = self._direct(
                lambda req: io_struct.GetInternalStateReqOutput(internal_state={
                    "stand_in": "reflow tests/sglang_app", "memory_events": list(s.memory_saver_adapter.events)}))

        @staticmethod
        def _direct(handler, thread: bool = False):
            async def communicate(obj):  # what FanOutCommunicator returns: one output per DP rank
                return [await asyncio.to_thread(handler, obj) if thread else handler(obj)]
            return communicate

        def set_server_stop_hook(self, hook):
            self._stop_hook = hook

        def is_ready(self) -> bool:
            return True

        def _dispatch_to_scheduler(self, obj):  # the ZMQ send: no scheduler process here
            if isinstance(obj, io_struct.UpdateWeightFromDiskReqInput):  # answered through the output handler
                asyncio.get_running_loop().create_task(self._disk_update(obj))

        async def _disk_update(self, obj):
            out = await asyncio.to_thread(self.scheduler.update_weights_from_disk, obj)
            self._handle_update_weights_from_disk_req_output(out)

        async def _async_dispatch_to_scheduler(self, obj):
            pass

        async def generate_request(self, obj, request=None):
            obj.normalize_batch_and_arguments()
            async with self.is_pause_cond:
                await self.is_pause_cond.wait_for(lambda: not self.is_pause)
            async with self.model_update_lock.reader_lock:
                await self._validate_and_resolve_lora(obj)  # SGLang's own: adapter names -> acquired ids, or its error
                try:
                    out = await asyncio.to_thread(self._generate_all, obj)
                finally:
                    if self.enable_lora and obj.lora_path:
                        await self.lora_registry.release(obj.lora_id)
            self.last_receive_tstamp = time.time()
            yield out[0] if obj.is_single else out

        def _generate_all(self, obj):
            """One sample per entry of SGLang's normalized request (normalize_batch_and_arguments
            expands n > 1 into n copies, copy j of prompt i at j * batch_size + i, each with its
            own rid); answered prompt-major, as the real manager answers."""
            if obj.is_single:
                entries = [(obj.input_ids, obj.text, obj.sampling_params, obj.return_logprob, obj.rid,
                            obj.logprob_start_len, obj.lora_id)]
            else:
                per = [obj.input_ids or [None] * len(obj.rid), obj.text or [None] * len(obj.rid),
                       obj.sampling_params, obj.return_logprob, obj.rid, obj.logprob_start_len,
                       obj.lora_id or [None] * len(obj.rid)]
                order = [j * obj.batch_size + i for i in range(obj.batch_size) for j in range(obj.parallel_sample_num)]
                entries = [tuple(field[k] for field in per) for k in order]
            return [self._sample(*entry) for entry in entries]

        def _input_logprobs(self, prompt: list[int], start: int, model) -> list:
            """meta_info.input_token_logprobs as SGLang builds them: the scheduler's own post-processing
            (SchedulerLogprobResultProcessor: None first, the sampling position dropped, ids clipped) and
            the tokenizer manager's own formatting, over per-position next-token logprobs of the HF model
            (what the GPU logits processor computes)."""
            import torch
            from sglang.srt.managers.scheduler_components.logprob_result_processor import (
                SchedulerLogprobResultProcessor,
            )

            with torch.no_grad():
                logits = model(torch.tensor([prompt])).logits[0].float()  # [T, V]
            logp = torch.log_softmax(logits, -1)  # [T, V]
            raw = [float(logp[k, prompt[k + 1]]) for k in range(start, len(prompt) - 1)] + [0.0]  # last: sampled
            req = types.SimpleNamespace(is_prefill_only=False, origin_input_ids=prompt, logprob_start_len=start,
                                        logprob=types.SimpleNamespace(input_token_logprobs_val=None,
                                                                      input_token_logprobs_idx=None))
            SchedulerLogprobResultProcessor(model_config=self.model_config)._process_input_token_logprobs(req, raw)
            return [list(e) for e in self.detokenize_logprob_tokens(req.logprob.input_token_logprobs_val,
                                                                     req.logprob.input_token_logprobs_idx, False)]

        def _sample(self, input_ids, text, spd, return_logprob, rid, logprob_start_len=-1, lora_id=None):
            prompt = input_ids if input_ids is not None else self.tokenizer(text)["input_ids"]
            sp = SamplingParams(**{**spd, "n": 1})
            sp.normalize(self.tokenizer)
            sp.verify(self.hf.config.vocab_size)
            model = sglang_lora_side.model_for(self, lora_id)  # the HF model, or it with the request's adapter
            out, lps, finish = _generate_one(model, prompt, sp, self.tokenizer.eos_token_id, bool(return_logprob),
                                             sp.sampling_seed)
            meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(prompt), "completion_tokens": len(out),
                    "cached_tokens": 0, "weight_version": self.config_value("weight_version")}
            if return_logprob:
                meta["output_token_logprobs"] = lps
                start = -1 if logprob_start_len is None else logprob_start_len
                meta["input_token_logprobs"] = self._input_logprobs(prompt, start, model) if 0 <= start < len(prompt) else []
            return {"text": self.tokenizer.decode(out), "output_ids": out, "meta_info": meta}

    return StandInTokenizerManager


def serve(hs, argv: list[str]) -> None:
    """Start SGLang's own HTTP server (blocking) for launch flags `argv` (those reflow's launcher
    passes to `sglang.launch_server`); `hs` is the imported http_server module."""
    import tempfile

    import torch
    import torch.distributed as dist
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.parser.template_manager import TemplateManager
    from sglang.srt.runtime_context import SpawnRanks, get_model, publish
    from sglang.srt.server_args import prepare_server_args
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    server_args = prepare_server_args([*argv, "--device", "cpu"])
    publish(server_args, role="tokenizer", ranks=SpawnRanks(world_rank=0))
    # A one-rank gloo group: the scheduler's weight code ends each call with a TP barrier.
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp(prefix='sglang_app_')}", rank=0,
                            world_size=1)
    path = get_model().model_path
    model_config = ModelConfig.from_server_args(server_args)  # SGLang's own: resolves --dtype as its loader does
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=model_config.dtype).eval()
    tm = _tokenizer_manager_class()(server_args, model_config, hf, AutoTokenizer.from_pretrained(path), path)
    scheduler_info = {"max_total_num_tokens": 4096, "max_req_input_len": 2048}
    print(f"sglang_app {path}: stand-in modules used: {sorted(StandInFinder.used)}; SGLang model class "
          f"{tm.scheduler.tp_worker.model_runner.weight_updater.get_model().sglang_class.__name__}, "
          f"dtype {model_config.dtype}", flush=True)
    hs._setup_and_run_http_server(server_args, tm, TemplateManager(), None, [scheduler_info], None)


def serve_many(launches: list[list[str]], serve_one=None, load=load_http_server) -> None:
    """One server process per list of launch flags, forked after the one slow import (~10 s of CPU
    each otherwise). SIGTERM to this process stops them all; each child also gets SIGTERM if
    this process dies (PR_SET_PDEATHSIG). SIGUSR1 has every server print its threads' stacks."""
    import ctypes
    import faulthandler
    import os
    import signal
    from pathlib import Path

    children: list[int] = []

    def dump(signum, frame):
        for child in children:
            print(f"sglang_app: threads of server process {child}:", flush=True)
            os.kill(child, signal.SIGUSR1)
            time.sleep(0.2)  # one dump after the other in the shared log

    signal.signal(signal.SIGUSR1, dump)  # set before the slow import: a dump asked early must not kill us
    hs = load()
    for argv in launches:  # SGLang's model registry resolves lazily: do it once, before forking
        path = argv[argv.index("--model-path") + 1]
        sglang_model_class(json.loads((Path(path) / "config.json").read_text())["architectures"])
    for argv in launches:
        pid = os.fork()
        if pid == 0:
            ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
            faulthandler.register(signal.SIGUSR1, all_threads=True)  # the harness's ask for stacks on a hang
            try:
                (serve_one or serve)(hs, argv)
            finally:
                os._exit(0)
        children.append(pid)

    def stop(signum, frame):
        for child in children:
            os.kill(child, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    for child in children:
        os.waitpid(child, 0)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", action="append", required=True, metavar="JSON",
                    help="one SGLang server: its launch flags as a JSON list (repeatable)")
    serve_many([json.loads(spec) for spec in ap.parse_args().serve])
