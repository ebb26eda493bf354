"""One weight payload per receiver: pushes to 1, 2 and 4 long-lived receivers (issue 14, point 2).

A shared-memory handle pays for one rebuild (reflow.engines.weights.buckets.SharedBucket): the
same payload sent to every engine and TP rank broke the third receiver that opened it after two
others had freed theirs ("unable to open shared memory object"). Receivers here are what the
trainer meets: embedded engines in their own processes (each keeps running and frees its copy
after loading), and stand-ins for SGLang TP ranks that rebuild their entry with SGLang's own
SafeUnpickler and FlattenedTensorBucket (tests/payload_rank.py).
"""
from __future__ import annotations

import multiprocessing
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reflow.engines.http_serve import new_api_key
from reflow.engines.rollout_client import EngineClient
from reflow.engines.sglang import contract as sglang_contract
from reflow.engines.weights import push as weight_push
from reflow.engines.weights.push import push_weights
from reflow.engines.weights.settings import PushSettings
from reflow.rl.demo_policy import build_model, build_tokenizer
from tests.payload_rank import digest, serve_rank

pytestmark = pytest.mark.slow  # up to 8 receiver processes for the module
KEY = new_api_key()
MAX_RECEIVERS = 4
BUCKET_BYTES = 8 << 10  # the tiny policy (~80 kB in float32) in about ten buckets per push

_ENGINE_MAIN = """
import sys
from reflow.engines.embedded.engine import EmbeddedEngine
engine = EmbeddedEngine(sys.argv[1], sys.argv[2], threads=1, api_key=sys.stdin.readline().strip())
engine.ready()
print(engine.url(), flush=True)
sys.stdin.read()  # serve until the test closes stdin
engine.shutdown()
"""


def _read_url(proc: subprocess.Popen, log: Path, deadline: float) -> str:
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready and (line := proc.stdout.readline().strip()):
            return line
        if proc.poll() is not None:
            break
    raise RuntimeError(f"engine process {proc.pid} gave no URL (exit code {proc.poll()}); its log {log}: "
                       f"{log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def engine_processes(tiny_policy, tmp_path_factory):
    """MAX_RECEIVERS embedded engines, each in its own process, started together (logs to files: a
    full stderr pipe would stall a server)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    logs = [tmp_path_factory.mktemp("receivers") / f"receiver-{i}.log" for i in range(MAX_RECEIVERS)]
    procs = []
    for i, log in enumerate(logs):
        with log.open("w") as err:  # the child keeps its own descriptor
            procs.append(subprocess.Popen([sys.executable, "-c", _ENGINE_MAIN, str(tiny_policy), f"receiver-{i}"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                          env=env))
    try:
        for p in procs:
            p.stdin.write(KEY + "\n")
            p.stdin.flush()
        deadline = time.monotonic() + 180
        urls = [_read_url(p, log, deadline) for p, log in zip(procs, logs)]
        yield [EngineClient(u, timeout=60, api_key=KEY) for u in urls]
    finally:
        for p in procs:
            p.stdin.close()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


def _named(seed: int):
    """A fresh policy's weights, shaped like the engines' tiny policy."""
    model = build_model(build_tokenizer(), hidden=32, layers=2, heads=2, mlp=64, seed=seed)
    return list(model.state_dict().items())


@pytest.mark.parametrize("receivers", [1, 2, 4])
def test_push_to_long_lived_embedded_engines(engine_processes, receivers):
    """Every engine, each in its own process, loads every bucket of two pushes bit-exactly."""
    clients = engine_processes[:receivers]
    for push in range(2):
        named = _named(100 * receivers + push)
        version = f"r{receivers}-p{push}"
        stats = push_weights(clients, named, version, PushSettings(bucket_bytes=BUCKET_BYTES, verify="full",
                                                                   map_once=False))  # SGLang's calls
        assert stats["buckets"] >= 8 and stats["engines"] == receivers
        assert stats["verified_tensors"] == receivers * len(named)
        assert [c.model_info()["weight_version"] for c in clients] == [version] * receivers


# ---------------------------------------------------------------- mappings the engines keep (weight_sync.map_once)


def _engine_weights(client, names) -> dict:
    return {n: client.get_weights_by_name(n, truncate_size=10**6) for n in names}


def test_mapped_pushes_map_once_and_follow_the_trainers_tensors(engine_processes):
    """Two engine processes map the sender's weights once: later pushes of new values are one call each and
    land bit-exactly; tensors already in shared memory are mapped where they are (the engines read the
    sender's memory); a layout change maps again; an engine that another sender mapped since (as after a
    restart) answers 400 and the push maps it again."""
    import torch

    from reflow.engines.weights.buckets import _use_file_system_sharing
    from reflow.engines.weights.mapped import MappedSender

    clients, sender = engine_processes[:2], MappedSender()
    assert sender.supports(clients)
    assert not sender.supports([_NoExtensions()])  # SGLang engines keep SGLang's calls
    full = PushSettings(verify="full")
    for push in range(3):  # packed: one shared buffer, packed again at each push, mapped by each engine once
        named = _named(300 + push)
        stats = push_weights(clients, named, f"packed-{push}", full)
        assert stats["buckets"] == 1 and stats["mapped"] == (2 if push == 0 else 0)
        assert stats["verified_tensors"] == 2 * len(named)
    _use_file_system_sharing()
    # the trainer's own tensors, in shared memory, as DeepSpeedRank hands them (LiveViews: addresses checked)
    live = _live_views([(n, t.clone().share_memory_()) for n, t in _named(400)])
    mapped = weight_push.MAPPED.map_calls
    for push in range(3):
        with torch.no_grad():
            for _, t in live:
                t.add_(0.25 * (push + 1))  # an optimizer step, in place
        stats = push_weights(clients, live, f"live-{push}", full, stable=True)
        assert stats["verified_tensors"] == 2 * len(live) and stats["buckets"] == len(live)  # a storage each
        assert stats["mapped"] == (2 if push == 0 else 0)
    assert weight_push.MAPPED.map_calls == mapped + 2
    assert weight_push.MAPPED._facts[2] is live  # the pushes after the first took its facts without a walk
    names = [n for n, _ in live[:3]]
    assert _engine_weights(clients[0], names) == {n: t.tolist() for n, t in live[:3]}
    # another sender maps engine 0 (as a restarted trainer would): the next push re-maps it, once
    sender.push(clients[:1], _named(500), "other-sender")
    stats = push_weights(clients, live, "live-again", full, stable=True)
    assert stats["mapped"] == 1 and stats["verified_tensors"] == 2 * len(live)
    # the parameters moved (an offload and reload): a new LiveViews at new addresses is mapped again by both
    moved = _live_views([(n, t.clone().share_memory_()) for n, t in _named(410)])
    stats = push_weights(clients, moved, "moved", full, stable=True)
    assert stats["mapped"] == 2 and stats["verified_tensors"] == 2 * len(moved)


def _live_views(named):
    from reflow.engines.weights.mapped import LiveViews, addresses

    return LiveViews(named, addresses(t for _, t in named))


def test_a_mapping_follows_its_own_buffer_when_another_layout_is_pushed_between(engine_processes):
    """One sender pushing two layouts in turn (here: all tensors to one engine, three of them to another) keeps a
    buffer per layout: the first engine's next push lands in the buffer it mapped (before, the other layout's
    push replaced the buffer, and the first engine copied stale values from the one it still mapped)."""
    from reflow.engines.weights.mapped import MappedSender
    from reflow.engines.weights.verify import verify_weights

    sender, (a, b) = MappedSender(), engine_processes[:2]
    sender.push([a], _named(600), "a-1")
    sender.push([b], _named(601)[:3], "b-1")
    latest = _named(602)
    out = sender.push([a], latest, "a-2")
    assert (out["buckets"], out["mapped"], out["copies"]) == (1, 0, 1)  # and a's weights are laid out as the buffer
    assert verify_weights([a], latest, "a-2", "full") == len(latest)


class _NoExtensions:
    url = "sglang-standin://no-extensions"

    def server_info(self) -> dict:
        return {"tp_size": 1}


# ---------------------------------------------------------------- SGLang's own receiving code


class SGLangServerRanks:
    """One SGLang server at TP=k as `_send_buckets` calls it: `/server_info`'s tp_size, and
    `/update_weights_from_tensor` handing entry i to rank i only (TpModelWorker.deserialize_own_rank).
    Each rank is a long-lived process running SGLang's code (tests/payload_rank.py). Ranks load one
    after the other: a legal schedule of SGLang's concurrent ranks, and the one where a rank has
    freed its copy before the next one opens it."""

    def __init__(self, name: str, ranks: list):
        self.url, self.ranks, self.loaded = f"sglang-standin://{name}", ranks, [{} for _ in ranks]

    def server_info(self) -> dict:
        return {"tp_size": len(self.ranks)}

    def update_weights_from_tensor(self, payloads, load_format, flush_cache, weight_version) -> dict:
        if load_format != "flattened_bucket" or len(payloads) != len(self.ranks):
            return {"success": False, "message": f"{len(payloads)} {load_format} payloads for tp_size {len(self.ranks)}"}
        for rank, (conn, payload) in enumerate(zip(self.ranks, payloads)):
            conn.send(str(payload))
            if not conn.poll(60):
                raise RuntimeError(f"TP rank {rank} of {self.url} gave no answer in 60 s: did its process die?")
            status, out = conn.recv()
            if status != "ok":
                return {"success": False, "message": f"TP rank {rank}: {out}"}
            self.loaded[rank].update(out)
        return {"success": True, "message": "Success"}


@pytest.fixture(scope="module")
def rank_processes():
    if sglang_contract.load() is None:
        pytest.skip("sglang==0.5.23 is not installed (make setup installs it --no-deps)")
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(MAX_RECEIVERS)]
    procs = [ctx.Process(target=serve_rank, args=(child,), daemon=True) for _, child in pipes]
    for p in procs:
        p.start()
    try:
        yield [parent for parent, _ in pipes]
    finally:
        for parent, _ in pipes:
            parent.send(None)
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("engines, tp", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)])
def test_sglangs_code_rebuilds_every_receivers_payload(rank_processes, engines, tp):
    """Every TP rank of every engine rebuilds every bucket through SGLang's SafeUnpickler and
    FlattenedTensorBucket, bit-exactly: 4 engines at TP 1 and 2 engines at TP 2 included."""
    servers = [SGLangServerRanks(f"e{e}", rank_processes[e * tp:(e + 1) * tp]) for e in range(engines)]
    named = _named(7 + 10 * engines + tp)
    buckets = weight_push._send_buckets(servers, named, BUCKET_BYTES, f"e{engines}-tp{tp}")
    assert buckets >= 8
    want = {n: digest(t) for n, t in named}
    for s in servers:
        assert s.loaded == [want] * tp
