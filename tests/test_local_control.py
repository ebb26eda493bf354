"""The embedded engine's local socket (engines/local_control.py): who may use it, what it answers,
and the mapped push going through it, back to HTTP when it fails. A real engine (CPU) in this process."""
from __future__ import annotations

import json
import os
import socket
import stat

import pytest
import torch

from reflow.engines.embedded.engine import EmbeddedEngine
from reflow.engines.http_serve import new_api_key
from reflow.engines.local_control import LOCAL_CONTROL, MAX_LINE, LocalControlClient, LocalControlError
from reflow.engines.rollout_client import EngineClient, EngineError
from reflow.engines.weights.mapped import MappedSender
from reflow.engines.weights.verify import verify_weights

KEY = new_api_key()


@pytest.fixture()
def engine(tiny_policy):
    e = EmbeddedEngine(str(tiny_policy), "local-control", threads=1, api_key=KEY)
    e.ready()
    yield e
    e.shutdown()


def _info(engine) -> dict:
    return EngineClient(engine.url(), api_key=KEY).server_info()[LOCAL_CONTROL]


def _raw(path: str, *lines: bytes) -> list[dict]:
    """Send raw lines on a fresh connection; the answers until the engine closes it (or 2 s pass). An engine that
    answers a line by closing (a wrong key) may do so before the later lines are sent: those then meet a closed
    socket (EPIPE, seen in a CI rehearsal). If they arrived before it closed, unread, its close resets the
    connection: the reading side gets its queued answers first, then ECONNRESET where EOF would be. Either way
    what it answered is read from the receive buffer, and a reset ends the stream like EOF."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2.0)
        s.connect(path)
        try:
            for line in lines:
                s.sendall(line)
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = b""
        try:
            while chunk := s.recv(1 << 16):
                data += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return [json.loads(x) for x in data.splitlines()]


def test_raw_keeps_the_answer_of_a_peer_that_closes_with_a_line_unread(tmp_path):
    """What the engine does to a wrong key, made deterministic: answer the first line, close with the second
    still unread. On Linux the closing side then resets the connection (ECONNRESET): the answer already
    received must be read, and the reset taken as the end of the stream (issue 52: it was raised, once in CI)."""
    import threading
    import time

    path = str(tmp_path / "s.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    first = b'{"api_key": "wrong"}\n'

    def peer() -> None:
        conn, _ = listener.accept()
        with conn:
            got = b""
            while len(got) < len(first):
                got += conn.recv(len(first) - len(got))  # exactly the first line: the second stays queued
            conn.sendall(b'{"success": false, "status": 401}\n')
            time.sleep(0.3)  # the client has sent its second line by now

    t = threading.Thread(target=peer, daemon=True)
    t.start()
    try:
        assert _raw(path, first, b'{"op": "x"}\n') == [{"success": False, "status": 401}]
    finally:
        t.join(5)
        listener.close()


def _named(model_params: dict, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(p.shape, generator=g) * 0.02) for n, p in model_params.items()]


def test_only_its_user_with_the_key_gets_an_answer(engine):
    info = _info(engine)
    assert info["host"] == socket.gethostname() and LocalControlClient.usable(info)
    assert stat.S_IMODE(os.stat(os.path.dirname(info["path"])).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(info["path"]).st_mode) == 0o600
    update = b'{"op": "update_weights_from_mapped", "body": {"mapping_id": "x"}}\n'
    wrong = json.dumps({"api_key": "not-" + KEY, "instance": info["instance"]}).encode() + b"\n"
    assert _raw(info["path"], wrong, update) == [{"success": False, "status": 401,
                                                  "message": "wrong API key or engine instance"}]  # then closed
    other = json.dumps({"api_key": KEY, "instance": "another-engine"}).encode() + b"\n"
    assert _raw(info["path"], other, update)[0]["status"] == 401
    assert _raw(info["path"], update)[0]["status"] == 401  # an operation before the key is proven: refused
    client = LocalControlClient(info, "not-" + KEY, 5.0)
    with pytest.raises(LocalControlError, match="wrong API key"):
        client.call("update_weights_from_mapped", {})


def test_answers_as_http_would(engine):
    info = _info(engine)
    client = LocalControlClient(info, KEY, 5.0)
    with pytest.raises(LocalControlError) as e:
        client.call("update_weights_from_mapped", {"mapping_id": "nothing-mapped", "weight_version": "1"})
    assert e.value.status == 400 and "unknown weight mapping 'nothing-mapped'" in e.value.message
    with pytest.raises(LocalControlError) as e:
        client.call("generate", {})
    assert e.value.status == 404 and "update_weights_from_mapped" in e.value.message
    hello = json.dumps({"api_key": KEY, "instance": info["instance"]}).encode() + b"\n"
    answers = _raw(info["path"], hello, b"x" * (MAX_LINE + 10) + b"\n")
    assert answers[0] == {"success": True} and answers[1]["status"] == 400 and "longer than" in answers[1]["message"]
    assert _raw(info["path"], hello, b"[1, 2]\n")[1]["status"] == 400


def test_mapped_push_goes_through_the_socket_and_back_to_http_when_it_fails(engine):
    c = EngineClient(engine.url(), api_key=KEY)
    params = {n: p for n, p in engine.generator.model.named_parameters()}
    sender = MappedSender()
    assert sender.supports([c]) and c.url in sender.local
    named = _named(params, 1)
    out = sender.push([c], named, "v1")
    assert out["mapped"] == 1 and out["copies"] == 1 and sender.local_calls == 1
    assert verify_weights([c], named, "v1", "full") == len(named)
    sender.local[c.url]._conn.shutdown(socket.SHUT_RDWR)  # the socket breaks under the sender
    named = _named(params, 2)
    sender.push([c], named, "v2")
    assert sender.local_calls == 1 and c.url not in sender.local  # this push went through HTTP
    assert verify_weights([c], named, "v2", "full") == len(named)
    named = _named(params, 3)
    assert sender.supports([c]) and c.url in sender.local  # push_weights asks first: /server_info asked again
    sender.push([c], named, "v3")  # and the socket is used again
    assert sender.local_calls == 2 and verify_weights([c], named, "v3", "full") == len(named)


def test_a_stopped_engine_answers_nothing_more(tiny_policy):
    e = EmbeddedEngine(str(tiny_policy), "local-control-stop", threads=1, api_key=KEY)
    e.ready()
    info = _info(e)
    client = LocalControlClient(info, KEY, 5.0)
    with pytest.raises(LocalControlError):  # connected and proven: the engine answers (an error: nothing mapped)
        client.call("update_weights_from_mapped", {"mapping_id": "m"})
    e.shutdown()
    with pytest.raises(OSError):
        client.call("update_weights_from_mapped", {"mapping_id": "m"})
    assert not os.path.exists(os.path.dirname(info["path"]))
    with pytest.raises(EngineError):
        EngineClient(e.url(), api_key=KEY, timeout=2.0).server_info()
