"""Checkpoints load from a local folder or a URL (s3:// against moto's S3 server on loopback)."""
from __future__ import annotations

import socket

import pytest
import torch

from reflow.engines.hf_io import CheckpointError, load_causal_lm, load_tokenizer, resolve_checkpoint


@pytest.fixture(scope="module")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def test_missing_and_malformed_folders_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        resolve_checkpoint(str(tmp_path / "empty"))


def test_load_from_s3_url_matches_local(tiny_policy, s3_endpoint, tmp_path, monkeypatch):
    import s3fs

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("REFLOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("reflow.engines.hf_io.CACHE_DIR", tmp_path / "cache")
    fs = s3fs.S3FileSystem()
    fs.mkdir("ckpts")
    fs.put(str(tiny_policy) + "/", "ckpts/policy/", recursive=True)

    url = "s3://ckpts/policy"
    remote, local = load_causal_lm(url), load_causal_lm(str(tiny_policy))
    for (n1, p1), (n2, p2) in zip(remote.state_dict().items(), local.state_dict().items()):
        assert n1 == n2
        torch.testing.assert_close(p1, p2, rtol=0, atol=0)
    assert load_tokenizer(url)("12+34=").input_ids == load_tokenizer(str(tiny_policy))("12+34=").input_ids
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint("s3://ckpts/missing")
