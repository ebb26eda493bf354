"""The embedded engine judged by SGLang 0.5.23's own contract code (sglang installed --no-deps).

Expected texts are computed by SGLang's code in this test, not copied: if a new SGLang changes a
message, the test follows it; if the engine stops using SGLang's code, the test fails.
"""
from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from reflow.engines.embedded.contract import NO_INPUT
from reflow.engines.http_serve import bearer, new_api_key
from reflow.engines.rollout_client import EngineClient
from reflow.engines.sglang import contract as sglang_contract
from tests.engine_fixtures import served

CONTRACT = sglang_contract.load()
KEY = new_api_key()  # its auth against SGLang's own --api-key code: tests/test_http_auth.py
pytestmark = pytest.mark.skipif(CONTRACT is None, reason="sglang==0.5.23 is not installed (make setup installs it)")


@pytest.fixture(scope="module")
def engine(tiny_policy):
    with served(tiny_policy, "contract-engine", KEY) as e:
        yield e


def _post(engine, body) -> tuple[int, str]:
    r = httpx.post(engine.url() + "/generate", json=body, headers=bearer(KEY))
    err = r.json().get("error") if r.status_code != 200 else None
    return r.status_code, err if isinstance(err, str) or err is None else err["message"]


def test_pinned_version_and_sglangs_own_classes():
    assert CONTRACT.version == sglang_contract.PINNED_VERSION
    assert CONTRACT.GenerateRequest.__module__ == "sglang.api.v1.api_types"
    assert CONTRACT.SamplingParams.__module__ == "sglang.srt.sampling.sampling_params"
    assert CONTRACT.FlattenedTensorBucket.__module__ == "sglang.srt.weight_sync.tensor_bucket"


@pytest.mark.parametrize("body", [
    {"input_ids": [5, 6], "sampling_params": {"foo": 1}},  # unknown key
    {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": "5"}},  # wrong type
    {"input_ids": [5, 6], "sampling_params": {"temperature": "hot"}},
    {"input_ids": "abc"},
    {"input_ids": [5, 6], "stream": "yes"},
])
def test_schema_violations_get_sglangs_gate_text(engine, body):
    want = CONTRACT.generate_contract_error(body)
    assert want is not None
    assert _post(engine, body) == (400, want)


@pytest.mark.parametrize("sp", [{"top_p": 0.0}, {"top_p": 1.5}, {"temperature": -1.0}, {"min_p": 2.0},
                                {"top_k": 0}, {"min_new_tokens": 9, "max_new_tokens": 4}])
def test_range_violations_get_sglangs_verify_text(engine, tiny_policy, sp):
    from reflow.engines.hf_io import load_tokenizer

    with pytest.raises(ValueError) as e:  # what SGLang's tokenizer manager would raise
        CONTRACT.sampling_params(sp, load_tokenizer(str(tiny_policy)), 10_000)
    assert _post(engine, {"input_ids": [5, 6], "sampling_params": sp}) == (400, str(e.value))


def test_no_input_is_sglangs_text(engine):
    root = Path(sglang_contract.installed_root())
    assert NO_INPUT in (root / "srt" / "managers" / "io_struct.py").read_text()  # io_struct needs triton
    assert _post(engine, {"sampling_params": {"max_new_tokens": 2}}) == (400, NO_INPUT)


@pytest.mark.parametrize("body", [
    {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True},
    {"input_ids": [[5, 6], [7, 8, 9]], "sampling_params": {"max_new_tokens": 3, "n": 2}},
    {"text": "1+1=", "sampling_params": {"max_new_tokens": 3, "temperature": 0.0, "stop": ["="]}},
    {"input_ids": [[5, 6]], "sampling_params": {"max_new_tokens": 0}, "return_logprob": [True]},
])
def test_every_response_validates_against_sglangs_response_type(engine, body):
    r = httpx.post(engine.url() + "/generate", json=body, headers=bearer(KEY))
    assert r.status_code == 200, r.text
    items = r.json() if isinstance(r.json(), list) else [r.json()]
    for item in items:
        decoded = CONTRACT.GenerateResponse.from_json_value(item)
        assert decoded.meta_info.finish_reason is not None and decoded.output_ids is not None
        assert decoded.meta_info.weight_version == "default"


def test_a_response_breaking_the_schema_is_a_500(engine, monkeypatch):
    import reflow.engines.embedded.server as server

    real = server.make_response
    monkeypatch.setattr(server, "make_response", lambda *a: {**real(*a), "output_ids": ["x"]})
    status, message = _post(engine, {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}})
    assert status == 500 and "SGLang's schema rejects" in message


def test_client_sees_sglangs_message(engine):
    from reflow.engines.rollout_client import EngineError

    with pytest.raises(EngineError, match="unknown field `foo`"):
        EngineClient(engine.url(), api_key=KEY).generate(input_ids=[5], sampling_params={"foo": 1})


def test_loader_returns_none_without_sglang(monkeypatch):
    import importlib.util

    monkeypatch.delitem(sys.modules, "sglang")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    sglang_contract.load.cache_clear()
    try:
        assert sglang_contract.load() is None
    finally:
        monkeypatch.undo()
        sglang_contract.load.cache_clear()
    assert sglang_contract.load() is not None
