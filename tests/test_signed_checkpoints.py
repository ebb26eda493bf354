"""Signed checkpoint manifests (issue 13, point 4): DeepSpeed unpickles optim/*.pt on resume, and the
sha256 records sit in the same bucket, so only an HMAC over MANIFEST.json with a key kept outside
the bucket stops a bucket writer from running code in the trainer ranks."""
from __future__ import annotations

import hashlib
import json
import logging

import pytest

from reflow.infra.store import checkpoint as ckpt
from reflow.infra.store import signing
from reflow.infra.store.storage import ExperimentStore
from tests.ckpt_fixtures import captured, s3_with_bucket

KEY_A, KEY_B = "a" * 24 + "0123456789abcdef", "b" * 24 + "0123456789abcdef"  # 40 characters each


class PlantedCode:
    """Unpickling this creates `path`: the code a bucket writer would plant in a checkpoint."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _cfg(tmp_path, *overrides):
    from reflow.infra.config.schema import load_config

    return load_config(None, ["experiment=exp", f"storage.root=file://{tmp_path}/runs", *overrides])


def _plant(store: ExperimentStore, ck: ckpt.Checkpoint, rel: str, marker) -> None:
    """What a bucket writer can do without the key: replace a pickled file, then rewrite MANIFEST.json
    and COMMITTED so every sha256 and size recorded in the bucket matches again."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save({"optimizer_state_dict": PlantedCode(marker)}, buf)
    data = buf.getvalue()
    store.write_bytes(ck.rel(rel), data)
    manifest = json.loads(store.read_bytes(ck.rel(ckpt.MANIFEST)))
    manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    raw = json.dumps(manifest, indent=2, sort_keys=True).encode()
    store.write_bytes(ck.rel(ckpt.MANIFEST), raw)
    store.write_text(ck.rel(ckpt.MARKER), hashlib.sha256(raw).hexdigest())


def _resume(group, cfg) -> str:
    """The train flow's resume path (find the checkpoint, then every rank fetches and loads it);
    returns why it was refused, or "" when it loaded."""
    import ray

    from reflow.tasks.checkpoint import ResumeError, find_checkpoints, load_first_valid

    try:
        load_first_valid(group, find_checkpoints.fn(cfg), num_ranks=1)
    except (ResumeError, ckpt.CheckpointInvalid, ray.exceptions.RayTaskError) as e:
        return str(e)
    return ""


@pytest.mark.slow
def test_a_bucket_writer_cannot_run_code_through_deepspeed_optimizer_states(ray_cluster, tiny_policy, tmp_path,
                                                                           monkeypatch):
    """A real 1-rank ZeRO-1 trainer saves; a bucket writer swaps its optimizer partition for a pickle
    that creates a marker file and fixes up MANIFEST.json + COMMITTED. Resume (auto or by URL) must
    refuse it before any rank unpickles it, whether the stale SIGNATURE is left or deleted. With the
    explicit `checkpoint.trust_unsigned` escape hatch the same files do run the planted code: the
    signature is what stops it, not some other check."""
    from reflow.engines.train.group import TrainerGroup
    from reflow.engines.train.settings import RankSettings
    from reflow.tasks.checkpoint import ResumeError, find_checkpoints, load_first_valid, save
    from tests.test_trainer import RANK_KW

    monkeypatch.setenv("REFLOW_KEYS_DIR", str(tmp_path / "keys"))  # this test's own local key
    monkeypatch.delenv("REFLOW_CHECKPOINT_KEY", raising=False)
    store = ExperimentStore.open(f"file://{tmp_path}/runs", "exp")
    group = TrainerGroup.create(1, "test-signed", "a", init_timeout_s=300, model_path=str(tiny_policy),
                                settings=RankSettings(**(RANK_KW | dict(zero_stage=1))))
    try:
        save(group, store, 1, ckpt.state_for(1, 4, 0, 1), "x: 1\n", keep_last=3)
        ck = ckpt.at_step(store, 1)
        assert _resume(group, _cfg(tmp_path)) == ""  # untouched, it resumes with no setting at all

        marker = tmp_path / "planted-code-ran"
        target = "optim/zero_pp_rank_0_mp_rank_00_optim_states.pt"
        assert target in json.loads(store.read_bytes(ck.rel(ckpt.MANIFEST)))["files"]
        found = find_checkpoints.fn(_cfg(tmp_path))  # verified now; the writer strikes before the ranks fetch
        _plant(store, ck, target, marker)
        with captured("reflow.checkpoint") as warnings, pytest.raises(ResumeError):
            load_first_valid(group, found, num_ranks=1)  # the ranks check the verified table, not the bucket's
        assert not marker.exists(), "a bucket writer ran code in a trainer rank"
        assert any("sha256" in w and target in w for w in warnings), warnings
        for resume in ("auto", ck.url):
            why = _resume(group, _cfg(tmp_path, f"resume={resume}"))
            assert not marker.exists(), "a bucket writer ran code in a trainer rank"
            assert "SIGNATURE does not match MANIFEST.json" in why, why

        store.rm(ck.rel(ckpt.SIGNATURE))  # the writer deletes the signature instead
        why = _resume(group, _cfg(tmp_path, f"resume={ck.url}"))
        assert not marker.exists(), "a bucket writer ran code in a trainer rank"
        assert "unsigned" in why and "checkpoint.trust_unsigned" in why, why

        _resume(group, _cfg(tmp_path, f"resume={ck.url}", "checkpoint.trust_unsigned=true"))
        assert marker.exists(), "the planted pickle never ran: this test would not notice a missing signature check"
    finally:
        group.kill()


# ---------------------------------------------------------------- the driver's signature check


@pytest.fixture()
def keys_dir(tmp_path, monkeypatch):
    """No configured key; this machine's generated keys go to a folder of the test's own."""
    monkeypatch.delenv(signing.KEY_ENV, raising=False)
    monkeypatch.setenv(signing.KEYS_DIR_ENV, str(tmp_path / "keys"))
    return tmp_path / "keys"


def _commit(store: ExperimentStore, step: int, keys=None) -> ckpt.Checkpoint:
    """A committed checkpoint with one pickled optimizer file (the trainer ranks are not needed here)."""
    ck = ckpt.at_step(store, step)
    ckpt.begin(ck)
    store.write_bytes(ck.rel("optim/mp_rank_00_model_states.pt"), b"pickle bytes %d" % step)
    data = store.read_bytes(ck.rel("optim/mp_rank_00_model_states.pt"))
    files = {"optim/mp_rank_00_model_states.pt": {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}}
    ckpt.commit(ck, files, ckpt.state_for(step, 4, 0, 1), "experiment: exp\n", keys)
    return ck


def _sign_as_attacker(store: ExperimentStore, ck: ckpt.Checkpoint, key: str) -> None:
    """A forger who knows the format and the algorithm, with a key of their own."""
    import hmac

    raw = store.read_bytes(ck.rel(ckpt.MANIFEST))
    mac = hmac.new(key.encode(), raw, hashlib.sha256).hexdigest()
    store.write_bytes(ck.rel(ckpt.SIGNATURE), json.dumps({"alg": ckpt.HMAC_ALG, "key_id": signing.key_id(
        key.encode()), "hmac": mac}).encode())


def test_forged_and_tampered_manifests_are_refused_on_s3(keys_dir, monkeypatch):
    """On moto's S3 server: a signed checkpoint verifies; every way a bucket writer without the key
    can change it is refused with a message that says what is wrong."""
    monkeypatch.setenv(signing.KEY_ENV, KEY_A)
    with s3_with_bucket() as server:
        store = ExperimentStore.open("s3://reflow-test/signed", "exp", endpoint_url=server.url, retries=1)
        ck, other = _commit(store, 1), _commit(store, 2)
        sig = json.loads(store.read_bytes(ck.rel(ckpt.SIGNATURE)))
        assert sig["key_id"] == signing.key_id(KEY_A.encode()) and sig["alg"] == "HMAC-SHA256"
        assert set(ckpt.check(ck)) == {"optim/mp_rank_00_model_states.pt", "state.json", "config.yaml"}

        _plant(store, ck, "optim/mp_rank_00_model_states.pt", "/nonexistent/never-created")
        with pytest.raises(ckpt.CheckpointInvalid, match=r"SIGNATURE does not match MANIFEST.json under key "
                                                         rf"{sig['key_id']} \(\$REFLOW_CHECKPOINT_KEY\)"):
            ckpt.check(ck)
        _sign_as_attacker(store, ck, KEY_B)
        with pytest.raises(ckpt.CheckpointInvalid, match=rf"signed with key id {signing.key_id(KEY_B.encode())}, "
                                                         r"which is not held here .*Set REFLOW_CHECKPOINT_KEY"):
            ckpt.check(ck)
        store.write_bytes(ck.rel(ckpt.SIGNATURE), b"not json")
        with pytest.raises(ckpt.CheckpointInvalid, match="SIGNATURE is unreadable"):
            ckpt.check(ck)
        store.rm(ck.rel(ckpt.SIGNATURE))
        with pytest.raises(ckpt.CheckpointInvalid, match=r"is unsigned \(no SIGNATURE\).*trust_unsigned=true"):
            ckpt.check(ck)
        with captured("reflow.checkpoint") as warnings:  # the explicit escape hatch, loudly
            ckpt.check(ck, signing.keyring("exp", trust_unsigned=True))
        assert any("unsigned; loading it anyway" in w for w in warnings), warnings
        ckpt.check(ck, signature=False)  # readers of model/ (safetensors) need no signature

        for name in (ckpt.MANIFEST, ckpt.SIGNATURE, ckpt.MARKER):  # a validly signed manifest of step 2
            store.write_bytes(ck.rel(name), store.read_bytes(other.rel(name)))
        with pytest.raises(ckpt.CheckpointInvalid, match="MANIFEST.json is that of step 2, not 1"):
            ckpt.check(ck)


def test_default_key_is_generated_once_outside_the_bucket(keys_dir, tmp_path, monkeypatch):
    """No key configured: the first save generates one in the keys folder (0600, folder 0700), later
    saves reuse it, nothing of it reaches the bucket or the log; another machine (no key file) is
    told which key it lacks, and its content in REFLOW_CHECKPOINT_KEY is enough to resume there.
    The new key is a notice (info, not a warning) saying where the key is and what it is for."""
    store = ExperimentStore.open(f"file://{tmp_path}/runs", "exp")
    with captured("reflow.checkpoint", logging.INFO) as notices, captured("reflow.checkpoint") as warnings:
        ck = _commit(store, 1)
        _commit(store, 2)
    key_file = keys_dir / "exp.key"
    key = key_file.read_text().strip()
    kid = signing.key_id(key.encode())
    assert len(key) == 64 and key_file.stat().st_mode & 0o777 == 0o600 and keys_dir.stat().st_mode & 0o777 == 0o700
    assert [json.loads(store.read_bytes(c.rel(ckpt.SIGNATURE)))["key_id"] for c in (ck, ckpt.at_step(store, 2))] \
        == [kid, kid]
    assert warnings == [] and len(notices) == 1, (warnings, notices)
    assert kid in notices[0] and str(key_file) in notices[0] and key not in notices[0]
    assert "proves on resume that a checkpoint was saved here" in notices[0] and "copy the file there" in notices[0]
    assert signing.key_location("exp") == str(key_file)
    assert signing.key_location("exp", "my-block") == "Prefect Secret block 'my-block'"
    bucket = [p for p in (tmp_path / "runs").rglob("*") if p.is_file()]
    assert bucket and not any(key.encode() in p.read_bytes() for p in bucket)
    ckpt.check(ck)

    monkeypatch.setenv(signing.KEYS_DIR_ENV, str(tmp_path / "elsewhere"))  # another machine
    with pytest.raises(ckpt.CheckpointInvalid, match=rf"key id {kid}, which is not held here \(held: none"):
        ckpt.check(ck)
    monkeypatch.setenv(signing.KEY_ENV, key)
    ckpt.check(ck)

    key_file.chmod(0o644)
    monkeypatch.setenv(signing.KEYS_DIR_ENV, str(keys_dir))
    monkeypatch.delenv(signing.KEY_ENV)
    with pytest.raises(signing.SigningKeyError, match=r"other users; run `chmod 600 .*exp.key`"):
        ckpt.check(ck)


def test_key_rotation_and_weak_keys_give_clear_errors(keys_dir, tmp_path, monkeypatch):
    store = ExperimentStore.open(f"file://{tmp_path}/runs", "exp")
    monkeypatch.setenv(signing.KEY_ENV, KEY_A)
    ck = _commit(store, 1)
    assert not keys_dir.exists()  # a configured key: nothing generated
    monkeypatch.setenv(signing.KEY_ENV, KEY_B)
    with pytest.raises(ckpt.CheckpointInvalid, match=rf"key id {signing.key_id(KEY_A.encode())}.*held: "
                                                     rf"{signing.key_id(KEY_B.encode())} from \$REFLOW_CHECKPOINT_KEY"):
        ckpt.check(ck)
    monkeypatch.setenv(signing.KEY_ENV, "short")
    with pytest.raises(signing.SigningKeyError, match=r"\$REFLOW_CHECKPOINT_KEY has 5 characters; use at least 32"):
        ckpt.check(ck)


def test_resume_refuses_unsigned_checkpoints_unless_told_and_eval_needs_no_signature(keys_dir, tmp_path):
    """Checkpoints from before signing (no SIGNATURE): resume says what to do; with the explicit
    checkpoint.trust_unsigned they load; evaluating their model needs nothing."""
    from reflow.tasks.checkpoint import ResumeError, find_checkpoints, resolve_checkpoint

    store = ExperimentStore.open(f"file://{tmp_path}/runs", "exp")
    for step in (1, 2):
        store.rm(_commit(store, step).rel(ckpt.SIGNATURE))
    with pytest.raises(ResumeError, match=r"none is valid .*iter_000002 is unsigned.*trust_unsigned=true"):
        find_checkpoints.fn(_cfg(tmp_path))
    assert [ck.step for ck, _ in find_checkpoints.fn(_cfg(tmp_path, "checkpoint.trust_unsigned=true"))] == [2, 1]
    assert resolve_checkpoint.fn(_cfg(tmp_path), "latest")["step"] == 2


def test_key_from_a_prefect_secret_block(prefect_server, keys_dir, tmp_path, monkeypatch):
    """checkpoint.signing_key_secret names a Secret block: its key signs (over $REFLOW_CHECKPOINT_KEY),
    only the block's name is in config.yaml, and a missing block is a clear error."""
    from prefect.blocks.system import Secret

    from reflow.infra.config.schema import dump_config
    from reflow.tasks.checkpoint import find_checkpoints, keyring

    Secret(value=KEY_A).save("reflow-test-ckpt-key", overwrite=True)
    monkeypatch.setenv(signing.KEY_ENV, KEY_B)
    cfg = _cfg(tmp_path, "checkpoint.signing_key_secret=reflow-test-ckpt-key")
    store = ExperimentStore.open(f"file://{tmp_path}/runs", "exp")
    ckpt.begin(ck := ckpt.at_step(store, 1))
    ckpt.commit(ck, {}, ckpt.state_for(1, 4, 0, 1), dump_config(cfg), keyring(cfg))
    assert json.loads(store.read_bytes(ck.rel(ckpt.SIGNATURE)))["key_id"] == signing.key_id(KEY_A.encode())
    assert [c.step for c, _ in find_checkpoints.fn(cfg)] == [1]
    assert "reflow-test-ckpt-key" in store.read_text(ck.rel("config.yaml"))
    assert KEY_A not in store.read_text(ck.rel("config.yaml")) and KEY_A not in repr(keyring(cfg))
    with pytest.raises(signing.SigningKeyError, match=r"Secret block 'no-such-block' .* could not be loaded"):
        find_checkpoints.fn(_cfg(tmp_path, "checkpoint.signing_key_secret=no-such-block"))


# ---------------------------------------------------------------- signatures name their experiment


def _copy_checkpoint(src: ckpt.Checkpoint, dst: ckpt.Checkpoint) -> None:
    """What a bucket writer can do without the key: copy every file of a checkpoint, SIGNATURE included."""
    fs, src_path = src.store.fs, src.store._path(src.prefix)
    for path in fs.find(src_path):
        rel = path.removeprefix(src_path.rstrip("/") + "/")
        dst.store.write_bytes(dst.rel(rel), fs.cat_file(path))


@pytest.mark.parametrize("shared_key", [True, False], ids=["one-key-for-all", "generated-per-experiment"])
def test_a_signed_checkpoint_of_another_experiment_is_refused_in_this_ones_folder(keys_dir, monkeypatch,
                                                                                  shared_key):
    """Issue 51, point 4: a bucket writer copies experiment A's signed checkpoint into B's checkpoints/
    and points B's `latest` at it. The keys that verify B's checkpoints also verify A's (one
    $REFLOW_CHECKPOINT_KEY for every experiment, or A's key file generated on this machine), so B used
    to resume from A's weights and optimizer. The signed manifest names its experiment: the copy is
    refused naming both, B falls back to its own checkpoint, and A's checkpoint still resumes from its
    own URL (explicit resume of another experiment's checkpoint). On moto's S3 server."""
    if shared_key:
        monkeypatch.setenv(signing.KEY_ENV, KEY_A)
    with s3_with_bucket() as server:
        root = f"s3://reflow-test/bound-{'shared' if shared_key else 'generated'}"
        a = ExperimentStore.open(root, "exp-a", endpoint_url=server.url, retries=1)
        b = ExperimentStore.open(root, "exp-b", endpoint_url=server.url, retries=1)
        own, theirs = _commit(b, 1), _commit(a, 3)
        moved = ckpt.at_step(b, 3)
        _copy_checkpoint(theirs, moved)
        b.write_text(ckpt.LATEST, ckpt.name_of(3))

        refused = r"signed as iter_000003 of experiment 'exp-a', but it lies in experiment 'exp-b'"
        with pytest.raises(ckpt.CheckpointInvalid, match=refused):
            ckpt.check(moved, signing.keyring("exp-b"))
        with pytest.raises(ckpt.CheckpointInvalid, match=refused):  # the copy named by its URL
            ckpt.check(ckpt.from_url(moved.url, b), signing.keyring("exp-b"))
        with captured("reflow.checkpoint") as warnings:
            assert [ck.step for ck, _, _ in ckpt.valid_candidates(b, signing.keyring("exp-b"))] == [own.step]
        assert any("skipping checkpoint" in w and "'exp-a'" in w and "'exp-b'" in w for w in warnings), warnings
        assert "optim/mp_rank_00_model_states.pt" in ckpt.check(ckpt.from_url(theirs.url, b), signing.keyring("exp-b"))
        assert json.loads(a.read_bytes(theirs.rel(ckpt.MANIFEST)))["experiment"] == "exp-a"


def test_a_signature_that_names_no_experiment_needs_trust_unsigned(keys_dir, tmp_path, monkeypatch):
    """A manifest signed before signatures named their experiment (valid HMAC, no `experiment`) could
    be another experiment's copy: refused with what to do, loaded only with checkpoint.trust_unsigned
    (the same escape hatch as unsigned ones, with a warning). Adding the field without the key breaks
    the HMAC."""
    import hmac

    monkeypatch.setenv(signing.KEY_ENV, KEY_A)
    store = ExperimentStore.open(f"file://{tmp_path}/runs", "exp")
    ck = _commit(store, 1)
    doc = json.loads(store.read_bytes(ck.rel(ckpt.MANIFEST)))
    del doc["experiment"]
    raw = json.dumps(doc, indent=2, sort_keys=True).encode()  # as the save of an earlier version wrote it
    store.write_bytes(ck.rel(ckpt.MANIFEST), raw)
    store.write_text(ck.rel(ckpt.MARKER), hashlib.sha256(raw).hexdigest())
    store.write_bytes(ck.rel(ckpt.SIGNATURE), json.dumps({"alg": ckpt.HMAC_ALG, "key_id": signing.key_id(
        KEY_A.encode()), "hmac": hmac.new(KEY_A.encode(), raw, hashlib.sha256).hexdigest()}).encode())
    with pytest.raises(ckpt.CheckpointInvalid, match=r"names no experiment.*checkpoint.trust_unsigned=true"):
        ckpt.check(ck)
    with captured("reflow.checkpoint") as warnings:
        ckpt.check(ck, signing.keyring("exp", trust_unsigned=True))
    assert any("names no experiment; loading it anyway" in w for w in warnings), warnings

    doc["experiment"] = "exp"  # a bucket writer "upgrades" it: the signature no longer matches
    raw = json.dumps(doc, indent=2, sort_keys=True).encode()
    store.write_bytes(ck.rel(ckpt.MANIFEST), raw)
    store.write_text(ck.rel(ckpt.MARKER), hashlib.sha256(raw).hexdigest())
    with pytest.raises(ckpt.CheckpointInvalid, match="SIGNATURE does not match MANIFEST.json"):
        ckpt.check(ck, signing.keyring("exp", trust_unsigned=True))
