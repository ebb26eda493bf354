"""Issue 13, point 3: every engine and router endpoint needs the runtime's bearer token; weight payloads
are bounded.

Written first, as proofs of concept of the attacks (each one succeeded before the fix): an
unauthenticated client loaded an arbitrary checkpoint into the engine, read its weights, opened a
weight session, added its own worker to the router, and a weight payload of ~60 bytes made the
engine allocate 8 GiB. The rule is SGLang 0.5.23's (`sglang/srt/utils/auth.py`,
`decide_request_auth`): probes (/health*, /ready*, /metrics*) and OPTIONS stay open, everything else
needs `Authorization: Bearer <api key>`; the tests compare ours with SGLang's own code where the
wheel is installed.
"""
from __future__ import annotations

import base64
import importlib.util
import pickle
from pathlib import Path

import httpx
import pytest
import torch

from reflow.engines.embedded.engine import EmbeddedEngine
from reflow.engines.http_serve import PROBE_PREFIXES, ThreadedServer, auth_refusal, new_api_key
from reflow.engines.rollout_client import EngineClient, EngineError, poll_health
from reflow.engines.sglang import contract as sglang_contract
from reflow.engines.sglang.router import Router
from reflow.engines.weights.buckets import BucketError, load_payload, serialize_bucket, serialize_named_tensors
from tests.engine_fixtures import served

KEY = new_api_key()
WRONG = new_api_key()
CONTRACT = sglang_contract.load()
needs_wheel = pytest.mark.skipif(CONTRACT is None, reason="sglang==0.5.23 is not installed")


@pytest.fixture(scope="module")
def engine(tiny_policy):
    with served(tiny_policy, "auth-engine", KEY) as e:
        yield e


@pytest.fixture(scope="module")
def evil_checkpoint(tiny_policy, tmp_path_factory):
    from reflow.engines.hf_io import load_tokenizer
    from reflow.rl.demo_policy import build_model, save_policy

    tok = load_tokenizer(str(tiny_policy))
    return str(save_policy(build_model(tok, hidden=32, layers=2, heads=2, mlp=64, seed=99), tok,
                           tmp_path_factory.mktemp("evil")))


def _auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _routes(app) -> list[tuple[str, str]]:
    return [(m, r.path) for r in app.routes for m in sorted(getattr(r, "methods", None) or ())]


# ---------------------------------------------------------------- the attacks, refused


@pytest.mark.parametrize("headers", [{}, _auth(WRONG), {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
                                     {"Authorization": "Bearer"}, {"Authorization": f"Bearer {KEY}x"}])
def test_unauthenticated_disk_load_is_refused_and_changes_nothing(engine, evil_checkpoint, headers):
    before = EngineClient(engine.url(), api_key=KEY).get_weights_by_name("model.norm.weight")
    r = httpx.post(engine.url() + "/update_weights_from_disk", headers=headers,
                   json={"model_path": evil_checkpoint, "weight_version": "pwned"})
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"].startswith("Unauthorized: ") and KEY not in r.text
    client = EngineClient(engine.url(), api_key=KEY)
    assert client.model_info()["weight_version"] == "default"
    assert client.get_weights_by_name("model.norm.weight") == before


def test_every_engine_endpoint_but_the_probes_needs_the_key(engine):
    routes = _routes(engine.app)
    assert ("POST", "/update_weights_from_tensor") in routes and ("GET", "/health_generate") in routes
    for method, path in routes:
        r = httpx.request(method, engine.url() + path, json={})
        if path.startswith(PROBE_PREFIXES):
            assert r.status_code == 200, (method, path, r.text)
        else:
            assert r.status_code == 401, (method, path, r.status_code)
    for path in ("/docs", "/openapi.json", "/no-such-endpoint"):  # FastAPI's own pages too
        assert httpx.get(engine.url() + path).status_code == 401
    assert httpx.options(engine.url() + "/generate").status_code != 401  # OPTIONS stays open, as in SGLang


def test_the_key_unlocks_everything(engine, evil_checkpoint, tiny_policy):
    c = EngineClient(engine.url(), api_key=KEY)
    assert c.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
    assert c.update_weights_from_disk(evil_checkpoint, weight_version="mine")["success"]
    assert c.model_info()["weight_version"] == "mine"
    assert c.update_weights_from_disk(str(tiny_policy), weight_version="default")["success"]
    with pytest.raises(EngineError) as e:
        EngineClient(engine.url(), api_key=WRONG).server_info()
    assert e.value.status == 401 and "does not match" in e.value.message
    for text in (str(e.value), repr(e.value)):
        assert WRONG not in text and KEY not in text
    assert poll_health(engine.url(), 5.0, 0.05, lambda: None) is None  # the readiness probe needs no key


def test_client_carries_the_key_through_pickle_but_never_shows_it(engine):
    c = EngineClient(engine.url(), timeout=7.0, api_key=KEY)
    c2 = pickle.loads(pickle.dumps(c))  # as into a Ray task
    assert c2.timeout == 7.0 and c2.server_info()["engine_id"] == "auth-engine"
    for text in (repr(c), str(c), repr(c2), repr(vars(c).get("url"))):
        assert KEY not in text
    with pytest.raises(EngineError) as e:  # no key at all: a clear 401 naming what is missing
        EngineClient(engine.url()).model_info()
    assert e.value.status == 401 and "Authorization: Bearer" in e.value.message


def test_an_empty_or_blank_key_is_refused():
    for bad in ("", "   ", "a b"):
        with pytest.raises(ValueError, match="api_key"):
            Router([], api_key=bad)
    with pytest.raises(TypeError):
        Router([])  # the router must be told the workers' key


def test_engine_generates_a_key_when_given_none(tiny_policy):
    e = EmbeddedEngine(str(tiny_policy), "auth-default", threads=1)
    try:
        key = e.api_key()
        assert len(key) >= 32 and key != KEY
        assert httpx.get(e.url() + "/server_info").status_code == 401
        assert EngineClient(e.url(), api_key=key).server_info()["engine_id"] == "auth-default"
    finally:
        e.shutdown()


# ---------------------------------------------------------------- the router


@pytest.fixture()
def router(engine):
    r = Router([engine.url()], api_key=KEY, timeout=60)
    r.ready()
    yield r
    r.shutdown()


def test_router_refuses_an_unauthenticated_worker_and_forwards_the_key(router, engine):
    for headers in ({}, _auth(WRONG)):
        r = httpx.post(router.url() + "/workers", json={"url": "http://attacker.invalid:1"}, headers=headers)
        assert r.status_code == 401
        wid = router.workers()["workers"][0]["id"]
        assert httpx.delete(f"{router.url()}/workers/{wid}", headers=headers).status_code == 401
        assert httpx.post(router.url() + "/generate", json={"input_ids": [5]}, headers=headers).status_code == 401
        assert httpx.get(router.url() + "/workers", headers=headers).status_code == 401
    assert router.workers()["urls"] == [engine.url()]
    assert httpx.get(router.url() + "/health").status_code == 200  # a probe
    # the router adds its key when it forwards: the engine behind it refuses anything without one
    out = EngineClient(router.url(), api_key=KEY).generate(  # ignore_eos: a sampled eos would end it sooner
        input_ids=[5, 6], sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 3
    router.add_worker("http://127.0.0.1:1")  # the trusted side (a Ray call into the router actor)
    assert "http://127.0.0.1:1" in router.workers()["urls"]
    r = httpx.post(router.url() + "/workers", json={"url": "http://127.0.0.1:2"}, headers=_auth())
    assert r.status_code == 202 and "http://127.0.0.1:2" in router.workers()["urls"]


def test_every_router_endpoint_but_the_probes_needs_the_key(router):
    for method, path in _routes(router.app):
        r = httpx.request(method, router.url() + path)
        assert (r.status_code == 401) == (not path.startswith(PROBE_PREFIXES)), (method, path, r.status_code)


# ---------------------------------------------------------------- the same rule as SGLang's


def _sglang_auth():
    if CONTRACT is None or CONTRACT.auth is None:
        pytest.skip("sglang==0.5.23 is not installed")
    return CONTRACT.auth


@needs_wheel
def test_our_decision_is_sglangs_on_every_route(engine, router):
    auth = _sglang_auth()
    assert auth.__name__ == "sglang.srt.utils.auth"
    paths = {p for app in (engine.app, router.app) for _, p in _routes(app)}
    paths |= {"/health", "/healthz", "/health_generate", "/ready", "/readiness", "/metrics", "/metrics/x",
              "/docs", "/", "/v1/models", "/healthgenerate/../update_weights_from_disk"}
    headers = [None, f"Bearer {KEY}", f"bearer {KEY}", f"Bearer {WRONG}", KEY, f"Basic {KEY}", "Bearer", "",
               f"Bearer  {KEY}", f"Bearer {KEY} "]
    for method in ("GET", "POST", "PUT", "OPTIONS"):
        for path in sorted(paths):
            for h in headers:
                want = auth.decide_request_auth(method=method, path=path, authorization_header=h, api_key=KEY,
                                                admin_api_key=None, auth_level=auth.AuthLevel.NORMAL).allowed
                assert (auth_refusal(method, path, h, KEY) is None) == want, (method, path, h)


@needs_wheel
@pytest.mark.filterwarnings("ignore:ORJSONResponse is deprecated")  # SGLang's 401 response class
def test_client_against_sglangs_own_api_key_middleware(tiny_policy):
    """SGLang's `add_api_key_middleware` (what `--api-key` installs) in front of the engine's app:
    EngineClient's header passes it, a request without the key gets SGLang's own 401, and the
    readiness probe the launcher polls needs no key."""
    from reflow.engines.embedded.generator import Generator
    from reflow.engines.embedded.server import build_app
    from reflow.engines.hf_io import load_causal_lm, load_tokenizer

    auth = _sglang_auth()
    gen = Generator(load_causal_lm(str(tiny_policy)), load_tokenizer(str(tiny_policy)), threads=1)
    app = build_app(gen, {"model_path": str(tiny_policy), "engine_id": "auth-sglang-mw"}, KEY)
    auth.add_api_key_middleware(app, api_key=KEY, admin_api_key=None)  # added last: outermost, SGLang decides first
    server = ThreadedServer(app, "127.0.0.1", 0, "auth-sglang-mw")
    try:
        assert poll_health(server.url(), 60.0, 0.05, lambda: None) is None
        r = httpx.post(server.url() + "/update_weights_from_disk", json={"model_path": "/x"})
        assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"})  # SGLang's body, not ours
        c = EngineClient(server.url(), api_key=KEY)
        assert c.generate(input_ids=[5], sampling_params={"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1
        assert c.begin_weight_update()["success"] and c.end_weight_update()["success"]
    finally:
        server.stop(before_close=app.state.engine.close)


# ---------------------------------------------------------------- payload limits


def _reduce_payload(module: str, name: str, *args) -> str:
    """A pickle that calls module.name(*args): what an allow-listed class becomes when called."""
    body = pickle.dumps(args, protocol=4)[2:-1]  # the args tuple's opcodes, without PROTO/STOP
    return base64.b64encode(b"\x80\x04" + f"c{module}\n{name}\n".encode() + body + b"R.").decode()


@pytest.mark.parametrize("module, name, args", [
    ("torch", "UntypedStorage", (8 << 30,)),  # 8 GiB from ~60 bytes, before the fix
    ("torch.storage", "UntypedStorage", (8 << 30,)),
    ("torch.storage", "TypedStorage", (1 << 31,)),
    ("torch", "Tensor", (1 << 16, 1 << 16)),
    ("builtins", "bytes", (8 << 30,)),
])
def test_a_payload_cannot_call_an_allocating_constructor(module, name, args):
    with pytest.raises(BucketError, match="may not call|refused to unpickle"):
        load_payload(_reduce_payload(module, name, *args), "direct")


def test_payload_shared_memory_is_capped():
    named = [("a", torch.ones(1024)), ("b", torch.ones(1024))]  # 8 KiB
    for fmt, payload in (("flattened_bucket", serialize_bucket(named)), ("direct", serialize_named_tensors(named))):
        assert len(load_payload(payload, fmt, max_bytes=16 << 10)) == 2
        with pytest.raises(BucketError, match="more than the 4096-byte limit"):
            load_payload(payload, fmt, max_bytes=4096)


def test_engine_caps_bodies_and_payloads_by_its_model(tiny_policy):
    e = EmbeddedEngine(str(tiny_policy), "auth-limits", threads=1, api_key=KEY, max_body_bytes=64 << 10)
    c = EngineClient(e.url(), api_key=KEY)
    try:
        r = httpx.post(e.url() + "/generate", headers=_auth(), content=b"[" + b"1," * (64 << 10) + b"1]")
        assert r.status_code == 413 and "65536-byte limit" in r.json()["error"]
        unsized = (b"x" * 4096 for _ in range(32))  # chunked: no Content-Length to refuse up front
        r = httpx.post(e.url() + "/generate", headers={**_auth(), "content-type": "application/json"},
                       content=unsized)
        assert r.status_code == 413
        assert c.generate(input_ids=[5], sampling_params={"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1
        numel = sum(t.numel() for t in e.generator.model.state_dict().values())
        huge = [("model.norm.weight", torch.ones(numel * 2))]  # twice the whole model in fp32: bigger than any push
        c.begin_weight_update()
        try:
            with pytest.raises(EngineError, match="limit"):
                c.update_weights_from_tensor([serialize_bucket(huge)], "flattened_bucket")
            # a declared shape must be the parameter's: the engine allocates nothing for a made-up one
            with pytest.raises(EngineError, match=r"shape mismatch for 'model\.norm\.weight'"):
                c.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[1 << 40]],
                                                  load_format="flattened_bucket")
            with pytest.raises(EngineError, match="unknown weight name 'made.up'"):
                c.update_weights_from_distributed(["made.up"], ["float32"], [[4]])
        finally:
            c.end_weight_update()
    finally:
        e.shutdown()


# ---------------------------------------------------------------- SGLang servers, the runtime


def test_sglang_server_gets_the_key_and_binds_loopback(tmp_path):
    """The key reaches the server through a 0600 file in a private folder (SGLang's --config), never its
    command line, which any local user reads in /proc; the file goes once the server answers."""
    import stat

    from reflow.engines.sglang.launcher import EngineStartError, SGLangEngine
    from tests.test_sglang_engine import _stub_sglang

    e = SGLangEngine("/models/x", "stub-auth", env=_stub_sglang(tmp_path, False), startup_timeout_s=60, api_key=KEY)
    try:
        assert e.args["host"] == "127.0.0.1" and e.api_key() == KEY
        assert KEY not in Path(f"/proc/{e.proc.pid}/cmdline").read_bytes().decode()
        config = Path(e.cmd[e.cmd.index("--config") + 1])
        assert KEY in config.read_text() and stat.S_IMODE(config.stat().st_mode) == 0o600
        assert stat.S_IMODE(config.parent.stat().st_mode) == 0o700
        with pytest.raises(EngineStartError) as err:
            e.ready(timeout=0.5)
        assert KEY not in str(err.value)
        assert e.ready() and not config.parent.exists()
    finally:
        e.shutdown()


@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None, reason="sglang-router is not installed")
def test_sglang_router_gets_the_key_on_stdin_not_the_command_line():
    """sglang-router has no key file or variable, and its --api-key stayed readable in /proc/<pid>/cmdline until
    the binary renamed its process (~1 s): reflow's launcher reads the key from stdin and adds it to the argument
    list in memory. The real router still demands it."""
    from reflow.engines.sglang.router import SGLangRouter

    r = SGLangRouter([], api_key=KEY)
    try:
        assert KEY not in Path(f"/proc/{r.proc.pid}/cmdline").read_bytes().decode()
        r.ready(timeout=60)
        assert KEY not in Path(f"/proc/{r.proc.pid}/cmdline").read_bytes().decode()
        assert httpx.get(r.url() + "/workers", timeout=10).status_code == 401
        assert httpx.get(r.url() + "/workers", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).status_code == 200
    finally:
        r.shutdown()


@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None, reason="sglang-router is not installed")
def test_sglang_routers_listen_on_loopback_only_and_two_run_at_once():
    """sglang-router serves Prometheus metrics beside its API, by default on 0.0.0.0:29000: every interface of the
    node, and a second router there (a second run's, a test's beside) panicked at its start ("failed to install
    Prometheus metrics exporter ... Address already in use"). reflow gives the metrics the router's own host and a
    port of their own: two routers run at once, and every socket either listens on is on loopback."""
    import psutil

    from reflow.engines.sglang.router import SGLangRouter

    routers: list = []
    try:
        for _ in range(2):
            routers.append(SGLangRouter([], api_key=KEY))
            routers[-1].ready(timeout=60)
        for r in routers:
            proc = psutil.Process(r.proc.pid)
            listening = {(c.laddr.ip, c.laddr.port) for p in (proc, *proc.children(recursive=True))
                         for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN}
            assert len(listening) >= 2, listening  # its API and its metrics
            assert {ip for ip, _ in listening} == {"127.0.0.1"}, listening
    finally:
        for r in routers:
            r.shutdown()


def test_runtime_reuses_the_key_its_actors_hold(ray_cluster):
    import ray

    from reflow.infra.cluster.runtime import Runtime, runtime_api_key

    class Holder:
        def api_key(self) -> str:
            return "the-old-runs-key"

    ns = "auth-runtime-test"
    fresh = {runtime_api_key(ns, 2) for _ in range(3)}
    assert len(fresh) == 3 and all(len(k) >= 32 for k in fresh)  # nothing to reuse: a new key each time
    holder = ray.remote(Holder).options(name="engine-1", namespace=ns).remote()
    try:
        assert runtime_api_key(ns, 2) == "the-old-runs-key"  # a later flow run talks to the same actors
    finally:
        ray.kill(holder)
    assert not Runtime.__dataclass_fields__["api_key"].repr  # a logged Runtime never shows it
