"""Checkpoints: storage retries and preflight, commit/validation/retention, and a real 2-rank
ZeRO-2 DeepSpeed round trip (HF folder loadable by transformers, fallback past a corrupt one)."""
from __future__ import annotations

import json

import pytest
import ray
import torch

from reflow.infra.store import checkpoint as ckpt
from reflow.infra.store.storage import ChecksumError, ExperimentStore, StorageError, with_retries
from tests.ckpt_fixtures import captured


def _store(tmp_path, **kw) -> ExperimentStore:
    return ExperimentStore.open(f"file://{tmp_path}/runs", "exp", **kw)


def _fake_checkpoint(store: ExperimentStore, step: int, tmp_path) -> ckpt.Checkpoint:
    """A committed checkpoint with one uploaded payload file (no trainer involved)."""
    ck = ckpt.at_step(store, step)
    ckpt.begin(ck)
    local = tmp_path / f"payload{step}.bin"
    local.write_bytes(bytes([step]) * 100)
    files = {"optim/payload.bin": store.put_file(local, ck.rel("optim/payload.bin"))}
    state = ckpt.state_for(step, 4, 0, 1)
    ckpt.commit(ck, files, state, "experiment: exp\n")
    return ck


# ---------------------------------------------------------------- storage


def test_retries_recover_transient_errors_and_not_permanent_ones():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionRefusedError("server away")
        return "ok"

    with captured("reflow.storage") as warnings:
        assert with_retries(flaky, "write s3://b/x", retries=3, backoff_s=0.01) == "ok"
    assert len(calls) == 3 and any("retry 2/3" in w for w in warnings), warnings
    with pytest.raises(FileNotFoundError):
        with_retries(lambda: (_ for _ in ()).throw(FileNotFoundError("gone")), "read", 5, 0.01)


def test_preflight_names_the_url_and_no_secrets(tmp_path, monkeypatch):
    _store(tmp_path).preflight()  # a writable folder passes
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDSECRETKEYID")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "verysecretvalue")
    from tests.ckpt_fixtures import free_port

    bad = ExperimentStore.open("s3://no-such-bucket/prefix", "exp", endpoint_url=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(StorageError) as e:
        bad.preflight()
    msg = str(e.value)
    assert "s3://no-such-bucket/prefix/exp" in msg and "preflight" in msg
    assert "verysecretvalue" not in msg and "AKIDSECRETKEYID" not in msg
    with pytest.raises(StorageError, match="embeds credentials"):
        ExperimentStore.open("s3://KEY:SECRET@bucket/x", "exp")


def test_preflight_leaves_no_folder_it_created(tmp_path):
    """A run that fails after its storage preflight (or never writes) leaves no empty `_preflight/` or
    experiment folder behind; folders that existed before stay, and so does anything in them."""
    _store(tmp_path).preflight()
    assert not (tmp_path / "runs").exists()
    (tmp_path / "runs" / "exp" / "_preflight").mkdir(parents=True)
    (tmp_path / "runs" / "other").mkdir()
    _store(tmp_path).preflight()
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["exp", "other"]
    assert (tmp_path / "runs" / "exp" / "_preflight").is_dir() and not any((tmp_path / "runs" / "exp" / "_preflight").iterdir())
    ExperimentStore.open(f"file://{tmp_path}/runs", "fresh").preflight()
    assert not (tmp_path / "runs" / "fresh").exists()


def test_download_checks_sha256(tmp_path):
    store = _store(tmp_path)
    local = tmp_path / "f.bin"
    local.write_bytes(b"abc")
    meta = store.put_file(local, "x/f.bin")
    store.download("x", "f.bin", tmp_path / "back", sha256=meta["sha256"])
    with pytest.raises(ChecksumError, match="x/f.bin"):
        store.download("x", "f.bin", tmp_path / "back2", sha256="0" * 64)


# ---------------------------------------------------------------- commit, validation, retention


def test_uncommitted_and_tampered_checkpoints_are_skipped_with_a_warning(tmp_path):
    store = _store(tmp_path)
    for step in (1, 2, 3):
        _fake_checkpoint(store, step, tmp_path)
    assert [ck.step for ck, _, _ in ckpt.valid_candidates(store)] == [3, 2, 1]
    store.rm(ckpt.at_step(store, 3).rel(ckpt.MARKER))  # "killed before the marker"
    store.write_text(ckpt.at_step(store, 2).rel(ckpt.MANIFEST), "{}")  # manifest no longer matches
    with captured("reflow.checkpoint") as warnings:
        found = ckpt.valid_candidates(store)
    assert [ck.step for ck, _, _ in found] == [1]
    assert any("iter_000003, which is not committed" in w for w in warnings), warnings
    assert any("skipping checkpoint" in w and "iter_000002" in w for w in warnings), warnings


def test_retention_keeps_last_n_and_what_latest_names(tmp_path):
    store = _store(tmp_path)
    for step in range(1, 6):
        _fake_checkpoint(store, step, tmp_path)
    ckpt.apply_retention(store, keep_last=2)
    assert store.listdir(ckpt.ROOT) == ["iter_000004", "iter_000005", "latest"]
    store.write_text(ckpt.LATEST, "iter_000004")  # e.g. a resume from an explicit older checkpoint
    ckpt.apply_retention(store, keep_last=1)
    assert store.listdir(ckpt.ROOT) == ["iter_000004", "iter_000005", "latest"]
    ckpt.begin(ckpt.at_step(store, 6))
    store.write_text(ckpt.at_step(store, 3).rel("optim/partial.bin"), "half a save")
    ckpt.apply_retention(store, keep_last=1)  # an unfinished save older than the newest is removed
    assert "iter_000003" not in store.listdir(ckpt.ROOT)


@pytest.mark.parametrize("pointer", [b"iter_" + b"9" * 5000, b"iter_" + b"0" * 5000, b"iter_-3", "iter_\u00b2".encode(),
                                     "iter_\u0663".encode(), b"garbage", b"", b"../../etc/iter_000001", b"\xffiter_1"])
def test_a_malformed_latest_pointer_falls_back_to_the_listing(tmp_path, pointer):
    """`latest` is written by whoever can write the bucket (issue 51, point 4): a name int() refuses
    (over 4300 digits, a superscript digit), a negative or non-ASCII number, garbage, a path or bytes
    that are not UTF-8 are not a checkpoint name. Resume, retention and the listing go on from the committed checkpoints, with
    a warning naming the pointer; none raises."""
    store = _store(tmp_path)
    for step in (1, 2):
        _fake_checkpoint(store, step, tmp_path)
    store.write_bytes(ckpt.LATEST, pointer)
    with captured("reflow.checkpoint") as warnings:
        assert ckpt.latest_step(store) is None
        assert [ck.step for ck, _, _ in ckpt.valid_candidates(store)] == [2, 1]
        assert ckpt.apply_retention(store, keep_last=2) == []
    assert any("checkpoints/latest" in w and "not a checkpoint name" in w for w in warnings), warnings
    assert all(len(w) < 1000 for w in warnings), "a 5000-digit pointer is shortened in the warning"


def test_checkpoint_names_are_plain_ascii_steps_of_bounded_length(tmp_path):
    """The same parse serves folder names in the listing and resume URLs: a folder iter_<5000 digits>
    is ignored, not a crash; such a resume URL is refused as not a checkpoint URL."""
    assert ckpt.step_of("iter_000042") == 42 and ckpt.step_of(ckpt.name_of(10**12)) == 10**12
    for name in ("iter_" + "9" * 5000, "iter_\u00b2", "iter_\u0663", "iter_-1", "iter_+1", "iter_ 1", "iter_1_2"):
        assert ckpt.step_of(name) is None, name
    store = _store(tmp_path)
    _fake_checkpoint(store, 1, tmp_path)
    (tmp_path / "runs/exp/checkpoints" / ("iter_" + "7" * 200)).mkdir()  # within NAME_MAX, still refused
    assert [ck.step for ck in ckpt.committed(store)] == [1]
    with pytest.raises(ckpt.CheckpointInvalid, match="is not a checkpoint URL"):
        ckpt.from_url(store.url(ckpt.ROOT, "iter_" + "9" * 5000), store)


# ---------------------------------------------------------------- real trainer ranks


@pytest.mark.slow
def test_zero2_two_ranks_save_load_hf_and_fallback(ray_cluster, tiny_policy, tmp_path):
    """Save (ZeRO-2, 2 ranks) -> the HF folder equals the trainer's weights; a corrupt newer
    checkpoint is skipped; a fresh group loads the older one and its next update reproduces the
    original group's bit for bit (optimizer state and LR schedule restored, not just the weights)."""
    from transformers import AutoModelForCausalLM

    from reflow.engines.train.group import TrainerGroup
    from reflow.engines.train.settings import RankSettings
    from reflow.tasks.checkpoint import load_first_valid, save
    from tests.test_trainer import RANK_KW, _batch, _train_kw

    store = _store(tmp_path)
    settings = RankSettings(**(RANK_KW | dict(zero_stage=2, lr=1e-2, lr_schedule="linear", total_steps=8)))
    kw = dict(model_path=str(tiny_policy), settings=settings)
    a = TrainerGroup.create(2, "test-ckpt", "a", init_timeout_s=300, **kw)
    batch = ray.put(_batch(tiny_policy))
    pad = 0
    ray.get(a.train_iteration(batch, **_train_kw(pad)))
    state = ckpt.state_for(1, 4, 0, 2)
    save(a, store, 1, state, "x: 1\n", keep_last=3)
    files = json.loads(store.read_bytes(ckpt.at_step(store, 1).rel(ckpt.MANIFEST)))["files"]
    assert {"optim/zero_pp_rank_0_mp_rank_00_optim_states.pt", "optim/zero_pp_rank_1_mp_rank_00_optim_states.pt",
            "rng/rank_00000.pt", "rng/rank_00001.pt", "model/model.safetensors"} <= set(files)

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "runs/exp/checkpoints/iter_000001/model")
    trained = dict(ray.get(a.named_weights()[0]))
    for name, p in hf.state_dict().items():
        if name in trained:
            torch.testing.assert_close(p, trained[name], rtol=0, atol=1e-6)

    m_a = ray.get(a.train_iteration(batch, **_train_kw(pad)))[0]
    after_two = ray.get(a.weights_checksum())[0]
    save(a, store, 2, ckpt.state_for(2, 4, 0, 2), "x: 2\n", keep_last=3)
    a.kill()
    bad = tmp_path / "runs/exp/checkpoints/iter_000002/optim/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    bad.write_bytes(bad.read_bytes()[:-8] + b"\0" * 8)  # same size, different bytes

    b = TrainerGroup.create(2, "test-ckpt", "b", init_timeout_s=300, **kw)
    found = [(ck, files) for ck, files, _ in ckpt.valid_candidates(store)]
    with captured("reflow.checkpoint") as warnings:
        assert load_first_valid(b, found, num_ranks=2).step == 1
    assert any("skipping checkpoint" in w and "sha256" in w for w in warnings), warnings

    # b is now where a was after one update: the same second update must give a's weights exactly.
    m_b = ray.get(b.train_iteration(batch, **_train_kw(pad)))[0]
    assert m_b["lr"] == m_a["lr"] < 1e-2  # the linear schedule continued, not restarted
    assert ray.get(b.weights_checksum())[0] == after_two
    b.kill()


def test_resume_modes_and_sentinel(tmp_path):
    from reflow.flows.schedule import save_due
    from reflow.infra.config.schema import load_config
    from reflow.tasks.checkpoint import ResumeError, find_checkpoints

    store = _store(tmp_path)
    _fake_checkpoint(store, 2, tmp_path)
    _fake_checkpoint(store, 4, tmp_path)
    cfg = lambda *o: load_config(None, ["experiment=exp", f"storage.root=file://{tmp_path}/runs", *o])  # noqa: E731
    assert [ck.step for ck, _ in find_checkpoints.fn(cfg())] == [4, 2]
    explicit = find_checkpoints.fn(cfg(f"resume={store.url('checkpoints/iter_000002')}"))
    assert [ck.step for ck, _ in explicit] == [2]
    with pytest.raises(ResumeError, match="already holds committed checkpoints"):
        find_checkpoints.fn(cfg("resume=never"))

    sentinel = tmp_path / "SAVE_NOW"
    c = cfg(f"checkpoint.sentinel={sentinel}", "checkpoint.save_interval=5")
    assert not save_due(c, 2, 10, 0.0) and save_due(c, 5, 10, 0.0) and save_due(c, 10, 10, 0.0)
    sentinel.touch()
    assert save_due(c, 2, 10, 0.0)
    ckpt.remove_sentinel(str(sentinel))
    assert not sentinel.exists() and not save_due(c, 3, 10, 0.0)


def test_checkpoints_by_default_every_few_minutes_not_only_at_the_end(tmp_path):
    """A crash should never cost more than `save_every_minutes` of work (default 10): the loop saves
    once that much time has passed since the start or the last save, besides interval/sentinel/last."""
    from reflow.flows.schedule import save_due
    from reflow.infra.config.schema import load_config

    cfg = load_config(None, [])
    assert cfg.checkpoint.save_interval is None and cfg.checkpoint.save_every_minutes == 10.0
    assert not save_due(cfg, 3, 100, minutes_since_save=9.9)
    assert save_due(cfg, 3, 100, minutes_since_save=10.0)
    assert save_due(cfg, 100, 100, minutes_since_save=0.0)  # the last iteration always
    off = load_config(None, ["checkpoint.save_every_minutes=null", "checkpoint.save_interval=5"])
    assert not save_due(off, 3, 100, minutes_since_save=1e6) and save_due(off, 5, 100, minutes_since_save=0.0)
    sentinel = tmp_path / "save-now"
    sentinel.touch()
    assert save_due(load_config(None, [f"checkpoint.sentinel={sentinel}"]), 3, 100, minutes_since_save=0.0)
    # save_last=false with no interval or timer: nothing saves (a throughput run whose checkpoint cannot fit)
    none = load_config(None, ["checkpoint.save_last=false", "checkpoint.save_every_minutes=null"])
    assert not any(save_due(none, d, 100, minutes_since_save=1e6) for d in (3, 99, 100))


def test_max_train_minutes_is_a_wall_clock_budget_checked_after_each_iteration():
    """over_budget: past max_train_minutes since the flow's start (a monotonic reading), never without a budget;
    the field must be positive (the error names it)."""
    from reflow.flows.schedule import over_budget
    from reflow.infra.config.schema import ConfigError, load_config

    cfg = load_config(None, ["max_train_minutes=1.5"])
    assert not over_budget(cfg, started=100.0, now=100.0 + 89.9) and over_budget(cfg, started=100.0, now=190.0)
    assert not over_budget(load_config(None, []), started=0.0, now=1e9)  # null: no budget
    assert over_budget(load_config(None, ["max_train_minutes=1e-9"]), started=0.0)  # the default `now`: monotonic
    for bad in ("0", "-1"):
        with pytest.raises(ConfigError, match="max_train_minutes"):
            load_config(None, [f"max_train_minutes={bad}"])
