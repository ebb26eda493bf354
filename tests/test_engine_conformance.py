"""Every rollout backend against docs/ENGINE_CONTRACT.md, through reflow's own client (issue 53 point 5).

One set of checks, parametrized over the backends reflow ships: the embedded engine (served in this
process, as tests/test_engine.py serves it) and SGLang 0.5.23's own HTTP app on CPU (servers forked by
tests/sglang_app.py, launched with the flags reflow's launcher gives `sglang.launch_server`; that file
says which parts are SGLang's code and which are CPU stand-ins). Every check goes through
`EngineClient` and reflow's weight pusher and verifier, and each is named after the contract row it
checks (each docstring starts with the rows of the document's tables it covers). A row that one backend
cannot show on CPU is skipped there with the reason, naming the row. One tiny Llama (build("llama")) is
served by both (by SGLang twice: plainly, and with reflow's LoRA flags for the adapter rows); tests that
depend on the weights push known ones first, so the order of tests does not matter. ~35 s on a quiet
machine (SGLang's import and start-up are ~15 s of it).
"""
from __future__ import annotations

import base64
import json
import os
import pickle
import re
import subprocess
import sys
import threading
import time
import tomllib
import uuid
from pathlib import Path

import httpx
import pytest
import torch

from reflow.engines.embedded.engine import SGLANG_API_VERSION
from reflow.engines.rollout_client import EngineClient, EngineError, generate_batch, poll_health
from reflow.engines.sglang import contract as sglang_contract
from reflow.engines.train.settings import LoraSettings
from reflow.engines.weights import push
from reflow.engines.weights.buckets import serialize_bucket
from reflow.engines.weights.mapped import CAPABILITY, MAPPED
from reflow.engines.weights.push import DISK_FILES, close_weight_groups, publish_weights, push_weights
from reflow.engines.weights.settings import PushSettings
from reflow.engines.weights.verify import engine_input_logprobs
from tests.reference import greedy_reference
from tests.sglang_backends import KEY, REPO, Backend, build, free_port, probe_of, pushed, stop

CONTRACT = sglang_contract.load()
DOC = REPO / "docs" / "ENGINE_CONTRACT.md"
ARCH = "llama"  # SGLang's Llama class answers get_weights_by_name, so every read-back row runs on both
NO_WHEEL = "sglang==0.5.23 is not installed (make setup installs it --no-deps): no SGLang app to test against"
# Sampling runs in the CPU stand-in of SGLang's scheduler (tests/sglang_app.py), not in SGLang's sampler.
STAND_IN_SAMPLER = "on CPU SGLang's sampler does not run (tests/sglang_app.py samples in a stand-in)"
STAND_IN_SCHEDULER = "on CPU SGLang's scheduler does not run (tests/sglang_app.py stands in for it)"
BACKENDS = [pytest.param("embedded", id="embedded"),
            pytest.param("sglang", id="sglang", marks=[pytest.mark.slow, pytest.mark.skipif(CONTRACT is None,
                                                                                           reason=NO_WHEEL)])]
LORA = LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))  # tests/test_lora.py's adapters
GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
PROMPT = [5, 6, 7, 8]


# ---------------------------------------------------------------- servers (one per backend, for the module)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("conformance_llama")
    build(ARCH, d)
    return d


@pytest.fixture(scope="module")
def embedded_url(model_dir):
    from reflow.engines.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine(str(model_dir), "conformance-0", threads=1, api_key=KEY)
    engine.ready()
    yield engine.url()
    close_weight_groups()
    engine.shutdown()


@pytest.fixture(scope="module")
def sglang_urls(model_dir, tmp_path_factory) -> dict[str, str]:
    """SGLang's own app for `model_dir`, launched with reflow's launcher flags: "base" as a colocated run
    launches it (memory saver on), "lora" as a trainer.lora run does. Two forked servers of tests.sglang_app."""
    from reflow.engines.sglang.launcher import command_line, server_args

    tmp = tmp_path_factory.mktemp("conformance_sglang")
    ports = {"base": free_port(), "lora": free_port()}
    extra = {"base": {"enable_memory_saver": True},
             "lora": {"lora_rank": LORA.rank, "lora_target_modules": tuple(LORA.target_modules)}}
    serve = []
    for name, port in ports.items():
        flags = command_line(server_args(str(model_dir), host="127.0.0.1", port=port, nccl_port=free_port(),
                                         api_key=KEY, **extra[name]), secrets_dir=tmp)[3:]  # the key in a --config
        serve += ["--serve", json.dumps(flags)]
    log = tmp / "servers.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tests.sglang_app", *serve], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT)

    def alive():
        if proc.poll() is not None:
            raise RuntimeError(f"tests.sglang_app exited with {proc.returncode}:\n{log.read_text()[-3000:]}")

    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    try:
        for url in urls.values():
            last = poll_health(url, 240.0, 0.2, alive)
            assert last is None, f"SGLang app {url} not healthy: {last}\n{log.read_text()[-6000:]}"
        yield urls
    finally:
        close_weight_groups()
        stop(proc)


def _url(request, name: str, server: str = "base") -> str:
    return request.getfixturevalue("embedded_url") if name == "embedded" else request.getfixturevalue("sglang_urls")[server]


@pytest.fixture(params=BACKENDS)
def backend(request) -> Backend:
    return Backend(request.param, ARCH, [_url(request, request.param)])


@pytest.fixture()
def client(backend) -> EngineClient:
    c = backend.clients(1)[0]
    yield c
    c.close()


def _serve(c: EngineClient, seed: int) -> tuple[torch.nn.Module, str]:
    """Push the weights of a fresh model (seed) through SGLang's own update window; returns it and its version."""
    model, _, named = pushed(ARCH, seed=seed)
    version = f"s{seed}-{uuid.uuid4().hex[:6]}"
    push_weights([c], named, version, PushSettings(mode="tensor", verify="off", map_once=False))
    return model, version


def _skip_on(backend: Backend, name: str, reason: str) -> None:
    if backend.name == name:
        pytest.skip(reason)


# ---------------------------------------------------------------- version and auth


def test_one_pinned_sglang_version_everywhere():
    """row: version. The version the embedded engine serves, pyproject's pin, the contract loader's pin
    and the document all name one SGLang release (and the installed wheel is it, where installed)."""
    pin = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["sglang"]
    assert pin == [f"sglang=={SGLANG_API_VERSION}"]
    assert sglang_contract.PINNED_VERSION == SGLANG_API_VERSION
    assert f"SGLang {SGLANG_API_VERSION}" in DOC.read_text()
    if CONTRACT is not None:
        assert CONTRACT.version == SGLANG_API_VERSION


def test_server_info_reports_the_pinned_version(client):
    """row: GET /server_info (version)."""
    assert client.server_info()["version"] == SGLANG_API_VERSION


def test_everything_but_the_probes_needs_the_bearer_token(backend):
    """row: auth. No token or a wrong one: 401 from every endpoint reflow calls; the probes stay open."""
    url = backend.urls[0]
    for key in (None, KEY[::-1]):
        anon = EngineClient(url, timeout=30, api_key=key)
        for method, args in (("model_info", {}), ("server_info", {}), ("flush_cache", {}),
                             ("pause_generation", {"mode": "abort"}), ("begin_weight_update", {}),
                             ("generate", {"input_ids": PROMPT, "sampling_params": GREEDY})):
            with pytest.raises(EngineError) as e:
                getattr(anon, method)(**args)
            assert e.value.status == 401, (method, key is None, e.value)
        anon.close()
    assert poll_health(url, 30.0, 0.1, lambda: None) is None  # /health_generate without a token: 200
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200


# ---------------------------------------------------------------- /generate


def test_generate_answers_prompt_major_with_logprob_triples(client):
    """rows: POST /generate (request fields, response fields, n > 1 order, logprob triples)."""
    prompts = [[5, 6, 7], [8, 9]]
    out = generate_batch([client], prompts, {"max_new_tokens": 3, "temperature": 0.7}, n=2)
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [3, 3, 2, 2]  # sample j of prompt i at i * n + j
    assert len({o["meta_info"]["id"] for o in out}) == 4
    version = client.model_info()["weight_version"]
    for o in out:
        meta = o["meta_info"]
        if CONTRACT is not None:
            CONTRACT.GenerateResponse.from_json_value(o)
        assert isinstance(o["text"], str) and meta["completion_tokens"] == len(o["output_ids"]) >= 1
        assert meta["finish_reason"]["type"] in ("stop", "length") and meta["weight_version"] == version
        triples = meta["output_token_logprobs"]
        assert [t[1] for t in triples] == o["output_ids"]
        assert all(isinstance(t[0], float) and t[0] <= 0.0 and len(t) == 3 for t in triples)
    single = client.generate(input_ids=PROMPT, sampling_params=GREEDY)  # one prompt, n=1: one dict
    assert isinstance(single, dict) and len(single["output_ids"]) == 4
    assert single["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


def test_seeded_requests_repeat(backend, client):
    """row: POST /generate (`sampling_seed`): the same seed gives the same sample (generate_batch's seeds)."""
    _skip_on(backend, "sglang", f"row 'sampling_seed': {STAND_IN_SAMPLER}")
    sp = {"max_new_tokens": 6, "temperature": 1.0}
    a, b = (generate_batch([client], [PROMPT], sp, n=2, seeds=[7, 8]) for _ in range(2))
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]


def test_greedy_output_logprobs_are_the_models(backend, client):
    """row: logprobs (output_token_logprobs, greedy): the served model's tokens and plain log-softmax values."""
    _skip_on(backend, "sglang", f"row 'logprobs (output)': {STAND_IN_SAMPLER}")
    model, version = _serve(client, seed=3)
    out = client.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
    assert out["output_ids"] == greedy_reference(model, PROMPT, 4, eos=())
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + out["output_ids"][:-1]])).logits[0, len(PROMPT) - 1:]  # [4, V]
    want = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(out["output_ids"])[:, None])[:, 0]  # [4]
    got = torch.tensor([t[0] for t in out["meta_info"]["output_token_logprobs"]])  # [4]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_sampled_logprobs_are_tempered_and_not_renormalized(backend, client):
    """row: logprobs (output_token_logprobs, sampled): log_softmax(logits / temperature) of the sampled
    token, taken before top-p renormalisation (the importance ratio's denominator)."""
    _skip_on(backend, "sglang", f"row 'logprobs (output)': {STAND_IN_SAMPLER}")
    model, _ = _serve(client, seed=4)
    sp = {"max_new_tokens": 5, "temperature": 0.7, "top_p": 0.9, "ignore_eos": True, "sampling_seed": 1}
    out = client.generate(input_ids=PROMPT, sampling_params=sp, return_logprob=True)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + out["output_ids"][:-1]])).logits[0, len(PROMPT) - 1:]  # [5, V]
    want = torch.log_softmax(logits.float() / 0.7, -1).gather(1, torch.tensor(out["output_ids"])[:, None])[:, 0]
    got = torch.tensor([t[0] for t in out["meta_info"]["output_token_logprobs"]])  # [5]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_input_logprobs_score_the_prompt(client):
    """row: logprobs (input_token_logprobs, logprob_start_len=0): one entry per prompt token, the first
    null, each the served model's logprob; what verify=logprobs reads (verify.engine_input_logprobs)."""
    model, _ = _serve(client, seed=5)
    probe = probe_of(model)
    got = engine_input_logprobs(client, probe.prompts)  # raises when ids or the leading null are wrong
    assert [len(g) for g in got] == [len(p) - 1 for p in probe.prompts]
    torch.testing.assert_close(torch.cat(got), torch.cat(probe.reference), rtol=0, atol=1e-5)
    plain = client.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
    assert plain["meta_info"]["input_token_logprobs"] == []  # default start -1: output logprobs only


def test_a_bad_request_is_a_400_with_a_message(client):
    """row: errors (POST /generate): unknown or out-of-range sampling params are refused, not ignored."""
    with pytest.raises(EngineError) as e:
        client.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2, "no_such_key": 1})
    assert e.value.status == 400 and "no_such_key" in e.value.message
    with pytest.raises(EngineError) as e:
        client.generate(input_ids=PROMPT, sampling_params={"top_p": 0.0})
    assert e.value.status == 400 and "top_p" in e.value.message


# ---------------------------------------------------------------- info


def test_model_and_server_info_fields(client, model_dir):
    """rows: GET /model_info, GET /server_info, GET /v1/models: the fields reflow reads."""
    info = client.model_info()
    # the served weights' folder: the model's own, or the folder of a disk push made earlier on this engine (SGLang's
    # model_path follows update_weights_from_disk: in random order test_disk_update may run first)
    assert info["tokenizer_path"] == str(model_dir)
    assert info["model_path"] == str(model_dir) or (Path(info["model_path"]) / "config.json").is_file(), info
    assert isinstance(info["weight_version"], str)
    server = client.server_info()
    assert server["dtype"] == "float32"  # pinned by the launcher; what the weight check casts to
    assert int(server.get("tp_size", 1) or 1) == 1 and not server.get("enable_lora")
    assert client.lora_adapters() == []  # /v1/models: the base model's card only


def test_reflow_extensions_only_where_advertised(backend, client):
    """row: reflow extensions. The embedded engine advertises /reflow/* and disk `files` in /server_info;
    SGLang advertises neither and does not serve them, so reflow never sends them there."""
    ours = backend.name == "embedded"
    info = client.server_info()
    assert bool(info.get(CAPABILITY)) is ours and bool(info.get(DISK_FILES)) is ours
    assert MAPPED.supports([client]) is ours
    with pytest.raises(EngineError) as e:
        client.map_weights(["not a payload"], "")
    assert e.value.status == (400 if ours else 404)


# ---------------------------------------------------------------- control plane


def test_pause_holds_new_requests_until_continue(client):
    """rows: POST /pause_generation, POST /continue_generation."""
    assert client.pause_generation("abort")["status"] == "ok"
    done: list = []
    t = threading.Thread(target=lambda: done.append(client.generate(input_ids=PROMPT, sampling_params=GREEDY)))
    try:
        t.start()
        t.join(1.0)
        held = not done
    finally:
        assert client.continue_generation()["status"] == "ok"
    t.join(30)
    assert held, "/generate was answered while generation was paused"
    assert done and len(done[0]["output_ids"]) == 4


def test_abort_all_is_accepted(client):
    """row: POST /abort_request (abort_all): 200 with an empty body; the engine keeps serving."""
    assert client.abort_request(abort_all=True) is None
    assert client._http.post("/abort_request", json={"abort_all": True}).content == b""
    assert len(client.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]) == 4


def test_an_aborted_request_finishes_with_type_abort(backend, client):
    """row: POST /abort_request (rid): a request aborted while waiting answers finish_reason abort."""
    _skip_on(backend, "sglang", f"row 'abort_request (rid)': {STAND_IN_SCHEDULER}; its stand-in does not "
                                "track requests, so an abort has nothing to land on")
    rid = f"conformance-{uuid.uuid4().hex}"
    client.pause_generation("in_place")
    done: list = []
    t = threading.Thread(target=lambda: done.append(client.generate(input_ids=PROMPT, sampling_params=GREEDY,
                                                                    rid=rid)))
    try:
        t.start()
        deadline = time.monotonic() + 10
        while client.server_info()["internal_states"][0]["num_waiting_reqs"] < 1:
            assert time.monotonic() < deadline, "the request never queued"
            time.sleep(0.02)
        client.abort_request(rid=rid)
        t.join(10)
    finally:
        client.continue_generation()
        t.join(30)
    assert done and done[0]["meta_info"]["finish_reason"]["type"] == "abort" and done[0]["output_ids"] == []


def test_flush_cache_when_idle(client):
    """row: /flush_cache (idle): 200 with a text body."""
    assert "flushed" in client.flush_cache().lower()


def test_release_and_resume_a_memory_tag(backend, client):
    """rows: POST /release_memory_occupation, POST /resume_memory_occupation (tags): 200 null each, the
    engine releases and resumes exactly the tag named, and generates again after the resume."""
    def events() -> list:
        info = client.server_info()
        if "memory_events" in info:  # the embedded engine's record
            return [(kind, tag) for kind, tags in info["memory_events"] for tag in tags]
        return [tuple(e) for e in info["internal_states"][0]["memory_events"]]  # SGLang's calls on its saver

    before = len(events())
    assert client._http.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).json() is None
    try:
        assert events()[before:] == [("release", "kv_cache")]
    finally:
        client.resume_memory_occupation(["kv_cache"])
    assert events()[before:] == [("release", "kv_cache"), ("resume", "kv_cache")]
    assert len(client.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]) == 4


def test_generate_is_refused_while_weights_are_released(backend, client):
    """row: /release_memory_occupation (weights): no request runs on released weights."""
    _skip_on(backend, "sglang", "row 'release_memory_occupation (weights)': CPU cannot show what SGLang does "
                                "with a request on released memory (torch_memory_saver is GPU-only)")
    client.release_memory_occupation(["weights"])
    try:
        with pytest.raises(EngineError) as e:
            client.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert e.value.status == 400
    finally:
        client.resume_memory_occupation(["weights"])


# ---------------------------------------------------------------- weight updates


def test_weight_updates_need_a_session(client):
    """rows: POST /begin_weight_update, POST /end_weight_update, update_weights_from_tensor outside a
    session: a 400 and nothing changes; begin twice and end without begin are 400s too."""
    with pytest.raises(EngineError) as e:
        client.end_weight_update()
    assert e.value.status == 400 and e.value.message
    version = client.model_info()["weight_version"]
    _, _, named = pushed(ARCH, seed=6)
    payload = serialize_bucket(named[:1])
    with pytest.raises(EngineError) as e:
        client.update_weights_from_tensor([payload], "flattened_bucket", True, "outside")
    assert e.value.status == 400 and client.model_info()["weight_version"] == version
    pickle.loads(base64.b64decode(payload))  # refused unread: take its shared-memory reference back
    assert client.begin_weight_update()["success"] is True
    try:
        with pytest.raises(EngineError) as e:
            client.begin_weight_update()
        assert e.value.status == 400
    finally:
        assert client.end_weight_update()["success"] is True


def test_tensor_push_lands_and_reads_back(client):
    """rows: update_weights_from_tensor (flattened_bucket, weight_version), get_weights_by_name (truncate_size):
    a push in several buckets through pause/flush/begin/end/continue is read back whole and truncated."""
    model, _, named = pushed(ARCH, seed=7)
    version = f"t-{uuid.uuid4().hex[:6]}"
    settings = PushSettings(mode="tensor", verify="full", map_once=False, bucket_bytes=16 << 10)
    stats = push_weights([client], named, version, settings)
    assert stats["buckets"] > 1 and stats["verify_method"] == "weights" and stats["verified_tensors"] == len(named)
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(torch.tensor(client.get_weights_by_name(name, truncate_size=2)), dict(named)[name][:2])
    assert client.model_info()["weight_version"] == version
    out = client.generate(input_ids=PROMPT, sampling_params=GREEDY)
    assert out["meta_info"]["weight_version"] == version


def test_weight_version_relabel(client):
    """row: POST /update_weight_version: the label moves, the weights do not."""
    name = "model.layers.1.self_attn.o_proj.weight"
    before = client.get_weights_by_name(name, truncate_size=3)
    version = f"relabel-{uuid.uuid4().hex[:6]}"
    out = client.update_weight_version(version, abort_all_requests=False)
    assert out["success"] is True and out["new_version"] == version
    assert client.model_info()["weight_version"] == version
    assert client.generate(input_ids=PROMPT, sampling_params=GREEDY)["meta_info"]["weight_version"] == version
    assert client.get_weights_by_name(name, truncate_size=3) == before


def test_disk_update(backend, client, tmp_path):
    """row: POST /update_weights_from_disk (no session): the engine loads the folder and takes its version."""
    from reflow.rl.demo_policy import save_policy

    model, tok, named = pushed(ARCH, seed=8)
    version = f"disk-{uuid.uuid4().hex[:6]}"
    published = publish_weights(lambda out: save_policy(model, tok, out), str(tmp_path), version)
    stats = push_weights([client], named, version, PushSettings(mode="disk", verify="full"), model_path=published.path,
                         model_files=published.files)
    assert stats["verify_method"] == "weights" and stats["verified_tensors"] == len(named)
    assert stats["disk_files_checked"] == (backend.name == "embedded")  # the `files` extension is ours only


def test_distributed_update(client):
    """rows: init_weights_update_group, update_weights_from_distributed, destroy_weights_update_group (gloo):
    the engine joins reflow's group as rank 1, receives each bucket's broadcast, and drops the group."""
    model, _, named = pushed(ARCH, seed=9)
    version = f"dist-{uuid.uuid4().hex[:6]}"
    settings = PushSettings(mode="distributed", backend="gloo", verify="full", bucket_bytes=16 << 10)
    try:
        stats = push_weights([client], named, version, settings)
        assert stats["buckets"] > 1 and stats["verified_tensors"] == len(named)
        names = [g.name for g in push._GROUPS.values()]  # the group kept open for the next push
    finally:
        close_weight_groups()  # destroy_weights_update_group on the engine
    assert len(names) == 1
    with pytest.raises(EngineError) as e:  # it is gone: destroying it again is refused
        client.destroy_weights_update_group(names[0])
    assert e.value.status == 400


def test_take_over_ends_a_session_left_open(client):
    """row: recovery (EngineClient.take_over): a paused engine with a session open is brought back by
    end_weight_update + continue, relying on the 400 of a step with nothing to do."""
    client.pause_generation("abort")
    client.begin_weight_update()
    assert client.take_over([]) == ["end_weight_update"]
    assert len(client.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]) == 4  # not paused
    assert client.take_over([]) == []  # nothing left to end: its 400 is skipped


def test_take_over_resumes_released_tags(backend, client):
    """row: recovery (take_over with memory tags): a tag released earlier is resumed, one held is skipped."""
    _skip_on(backend, "sglang", "row 'recovery (memory tags)': SGLang's scheduler raises KeyError for a tag that "
                                "is not released; in-process here that is a 400, what its real scheduler process "
                                "answers cannot be shown on CPU")
    client.release_memory_occupation(["kv_cache"])
    assert client.take_over(["weights", "kv_cache"]) == ["resume kv_cache"]
    assert client.take_over(["weights", "kv_cache"]) == []


def test_flush_is_refused_while_requests_run(backend, client):
    """row: /flush_cache (busy): a 400 while requests run unpaused (what push's flush retries on). Seen
    only when the server reports the request running both before and after the flush."""
    _skip_on(backend, "sglang", f"row 'flush_cache (busy)': {STAND_IN_SCHEDULER}; its stand-in always flushes")
    def loads() -> int:
        return client.server_info()["internal_states"][0]["num_running_reqs"]

    seen = []
    for _ in range(5):
        t = threading.Thread(target=client.generate, kwargs={
            "input_ids": [PROMPT] * 32, "sampling_params": {"max_new_tokens": 100, "temperature": 1.0}})
        t.start()
        try:
            while t.is_alive() and not loads():
                time.sleep(0.005)
            before = loads()
            try:
                client.flush_cache()
                status = 200
            except EngineError as e:
                status = e.status
            if before and loads():
                seen.append(status)
        finally:
            t.join(60)
        if seen:
            break
    assert seen, "never caught a request running (the model decodes too fast for this check)"
    assert set(seen) == {400}


@pytest.mark.parametrize("name", BACKENDS)
def test_adapter_push_and_requests_naming_it(name, request, model_dir):
    """rows: load_lora_adapter_from_tensors, unload_lora_adapter, GET /v1/models, /generate `lora_path`: an
    adapter pushed as a version is listed, serves requests naming it, is verified (read back where merged,
    by logprobs where applied per request), replaced by the next version; a request naming an adapter the
    engine does not hold is a 400. (The SGLang server here is launched with reflow's LoRA flags.)"""
    from reflow.engines.train import lora as train_lora
    from reflow.engines.weights import lora
    from reflow.engines.weights.adapter_push import push_adapter
    from tests.test_lora import SETTINGS, _peft_model
    from tests.test_lora import _probe as lora_probe

    assert SETTINGS == LORA  # what the SGLang server was launched for
    c = EngineClient(_url(request, name, "lora"), timeout=60, api_key=KEY)
    config = lora.adapter_config(LORA.rank, LORA.alpha, list(LORA.target_modules), str(model_dir))
    _serve(c, seed=0)  # model_dir's own weights: what the adapters were trained on (other tests pushed others)
    try:
        for seed, version in ((1, "1"), (2, "2")):
            model = _peft_model(model_dir, seed)
            adapter, effective = train_lora.split([(n, p.detach()) for n, p in model.named_parameters()], LORA)
            stats = push_adapter([c], adapter, config, effective, version, PushSettings(verify="full"),
                                 probe=lora_probe(model))
            assert stats["verify_method"] == ("weights" if name == "embedded" else "logprobs"), stats
            assert c.lora_adapters() == [lora.adapter_name(version)] and c.model_info()["weight_version"] == version
        out = generate_batch([c], [PROMPT], GREEDY, lora_path=lora.adapter_name("2"))
        assert out[0]["output_ids"] == greedy_reference(model, PROMPT, 4, eos=())
        with pytest.raises(EngineError) as e:
            generate_batch([c], [PROMPT], GREEDY, lora_path=lora.adapter_name("1"))
        assert e.value.status == 400 and "reflow-v1" in e.value.message
    finally:
        for held in c.lora_adapters():  # the embedded engine serves the other tests: base weights back
            c.unload_lora_adapter(held)
    assert c.lora_adapters() == []


def test_doc_names_every_endpoint_the_client_calls():
    """The document names every path EngineClient calls (so a new endpoint gets a row)."""
    import inspect

    from reflow.engines import rollout_client

    called = set(re.findall(r'_call\("(?:GET|POST)", "(/[a-z_/0-9]+)"', inspect.getsource(rollout_client)))
    assert len(called) > 20
    doc = DOC.read_text()
    assert not sorted(p for p in called if not re.search(re.escape(p) + r"(?![a-z_/0-9])", doc))
