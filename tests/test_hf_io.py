"""Checkpoints load from a local folder or a URL (s3:// against moto's S3 server on loopback); with
a manifest, every file is checked and nothing else is loaded."""
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
    """No storage access passed: the defaults, with the endpoint from the environment (the fallback)."""
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


def _manifest(folder) -> dict[str, dict]:
    """What a checkpoint's manifest records for the files of `folder` (infra/store/checkpoint.py)."""
    from reflow.infra.store.storage import sha256_file

    return {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in sorted(folder.iterdir())}


def test_a_local_folder_is_checked_in_place_against_its_manifest(tiny_policy, tmp_path):
    import shutil

    from reflow.infra.store.storage import ChecksumError

    folder = shutil.copytree(tiny_policy, tmp_path / "model")
    files = _manifest(folder)
    assert resolve_checkpoint(str(folder), files=files) == folder.resolve()
    (folder / "extra.safetensors").write_bytes(b"planted")
    with pytest.raises(ChecksumError, match=r"holds extra\.safetensors, which its manifest does not list"):
        resolve_checkpoint(f"file://{folder}", files=files)
    (folder / "extra.safetensors").unlink()
    config = (folder / "config.json").read_bytes()
    (folder / "config.json").write_bytes(config + b" ")
    with pytest.raises(ChecksumError, match=r"config\.json is \d+ bytes where its manifest records"):
        resolve_checkpoint(str(folder), files=files)
    (folder / "config.json").write_bytes(config.replace(b"{", b"[", 1))  # same size, other bytes
    with pytest.raises(ChecksumError, match=rf"checkpoint {folder}: config\.json does not match its manifest"):
        resolve_checkpoint(str(folder), files=files)


def test_only_the_files_of_the_manifest_are_downloaded(tiny_policy, s3_endpoint, tmp_path, monkeypatch):
    """With a manifest, a file planted beside the checkpoint's own never reaches the local copy; the
    endpoint here is the explicit storage access's (no AWS_ENDPOINT_URL*)."""
    import s3fs

    from reflow.engines.storage_access import StorageAccess

    for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(k, "test")
    monkeypatch.setattr("reflow.engines.hf_io.CACHE_DIR", tmp_path / "cache")
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True)
    fs.mkdir("planted")
    fs.put(str(tiny_policy) + "/", "planted/model/", recursive=True)
    fs.pipe("planted/model/pytorch_model.bin", b"not in the manifest")
    local = resolve_checkpoint("s3://planted/model", StorageAccess(endpoint_url=s3_endpoint),
                               files=_manifest(tiny_policy))
    assert sorted(p.name for p in local.iterdir() if p.name != ".complete") == sorted(_manifest(tiny_policy))


def test_fp32_lm_head_computes_logits_in_float32_under_bf16_and_autocast(tiny_policy):
    """trainer.fp32_lm_head: a bf16 model's head gives float32 logits equal to the float32 product of its (bf16)
    weight and input, also inside torch.autocast(bf16); a weight written in place (a push) takes effect."""
    import torch.nn.functional as F

    from reflow.engines.hf_io import fp32_lm_head

    plain = load_causal_lm(str(tiny_policy), dtype="bf16")
    model = fp32_lm_head(load_causal_lm(str(tiny_policy), dtype="bf16"))
    head = model.get_output_embeddings()
    h = torch.randn(3, head.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 8
    want = F.linear(h.float(), head.weight.float())
    for autocast in (False, True):
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            got = head(h)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert plain.get_output_embeddings()(h).dtype == torch.bfloat16
    assert not torch.equal(plain.get_output_embeddings()(h).float(), want), "bf16 rounding changed nothing: no test"
    with torch.no_grad():
        head.weight.mul_(2)  # an in-place push
    torch.testing.assert_close(head(h), F.linear(h.float(), head.weight.float()), rtol=0, atol=0)
    logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits  # the whole model: float32 logits
    assert logits.dtype == torch.float32


def test_loads_in_two_threads_leave_weight_tying_on(tmp_path, monkeypatch):
    """transformers' from_pretrained turns weight tying off for the whole process while it loads (its
    initialization.no_tie_weights swaps PreTrainedModel.tie_weights for a no-op and puts back what it found).
    Two loads interleaved in threads of one process (an engine's disk pushes arriving together; the suite's two
    engines in one process) left the no-op in place for good: every model made afterwards, tied embeddings in its
    config, got an lm_head of its own (random where a checkpoint stores only the tied weight). Here the first load
    is held inside that window while a second starts, then each finishes in turn."""
    import threading

    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.modeling_utils import PreTrainedModel

    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, tie_word_embeddings=True)
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "tied")
    original = PreTrainedModel.tie_weights
    inside = {n: threading.Event() for n in ("load-a", "load-b")}
    go = {n: threading.Event() for n in ("load-a", "load-b")}
    real_init = Qwen2ForCausalLM.__init__

    def held_init(self, config, *args, **kwargs):  # from_pretrained builds the model inside its no-tie window
        name = threading.current_thread().name
        if name in inside:
            inside[name].set()
            go[name].wait(30)
        real_init(self, config, *args, **kwargs)

    monkeypatch.setattr(Qwen2ForCausalLM, "__init__", held_init)
    models: dict = {}
    threads = {n: threading.Thread(target=lambda n=n: models.__setitem__(n, load_causal_lm(str(tmp_path / "tied"))),
                                   name=n) for n in inside}
    try:
        threads["load-a"].start()
        assert inside["load-a"].wait(30)
        threads["load-b"].start()
        inside["load-b"].wait(1)  # unserialised, b is inside too now; serialised, it waits for a
        go["load-a"].set()
        threads["load-a"].join(60)
        go["load-b"].set()
        threads["load-b"].join(60)
    finally:
        for e in go.values():
            e.set()
    monkeypatch.undo()
    tie_fn = PreTrainedModel.tie_weights
    PreTrainedModel.tie_weights = original  # whatever happened, later tests get tying back
    assert tie_fn is original, "weight tying is left switched off in this process"
    assert sorted(models) == ["load-a", "load-b"]
    for m in models.values():
        assert m.lm_head.weight is m.model.embed_tokens.weight
    fresh = Qwen2ForCausalLM(cfg)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
