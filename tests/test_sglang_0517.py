"""reflow's SGLang backend against SGLang 0.5.17's own code: the GPU machine's SGLang (issue 57).

reflow is written against 0.5.23 (tests/test_sglang_real_app.py); 0.5.17 is the newest SGLang that pins the GPU
machine's torch 2.11. Here its wheel (tests/sglang_0517.py) is read in this process where only torch is needed,
and its real HTTP app is served in a child process (tests/sglang_app_0517.py) for the requests and endpoints
that differ between the two: no weight-update sessions, no contract modules, a receive bucket without `.empty`.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from reflow.engines.rollout_client import EngineClient, EngineError, generate_batch
from reflow.engines.sglang import contract as sglang_contract
from reflow.engines.weights import group as weight_group
from reflow.engines.weights.buckets import SharedBucket
from reflow.engines.weights.push import close_weight_groups, push_weights, update_window
from reflow.engines.weights.settings import PushSettings
from tests import sglang_0517
from tests.reference import greedy_reference
from tests.sglang_backends import KEY, build, probe_of, pushed, stop

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


def test_launcher_flags_are_fields_of_0517s_server_args():
    """Every flag reflow's launcher passes (SERVER_ARG_TYPES, LoRA's included, which the served tests below do not
    launch with) is a field of 0.5.17's ServerArgs of the same type (0.5.17 declares them in server_args.py)."""
    from tests.test_sglang_engine import check_field_table, wheel_fields

    check_field_table(wheel_fields(TARGET / "sglang"), sglang_0517.VERSION)


# ---------------------------------------------------------------- 0.5.17's real app (one child process)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama_0517")
    build("llama", d)
    return d


SERVED = pytest.mark.slow  # the tests below share a child process serving 0.5.17's app for the module


@pytest.fixture(scope="module")
def urls(model_dir, tmp_path_factory):
    """Two SGLang 0.5.17 app servers of a tiny Llama (SGLang's Llama reads weights back: verify=full)."""
    proc, urls = sglang_0517.start_apps(model_dir, 2, tmp_path_factory.mktemp("sglang_0517") / "servers.log")
    try:
        yield urls
    finally:
        close_weight_groups()  # the distributed push's group, kept open for a next push
        stop(proc)


def _clients(urls, k=None) -> list[EngineClient]:
    return [EngineClient(u, timeout=60, api_key=KEY) for u in urls[:k]]


def _generation_follows(clients, model, version: str) -> None:
    prompt = [5, 6, 7, 8]
    for c in clients:
        out = c.generate(input_ids=prompt, sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert out["meta_info"]["weight_version"] == version == c.model_info()["weight_version"]
        assert out["output_ids"] == greedy_reference(model, prompt, 4, eos=())


@SERVED
@pytest.mark.parametrize("mode", ["tensor", "distributed", "disk"])
def test_every_push_mode_lands_on_0517_which_has_no_weight_sessions(urls, mode, tmp_path):
    """0.5.17 serves no /begin_weight_update or /end_weight_update (404): the pusher finds that out from the 404
    and pushes inside its pause window alone, which is how 0.5.17 keeps an update whole (a paused manager
    updates at once; new requests wait on the pause). Every mode lands, the read-back check passes, and
    generation runs again on the pushed weights."""
    from reflow.engines.weights.push import publish_weights
    from reflow.rl.demo_policy import save_policy

    clients = _clients(urls)
    model, tok, named = pushed("llama", seed={"tensor": 1, "distributed": 2, "disk": 3}[mode])
    version = f"{mode}-{time.time_ns()}"
    path = publish_weights(lambda out: save_policy(model, tok, out), str(tmp_path), version).path if mode == "disk" else None
    stats = push_weights(clients, named, version, PushSettings(mode=mode, backend="gloo", verify="full",
                                                               bucket_bytes=16 << 10),
                         model_path=path, probe=probe_of(model))
    assert stats["mode"] == mode and stats["engines"] == 2 and stats["verify_method"] == "weights"  # read back
    _generation_follows(clients, model, version)


@SERVED
def test_a_request_sent_inside_the_window_decodes_on_the_pushed_weights(urls):
    """What keeps an update whole on 0.5.17, which has no session: inside the pusher's window (paused) a new
    request waits, the paused manager loads the update at once, and the request decodes on the pushed weights
    once the window closes."""
    c = _clients(urls, 1)[0]
    model, _, named = pushed("llama", seed=4)
    version, prompt, done = f"window-{time.time_ns()}", [5, 6, 7, 8], []
    request = threading.Thread(target=lambda: done.append(c.generate(input_ids=prompt, sampling_params={
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True})))
    with update_window([c]):
        assert c.weight_sessions is False  # learnt from the 404
        request.start()
        time.sleep(0.5)
        bucket = SharedBucket(named)
        out = c.update_weights_from_tensor(bucket.payloads(1), "flattened_bucket", True, version)
        assert out["success"] and not done, out
    request.join(60)
    assert done[0]["meta_info"]["weight_version"] == version
    assert done[0]["output_ids"] == greedy_reference(model, prompt, 4, eos=())


@SERVED
def test_take_over_of_a_0517_engine_skips_the_session_it_does_not_have(urls):
    """A later flow run takes over an engine a killed one left paused with its memory released
    (EngineClient.take_over): 0.5.17's 404 on /end_weight_update is skipped like the 400 of an engine with no
    session open; the memory comes back and generation runs."""
    c = _clients(urls, 1)[0]
    c.pause_generation("abort")
    c.release_memory_occupation(["weights", "kv_cache"])
    fresh = _clients(urls, 1)[0]
    assert fresh.take_over(["weights", "kv_cache"]) == ["resume weights", "resume kv_cache"]
    assert fresh.weight_sessions is False
    out = fresh.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 2


@SERVED
def test_a_404_names_the_sglang_that_lacks_the_endpoint(urls):
    """An endpoint the server does not serve (here 0.5.17's missing session) is a 404 whose message names the
    server's SGLang version and the versions reflow is tested against, so a run on another SGLang says why."""
    with pytest.raises(EngineError) as e:
        _clients(urls, 1)[0].begin_weight_update()
    assert e.value.status == 404
    assert f"SGLang {sglang_0517.VERSION}" in e.value.message and "0.5.23" in e.value.message


@SERVED
def test_batches_as_reflow_sends_them(urls):
    """0.5.17 has no /generate schema gate (entrypoints/api_contract); its GenerateReqInput normalizes reflow's
    batches: n samples per prompt, prompt-major, and seeded ones as one entry per sample."""
    clients = _clients(urls)
    prompts, sp = [[5, 6, 7], [8, 9]], {"max_new_tokens": 3, "temperature": 0.7, "ignore_eos": True}
    outs = generate_batch(clients, prompts, sp, n=2)
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [3, 3, 2, 2]
    assert len({o["meta_info"]["id"] for o in outs}) == 4
    seeded = [generate_batch(clients, prompts, sp, n=2, seeds=[1, 2, 3, 4]) for _ in range(2)]
    assert [o["output_ids"] for o in seeded[0]] == [o["output_ids"] for o in seeded[1]]
