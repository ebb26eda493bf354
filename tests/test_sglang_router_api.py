"""The router worker API (`GET/POST /workers`, `GET/DELETE /workers/{id}`) that sglang-router 0.3.2
serves, driven by reflow's one client (`WorkersClient`) against both routers: the real sglang-router
binary (installed by `make setup`, a 31 MB wheel) and reflow's own proxy, each in front of two
embedded engines that require the runtime's key.

What the binary cannot show here: its cache-aware routing under load and its health checker's
timing (60 s interval); the engines are the embedded CPU ones, not SGLang servers.
"""
from __future__ import annotations

import importlib.util
import sys
import uuid

import httpx
import pytest

from reflow.engines.embedded.engine import EmbeddedEngine
from reflow.engines.http_serve import bearer, new_api_key
from reflow.engines.rollout_client import EngineClient
from reflow.engines.sglang.router import Router, RouterError, SGLangRouter

KEY = new_api_key()  # shared by the routers and the engines, as a runtime's key is
HAS_SGLANG_ROUTER = importlib.util.find_spec("sglang_router") is not None
KINDS = ["reflow", pytest.param("sglang-router", marks=pytest.mark.skipif(
    not HAS_SGLANG_ROUTER, reason="sglang-router==0.3.2 is not installed (make setup installs it)"))]


@pytest.fixture(scope="module")
def engine_urls(tiny_policy):
    es = [EmbeddedEngine(str(tiny_policy), f"routed-api-{i}", threads=1, api_key=KEY) for i in range(2)]
    for e in es:
        e.ready()
    yield [e.url() for e in es]
    for e in es:
        e.shutdown()


def _start(kind: str, urls: list[str]):
    return Router(urls, api_key=KEY, timeout=60) if kind == "reflow" else SGLangRouter(urls, api_key=KEY)


@pytest.fixture(params=KINDS)
def router(request, engine_urls):
    r = _start(request.param, engine_urls)
    try:
        r.ready(timeout=30)
        yield r
    finally:
        r.shutdown()


def _generate(router, n_tokens: int = 3) -> dict:
    return EngineClient(router.url(), timeout=60, api_key=KEY).generate(
        input_ids=[5, 6, 7], sampling_params={"max_new_tokens": n_tokens, "ignore_eos": True})


def test_one_client_registers_removes_and_routes_on_both_routers(router, engine_urls):
    a, b = engine_urls
    assert sorted(router.workers()["urls"]) == sorted(engine_urls)
    assert _generate(router)["meta_info"]["completion_tokens"] == 3
    router.remove_worker(a)
    assert router.workers()["urls"] == [b]
    router.add_worker(a)
    assert sorted(router.workers()["urls"]) == sorted(engine_urls)
    router.remove_worker(b)  # only the worker added by URL is left: the router must send it the key
    assert router.workers()["urls"] == [a]
    for _ in range(3):
        assert _generate(router, 2)["meta_info"]["completion_tokens"] == 2
    with pytest.raises(RouterError, match=r"worker http://127\.0\.0\.1:1 is not registered .*registered: \['http"):
        router.remove_worker("http://127.0.0.1:1")


def test_worker_api_answers_alike(router, engine_urls):
    """The fields and statuses reflow's client relies on, from both routers."""
    h = bearer(KEY)
    listed = httpx.get(router.url() + "/workers", headers=h).json()
    assert listed["total"] == 2 and {"id", "url", "is_healthy", "load"} <= set(listed["workers"][0])
    assert httpx.get(router.url() + "/workers").status_code == 401  # the control plane needs the key
    assert httpx.post(router.url() + "/workers", json={"url": "http://127.0.0.1:1"}).status_code == 401
    wid = next(w["id"] for w in listed["workers"] if w["url"] == engine_urls[0])
    one = httpx.get(f"{router.url()}/workers/{wid}", headers=h)
    assert one.status_code == 200 and one.json()["url"] == engine_urls[0]
    again = httpx.post(router.url() + "/workers", json={"url": engine_urls[0], "api_key": KEY}, headers=h)
    assert again.status_code == 202  # accepted (sglang-router queues a job); already registered: same id
    assert again.json()["worker_id"] == wid and again.json()["location"] == f"/workers/{wid}"
    gone = httpx.delete(f"{router.url()}/workers/{uuid.uuid4()}", headers=h)
    assert gone.status_code == 404 and gone.json()["code"] == "WORKER_NOT_FOUND"
    for method, legacy in (("GET", "/list_workers"), ("POST", "/add_worker"), ("POST", "/remove_worker")):
        r = httpx.request(method, router.url() + legacy, params={"url": engine_urls[0]}, headers=h)
        assert r.status_code == 404, (legacy, r.status_code)  # sglang-router 0.3.x serves only /workers


def test_reflow_router_refuses_a_worker_key_it_cannot_send():
    r = Router([], api_key=KEY)
    try:
        r.ready()
        bad = httpx.post(r.url() + "/workers", json={"url": "http://127.0.0.1:2", "api_key": "another-key" * 4},
                         headers=bearer(KEY))
        assert bad.status_code == 400 and "sends its own API key" in bad.json()["error"]
        assert r.workers()["urls"] == []
    finally:
        r.shutdown()


@pytest.mark.skipif(not HAS_SGLANG_ROUTER, reason="sglang-router==0.3.2 is not installed (make setup installs it)")
def test_sglang_router_that_exits_is_reported_with_its_log():
    r = SGLangRouter(["not-a-url"], api_key=KEY, python=sys.executable)
    try:
        with pytest.raises(RouterError, match=r"sglang-router exited with code(.|\n)*URL must start with http"):
            r.ready(timeout=60)
    finally:
        r.shutdown()


def test_api_keys_never_start_with_a_dash_which_command_lines_would_take_for_an_option():
    """sglang-router and SGLang's server get the key as `--api-key KEY`: one that starts with '-' is read
    as an option and the process exits ('argument --api-key: expected one argument'; a clean-clone CI
    rehearsal hit it: token_urlsafe starts with '-' once in 64). Fresh keys avoid it; a given one is refused
    with the reason before anything starts."""
    assert not [k for k in (new_api_key() for _ in range(2000)) if k.startswith("-")]
    with pytest.raises(ValueError, match="must not start with '-'"):
        SGLangRouter(["http://127.0.0.1:2"], api_key="-" + KEY, python=sys.executable)
