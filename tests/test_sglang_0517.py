"""reflow's SGLang backend against SGLang 0.5.17's own code: the GPU machine's SGLang (issue 57).

reflow is written against 0.5.23 (tests/test_sglang_real_app.py); 0.5.17 is the newest SGLang that pins the GPU
machine's torch 2.11. Here its wheel (tests/sglang_0517.py) is read in this process where only torch is needed,
and its real HTTP app is served in a child process (tests/sglang_app_0517.py) for the requests and endpoints
that differ between the two: no weight-update sessions, no contract modules, a receive bucket without `.empty`.
"""
from __future__ import annotations

import pytest
import torch

from reflow.engines.sglang import contract as sglang_contract
from reflow.engines.weights import group as weight_group
from tests import sglang_0517

TARGET = sglang_0517.target()
pytestmark = pytest.mark.skipif(TARGET is None, reason=f"no SGLang {sglang_0517.VERSION}: {sglang_0517.why_missing()}")


@pytest.fixture
def sglang_0517_here():
    """0.5.17's sglang in this process (its modules dropped again after), no contract loaded from the venv's."""
    sglang_contract.load.cache_clear()
    sglang_contract.bucket_code.cache_clear()
    try:
        with sglang_0517.imported_first(TARGET):
            yield
    finally:
        sglang_contract.load.cache_clear()
        sglang_contract.bucket_code.cache_clear()


def test_contract_is_none_where_sglang_predates_it_and_bucket_code_is_its_own(sglang_0517_here):
    """0.5.17 has no sglang.api.v1.api_types / entrypoints/api_contract (they came in 0.5.2x): load() says
    there is no contract to check against (None) instead of raising, and the bucket classes, which 0.5.17
    has, still come from it."""
    assert sglang_contract.load() is None
    code = sglang_contract.bucket_code()
    assert code.version == sglang_0517.VERSION
    assert code.FlattenedTensorBucket.__module__ == "sglang.srt.weight_sync.tensor_bucket"
    assert str(TARGET) in __import__(code.FlattenedTensorBucket.__module__, fromlist=["x"]).__file__


def test_distributed_receive_uses_sglang_0517s_bucket_which_has_no_empty(sglang_0517_here):
    """The receiving side of update_weights_from_distributed (group.receive, the embedded engine's) builds its
    buffer as 0.5.17's own receiver does (`FlattenedTensorBucket(named_tensors=<empty tensors>)`) where the
    class has no `.empty`; the trainer's packed buffer fits it."""
    code = sglang_contract.bucket_code()
    assert not hasattr(code.FlattenedTensorBucket, "empty")
    named = [("a", torch.randn(3)), ("b", torch.randn(5, dtype=torch.bfloat16)), ("c", torch.arange(4))]
    flat, names, dtypes, shapes = weight_group.pack(weight_group.bucket_order(named))
    bucket = weight_group._empty_bucket(names, [getattr(torch, d) for d in dtypes], shapes, "cpu")
    assert isinstance(bucket, code.FlattenedTensorBucket)
    bucket.get_flattened_tensor().copy_(flat)
    got = dict(bucket.reconstruct_tensors())
    assert all(torch.equal(got[n], t) for n, t in named)
