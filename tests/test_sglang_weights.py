"""Weight pushes in every mode (tensor buckets, gloo distributed, disk) against embedded engines.

Two engines, so rank offsets and fan-out are exercised. Each push must round-trip bit-exactly
(verify="full"), and generation afterwards must equal a reference loop on the pushed model.
"""
from __future__ import annotations

import pytest
import torch

from reflow.engines.embedded.engine import EmbeddedEngine
from reflow.engines.http_serve import new_api_key
from reflow.engines.rollout_client import EngineClient, EngineError
from reflow.engines.sglang import contract as sglang_contract
from reflow.engines.weights import push
from reflow.engines.weights.buckets import serialize_bucket
from reflow.engines.weights.group import bucket_order, pack
from reflow.engines.weights.push import WeightSyncError, push_weights, verify_weights
from reflow.engines.weights.settings import PushSettings
from reflow.rl.demo_policy import build_model, save_policy
from tests.reference import greedy_reference

KEY = new_api_key()


@pytest.fixture(scope="module")
def engines(tiny_policy):
    es = [EmbeddedEngine(str(tiny_policy), f"weights-{i}", threads=1, api_key=KEY) for i in range(2)]
    for e in es:
        e.ready()
    yield es
    for e in es:
        e.shutdown()


@pytest.fixture()
def clients(engines):
    return [EngineClient(e.url(), timeout=60, api_key=KEY) for e in engines]


_greedy = greedy_reference  # plain full-sequence greedy loop (tests/reference.py)


def _new_named(tok, seed):
    model = build_model(tok, hidden=32, layers=2, heads=2, mlp=64, seed=seed)
    return model, list(model.state_dict().items())


@pytest.fixture(scope="module")
def tok(tiny_policy):
    from reflow.engines.hf_io import load_tokenizer

    return load_tokenizer(str(tiny_policy))


@pytest.fixture()
def rebuilt(monkeypatch):
    """Counts buckets rebuilt by SGLang's own FlattenedTensorBucket.reconstruct_tensors."""
    contract = sglang_contract.load()
    if contract is None:
        pytest.skip("sglang==0.5.23 is not installed")
    calls = []
    real = contract.FlattenedTensorBucket.reconstruct_tensors
    monkeypatch.setattr(contract.FlattenedTensorBucket, "reconstruct_tensors",
                        lambda self: calls.append(len(self.metadata)) or real(self))
    return calls


@pytest.mark.parametrize("mode", ["tensor", "mapped", "distributed", "disk"])
def test_each_mode_round_trips_exactly(clients, tok, tmp_path, mode, rebuilt):
    """mapped: mode=tensor through the mapping the embedded engines keep (weights/mapped.py), one buffer
    rebuilt by SGLang's class as well; tensor: SGLang's calls, a handle per bucket."""
    seed = {"tensor": 11, "mapped": 14, "distributed": 12, "disk": 13}[mode]
    model, named = _new_named(tok, seed)
    path = str(save_policy(model, tok, tmp_path / "pushed")) if mode == "disk" else None
    settings = PushSettings(bucket_bytes=16 << 10, verify="full", mode="tensor" if mode == "mapped" else mode,
                            map_once=mode == "mapped")
    if mode == "mapped":  # this push must map (SGLang's class rebuilds the buffer then): drop the mappings an earlier
        # test's push to these engines left in this process (map_once is the default), which it would reuse as they are
        from reflow.engines.weights.mapped import MAPPED

        with MAPPED.lock:
            for c in clients:
                MAPPED.maps.pop(c.url, None)
    stats = push_weights(clients, named, f"{mode}-v1", settings, model_path=path)
    assert stats["verified_tensors"] == 2 * len(named)
    if mode != "disk":
        assert (stats["buckets"] == 1) if mode == "mapped" else (stats["buckets"] > 1)
        assert sum(rebuilt) == 2 * len(named)  # every tensor via SGLang's class
    p = tok.encode("(3+4)*5=")
    for c in clients:
        out = c.generate(input_ids=p, sampling_params={"temperature": 0.0, "max_new_tokens": 10})
        assert out["output_ids"] == _greedy(model, p, 10, {tok.eos_token_id})
        assert out["meta_info"]["weight_version"] == f"{mode}-v1"
        c.begin_weight_update()  # no session left open, generation running again
        c.end_weight_update()


def test_distributed_buffer_has_sglangs_receive_layout(tok):
    contract = sglang_contract.load()
    if contract is None:
        pytest.skip("sglang==0.5.23 is not installed")
    named = [("a", torch.randn(3)), ("b", torch.randn(5, dtype=torch.bfloat16)), ("c", torch.arange(4))]
    flat, names, dtypes, shapes = pack(bucket_order(named))
    assert dtypes == ["int64", "float32", "bfloat16"]  # widest first: offsets stay aligned
    bucket = contract.FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")
    bucket.get_flattened_tensor().copy_(flat)
    got = dict(bucket.reconstruct_tensors())
    assert all(torch.equal(got[n], t) for n, t in named)


def test_updates_outside_a_session_are_refused_as_sglang_refuses(clients):
    c = clients[0]
    with pytest.raises(EngineError, match=r"update_weights_from_distributed must run between "
                                          r"begin_weight_update\(\) and end_weight_update\(\)") as e:
        c.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[32]], "g", "flattened_bucket")
    assert e.value.status == 400
    with pytest.raises(EngineError, match=r"update_weights_from_tensor must run between"):
        c.update_weights_from_tensor([serialize_bucket([("model.norm.weight", torch.ones(32))])], "flattened_bucket")
    with pytest.raises(EngineError, match=r"no weight-update session is open; call begin_weight_update\(\) first"):
        c.end_weight_update()
    c.begin_weight_update()
    try:
        with pytest.raises(EngineError, match=r"Group nope not in \["):  # [] or a group an earlier push kept open
            c.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[32]], "nope")
        with pytest.raises(EngineError, match="a weight-update session is already open"):
            c.begin_weight_update()
    finally:
        c.end_weight_update()
    with pytest.raises(EngineError, match="use backend 'gloo'"):
        c.init_weights_update_group("127.0.0.1", 1, 1, 2, "g", backend="nccl")
    with pytest.raises(EngineError, match="The group to be destroyed does not exist"):
        c.destroy_weights_update_group("g")


def test_refused_distributed_join_fails_fast_and_unwinds(clients, tok, monkeypatch):
    _, named = _new_named(tok, 21)
    # As on a GPU trainer (which packs on its CUDA device): here the engine's refusal is under test.
    monkeypatch.setattr(push, "group_device", lambda backend: torch.device("cpu"))
    with pytest.raises(WeightSyncError, match="use backend 'gloo'"):
        push_weights(clients[:1], named, "never", PushSettings(mode="distributed", backend="nccl", verify="off"))
    clients[0].begin_weight_update()  # session closed and generation resumed despite the failure
    clients[0].end_weight_update()


def test_verify_atol_for_quantised_engines(clients, tok):
    _, named = _new_named(tok, 31)
    push_weights(clients, named, "atol-v1", PushSettings(bucket_bytes=1 << 20, verify="off"))
    off = [(n, t + 1e-3) for n, t in named]  # what a quantised engine's rounding looks like
    with pytest.raises(WeightSyncError, match=r"max abs diff 0\.001 \(tolerance 0\)"):
        verify_weights(clients, off, "atol-v1", "sample", 2)
    assert verify_weights(clients, off, "atol-v1", "full", atol=2e-3) == 2 * len(named)


def test_trainer_group_meets_sglangs_own_group_construction():
    """Rank 0 built by reflow.engines.weights.group joins a group built the way SGLang's
    init_custom_process_group builds it (torch's tcp rendezvous + PrefixStore(group_name) + the
    process-group helper); that function itself needs triton to import, so its steps run here."""
    import datetime
    import socket
    import threading
    from pathlib import Path

    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    from reflow.engines.weights.group import broadcast, open_group

    root = sglang_contract.installed_root()
    if root is None:
        pytest.skip("sglang==0.5.23 is not installed")
    src = (Path(root) / "srt" / "utils" / "common.py").read_text()
    assert "store = PrefixStore(group_name, store)" in src and "_new_process_group_helper(" in src  # drift guard
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    got, timeout = {}, datetime.timedelta(seconds=30)

    def sglang_engine_rank():
        store, _, _ = next(rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
        pg, _ = _new_process_group_helper(2, 1, [], Backend("gloo"), PrefixStore("wug", store), group_name="wug",
                                          backend_options=None, timeout=timeout)
        _world.pg_group_ranks[pg] = {0: 0, 1: 1}
        t = torch.zeros(4)
        torch.distributed.broadcast(t, src=0, group=pg)
        got["t"] = t

    th = threading.Thread(target=sglang_engine_rank)
    th.start()
    broadcast(open_group("127.0.0.1", port, 0, 2, "wug", "gloo", timeout_s=30), torch.arange(4.0))
    th.join(30)
    assert torch.equal(got["t"], torch.arange(4.0))


def test_disk_mode_through_s3(clients, tok, tmp_path, monkeypatch):
    """mode=disk with weight_sync.disk_dir in object storage: the trainer side uploads a versioned HF
    folder (publish_weights), the engines download and load it; moto's S3 server on loopback.
    A custom endpoint reaches both sides through AWS_ENDPOINT_URL_S3 (forwarded to Ray workers)."""
    import socket

    import s3fs
    from moto.server import ThreadedMotoServer

    from reflow.engines.weights.push import publish_weights

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        for k, v in {"AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
                     "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr("reflow.engines.hf_io.CACHE_DIR", tmp_path / "cache")
        s3fs.S3FileSystem.clear_instance_cache()  # an earlier test's cached client may name another endpoint
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir("pushes")
        model, named = _new_named(tok, 14)
        url = publish_weights(lambda out: save_policy(model, tok, out), "s3://pushes/run1", "7").path
        assert url == "s3://pushes/run1/reflow-weight-push/v7"
        stats = push_weights(clients, named, "disk-s3-v7", PushSettings(bucket_bytes=16 << 10, verify="full", mode="disk"),
                             model_path=url)
        assert stats["verified_tensors"] == 2 * len(named)
        p = tok.encode("(3+4)*5=")
        out = clients[0].generate(input_ids=p, sampling_params={"temperature": 0.0, "max_new_tokens": 10})
        assert out["output_ids"] == _greedy(model, p, 10, {tok.eos_token_id})
    finally:
        server.stop()
        s3fs.S3FileSystem.clear_instance_cache()  # cached clients keep this (now dead) endpoint


def test_sampled_verify_compares_the_first_rows(clients, tok):
    """verify=sample with rows: the first `rows` rows of each sampled tensor, truncated by the engine
    as SGLang's get_weights_by_name does; a difference there is caught, one further down is not."""
    _, named = _new_named(tok, 15)
    push_weights(clients, named, "rows-v1", PushSettings(bucket_bytes=16 << 10, verify="off"))
    n = verify_weights(clients, named, "rows-v1", "sample", sample=len(named), rows=2)
    assert n == 2 * len(named)
    name, t = next((n, t) for n, t in named if t.dim() == 2 and t.shape[0] > 4)
    for row, caught in ((0, True), (3, False)):
        tampered = [(k, v.clone()) for k, v in named]
        dict(tampered)[name][row, 0] += 1.0
        if caught:
            with pytest.raises(WeightSyncError, match=name):
                verify_weights(clients, tampered, "rows-v1", "sample", sample=len(named), rows=2)
        else:
            verify_weights(clients, tampered, "rows-v1", "sample", sample=len(named), rows=2)
    with pytest.raises(WeightSyncError, match=name):  # rows=None compares whole tensors
        verify_weights(clients, tampered, "rows-v1", "sample", sample=len(named), rows=None)


def test_nccl_buckets_are_packed_on_the_trainers_cuda_device(clients, tok, monkeypatch):
    """Issue 14 point 5: a mode=distributed push over nccl used to pack and broadcast host buffers,
    which NCCL cannot send. The sender now packs on the trainer's current CUDA device, and without
    one refuses before any engine is paused."""
    assert push.group_device("gloo") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what a GPU trainer's CUDA runtime answers
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert push.group_device("nccl") == torch.device("cuda", 3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _, named = _new_named(tok, 22)
    with pytest.raises(WeightSyncError, match="sees no CUDA device.*set weight_sync.backend=gloo"):
        push_weights(clients[:1], named, "never", PushSettings(mode="distributed", backend="nccl", verify="off"))
    clients[0].begin_weight_update()  # refused before pause or session: nothing to unwind
    clients[0].end_weight_update()
    assert clients[0].generate(input_ids=[5], sampling_params={"max_new_tokens": 1})["output_ids"]


def test_tensor_mode_refuses_engines_on_another_host(clients, tok):
    """Issue 14 point 6: mode=tensor passes handles to this host's shared memory; an engine on
    another node cannot open them. Refused before anything is sent, naming the modes that work."""
    from reflow.engines.rollout_client import EngineClient

    _, named = _new_named(tok, 23)
    far = EngineClient("http://10.255.255.1:30000", timeout=1, api_key=KEY)  # not this host (never contacted)
    with pytest.raises(WeightSyncError, match=r"not on this trainer's host.*weight_sync\.mode=distributed.*disk"):
        push_weights([clients[0], far], named, "far", PushSettings(mode="tensor", verify="off"),
                     master_address="10.1.2.3")
    clients[0].begin_weight_update()  # refused before clients[0] was paused or entered a session
    clients[0].end_weight_update()
    push.check_same_host([EngineClient("http://10.1.2.3:1"), EngineClient("http://localhost:1")], "10.1.2.3")


def test_sharded_readback_is_recognised_and_bad_verify_modes_refused(clients, tok):
    """At TP > 1 SGLang's get_weights_by_name answers rank 0's shard: /server_info's tp_size says so,
    and verify_push then checks that engine by logprobs (no TP > 1 engine runs here: only the
    recognition is tested). An unknown verify mode is refused before anything is sent."""
    from reflow.engines.weights.verify import sharded_readback

    assert sharded_readback({"tp_size": 1}) is None and sharded_readback({}) is None
    assert "rank 0's shard" in sharded_readback({"tp_size": 2})
    _, named = _new_named(tok, 24)
    with pytest.raises(ValueError, match="verify must be one of"):
        push_weights(clients[:1], named, "never", PushSettings(verify="bogus"))
    assert clients[0].model_info()["weight_version"] != "never"
