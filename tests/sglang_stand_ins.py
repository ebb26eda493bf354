"""Stand-ins for the modules SGLang 0.5.23's http_server reaches but that cannot import on a CPU
machine (GPU-only, or not installed by `pip install --no-deps sglang`), and the import of the app
with them (`load_http_server`). Used by tests/sglang_app.py, which says what is real and what stands in."""
from __future__ import annotations

import asyncio
import base64
import importlib
import importlib.abc
import importlib.machinery
import sys
import types

# Third-party modules http_server's import graph reaches that cannot import here. A stand-in
# module answers any attribute with an inert placeholder class; none of them is on a path the
# tests exercise (they serve kernels, ZMQ transport, multimodal and OpenAI-protocol routes).
STAND_IN_MODULES = {
    "triton": "GPU-only kernel compiler",
    "tvm_ffi": "GPU kernel FFI",
    "zmq": "scheduler transport (not installed; the stand-in tokenizer manager needs none)",
    "pybase64": "not installed; replaced by the stdlib base64 (same b64decode(validate=True))",
    "torchvision": "multimodal processors (not installed)",
    "IPython": "notebook helpers (not installed)",
    "sentencepiece": "tokenizer backend (not installed; the tiny models use a fast tokenizer)",
    "compressed_tensors": "quantization configs (not installed)",
    "gguf": "GGUF loader (not installed)",
    "openai": "OpenAI protocol types for /v1 routes (not installed)",
    "partial_json_parser": "tool-call parsing (not installed)",
    "xgrammar": "grammar backend (not installed)",
    "soundfile": "audio (not installed)",
    "setproctitle": "process titles (not installed)",
    "dill": "custom logit processors (not installed; pickle stands in)",
    "uvloop": "not installed; asyncio's own loop stands in",
    "python_multipart": "form routes (not installed)",
}


class _PlaceholderMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _PlaceholderMeta(name, (_Placeholder,), {})

    def __getitem__(cls, key):
        return cls

    def __or__(cls, other):
        return cls

    def __ror__(cls, other):
        return cls

    def __iter__(cls):
        return iter(())


class _Placeholder(metaclass=_PlaceholderMeta):
    """What a stand-in module hands out: subclassable, callable, usable in pydantic annotations."""

    def __init__(self, *args, **kwargs):
        pass

    def __init_subclass__(cls, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Placeholder()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        from pydantic_core import core_schema

        return core_schema.any_schema()


class _StandInModule(types.ModuleType):
    __version__ = "3.4.0"  # read by version checks (triton >= 3)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _PlaceholderMeta(name, (_Placeholder,), {})


class _NoDriver:
    def __getattr__(self, name):
        raise RuntimeError("0 active drivers ([]). There should only be one.")  # triton's text without a GPU


def _special(name: str) -> types.ModuleType | None:
    """Stand-ins that must behave, not just exist."""
    import pickle

    mod = _StandInModule(name)
    mod.__path__ = []
    if name == "uvloop":
        mod.EventLoopPolicy = asyncio.DefaultEventLoopPolicy
        mod.new_event_loop = asyncio.new_event_loop
        mod.install = lambda: None
    elif name == "pybase64":
        mod.b64decode, mod.b64encode = base64.b64decode, base64.b64encode
    elif name == "dill":
        mod.dumps, mod.loads = pickle.dumps, pickle.loads
    elif name == "python_multipart":
        mod.__version__ = "0.0.99"
    elif name == "triton":  # no GPU driver: as real triton on a CPU machine, asking for one raises
        mod.runtime = types.SimpleNamespace(driver=_NoDriver())  # (0.5.17's fla/utils.py then picks "cpu")
    else:
        return None
    return mod


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on sys.meta_path: only names no real finder found, only under STAND_IN_MODULES."""

    used: set[str] = set()

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] not in STAND_IN_MODULES:
            return None
        self.used.add(fullname.split(".")[0])
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        mod = _special(spec.name) or _StandInModule(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module):
        pass


def load_http_server():
    """Import SGLang's http_server with the stand-ins; returns the module."""
    from reflow.engines.sglang import contract

    if contract.bucket_code() is None:  # registers the bare sglang package (any version)
        raise RuntimeError("sglang is not installed")
    # torch and transformers probe for triton once and cache the answer: let them see none.
    import torch._dynamo  # noqa: F401
    import torch._functorch.aot_autograd  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    import torch.utils.flop_counter  # noqa: F401
    import transformers.modeling_utils  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoProcessor  # noqa: F401

    sys.meta_path.append(StandInFinder())
    # The engine module launches scheduler/detokenizer processes (GPU runtime); http_server only
    # imports names from it for launch_server, which is not used here.
    engine = _StandInModule("sglang.srt.entrypoints.engine")
    sys.modules["sglang.srt.entrypoints.engine"] = engine
    return importlib.import_module("sglang.srt.entrypoints.http_server")
