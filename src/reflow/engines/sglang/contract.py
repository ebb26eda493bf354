"""SGLang 0.5.23's own contract code, loaded without SGLang's runtime (see docs/ENGINE_CONTRACT.md).

`import sglang` fails on a machine without triton/CUDA, but the modules that define the HTTP
contract only need torch and msgspec. Registering a bare `sglang` package (no __init__ run) with
the installed folder as its path lets exactly those import:
  - `sglang.srt.entrypoints.api_contract.generate_contract_error`: the /generate schema gate
    (built on `sglang.api.v1.api_types.GenerateRequest`), with serde's error texts;
  - `sglang.api.v1.api_types.GenerateResponse`: the response schema;
  - `sglang.srt.sampling.sampling_params.SamplingParams`: normalize() + verify(vocab_size);
  - `sglang.srt.weight_sync.tensor_bucket.FlattenedTensorBucket` (+ its metadata class);
  - `sglang.srt.utils.auth`: what `--api-key` installs (`decide_request_auth`,
    `add_api_key_middleware`), which tests hold reflow's own guard (engines/http_serve.py) to. Its
    package `sglang.srt.utils` needs the runtime, so without it the module file is loaded alone
    (it imports nothing of sglang's).

`load()` returns None when sglang is not installed (it is a test dependency, installed with
--no-deps), or when the installed one predates these modules (0.5.17, the GPU machine's SGLang, has
neither api_types nor api_contract); callers then fall back to reflow's own checks. `bucket_code()` gives
the bucket classes of any installed sglang, 0.5.17's included. When the real runtime is importable
(a GPU box with the full sglang install), the normal package is used as is.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass
from typing import Any

PINNED_VERSION = "0.5.23"
_CONTRACT_MODULES = ("sglang.api.v1.api_types", "sglang.srt.entrypoints.api_contract")


@dataclass(frozen=True)
class Contract:
    """Handles on SGLang's own classes and functions (see the module docstring)."""

    version: str
    generate_contract_error: Any  # (parsed JSON body) -> str | None
    GenerateRequest: Any
    GenerateResponse: Any
    JsonContractError: type
    SamplingParams: Any
    FlattenedTensorBucket: Any
    FlattenedTensorMetadata: Any
    auth: Any = None  # the module sglang.srt.utils.auth

    def check_response(self, body: dict) -> None:
        """Raise JsonContractError when one /generate response item breaks SGLang's schema."""
        self.GenerateResponse.from_json_value(body)

    def sampling_params(self, sp: dict, tokenizer, vocab_size: int):
        """SGLang's own object for one sampling_params dict, normalized and verified as its
        tokenizer manager does (raises ValueError with SGLang's message)."""
        obj = self.SamplingParams(**sp)
        obj.normalize(tokenizer)
        obj.verify(vocab_size)
        return obj


def _register_bare_package() -> bool:
    """Put an empty `sglang` package into sys.modules (unless one is there); False if not installed."""
    if "sglang" in sys.modules:
        return True
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return False
    pkg = types.ModuleType("sglang")
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__file__ = None
    sys.modules["sglang"] = pkg
    return True


def _installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "unknown"


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # deliberate: a parent package is missing, so the module is too
        return False


@dataclass(frozen=True)
class BucketCode:
    """SGLang's weight-bucket classes, from whichever sglang is installed (0.5.17's have no `.empty`)."""

    version: str
    FlattenedTensorBucket: Any
    FlattenedTensorMetadata: Any


@functools.lru_cache(maxsize=1)
def bucket_code() -> BucketCode | None:
    """SGLang's FlattenedTensorBucket and its metadata class, or None when sglang is not installed."""
    if not _register_bare_package():
        return None
    tb = importlib.import_module("sglang.srt.weight_sync.tensor_bucket")
    return BucketCode(_installed_version(), tb.FlattenedTensorBucket, tb.FlattenedTensorMetadata)


@functools.lru_cache(maxsize=1)
def load() -> Contract | None:
    """SGLang's contract code, or None when sglang is not installed or predates it (0.5.17 has neither
    sglang.api.v1.api_types nor sglang.srt.entrypoints.api_contract)."""
    if not _register_bare_package() or not all(map(_has_module, _CONTRACT_MODULES)):
        return None
    api, gate = map(importlib.import_module, _CONTRACT_MODULES)
    sp = importlib.import_module("sglang.srt.sampling.sampling_params")
    tb = bucket_code()
    assert tb is not None  # the bare package registered above
    return Contract(version=tb.version, generate_contract_error=gate.generate_contract_error,
                    GenerateRequest=api.GenerateRequest, GenerateResponse=api.GenerateResponse,
                    JsonContractError=api.JsonContractError, SamplingParams=sp.SamplingParams,
                    FlattenedTensorBucket=tb.FlattenedTensorBucket,
                    FlattenedTensorMetadata=tb.FlattenedTensorMetadata, auth=_auth_module())


def _auth_module():
    """sglang.srt.utils.auth: imported normally when its package imports, else its file on its own."""
    name = "sglang.srt.utils.auth"
    try:
        return importlib.import_module(name)
    except ImportError:  # deliberate: sglang.srt.utils/__init__ needs the GPU runtime (pybase64, triton...)
        pass
    path = f"{installed_root()}/srt/utils/auth.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def installed_root() -> str | None:
    """The installed sglang package folder (for tests that read its source), or None."""
    spec = importlib.util.find_spec("sglang") if "sglang" not in sys.modules else None
    if spec is not None and spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    mod = sys.modules.get("sglang")
    return list(mod.__path__)[0] if mod is not None and getattr(mod, "__path__", None) else None
