"""One contract for both backends: SGLang 0.5.23's real HTTP app and the embedded engine (issue 14).

The SGLang side is the wheel's own FastAPI app and start-up code, served in a child process by
tests/sglang_app.py (which says what is real and what stands in). Both backends are driven with
reflow's own client, pusher and verifier, on tiny Llama- and Qwen2-shaped models, with 1, 2 and 4
receivers: generate (with input logprobs), pause/continue, weight sessions, the three push modes
(tensor, distributed over gloo, disk), release/resume of memory, and the weight check (read back,
or by logprobs where SGLang cannot read back: its Qwen2 class). Servers live for the module.
"""
from __future__ import annotations

import base64
import pickle
import threading
import time

import pytest
import torch

from reflow.engines.rollout_client import EngineClient, EngineError
from reflow.engines.sglang import contract as sglang_contract
from reflow.engines.weights.buckets import SharedBucket
from reflow.engines.weights.push import WeightSyncError, push_weights
from reflow.engines.weights.settings import PushSettings
from reflow.engines.weights.verify import verify_push
from tests.reference import greedy_reference
from tests.sglang_backends import (
    ARCHS,
    AUTO,
    KEY,
    LORA,
    LORA_TARGETS,
    RECEIVERS,
    Backend,
    build,
    probe_of,
    pushed,
    start_sglang_apps,
    stop,
)

CONTRACT = sglang_contract.load()
LOG = "log"  # sglang_apps key of the servers' log
pytestmark = [pytest.mark.skipif(CONTRACT is None, reason="sglang==0.5.23 is not installed (make setup installs "
                                                          "it --no-deps): no real SGLang app to test against"),
              pytest.mark.slow]  # child processes (SGLang app servers) live for the module


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {a: tmp_path_factory.mktemp(f"tiny_{a}") for a in ARCHS}
    for arch, d in dirs.items():
        build(arch, d)
    return dirs


@pytest.fixture(scope="module")
def sglang_apps(model_dirs, tmp_path_factory):
    """SGLang's real app servers: one process per server, forked by tests/sglang_app.py after its
    one import of the app (that import costs ~10 s of CPU)."""
    log = tmp_path_factory.mktemp("sglang_app") / "servers.log"
    proc, urls, log = start_sglang_apps(model_dirs, log)  # a second start writes a log of its own
    try:
        yield {**urls, LOG: log}
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def embedded_engines(model_dirs):
    from reflow.engines.embedded.engine import EmbeddedEngine

    engines = {a: [EmbeddedEngine(str(model_dirs[a]), f"contract-{a}-{i}", threads=1, api_key=KEY)
                   for i in range(RECEIVERS)] for a in ARCHS}
    for es in engines.values():
        for e in es:
            e.ready()
    yield {a: [e.url() for e in es] for a, es in engines.items()}
    for es in engines.values():
        for e in es:
            e.shutdown()


def _backend(request, name: str, arch: str) -> Backend:
    urls = request.getfixturevalue("sglang_apps" if name == "sglang" else "embedded_engines")[arch]
    return Backend(name, arch, urls)


BACKENDS = [(b, a) for b in ("sglang", "embedded") for a in ARCHS]


@pytest.fixture(params=BACKENDS, ids=[f"{b}-{a}" for b, a in BACKENDS])
def backend(request) -> Backend:
    return _backend(request, *request.param)


# ---------------------------------------------------------------- data plane


def test_generate_answers_in_sglangs_response_shape(backend):
    c = backend.clients(1)[0]
    out = c.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params={"max_new_tokens": 3, "n": 2, "temperature": 0.7},
                     return_logprob=True)
    assert isinstance(out, list) and len(out) == 4  # prompt-major, n samples each
    for item in out:
        decoded = CONTRACT.GenerateResponse.from_json_value(item)
        assert decoded.meta_info.completion_tokens == len(item["output_ids"]) == len(
            item["meta_info"]["output_token_logprobs"])
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [3, 3, 2, 2]
    assert len({o["meta_info"]["id"] for o in out}) == 4


def test_partial_rollout_rounds_pass_sglangs_gate(backend):
    """rollout.partial's rounds (engines/partial_rollout.py) send per-entry sampling params (each its own
    max_new_tokens and sampling_seed) for prompt + tokens so far: SGLang's schema gate and SamplingParams
    take them, and a batch closes on its complete groups. (SGLang samples a seeded token from its seed and
    position, sampler.multinomial_with_seed, so a continued sample draws as one request would.)"""
    from reflow.engines import partial_rollout as pr
    from reflow.engines.rollout_stages import sample_seeds, sampling_params
    from reflow.rl.types import Prompt

    prompts = [Prompt(i, str(i), [5 + i, 6, 7]) for i in range(4)]
    settings = pr.PartialSettings.of("carry", 2, 2, 1.0)
    batch, rest, stats = pr.roll(backend.clients(1), settings, sampling_params(0.7, 1.0, -1, 5), 2, 3, [], prompts,
                                 sample_seeds(1, 3, 8))
    assert batch.n_groups == 2 and len(rest) == 2 and stats["partial_rounds"] >= 3  # 5 tokens in rounds of 2
    assert all(len(r) == len(lp) == len(v) for r, lp, v in zip(batch.response_ids, batch.rollout_logprobs,
                                                                  batch.token_versions))
    assert all(v == [3] * len(v) for v in batch.token_versions)


def test_bad_sampling_params_are_400_with_sglangs_text(backend):
    c = backend.clients(1)[0]
    with pytest.raises(EngineError) as e:
        c.generate(input_ids=[5], sampling_params={"foo": 1})
    assert e.value.status == 400 and e.value.message == CONTRACT.generate_contract_error(
        {"input_ids": [5], "sampling_params": {"foo": 1}})
    with pytest.raises(EngineError) as e:
        c.generate(input_ids=[5], sampling_params={"top_p": 0.0})
    assert e.value.status == 400 and "top_p must be in (0, 1]" in e.value.message


def test_pause_holds_new_requests_until_continue(backend):
    c = backend.clients(1)[0]
    assert c.pause_generation("abort")["status"] == "ok"
    done: list = []
    # ignore_eos: an earlier test (random order, make test-random SEED=4343) may have pushed weights that say eos first
    t = threading.Thread(target=lambda: done.append(c.generate(input_ids=[5, 6], sampling_params={
        "max_new_tokens": 2, "temperature": 0, "ignore_eos": True})))
    try:
        t.start()
        t.join(1.0)
        held = not done
    finally:
        c.continue_generation()
    t.join(30)
    assert held, f"{backend.name} answered /generate while paused"
    assert done and len(done[0]["output_ids"]) == 2


def test_deprecated_info_routes_and_weight_version_update(backend):
    """Routes the real server serves that reflow's clients may call (issue 14 point 7)."""
    import httpx

    c = backend.clients(1)[0]
    headers = {"Authorization": f"Bearer {KEY}"}
    for old, new in (("/get_model_info", "/model_info"), ("/get_server_info", "/server_info")):
        r = httpx.get(c.url + old, headers=headers)
        assert r.status_code == 200, (old, r.text)
        assert set(r.json()) >= {"model_path"} and r.json()["model_path"] == c._call("GET", new)["model_path"]
    version = f"manual-{time.time_ns()}"
    r = httpx.post(c.url + "/update_weight_version", json={"new_version": version}, headers=headers)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert c.model_info()["weight_version"] == version


def test_weight_updates_need_a_session(backend):
    from reflow.engines.weights.buckets import serialize_bucket

    c = backend.clients(1)[0]
    with pytest.raises(EngineError) as e:
        c.end_weight_update()
    assert e.value.status == 400
    _, _, named = pushed(backend.arch, seed=0)
    payload = serialize_bucket(named[:1])
    with pytest.raises(EngineError) as e:
        c.update_weights_from_tensor([payload], "flattened_bucket", True, "outside")
    assert e.value.status == 400 and c.model_info()["weight_version"] != "outside"
    # Refused unread, the pickle still holds a reference to its /dev/shm segment: take it as a
    # receiver would, or the segment outlives the test.
    pickle.loads(base64.b64decode(payload))
    c.begin_weight_update()
    try:
        with pytest.raises(EngineError) as e:
            c.begin_weight_update()
        assert e.value.status == 400
    finally:
        c.end_weight_update()


# ---------------------------------------------------------------- weight push


def test_tensor_push_lands_and_generation_follows_it(backend):
    """Proof without get_weights_by_name (works for every model): after a tensor push, greedy
    tokens and their logprobs are the trainer model's at the pushed weights."""
    model, tok, named = pushed(backend.arch, seed=11)
    clients = backend.clients(1)
    push_weights(clients, named, "v11", PushSettings(mode="tensor", verify="off"))
    prompt = [5, 6, 7, 8]
    out = clients[0].generate(input_ids=prompt, sampling_params={"max_new_tokens": 5, "temperature": 0,
                                                                 "ignore_eos": True}, return_logprob=True)
    assert out["meta_info"]["weight_version"] == "v11" == clients[0].model_info()["weight_version"]
    assert out["output_ids"] == greedy_reference(model, prompt, 5, eos=())
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out["output_ids"][:-1]])).logits[0, len(prompt) - 1:]
    want = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(out["output_ids"])[:, None])[:, 0]
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_input_token_logprobs_in_sglangs_shape(backend):
    """Teacher-forced logprobs (return_logprob, logprob_start_len): SGLang's entries, one per prompt
    token from the start, the first null, each the current model's logprob of that token. The
    logprob check of a push stands on this answer."""
    model, _, named = pushed(backend.arch, seed=13)
    c = backend.clients(1)[0]
    push_weights([c], named, "v13", PushSettings(mode="tensor", verify="off"))
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    out = c.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1, "temperature": 0},
                     return_logprob=True, logprob_start_len=0)
    for p, item in zip(prompts, out):
        entries = CONTRACT.GenerateResponse.from_json_value(item).meta_info.input_token_logprobs
        assert [e.token_id for e in entries] == p and entries[0].logprob is None
        with torch.no_grad():
            want = torch.log_softmax(model(torch.tensor([p])).logits[0, :-1].float(), -1)  # [T-1, V]
        want = want.gather(1, torch.tensor(p[1:])[:, None])[:, 0]  # [T-1]
        torch.testing.assert_close(torch.tensor([e.logprob for e in entries[1:]]), want, rtol=0, atol=1e-5)
    late = c.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 1, "temperature": 0},
                      return_logprob=True, logprob_start_len=2)["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in late] == prompts[0][2:] and late[0][0] is None  # SGLang nulls the first one kept
    plain = c.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 1}, return_logprob=True)
    assert plain["meta_info"]["input_token_logprobs"] == []  # the default (-1): output logprobs only


# What verify=full does per backend and model: read every tensor back, or, where SGLang's model class has
# no get_weights_by_name (Qwen2: issue 14 point 1, which raised an EngineError 400 after every push
# before), fall back to the logprob check.
VERIFY_METHOD = {("sglang", "llama"): "weights", ("sglang", "qwen2"): "logprobs",
                 ("embedded", "llama"): "weights", ("embedded", "qwen2"): "weights"}


@pytest.mark.parametrize("name,arch", BACKENDS, ids=[f"{b}-{a}" for b, a in BACKENDS])
def test_tensor_push_verifies(name, arch, request):
    """verify=full passes on every backend and model, and says how it checked."""
    clients = _backend(request, name, arch).clients(1)
    model, _, named = pushed(arch, seed=12)
    stats = push_weights(clients, named, "v12", PushSettings(mode="tensor", verify="full"), probe=probe_of(model))
    assert stats["verify_method"] == VERIFY_METHOD[name, arch]
    if stats["verify_method"] == "weights":
        assert stats["verified_tensors"] == len(named) and "verify_fallback" not in stats
    else:
        assert stats["verified_tensors"] == 0 and stats["logprob_engines"] == 1 and stats["logprob_max_diff"] < 1e-5
        assert "get_weights_by_name refused" in stats["verify_fallback"][clients[0].url]


def test_logprob_check_catches_other_weights(backend):
    """The logprob check fails an engine that computes with other weights than the probe's model,
    and is refused, not skipped, where no probe is given and the weights cannot be read back."""
    model, _, named = pushed(backend.arch, seed=14)
    other, _, _ = pushed(backend.arch, seed=15)
    c = backend.clients(1)[0]
    stats = push_weights([c], named, "v14", PushSettings(verify="logprobs"), probe=probe_of(model))
    assert stats["verify_method"] == "logprobs" and stats["logprob_max_diff"] < 1e-5
    with pytest.raises(WeightSyncError, match="logprobs of the probe batch differ from the trainer's"):
        verify_push([c], named, "v14", "logprobs", probe=probe_of(other))
    if VERIFY_METHOD[backend.name, backend.arch] == "logprobs":
        with pytest.raises(WeightSyncError, match="no logprob probe was given"):
            verify_push([c], named, "v14", "full")


RECEIVER_CASES = [pytest.param(b, a, k, id=f"{b}-{a}-{k}") for b in ("sglang", "embedded") for a in ARCHS
                  for k in (1, 2, 4)]


@pytest.mark.parametrize("name,arch,receivers", RECEIVER_CASES)
def test_tensor_push_to_several_receivers(name, arch, receivers, request):
    """Every receiver rebuilds the bucket (issue 14 point 2: one shared payload used to survive
    only two long-lived receivers; each receiver now gets its own pickle)."""
    clients = _backend(request, name, arch).clients(receivers)
    assert len(clients) == receivers
    model, _, named = pushed(arch, seed=20 + receivers)
    version = f"r{receivers}-{time.time_ns()}"
    settings = PushSettings(mode="tensor", verify="full", bucket_bytes=16 << 10, map_once=False)  # SGLang's calls
    stats = push_weights(clients, named, version, settings, probe=probe_of(model))
    assert stats["engines"] == receivers and stats["buckets"] > 1
    checked = receivers * len(named) if VERIFY_METHOD[name, arch] == "weights" else 0
    assert stats["verified_tensors"] == checked and stats["verify_method"] == VERIFY_METHOD[name, arch]


def _generation_follows(clients: list[EngineClient], model, version: str) -> None:
    prompt = [5, 6, 7, 8]
    for c in clients:
        out = c.generate(input_ids=prompt, sampling_params={"max_new_tokens": 4, "temperature": 0,
                                                            "ignore_eos": True})
        assert out["meta_info"]["weight_version"] == version
        assert out["output_ids"] == greedy_reference(model, prompt, 4, eos=())


@pytest.mark.parametrize("receivers", [1, 2, 4])
def test_distributed_push(backend, receivers):
    """mode=distributed: SGLang's own init_custom_process_group joins reflow's gloo group (trainer
    rank 0, engine i rank 1 + i), and each bucket arrives through one broadcast."""
    clients = backend.clients(receivers)
    model, _, named = pushed(backend.arch, seed=40 + receivers)
    version = f"d{receivers}-{time.time_ns()}"
    stats = push_weights(clients, named, version, PushSettings(mode="distributed", backend="gloo", verify="full",
                                                               bucket_bytes=16 << 10), probe=probe_of(model))
    assert stats["mode"] == "distributed" and stats["buckets"] > 1 and stats["engines"] == receivers
    assert stats["verify_method"] == VERIFY_METHOD[backend.name, backend.arch]
    _generation_follows(clients, model, version)
    if receivers != 2:
        return
    # The group stays open: the next push to the same engines skips the rendezvous (1.2 s over NCCL) ...
    model, _, named = pushed(backend.arch, seed=60)
    settings = PushSettings(mode="distributed", backend="gloo", verify="full", bucket_bytes=16 << 10)
    stats = push_weights(clients, named, version + "b", settings, probe=probe_of(model))
    assert stats["group_reused"] is True
    _generation_follows(clients, model, version + "b")
    # ... and other engines (a recreated one has a new URL) get a group of their own.
    assert push_weights(clients[:1], named, version + "c", settings, probe=probe_of(model))["group_reused"] is False
    stats = push_weights(clients, named, version + "d", settings, probe=probe_of(model))
    assert stats["group_reused"] is False and stats["verify_method"] == VERIFY_METHOD[backend.name, backend.arch]
    _generation_follows(clients, model, version + "d")


def test_disk_push(backend, tmp_path):
    """mode=disk: every engine reloads the HF folder the trainer wrote (SGLang: its DefaultModelLoader
    over the stand-in model's load_weights), without a session."""
    from reflow.engines.weights.push import publish_weights
    from reflow.rl.demo_policy import save_policy

    clients = backend.clients(2)
    model, tok, named = pushed(backend.arch, seed=50)
    version = f"disk-{time.time_ns()}"
    path = publish_weights(lambda out: save_policy(model, tok, out), str(tmp_path), version).path
    stats = push_weights(clients, named, version, PushSettings(mode="disk", verify="full"), model_path=path,
                         probe=probe_of(model))
    assert stats["mode"] == "disk" and stats["verify_method"] == VERIFY_METHOD[backend.name, backend.arch]
    _generation_follows(clients, model, version)


def _memory_events(c: EngineClient) -> list:
    """What the engine released and resumed, in order: the embedded engine's record, or the calls
    SGLang's scheduler made on its memory saver (the stand-in's record)."""
    info = c.server_info()
    if "memory_events" in info:
        return [(kind, tag) for kind, tags in info["memory_events"] for tag in tags]
    return [tuple(e) for e in info["internal_states"][0]["memory_events"]]


def test_release_resume_around_a_push(backend):
    """Colocated mode's order (tasks/colocate.py): release everything, resume the weights, push,
    resume the rest; generation then follows the pushed weights."""
    c = backend.clients(1)[0]
    model, _, named = pushed(backend.arch, seed=60)
    before = len(_memory_events(c))
    c.release_memory_occupation(["weights", "kv_cache", "cuda_graph"])
    c.resume_memory_occupation(["weights"])
    push_weights([c], named, "v60", PushSettings(verify="full"), probe=probe_of(model))
    c.resume_memory_occupation(["kv_cache", "cuda_graph"])
    events = _memory_events(c)[before:]
    assert [k for k, _ in events] == ["release"] * 3 + ["resume"] * 3
    assert {t for k, t in events[:3]} == {t for k, t in events[3:]} == {"weights", "kv_cache", "cuda_graph"}
    assert events[3][1] == "weights"
    _generation_follows([c], model, "v60")


@pytest.mark.parametrize("name", ["sglang", "embedded"])
def test_server_info_names_the_dtype_the_engine_holds(name, request):
    """Issue 14 point 4: under SGLang's --dtype auto a float32 checkpoint is held as float16 while
    /server_info says "auto". reflow's launcher now pins the dtype (these servers get its flags): the
    reported dtype must reproduce the values the engine holds, read back through get_weights_by_name."""
    c = _backend(request, name, "llama").clients(1)[0]
    _, _, named = pushed("llama", seed=30)
    push_weights([c], named, "v30", PushSettings(mode="tensor", verify="off"))
    reported = str(c.server_info()["dtype"]).removeprefix("torch.")
    assert reported != "auto", "the engine does not say which dtype it holds"
    dtype = {"float": torch.float32, "half": torch.float16}.get(reported) or getattr(torch, reported)
    sent = dict(named)["model.layers.0.self_attn.q_proj.weight"]
    got = torch.tensor(c.get_weights_by_name("model.layers.0.self_attn.q_proj.weight", truncate_size=1000))
    assert torch.equal(got, sent.to(dtype).float())


# ---------------------------------------------------------------- SGLang's own behaviour behind two fixes


def test_sglangs_server_demands_the_key_it_read_from_its_config_file(sglang_apps):
    """The launcher hands SGLang the key in a `--config` file, not as `--api-key` on the command line (issue 51):
    SGLang's own start-up merged it, so its middleware refuses a request without it and takes one with it."""
    import httpx

    url = sglang_apps[AUTO][0]
    assert httpx.get(f"{url}/model_info", timeout=30).status_code == 401
    assert httpx.get(f"{url}/model_info", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code == 200


def test_sglang_auto_dtype_holds_float32_checkpoints_as_float16(sglang_apps):
    """Why the launcher pins --dtype (issue 14 point 4): under "auto", SGLang's ModelConfig loads a
    float32 checkpoint as float16, and /server_info still says "auto"."""
    c = EngineClient(sglang_apps[AUTO][0], timeout=60, api_key=KEY)
    _, _, named = pushed("llama", seed=70)
    push_weights([c], named, "v40", PushSettings(mode="tensor", verify="off"))
    assert c.server_info()["dtype"] == "auto"
    sent = dict(named)["model.layers.0.mlp.up_proj.weight"]
    got = torch.tensor(c.get_weights_by_name("model.layers.0.mlp.up_proj.weight", truncate_size=1000))
    assert torch.equal(got, sent.half().float()) and not torch.equal(got, sent)


def test_one_pickled_payload_serves_two_receipts_only(sglang_apps):
    """Why every receiver needs its own payload (issue 14 point 2): SGLang rebuilds a shared-memory
    handle through torch's file_system strategy, and each rebuild that is freed again consumes a
    reference the one pickle carried; the third receiver cannot open the buffer any more."""
    from reflow.engines.weights.buckets import serialize_bucket

    c = EngineClient(sglang_apps[AUTO][0], timeout=60, api_key=KEY)
    _, _, named = pushed("llama", seed=71)
    payload = serialize_bucket(named[:2])
    c.begin_weight_update()
    try:
        for i in range(2):
            assert c.update_weights_from_tensor([payload], "flattened_bucket", True, f"p{i}")["success"]
        with pytest.raises(EngineError):
            c.update_weights_from_tensor([payload], "flattened_bucket", True, "p2")
    finally:  # a fresh connection: the server closes the one a 500 went out on
        EngineClient(sglang_apps[AUTO][0], timeout=60, api_key=KEY).end_weight_update()
    assert "unable to open shared memory object" in sglang_apps[LOG].read_text()


def test_lora_adapter_push_through_sglangs_lora_path(sglang_apps, model_dirs):
    """Adapter-only pushes to SGLang's app launched with reflow's LoRA flags (issue 20; what is SGLang's
    own code: tests/sglang_lora_side.py): each version loads as `reflow-v<version>` through its
    tokenizer manager, TP worker (expected_checksums) and LoRA manager, the previous version is unloaded,
    the same version pushed again is unloaded first, and since /server_info says enable_lora the push is
    verified by logprobs of probe requests naming the adapter; a request naming an unloaded version is
    refused by SGLang's resolution, and one without lora_path is served by the base model."""
    from reflow.engines.rollout_client import generate_batch
    from reflow.engines.train import lora as train_lora
    from reflow.engines.weights import lora
    from reflow.engines.weights.adapter_push import push_adapter
    from tests.test_lora import SETTINGS, _peft_model, _probe

    assert SETTINGS.rank == 4 and tuple(SETTINGS.target_modules) == LORA_TARGETS  # what the server was launched for
    c = EngineClient(sglang_apps[LORA][0], timeout=60, api_key=KEY)
    assert c.server_info()["enable_lora"] is True
    config = lora.adapter_config(4, SETTINGS.alpha, list(LORA_TARGETS), str(model_dirs["llama"]))
    for seed, version, unloaded in ((1, "1", 0), (2, "2", 1), (2, "2", 0)):
        model = _peft_model(model_dirs["llama"], seed)
        adapter, effective = train_lora.split([(n, p.detach()) for n, p in model.named_parameters()], SETTINGS)
        stats = push_adapter([c], adapter, config, effective, version, PushSettings(verify="full"), probe=_probe(model))
        assert stats["verify_method"] == "logprobs" and stats["logprob_max_diff"] < 1e-5, stats
        assert "enable_lora" in stats["verify_fallback"][c.url] and stats["unloaded"] == unloaded
        assert c.lora_adapters() == [lora.adapter_name(version)] and c.model_info()["weight_version"] == version
    other = _peft_model(model_dirs["llama"], 3)  # the adapter's logprobs are not the base model's, nor another's
    with pytest.raises(WeightSyncError, match="logprobs of the probe batch differ"):
        verify_push([c], effective, "2", "logprobs", probe=_probe(other), lora_path="reflow-v2")
    with pytest.raises(WeightSyncError, match="logprobs of the probe batch differ"):
        verify_push([c], effective, "2", "logprobs", probe=_probe(model))  # no lora_path: the base model answers
    sp = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    prompt = [5, 6, 7, 8]
    out = generate_batch([c], [prompt], sp, lora_path="reflow-v2")
    assert out[0]["output_ids"] == greedy_reference(model, prompt, 3, eos=())
    with pytest.raises(EngineError, match="reflow-v1") as e:
        generate_batch([c], [prompt], sp, lora_path="reflow-v1")
    assert e.value.status == 400
    shared = SharedBucket(adapter)
    try:  # one tensor's sha256 wrong: SGLang's TP worker refuses the payload and nothing is registered
        sums = {**lora.checksums(adapter), adapter[0][0]: "0" * 64}
        with pytest.raises(EngineError):
            c.load_lora_adapter_from_tensors("reflow-v9", config, shared.payloads(1), "flattened_bucket", sums)
    finally:
        shared.release()
    deadline = time.monotonic() + 10  # the server's log reaches the file a little later
    while "adapter sync MISMATCH of 8 expected: 1 value-diff" not in sglang_apps[LOG].read_text():
        assert time.monotonic() < deadline, "SGLang's TP worker did not report the checksum mismatch"
        time.sleep(0.1)
    assert EngineClient(sglang_apps[LORA][0], timeout=60, api_key=KEY).lora_adapters() == ["reflow-v2"]
