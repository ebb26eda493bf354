"""The embedded engine against SGLang's contract: numbers, shapes, errors, weight sync.

Most tests run a real EmbeddedEngine (uvicorn on a free port) in this process; one runs the
engine and a pusher as two Ray actors to prove the shared-memory handles cross processes.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from reflow.engines import rollout_stages as ro
from reflow.engines.embedded.engine import EmbeddedEngine
from reflow.engines.embedded.generator import Generator
from reflow.engines.hf_io import load_causal_lm, load_tokenizer, set_tf32
from reflow.engines.http_serve import bearer, new_api_key
from reflow.engines.rollout_client import EngineClient, EngineError, generate_batch
from reflow.engines.rollout_fns import RolloutSettings
from reflow.engines.weights.buckets import BucketError, flatten, load_payload, serialize_bucket, unflatten
from reflow.engines.weights.mapped import MAPPED
from reflow.engines.weights.push import WeightSyncError, push_weights, verify_weights
from reflow.engines.weights.settings import PushSettings
from reflow.rl.demo_policy import build_model
from reflow.tasks.faults import is_transient_fault
from tests.engine_fixtures import served
from tests.reference import greedy_reference

KEY = new_api_key()  # the engines' API key (tests/test_http_auth.py: what it guards)
AUTH = bearer(KEY)
PROMPTS = ["12+34=", "5+6=", "(3+4)*5=", "7*8=", "99-1=", "1+1=", "2*(3+4)=", "10+20+30="]


@pytest.fixture(scope="module")
def tok(tiny_policy):
    return load_tokenizer(str(tiny_policy))


@pytest.fixture(scope="module")
def model(tiny_policy):
    return load_causal_lm(str(tiny_policy))


@pytest.fixture(scope="module", params=["eager", "static"])
def gen(request, model, tok):
    """Both decoders answer every generation test (static: the GPU path's cache and steps, without graphs)."""
    return Generator(model, tok, max_batch_size=64, threads=1, decoder=request.param)


@pytest.fixture(scope="module")
def engine(tiny_policy):
    with served(tiny_policy, "test-engine", KEY) as e:
        yield e


@pytest.fixture()
def fresh_engine(tiny_policy):
    """An engine whose weights a test may change."""
    e = EmbeddedEngine(str(tiny_policy), "scratch-engine", threads=1, api_key=KEY)
    e.ready()
    yield e
    e.shutdown()


@pytest.fixture()
def client(engine):
    return EngineClient(engine.url(), timeout=60, api_key=KEY)


def _ids(tok, texts):
    return [tok.encode(t) for t in texts]


_argmax_loop = greedy_reference  # plain full-sequence greedy loop (tests/reference.py)


# ---------------------------------------------------------------- generation numbers


def test_greedy_equals_argmax_loop(gen, model, tok):
    prompts = _ids(tok, PROMPTS)
    recs = gen.generate(prompts, {"temperature": 0.0, "max_new_tokens": 24})
    for p, r in zip(prompts, recs):
        assert r["output_ids"] == _argmax_loop(model, p, 24, gen.eos_ids)


def test_logprobs_are_log_softmax_of_tempered_logits_before_filtering(gen, model, tok):
    prompts = _ids(tok, PROMPTS[:3])
    T, k = 0.7, 5
    sp = {"temperature": T, "top_p": 0.9, "top_k": k, "min_p": 0.02, "max_new_tokens": 12, "sampling_seed": 11}
    for sp_ in (sp, {"temperature": 0.0, "max_new_tokens": 12}):
        recs = gen.generate(prompts, sp_, n=2)
        for i, r in enumerate(recs):
            p, out = prompts[i // 2], r["output_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([p + out])).logits[0, len(p) - 1:-1].float()  # [L, V]
            t = sp_["temperature"] or 1.0
            want = torch.log_softmax(logits / t, -1).gather(-1, torch.tensor(out)[:, None])[:, 0]  # [L]
            got = torch.tensor([lp for lp, _, _ in r["output_token_logprobs"]])
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            assert [tid for _, tid, _ in r["output_token_logprobs"]] == out
            if sp_["temperature"]:  # every sampled token survived top-k
                assert all(o in logits[j].topk(k).indices for j, o in enumerate(out))


@pytest.mark.parametrize("decoder", ["eager", "static"])
def test_fp32_lm_head_engine_samples_from_float32_logits(tiny_policy, tok, decoder):
    """EmbeddedEngine(fp32_lm_head=True) on a bf16 model: its head gives float32 logits, and each decoder's
    log-probs are those of that head (the trainer's, with trainer.fp32_lm_head)."""
    from reflow.engines.hf_io import fp32_lm_head

    ref = fp32_lm_head(load_causal_lm(str(tiny_policy), dtype="bf16"))
    e = EmbeddedEngine(str(tiny_policy), "fp32-head-engine", threads=1, api_key=KEY, dtype="bf16",
                       fp32_lm_head=True, decoder=decoder, tf32=decoder == "static")
    try:
        # trainer.tf32 reaches the engine's process (this one: the flag is restored below) and its /server_info
        precision = "high" if decoder == "static" else "highest"
        assert torch.get_float32_matmul_precision() == precision
        assert httpx.get(f"{e.url()}/server_info", headers=AUTH).json()["matmul_precision"] == precision
        head = e.generator.model.get_output_embeddings()
        assert head.weight.dtype == torch.bfloat16
        assert head(torch.ones(1, head.in_features, dtype=torch.bfloat16)).dtype == torch.float32
        prompts = _ids(tok, PROMPTS[:3])
        recs = e.generator.generate(prompts, {"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": 3})
        for p, r in zip(prompts, recs):
            out = r["output_ids"]
            with torch.no_grad():
                logits = ref(torch.tensor([p + out])).logits[0, len(p) - 1:-1]  # [L, V] float32
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out)[:, None])[:, 0]
            got = torch.tensor([lp for lp, _, _ in r["output_token_logprobs"]])
            torch.testing.assert_close(got, want, rtol=0, atol=0.05)  # bf16 layers: the same ops, other kernels
    finally:
        e.shutdown()
        set_tf32(False)


def test_decode_fusion_reaches_the_static_decoder_on_gpus_only(tiny_policy, tok):
    """rollout.decode_fusion=auto compiles the static decoder's elementwise work with inductor where the engine holds a
    GPU and nowhere else (CPU engines decode eagerly); the backend reaches the engine's generator and its
    /server_info, and a fused static decoder answers as the eager one (aot_eager here: the same wiring, no codegen)."""
    from reflow.infra.cluster.runtime import decode_fusion
    from reflow.infra.config.schema import load_config

    cfg = load_config(None, [])
    assert (cfg.rollout.decode_fusion, decode_fusion(cfg, True), decode_fusion(cfg, False)) == ("auto", "inductor", None)
    assert decode_fusion(load_config(None, ["rollout.decode_fusion=off"]), True) is None
    e = EmbeddedEngine(str(tiny_policy), "fused-engine", threads=1, api_key=KEY, decoder="static",
                       decode_fusion="aot_eager", kv_reserve=0.5)
    try:
        info = httpx.get(f"{e.url()}/server_info", headers=AUTH).json()
        assert info["decode_fusion"] == "aot_eager"
        assert (info["kv_reserve"], e.generator.kv_reserve) == (0.5, 0.5)  # rollout.kv_reserve reaches the generator
        assert info["kv_moves"] == {"grown": 0, "moved": 0, "preempted": 0}
        prompts = _ids(tok, PROMPTS[:3])
        params = {"temperature": 0.0, "max_new_tokens": 6}
        settings = RolloutSettings([e.url()], params, 1, 60.0, KEY)
        before = ro.decode_clock(settings)  # what a rollout's metrics read before and after its batch
        fused = e.generator.generate(prompts, params)
        stats = ro.decode_stats(before, ro.decode_clock(settings))
        assert stats["decode_steps"] == 6 and stats["decode_ms_per_step"] > 0, stats
        assert 0 <= stats["decode_device_wait_share"] <= 1, stats
        assert ro.decode_clock(RolloutSettings([e.url()], params, 1, 60.0, "not-the-key")) is None  # no figures
        assert ro.decode_stats(None, before) == {} and ro.decode_stats(before, before) == {}
        assert e.generator._static is not None and e.generator._static.fused is not None  # the fused step ran
        plain = Generator(e.generator.model, e.generator.tokenizer, max_batch_size=8, decoder="static").generate(
            prompts, params)
        assert [r["output_ids"] for r in fused] == [r["output_ids"] for r in plain]
        clock = httpx.get(f"{e.url()}/server_info", headers=AUTH).json()["decode_time"]  # the static loop's clock
        assert clock["steps"] == 6 and 0 <= clock["device_wait_s"] <= clock["loop_s"], clock
    finally:
        e.shutdown()


def test_n_samples_are_prompt_major(gen, tok):
    prompts = _ids(tok, ["1+1=", "(3+4)*5=", "99-1="])
    recs = gen.generate(prompts, {"max_new_tokens": 5}, n=3)
    assert len(recs) == 9
    assert [r["prompt_tokens"] for r in recs] == [len(p) for p in prompts for _ in range(3)]
    assert len({r["id"] for r in recs}) == 9


def test_finish_reasons_stop_token_ids_and_min_new_tokens(gen, model, tok):
    p = tok.encode("12+34=")
    ref = _argmax_loop(model, p, 10, set())
    greedy = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
    r = gen.generate([p], greedy)[0]
    assert r["finish_reason"] == {"type": "length", "length": 10} and r["output_ids"] == ref
    stop = ref[3]
    r = gen.generate([p], {**greedy, "ignore_eos": False, "stop_token_ids": [stop]})[0]
    cut = ref.index(stop) + 1
    assert r["finish_reason"] == {"type": "stop", "matched": stop}
    assert r["output_ids"] == ref[:cut] and r["completion_tokens"] == cut
    assert r["text"] == tok.decode(ref[:cut - 1])  # the matched stop token is trimmed from text only
    r = gen.generate([p], {**greedy, "ignore_eos": False, "stop_token_ids": [ref[0]], "min_new_tokens": 3})[0]
    assert len(r["output_ids"]) >= 3 and ref[0] not in r["output_ids"][:3]
    r = gen.generate([p], {"temperature": 0.0, "max_new_tokens": 0})[0]
    assert r["output_ids"] == [] and r["finish_reason"] == {"type": "length", "length": 0}


def test_stop_string(gen, model, tok):
    p = tok.encode("12+34=")
    ref_text = tok.decode(_argmax_loop(model, p, 12, set()))
    stop = ref_text[4:6]
    r = gen.generate([p], {"temperature": 0.0, "max_new_tokens": 12, "stop": [stop]})[0]
    assert r["finish_reason"] == {"type": "stop", "matched": stop}
    assert r["text"] == ref_text[:ref_text.index(stop)]


def test_sampling_seed_is_deterministic_and_batch_independent(gen, tok):
    p = tok.encode("5+6=")
    sp = {"temperature": 1.0, "max_new_tokens": 16, "sampling_seed": 1234}
    alone = gen.generate([p], sp)[0]["output_ids"]
    batched = gen.generate(_ids(tok, PROMPTS[:4]) + [p], [{"max_new_tokens": 16}] * 4 + [sp])[-1]["output_ids"]
    assert alone == batched == gen.generate([p], sp)[0]["output_ids"]
    others = {tuple(gen.generate([p], {**sp, "sampling_seed": s})[0]["output_ids"]) for s in range(4)}
    assert len(others) > 1
    wide = {**sp, "sampling_seed": 2**64 + 1234}  # past int64 (a direct caller; HTTP checks i64): its low 64 bits
    assert gen.generate([p], wide)[0]["output_ids"] == alone


def test_compaction_matches_batch_size_one(model, tok, monkeypatch):
    gen = Generator(model, tok, max_batch_size=5, threads=1)
    prompts = _ids(tok, PROMPTS) + [tok.encode("(1+2)*(3+4)*(5+6)=")]
    params = [{"temperature": 0.0, "max_new_tokens": m, "ignore_eos": True} for m in (1, 9, 3, 17, 5, 2, 12, 7, 1)]
    sizes = []
    real = gen._forward
    monkeypatch.setattr(gen, "_forward", lambda ids, *a: sizes.append(tuple(ids.shape)) or real(ids, *a))
    batched = gen.generate(prompts, params)
    monkeypatch.undo()
    single = [gen.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    assert [r["output_ids"] for r in batched] == [r["output_ids"] for r in single]
    assert [len(r["output_ids"]) for r in batched] == [sp["max_new_tokens"] for sp in params]
    assert [b for b, t in sizes if t > 1] == [5, 4]  # two chunks of at most 5 prefilled
    decode_batches = [b for b, t in sizes if t == 1]
    assert decode_batches[0] == 4 and min(decode_batches) == 1  # rows leave the batch as they finish



def test_seeded_draws_are_uniform_and_follow_the_probabilities():
    """One hashed uniform per (seed, position), independent across both; inverting a row's distribution at it
    samples that distribution, renormalised after top-k, and never a token the filter dropped."""
    from reflow.engines.embedded.sampling import TOP_K_ALL, sample_tokens, seeded_uniform

    n = 100_000
    u = seeded_uniform(torch.arange(n), torch.full((n,), 5))
    assert 0 < u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    nxt = seeded_uniform(torch.arange(n), torch.full((n,), 6))
    assert abs(torch.corrcoef(torch.stack([u, nxt]))[0, 1]) < 0.02  # positions
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]) < 0.02  # neighbouring seeds
    assert torch.equal(seeded_uniform(torch.tensor([7, 3]), torch.tensor([5, 9]))[0], u[7])  # batch-independent

    probs = torch.tensor([0.1, 0.2, 0.0001, 0.6999])
    logits, ones = probs.log().expand(n, 4).clone(), torch.ones(n)
    for top_k, want in ((TOP_K_ALL, probs), (2, torch.tensor([0.0, 0.2, 0.0, 0.6999]) / 0.8999)):
        tokens, _ = sample_tokens(logits, ones, ones, torch.full((n,), top_k), torch.zeros(n), u)
        got = torch.bincount(tokens, minlength=4).double() / n
        torch.testing.assert_close(got, want.double(), atol=0.006, rtol=0)
    edge = torch.full((4,), 1 - 2.0**-53, dtype=torch.float64)  # the largest draw: the kept token before the cut
    tokens, _ = sample_tokens(logits[:4], ones[:4], ones[:4], torch.full((4,), 2), torch.zeros(4), edge)
    assert tokens.tolist() == [3, 3, 3, 3]


def test_samples_sent_as_separate_requests_share_one_prefill(model, tok, monkeypatch):
    """A seeded rollout sends each sample as its own request (n=1, its own seed): equal prompts are prefilled
    once, and each sample is the one its seed gives alone."""
    gen = Generator(model, tok, max_batch_size=16, threads=1)
    prompts = _ids(tok, PROMPTS[:3])
    sps = [{"temperature": 1.0, "max_new_tokens": 5, "sampling_seed": 100 + i} for i in range(12)]
    sizes = []
    real = gen._forward
    monkeypatch.setattr(gen, "_forward", lambda ids, *a: sizes.append(tuple(ids.shape)) or real(ids, *a))
    out = gen.generate([list(p) for p in prompts for _ in range(4)], sps)
    monkeypatch.undo()
    assert [b for b, t in sizes if t > 1] == [3]
    alone = [gen.generate([p], [sp])[0]["output_ids"] for p, sp in zip([p for p in prompts for _ in range(4)], sps)]
    assert [r["output_ids"] for r in out] == alone and len({tuple(a) for a in alone}) > 3


# ---------------------------------------------------------------- HTTP contract


def test_generate_response_shape(client, tok, engine):
    single = client.generate(input_ids=tok.encode("1+1="), sampling_params={"max_new_tokens": 3}, return_logprob=True)
    assert set(single) == {"text", "output_ids", "meta_info"}
    meta = single["meta_info"]
    assert {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
            "output_token_logprobs"} <= set(meta)
    assert meta["weight_version"] == client.model_info()["weight_version"] == "default"
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == 3
    many = client.generate(text=["1+1=", "2+2="], sampling_params={"max_new_tokens": 2, "n": 2})
    assert isinstance(many, list) and len(many) == 4 and "output_token_logprobs" not in many[0]["meta_info"]
    other = EngineClient(engine.url(), api_key=KEY)
    out = generate_batch([client, other], _ids(tok, PROMPTS[:5]), {"max_new_tokens": 4}, n=2)
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [len(p) for p in _ids(tok, PROMPTS[:5]) for _ in "ab"]


@pytest.mark.parametrize("body, message", [
    ({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": "5"}}, 'invalid type: string "5", expected i64'),
    ({"input_ids": [5, 6], "sampling_params": {"foo": 1}}, "unknown field `foo`"),
    ({"input_ids": [5, 6], "sampling_params": {"top_p": 0.0}}, "top_p must be in (0, 1]"),
    ({"input_ids": [5, 6], "sampling_params": {"top_p": 1.5}}, "top_p must be in (0, 1]"),
    ({"input_ids": [5, 6], "sampling_params": {"temperature": -1}}, "temperature must be a non-negative"),
    ({"sampling_params": {}}, "Either text, input_ids or input_embeds should be provided."),
    ({"input_ids": [5, 6], "stream": True}, "stream=true is not supported"),
    ({"input_ids": "abc"}, 'invalid type: string "abc", expected a value or an array of values for TokenIdsOrList'),
    ({"input_ids": [5, 999]}, "prompt token ids must be in"),
    ({"input_ids": [5], "sampling_params": {"frequency_penalty": 0.5}}, "not supported by the embedded engine"),
    ({"input_ids": [5], "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}}, "min_new_tokens must be in"),
])
def test_malformed_generate_is_400_with_message(engine, body, message):
    r = httpx.post(engine.url() + "/generate", json=body, headers=AUTH)
    err = r.json()["error"]  # SGLang: a string for contract errors, {"message"} for the others
    assert r.status_code == 400 and message in (err if isinstance(err, str) else err["message"])


@pytest.mark.parametrize("body, message", [
    ({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": "5"}}, 'invalid type: string "5", expected i64'),
    ({"input_ids": [5, 6], "sampling_params": {"foo": 1}}, "unknown field `foo`"),
    ({"input_ids": [5, 6], "sampling_params": {"top_p": 0.0}}, "top_p must be in (0, 1], got 0.0."),
    ({"sampling_params": {}}, "Either text, input_ids or input_embeds should be provided."),
])
def test_own_checks_when_sglang_is_absent(engine, monkeypatch, body, message):
    from reflow.engines.sglang import contract as sglang_contract

    monkeypatch.setattr(sglang_contract, "load", lambda: None)  # as on a machine without the wheel
    r = httpx.post(engine.url() + "/generate", json=body, headers=AUTH)
    err = r.json()["error"]
    assert r.status_code == 400 and message in (err if isinstance(err, str) else err["message"])
    ok = httpx.post(engine.url() + "/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}},
                    headers=AUTH)  # ignore_eos: the shared engine's random weights may sample EOS first
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2
    named = [("model.norm.weight", torch.ones(32))]
    assert torch.equal(load_payload(serialize_bucket(named), "flattened_bucket")[0][1], torch.ones(32))


def test_out_of_memory_in_generate_names_the_settings_that_fix_it(engine, monkeypatch):
    """A GPU generate that runs out of memory (session 46: an engine at rollout.kv_mem_fraction=0.6 beside a colocated
    trainer on an 80 GiB card) answered a bare "500: Internal Server Error": the client's error said nothing of
    why. The failure now comes back in SGLang's error shape with torch's message and the settings that lower the
    engine's memory; the engine goes on answering. Injected at the generator (CPU raises no CUDA OOM); a failure of
    any other kind comes back with its type and message too."""
    gen = engine.app.state.engine.gen
    client = EngineClient(engine.url(), timeout=60, api_key=KEY)
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.92 GiB. GPU 0 has a total capacity "
                                     "of 79.18 GiB of which 924.56 MiB is free.")
    monkeypatch.setattr(gen, "generate", oom)
    with pytest.raises(EngineError) as err:
        client.generate([5, 6], {"max_new_tokens": 2, "ignore_eos": True})
    msg = str(err.value)
    assert "Internal Server Error" not in msg and "Tried to allocate 1.92 GiB" in msg, msg
    assert "rollout.max_batch_size" in msg and "rollout.kv_mem_fraction" in msg and "cluster.colocate" in msg, msg
    r = httpx.post(engine.url() + "/generate", json=body, headers=AUTH)
    assert r.status_code == 500 and "out of memory" in r.json()["error"]["message"]  # not 503: a retry would fail again
    assert not is_transient_fault(err.value)
    health = httpx.get(engine.url() + "/health_generate")  # the probe says unhealthy, with the cause, not a bare 500
    assert health.status_code == 503 and "out of memory" in health.text, (health.status_code, health.text)

    def broken(*a, **k):
        raise RuntimeError("a kernel failed")
    monkeypatch.setattr(gen, "generate", broken)
    r = httpx.post(engine.url() + "/generate", json=body, headers=AUTH)
    assert r.status_code == 500 and r.json()["error"]["message"] == "generate failed: RuntimeError: a kernel failed"
    monkeypatch.undo()
    ok = httpx.post(engine.url() + "/generate", json=body, headers=AUTH)
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2


def test_weight_session_and_memory_state_errors(client):
    named = [("model.norm.weight", torch.ones(32))]
    with pytest.raises(EngineError, match=r"update_weights_from_tensor must run between "
                                          r"begin_weight_update\(\) and end_weight_update\(\)") as e:
        client.update_weights_from_tensor([serialize_bucket(named)], "flattened_bucket")
    assert e.value.status == 400 and e.value.endpoint == "/update_weights_from_tensor"
    with pytest.raises(EngineError, match="no weight-update session is open"):
        client.end_weight_update()
    client.begin_weight_update()
    with pytest.raises(EngineError, match="already open"):
        client.begin_weight_update()
    with pytest.raises(EngineError, match="unknown weight name 'nope'"):
        client.update_weights_from_tensor([serialize_bucket([("nope", torch.ones(2))])], "flattened_bucket")
    client.end_weight_update()
    client.release_memory_occupation()
    with pytest.raises(EngineError, match="already released"):
        client.release_memory_occupation(["weights"])
    with pytest.raises(EngineError, match="memory is released"):
        client.generate(input_ids=[5, 6])
    client.resume_memory_occupation()
    with pytest.raises(EngineError, match="not released"):
        client.resume_memory_occupation()
    out = client.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 1})
    assert out["meta_info"]["completion_tokens"] == 1


def test_pause_parks_generation_and_abort_returns_partial_output(client, engine, tok):
    result = {}
    long = {"max_new_tokens": 100, "ignore_eos": True, "temperature": 1.0}
    rids = [f"r{i}" for i in range(256)]
    worker = threading.Thread(target=lambda: result.update(
        out=client.generate(input_ids=_ids(tok, PROMPTS) * 32, sampling_params=long, rid=rids)))
    worker.start()
    deadline = time.monotonic() + 10
    while httpx.get(engine.url() + "/v1/loads", headers=AUTH).json()["loads"][0]["num_running_reqs"] == 0:
        assert time.monotonic() < deadline
    client.pause_generation("in_place")
    assert client.flush_cache()  # parked requests do not block a flush
    client.abort_request(abort_all=True)
    late = threading.Thread(target=lambda: result.update(late=client.generate(input_ids=[5, 6])))
    late.start()  # arrives while paused: must wait for continue, and is not aborted
    worker.join(0.3)
    assert worker.is_alive() and late.is_alive()  # nothing finishes while paused
    client.continue_generation()
    worker.join(10)
    late.join(10)
    reasons = {o["meta_info"]["finish_reason"]["type"] for o in result["out"]}
    assert reasons == {"abort"} and all(0 < len(o["output_ids"]) < 100 for o in result["out"])
    assert result["late"]["meta_info"]["finish_reason"]["type"] in ("stop", "length")


def test_concurrent_requests_merge_without_mixing(engine, model, tok):
    prompts = _ids(tok, PROMPTS)
    results = [None] * len(prompts)

    def one(i):
        c = EngineClient(engine.url(), api_key=KEY)
        sp = {"temperature": 0.0, "max_new_tokens": 4 + 3 * i, "ignore_eos": True}
        results[i] = c.generate(input_ids=prompts[i], sampling_params=sp, rid=f"req-{i}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for i, r in enumerate(results):
        assert r["meta_info"]["id"] == f"req-{i}"
        assert r["output_ids"] == _argmax_loop(model, prompts[i], 4 + 3 * i, set())


# ---------------------------------------------------------------- SGLang's routes (issue 14, point 7)


def _sglang_routes() -> dict[str, set[str]]:
    """path -> HTTP methods of SGLang 0.5.23's HTTP server, read from the wheel's own sources."""
    import ast
    from pathlib import Path

    from reflow.engines.sglang import contract as sglang_contract

    root = sglang_contract.installed_root()
    if root is None:
        pytest.skip("sglang==0.5.23 is not installed")
    routes: dict[str, set[str]] = {}
    for name, owner in (("http_server.py", "app"), ("v1_loads.py", "router")):
        for node in ast.walk(ast.parse((Path(root) / "srt" / "entrypoints" / name).read_text())):
            for d in getattr(node, "decorator_list", []):
                if not (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.args
                        and getattr(d.func.value, "id", None) == owner and isinstance(d.args[0], ast.Constant)):
                    continue
                if d.func.attr == "api_route":
                    listed = next(k.value for k in d.keywords if k.arg == "methods")
                    methods = {e.value for e in listed.elts}
                else:
                    methods = {d.func.attr.upper()}
                routes.setdefault(d.args[0].value, set()).update(methods)
    return routes


def test_every_embedded_route_is_sglangs_with_its_methods(engine):
    from fastapi.routing import APIRoute

    sglang = _sglang_routes()
    assert len(sglang) > 60  # the whole app was read
    ours = {r.path: set(r.methods) for r in engine.app.routes if isinstance(r, APIRoute)}
    for path in ("/get_model_info", "/get_server_info", "/update_weight_version", "/model_info", "/server_info"):
        assert path in ours, f"the embedded engine does not serve {path}"
    extensions = {p for p in ours if p.startswith("/reflow/")}  # reflow's own, asked only where advertised
    assert extensions == {"/reflow/map_weights", "/reflow/update_weights_from_mapped", "/reflow/generate_closing"}
    assert all(path not in sglang for path in extensions)
    for path, methods in ours.items():
        if path in extensions:
            continue
        assert path in sglang, f"{path} is not an endpoint of SGLang 0.5.23"
        assert methods == sglang[path], (path, methods, sglang[path])


def test_update_weight_version_fields_match_sglangs_request():
    """The embedded engine's table against the wheel's UpdateWeightVersionReqInput (io_struct needs
    the GPU runtime to import, so its source is read)."""
    import ast
    from pathlib import Path

    from reflow.engines.embedded.server import REQUIRED, WEIGHT_VERSION_FIELDS
    from reflow.engines.sglang import contract as sglang_contract

    root = sglang_contract.installed_root()
    if root is None:
        pytest.skip("sglang==0.5.23 is not installed")
    tree = ast.parse((Path(root) / "srt" / "managers" / "io_struct.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "UpdateWeightVersionReqInput")
    fields = {n.target.id: (ast.unparse(n.annotation), None if n.value is None else ast.literal_eval(n.value))
              for n in cls.body if isinstance(n, ast.AnnAssign)}
    ours = {k: (kind.__name__, None if default is REQUIRED else default)
            for k, (kind, default) in WEIGHT_VERSION_FIELDS.items()}
    assert fields == ours


def test_info_aliases_and_update_weight_version(fresh_engine, tok):
    url, c = fresh_engine.url(), EngineClient(fresh_engine.url(), api_key=KEY)
    for old, new in (("/get_model_info", "/model_info"), ("/get_server_info", "/server_info")):
        assert httpx.get(url + old).status_code == 401  # behind the API key like the rest
        assert httpx.get(url + old, headers=AUTH).json() == httpx.get(url + new, headers=AUTH).json()
    assert httpx.post(url + "/update_weight_version", json={"new_version": "x"}).status_code == 401
    assert c.update_weight_version("v7") == {"success": True, "message": "Weight version updated to v7",
                                             "new_version": "v7"}
    assert c.model_info()["weight_version"] == "v7"
    out = c.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 1})
    assert out["meta_info"]["weight_version"] == "v7"
    for body, message in (({}, "new_version: field required"), ({"new_version": 7}, "new_version: expected str"),
                          ({"new_version": "v8", "abort_all_requests": "no"}, "abort_all_requests: expected bool")):
        r = httpx.post(url + "/update_weight_version", json=body, headers=AUTH)
        assert r.status_code == 400 and r.json()["object"] == "error" and r.json()["code"] == 400
        assert message in r.json()["message"]
    assert c.model_info()["weight_version"] == "v7"  # a refused body changes nothing


def test_take_over_brings_back_an_engine_left_paused_mid_update_and_released(fresh_engine):
    """What a flow run killed mid-train in colocated mode leaves (infra/runtime._take_over): generation paused, a
    weight update open, every memory tag released. Once taken over it generates; a second take-over changes nothing."""
    c = EngineClient(fresh_engine.url(), api_key=KEY)
    c.pause_generation("abort")
    c.begin_weight_update()
    c.release_memory_occupation(["weights", "kv_cache", "cuda_graph"])
    assert httpx.get(fresh_engine.url() + "/health_generate", headers=AUTH).status_code == 503
    tags = ["weights", "kv_cache", "cuda_graph"]
    assert c.take_over(tags) == ["end_weight_update", "resume weights", "resume kv_cache", "resume cuda_graph"]
    out = c.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2, "ignore_eos": True})
    assert len(out["output_ids"]) == 2
    assert c.take_over(tags) == []  # already fresh: each step's 400 ("not released", "no session") skips it
    c.begin_weight_update()  # the session really was closed (a second begin would be refused)
    c.end_weight_update()


@pytest.mark.parametrize("abort_all", [True, False])
def test_update_weight_version_aborts_running_requests_by_default(fresh_engine, abort_all):
    c = EngineClient(fresh_engine.url(), api_key=KEY)
    running = lambda: c._call("GET", "/v1/loads")["loads"][0]["num_running_reqs"]  # noqa: E731
    # The batch must still be running when the relabel arrives: decoding is parked in place once it runs (a
    # quick engine on a loaded CI machine finished all 128 between the poll and the relabel, stop 59). A batch
    # that finished before the pause took effect is no evidence either way, and is sent again.
    result = {}
    for _ in range(5):
        result.clear()
        worker = threading.Thread(target=lambda: result.update(out=c.generate(
            input_ids=[[5, 6]] * 128, sampling_params={"max_new_tokens": 100, "ignore_eos": True})))
        worker.start()
        deadline = time.monotonic() + 10
        while running() == 0 and worker.is_alive():
            assert time.monotonic() < deadline
        c.pause_generation("in_place")
        if running():
            break
        c.continue_generation()
        worker.join(30)
    else:
        pytest.fail("five batches of 128 x 100 tokens each finished before an in-place pause took effect")
    c.update_weight_version("relabelled", abort_all_requests=abort_all)
    c.continue_generation()
    worker.join(30)
    reasons = {o["meta_info"]["finish_reason"]["type"] for o in result["out"]}
    assert reasons == ({"abort"} if abort_all else {"length"})
    assert c.model_info()["weight_version"] == "relabelled"


# ---------------------------------------------------------------- tensor buckets and weight push


def test_bucket_roundtrip_and_unsafe_pickle_refused():
    named = [("a", torch.randn(3, 5)), ("b", torch.arange(7)), ("c", torch.randn(3, dtype=torch.bfloat16))]
    flat, meta = flatten(named)
    assert meta[0] == ("a", (3, 5), "torch.float32", 0, 60, 60) and flat.dtype == torch.uint8
    for (n, t), (n2, t2) in zip(named, unflatten(flat, meta)):
        assert n == n2 and torch.equal(t, t2)
    for fmt, payload in (("flattened_bucket", serialize_bucket(named)), ("direct", None)):
        if payload is None:
            from reflow.engines.weights.buckets import serialize_named_tensors
            payload = serialize_named_tensors(named)
        assert all(torch.equal(t, t2) for (_, t), (_, t2) in zip(named, load_payload(payload, fmt)))
    import base64
    import os
    import pickle
    with pytest.raises(BucketError, match="refused to unpickle global posix.system"):
        load_payload(base64.b64encode(pickle.dumps(os.system)).decode(), "flattened_bucket")


def _rebuild_in_turn(tmp_path, payloads: list[str]) -> subprocess.CompletedProcess:
    """One receiver process loads each payload in turn and frees it before the next: for the shared
    segment's reference count, what as many long-lived receivers (engines, TP ranks) do."""
    files = []
    for i, payload in enumerate(payloads):
        files.append(tmp_path / f"payload-{i}.txt")
        files[-1].write_text(str(payload))
    code = ("import sys\nfrom reflow.engines.weights.buckets import load_payload\nfor f in sys.argv[1:]:\n"
            "    print(float(load_payload(open(f).read(), 'flattened_bucket')[0][1].sum()), flush=True)")
    return subprocess.run([sys.executable, "-c", code, *map(str, files)], capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # ~7 s of CPU in receiver processes: make test-fast stays under a minute
def test_each_receiver_gets_its_own_payload_of_one_buffer(tmp_path):
    """A pickle adds one reference to the shared segment and a rebuild takes one: four payloads of one
    bucket (one buffer, no copy) serve four receivers, then the next bucket; one payload rebuilt three
    times loses its file at the third (the flaw of sending one payload to every engine and TP rank)."""
    from reflow.engines.weights.buckets import SharedBucket

    for k in range(2):
        shared = SharedBucket([("a", torch.full((4096,), float(k + 1)))])
        payloads = shared.payloads(4)
        assert len(set(payloads)) == 1 and all(p.buffers[0] is shared.flat for p in payloads)  # same handle
        done = _rebuild_in_turn(tmp_path, payloads)
        assert done.returncode == 0, done.stderr[-2000:]
        assert [float(x) for x in done.stdout.split()] == [4096.0 * (k + 1)] * 4
        shared.release()
        assert shared.flat is None and all(p.buffers == [] for p in payloads)
    once = serialize_bucket([("a", torch.ones(4096))])
    done = _rebuild_in_turn(tmp_path, [once] * 3)
    assert done.stdout.split() == ["4096.0", "4096.0"] and done.returncode != 0
    assert "unable to open shared memory object" in done.stderr


# The subset of SGLang 0.5.23's SafeUnpickler.ALLOWED_GLOBALS (sglang/srt/utils/common.py) that
# a CPU payload can need: the real server refuses anything else.
SGLANG_ALLOWED = {("torch", "Tensor"), ("torch", "Size"), ("torch.storage", "UntypedStorage"),
                  ("torch.storage", "TypedStorage"), ("torch", "UntypedStorage"), ("copyreg", "__newobj__"),
                  ("torch.multiprocessing.reductions", "rebuild_tensor"),
                  ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
                  ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
                  ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
                  ("torch", "float32"), ("torch", "bfloat16"), ("torch", "uint8"), ("torch", "int64")}


def test_payload_globals_are_on_sglangs_allow_list():
    import base64
    import io

    from reflow.engines.weights.buckets import _SafeUnpickler, serialize_named_tensors

    seen = set()

    class Recording(_SafeUnpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    named = [("a", torch.randn(3, 2)), ("b", torch.randn(2, dtype=torch.bfloat16)), ("c", torch.arange(3))]
    for payload in (serialize_bucket(named), serialize_named_tensors(named)):
        Recording(io.BytesIO(base64.b64decode(payload))).load()
    assert ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata") in seen
    assert seen <= SGLANG_ALLOWED, seen - SGLANG_ALLOWED


@pytest.mark.parametrize("map_once", [False, True])
def test_push_weights_full_verify_changes_generation(fresh_engine, tok, map_once):
    """SGLang's calls (buckets, each a handle) and the mapping the engine keeps (weights/mapped.py) alike."""
    c = EngineClient(fresh_engine.url(), api_key=KEY)
    new = build_model(tok, hidden=32, layers=2, heads=2, mlp=64, seed=7)
    named = list(new.state_dict().items())
    local_calls = MAPPED.local_calls
    stats = push_weights([c], named, "v1", PushSettings(bucket_bytes=16 << 10, verify="full", map_once=map_once))
    assert stats["buckets"] == 1 if map_once else stats["buckets"] > 1
    assert stats["verified_tensors"] == len(named) and ("mapped" in stats) == map_once
    if map_once:  # the engine laid its weights out as the mapped buffer: one copy (embedded/weight_layout.py)
        assert stats["copies"] == 1 and MAPPED.local_calls > local_calls  # through the local socket
    assert c.model_info()["weight_version"] == "v1"
    p = tok.encode("(3+4)*5=")
    out = c.generate(input_ids=p, sampling_params={"temperature": 0.0, "max_new_tokens": 12})
    assert out["output_ids"] == _argmax_loop(new, p, 12, {tok.eos_token_id})
    assert out["meta_info"]["weight_version"] == "v1"
    bad = [(n, t + 1e-3 if n == "model.layers.1.mlp.up_proj.weight" else t) for n, t in named]
    with pytest.raises(WeightSyncError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*max abs diff 0\.001"):
        verify_weights([c], bad, "v1", "full")
    with pytest.raises(WeightSyncError, match="weight_version 'v1', expected 'v2'"):
        verify_weights([c], named, "v2", "sample", 3)
    with pytest.raises(EngineError, match="shape mismatch for 'model.norm.weight'"):
        push_weights([c], [("model.norm.weight", torch.ones(3))], "v3", PushSettings(bucket_bytes=1 << 20, verify="off",
                                                                                   map_once=map_once))
    c.begin_weight_update()  # the failed push left no session open and generation running
    c.end_weight_update()
    assert c.generate(input_ids=p, sampling_params={"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_update_weights_from_disk_and_get_weights_by_name(fresh_engine, tok, tmp_path):
    from reflow.rl.demo_policy import save_policy

    c = EngineClient(fresh_engine.url(), api_key=KEY)
    new = build_model(tok, hidden=32, layers=2, heads=2, mlp=64, seed=5)
    path = str(save_policy(new, tok, tmp_path / "new_policy"))
    out = c.update_weights_from_disk(path, weight_version="disk-1")  # no session needed
    assert out["success"] and out["num_paused_requests"] == 0
    info = c.model_info()
    assert info["weight_version"] == "disk-1" and info["model_path"] == path
    rows = c.get_weights_by_name("model.embed_tokens.weight", truncate_size=3)  # SGLang: first rows, nested
    torch.testing.assert_close(torch.tensor(rows), new.model.embed_tokens.weight[:3].detach(), rtol=0, atol=0)
    p = tok.encode("7*8=")
    got = c.generate(input_ids=p, sampling_params={"temperature": 0.0, "max_new_tokens": 8})["output_ids"]
    assert got == _argmax_loop(new, p, 8, {tok.eos_token_id})
    with pytest.raises(EngineError, match="does not exist"):
        c.update_weights_from_disk(str(tmp_path / "missing"))


def test_push_between_two_ray_actors(ray_cluster, tiny_policy, tok):
    import ray

    class Pusher:  # defined here so Ray ships it by value
        def push(self, url, api_key, named, version):
            from reflow.engines.rollout_client import EngineClient as Client
            from reflow.engines.weights.push import push_weights as push
            from reflow.engines.weights.settings import PushSettings as Settings

            return push([Client(url, api_key=api_key)], named, version, Settings(bucket_bytes=32 << 10, verify="full"))

    engine = ray.remote(EmbeddedEngine).options(num_cpus=1).remote(str(tiny_policy), "ray-engine", threads=1,
                                                                   api_key=KEY)
    pusher = ray.remote(Pusher).options(num_cpus=1).remote()
    try:
        url = ray.get(engine.url.remote())
        assert ray.get(engine.ready.remote())
        new = build_model(tok, hidden=32, layers=2, heads=2, mlp=64, seed=3)
        stats = ray.get(pusher.push.remote(url, KEY, list(new.state_dict().items()), "ray-v1"), timeout=60)
        assert stats["verified_tensors"] == len(new.state_dict())
        p = tok.encode("12+34=")
        client = EngineClient(url, api_key=KEY)
        out = client.generate(input_ids=p, sampling_params={"temperature": 0.0, "max_new_tokens": 10})
        assert out["output_ids"] == _argmax_loop(new, p, 10, {tok.eos_token_id})
        assert out["meta_info"]["weight_version"] == "ray-v1"
    finally:
        ray.get(engine.shutdown.remote(), timeout=10)
        ray.kill(engine)
        ray.kill(pusher)


def test_verify_every_checks_due_versions_in_full_and_the_others_by_version(fresh_engine, tok):
    c = EngineClient(fresh_engine.url(), api_key=KEY)
    named = list(build_model(tok, hidden=32, layers=2, heads=2, mlp=64, seed=3).state_dict().items())
    every = PushSettings(bucket_bytes=1 << 20, verify="full", verify_every=2)
    assert push_weights([c], named, "3", every)["verify_method"] == "version"  # not due: weight_version only
    due = push_weights([c], named, "4", every)
    assert due["verify_method"] == "weights" and due["verified_tensors"] == len(named)
    assert push_weights([c], named, "v5", every)["verified_tensors"] == len(named)  # not a number: always checked
    from reflow.engines.weights.verify import versions_only

    with pytest.raises(WeightSyncError, match="weight_version 'v5', expected '6'"):
        versions_only([c], "6")  # what a push whose check is not due still proves


def test_weights_by_name_copies_only_the_rows_asked_for(tok):
    """/get_weights_by_name answers the first truncate_size rows, and converts only those: converting the whole
    tensor first made a sampled read-back of an embedding matrix cost ~0.5 s on the GPU demo (RESULTS.md 21)."""
    from reflow.engines.embedded.server import _weights_by_name
    from reflow.engines.embedded.state import EngineState

    gen = Generator(build_model(tok, hidden=32, layers=2, heads=2, mlp=64, seed=3), tok, max_batch_size=4, threads=1)
    full = gen.get_weight("model.embed_tokens.weight")
    head = gen.get_weight("model.embed_tokens.weight", rows=3)
    assert head.shape == (3, full.shape[1]) and head.untyped_storage().nbytes() == head.numel() * head.element_size()
    assert torch.equal(head, full[:3])
    state = EngineState(gen, {})
    assert torch.equal(torch.tensor(_weights_by_name(state, {"name": "model.embed_tokens.weight", "truncate_size": 3})),
                       full[:3].float())
    bias = next(n for n, t in gen.model.named_parameters() if t.dim() == 1)  # a 1-D tensor: its first entries
    assert torch.equal(torch.tensor(_weights_by_name(state, {"name": bias, "truncate_size": 2})),
                       gen.get_weight(bias)[:2].float())


def test_non_finite_log_probs_answer_500_naming_the_weights_not_a_bare_error(tiny_policy, tok):
    """A policy whose logits are NaN (a diverged update pushed) gets a 500 that says what is wrong, never a response
    with NaN log-probs (the JSON encoder would write them as null) nor a bare 'Internal Server Error'."""
    e = EmbeddedEngine(str(tiny_policy), "nan-engine", threads=1, api_key=KEY)
    try:
        with torch.no_grad():
            e.generator.model.model.norm.weight.fill_(float("nan"))  # every logit NaN
        r = httpx.post(f"{e.url()}/generate", headers=AUTH, timeout=60, json={
            "input_ids": _ids(tok, ["1+1="])[0], "sampling_params": {"max_new_tokens": 3}, "return_logprob": True})
        assert r.status_code == 500 and "non-finite log-prob" in r.text and "weights last pushed" in r.text, r.text
    finally:
        e.shutdown()
