"""Two embedded engines (Ray actors, real processes) behind reflow's router.

Killing one engine's process mid-rollout must still complete the whole batch: the router sees the
dropped connections, deregisters the engine and re-sends those requests to the survivor.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from reflow.engines.embedded.engine import EmbeddedEngine
from reflow.engines.http_serve import bearer, new_api_key
from reflow.engines.rollout_client import EngineClient, EngineError, generate_batch
from reflow.engines.sglang.router import Router, RouterError

KEY = new_api_key()  # shared by the router and its engines, as a runtime's key is


@pytest.fixture()
def two_engines(ray_cluster, tiny_policy):
    """Fresh per test: one test kills an engine, so sharing them would make the others order-dependent."""
    import ray

    actors = [ray.remote(EmbeddedEngine).options(num_cpus=1).remote(str(tiny_policy), f"routed-{i}", threads=1,
                                                                    api_key=KEY)
              for i in range(2)]
    urls = ray.get([a.url.remote() for a in actors])
    ray.get([a.ready.remote() for a in actors])
    yield actors, urls
    for a in actors:
        ray.kill(a)


@pytest.fixture()
def router(two_engines):
    r = Router(two_engines[1], api_key=KEY, timeout=120)
    r.ready()
    yield r
    r.shutdown()


def _running(url: str, api_key: str = KEY) -> int:
    """Requests the engine at `url` holds, running or waiting (0 when it does not answer)."""
    try:
        load = httpx.get(f"{url}/v1/loads", timeout=5, headers=bearer(api_key)).json()["loads"][0]
        return load["num_running_reqs"] + load["num_waiting_reqs"]
    except httpx.TransportError:
        return 0


def _pid(actor) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()))


def _kill_when_busy(victim, url: str, api_key: str) -> tuple[threading.Thread, threading.Event]:
    """Start a thread that SIGKILLs the engine actor `victim`'s process once it holds a request; (thread,
    killed). A signal, not ray.kill: ray.kill returns before the actor is gone (GCS, then its raylet), and
    on a loaded machine the victim could finish its requests, and even answer the push's liveness check,
    before it dies (CI saw the push find it alive: engines_recreated 0). A victim that never gets work
    within 120 s is left alone (`killed` stays clear: the test says so)."""
    killed, pid = threading.Event(), _pid(victim)

    def run() -> None:
        deadline = time.monotonic() + 120
        while _running(url, api_key) == 0:
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        killed.set()

    killer = threading.Thread(target=run)
    killer.start()
    return killer, killed


def test_least_loaded_spreads_requests_and_workers_register(router, two_engines):
    _, urls = two_engines
    clients = [EngineClient(router.url(), timeout=120, api_key=KEY)] * 4  # four concurrent shards through one router
    out = generate_batch(clients, [[5, 6, 7]] * 16, {"max_new_tokens": 24, "ignore_eos": True}, n=2)
    assert len(out) == 32 and all(o["meta_info"]["completion_tokens"] == 24 for o in out)
    router.remove_worker(urls[0])
    assert router.workers()["urls"] == [urls[1]]
    router.add_worker(urls[0])
    assert sorted(router.workers()["urls"]) == sorted(urls)
    with pytest.raises(RouterError, match="is not registered"):
        router.remove_worker("http://127.0.0.1:1")


def test_router_with_no_live_engine_is_a_clear_503():
    r = Router([], api_key=KEY)
    r.ready()
    try:
        with pytest.raises(EngineError, match="no live engine behind the router") as e:
            EngineClient(r.url(), api_key=KEY).generate(input_ids=[5, 6])
        assert e.value.status == 503
    finally:
        r.shutdown()


def test_killing_an_engine_mid_rollout_still_completes_the_batch(router, two_engines):
    actors, urls = two_engines
    clients = [EngineClient(router.url(), timeout=120, api_key=KEY)] * 4
    sp = {"max_new_tokens": 48, "ignore_eos": True, "temperature": 1.0}
    victim = _pid(actors[0])
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(out=generate_batch(clients, [[5, 6, 7, 8]] * 32, sp, n=2)))
    worker.start()
    deadline = time.monotonic() + 30
    while _running(urls[0]) == 0:  # the victim is decoding part of the batch
        assert time.monotonic() < deadline, "engine 0 never received work"
        time.sleep(0.02)
    os.kill(victim, signal.SIGKILL)  # the process dies now (not ray.kill's later): its connections drop mid-request
    worker.join(120)
    assert not worker.is_alive()
    out = result["out"]
    assert len(out) == 64
    assert {o["meta_info"]["finish_reason"]["type"] for o in out} == {"length"}  # redone, not aborted
    assert all(len(o["output_ids"]) == 48 for o in out)
    assert router.workers()["dead"] == [urls[0]]


def test_iteration_completes_when_an_engine_dies_mid_rollout(ray_cluster, prefect_server, tiny_policy, tmp_path):
    """The whole iteration, not just the batch: the router finishes the rollout on the survivor,
    and the push that follows recreates the lost engine and gives it the new weights."""
    import ray

    from reflow.flows.iteration import iteration
    from reflow.infra.cluster.runtime import shutdown_runtime, start_runtime
    from reflow.infra.config.schema import load_config

    cfg = load_config(None, [
        "experiment=router-kill", f"model.path={tiny_policy}", "num_iterations=1", "data.num_train=64",
        "data.num_eval=4", "rollout.num_engines=2", "rollout.router=true", "rollout.prompts_per_iteration=32",
        "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=48", "trainer.micro_batch_size=32",
        "weight_sync.verify=full", f"storage.root=file://{tmp_path}/runs"])
    rt = start_runtime(cfg)
    try:
        victim, victim_url = rt.engines[0], rt.engine_urls[0]
        EngineClient(victim_url, api_key=rt.api_key).pause_generation()  # it holds what it is sent until killed
        killer, killed = _kill_when_busy(victim, victim_url, rt.api_key)
        m = iteration(cfg, 0)
        killer.join(60)
        assert killed.is_set(), "engine 0 never received work"
        assert _running(victim_url, rt.api_key) == 0
        recreated = {k: v for k, v in m.items() if k.startswith("engines_recreated")}
        assert recreated == {"engines_recreated": 1.0, "engines_recreated_before_generate": 0.0}, recreated
        assert m["push_verified_tensors"] > 0  # the full check passed on both engines, the new one included
        assert rt.engine_urls[0] != victim_url
        assert sorted(ray.get(rt.router.workers.remote())["urls"]) == sorted(rt.engine_urls)
    finally:
        shutdown_runtime(cfg.experiment)


def test_engine_lost_during_generate_is_recreated_with_current_weights_before_the_retry(
        ray_cluster, prefect_server, tiny_policy, tmp_path):
    """No router: a killed engine fails the generate attempt; the retry (not the next push, after
    the retries are spent) recreates it, gives it the trainer's current weights and generates."""
    import ray

    from reflow.flows.iteration import iteration
    from reflow.infra.cluster.runtime import shutdown_runtime, start_runtime
    from reflow.infra.config.schema import load_config
    from reflow.tasks.rollout import generate

    cfg = load_config(None, [
        "experiment=gen-kill", f"model.path={tiny_policy}", "num_iterations=2", "data.num_train=64",
        "data.num_eval=4", "rollout.num_engines=1", "rollout.prompts_per_iteration=16",
        "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=48", "trainer.micro_batch_size=32",
        "weight_sync.verify=full", f"storage.root=file://{tmp_path}/runs"])
    rt = start_runtime(cfg)
    try:
        iteration(cfg, 0)  # the engine now serves policy version 1, which model.path does not hold
        victim, victim_url = rt.engines[0], rt.engine_urls[0]
        # Paused, the victim holds the attempt's requests until it dies: on a loaded machine a running one could
        # finish between two polls of its load (a clean-clone run saw none running: nothing killed)
        EngineClient(victim_url, api_key=rt.api_key).pause_generation()
        killer, killed = _kill_when_busy(victim, victim_url, rt.api_key)
        batch = generate(cfg, 1)
        killer.join(60)
        assert killed.is_set() and rt.engine_urls[0] != victim_url
        assert batch.stats["engines_recreated_before_generate"] == 1.0
        assert len(ray.get(batch.ref)) == 16 * 4
        assert EngineClient(rt.engine_urls[0], api_key=rt.api_key).model_info()["weight_version"] == "1"
    finally:
        shutdown_runtime(cfg.experiment)


def test_generation_launched_ahead_is_the_same_batch_and_falls_back_when_its_engine_dies(
        ray_cluster, prefect_server, tiny_policy, tmp_path):
    """The synchronous loop's rollout source (tasks/rollout_source.py, staleness 0) generates iteration i's
    batch ahead of its flow run: the same samples as the generate task would make itself, a batch of an
    earlier flow run of the iteration in the stage cache still goes first, and a batch whose engine died is
    left to the flow run, whose generate task makes it the usual way (engine recreated with the current
    weights)."""
    import ray

    from reflow.flows.iteration import iteration
    from reflow.infra.cluster.runtime import shutdown_runtime, start_runtime
    from reflow.infra.config.schema import load_config
    from reflow.tasks import rollout
    from reflow.tasks.rollout_source import RolloutSource, prefetches

    cfg = load_config(None, [
        "experiment=gen-ahead", f"model.path={tiny_policy}", "num_iterations=3", "data.num_train=64",
        "data.num_eval=4", "rollout.num_engines=1", "rollout.prompts_per_iteration=16",
        "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=48", "trainer.micro_batch_size=32",
        f"storage.root=file://{tmp_path}/runs"])
    rt = start_runtime(cfg)
    try:
        iteration(cfg, 0)  # the engine serves policy version 1
        expected = ray.get(rollout._launch(rt, 1, 1)[0])  # what the task would generate itself (nothing stored)
        source = RolloutSource(cfg, 1, end=3)  # launches batch 1 by policy 1 at once
        batch, waits = source.take(1)
        assert batch is not None and waits["async_fallback"] == 0.0
        assert batch.stats["generate_started_ahead"] == 1.0 and batch.stats["rollout_policy_version"] == 1.0
        assert ray.get(batch.ref).response_ids == expected.response_ids
        ray.get(list(batch.saving))  # generated and scored, in the stage cache now: a re-run of iteration 1 loads it
        source.restart(1)
        again, _ = source.take(1)
        assert again is not None and again.stats["scored_from_storage"] == 1.0
        assert ray.get(again.ref).response_ids == expected.response_ids
        source.close()

        iteration(cfg, 1)  # policy version 2
        victim, victim_url = rt.engines[0], rt.engine_urls[0]
        EngineClient(victim_url, api_key=rt.api_key).pause_generation()  # it holds the batch's requests until killed
        killer, killed = _kill_when_busy(victim, victim_url, rt.api_key)
        source = RolloutSource(cfg, 2, end=3)
        lost, waits = source.take(2)
        killer.join(60)
        source.close()
        assert killed.is_set() and lost is None and waits["async_fallback"] == 1.0
        batch = rollout.generate(cfg, 2)  # the flow run's own task
        assert rt.engine_urls[0] != victim_url
        assert batch.stats["generate_started_ahead"] == 0.0
        assert batch.stats["engines_recreated_before_generate"] == 1.0
        assert len(ray.get(batch.ref)) == 16 * 4
        off = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"generate_ahead": False})})
        assert prefetches(cfg) and not prefetches(off)
    finally:
        shutdown_runtime(cfg.experiment)
