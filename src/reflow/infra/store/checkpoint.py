"""Atomic checkpoints in object storage: layout, commit, validation, retention, resume candidates.

    <experiment>/checkpoints/iter_000042/    42 = iterations completed (= the policy version it holds)
        model/  optim/  rng/                 uploaded by the trainer ranks (engines/train/checkpoint.py)
        critic/{model,optim,rng}/            PPO only: the same from the critic ranks (engines/train/critic.py)
        state.json                           step, data cursor, ranks, time
        config.yaml                          the resolved run config (no credentials: none are in it)
        LINEAGE.json                         parent, config/code/data digests, flow runs (infra/store/lineage.py)
        MANIFEST.json                        {experiment, step, files: {relative path: {sha256, bytes}}}
        SIGNATURE                            {alg, key_id, hmac}: HMAC-SHA256 of MANIFEST.json's bytes
        COMMITTED                            sha256 of MANIFEST.json; written only after all of it
    <experiment>/checkpoints/latest          name of the newest committed checkpoint, written last

A checkpoint counts only with its marker, and is loaded only if every file matches the manifest
(the trainer ranks check sha256 while downloading). Resume tries `latest` first, then older
committed checkpoints, warning about each one it skips. This module talks to storage only;
tasks/checkpoint.py drives the trainer ranks.

Trust: optim/*.pt are pickles that DeepSpeed loads with torch.load(weights_only=False), and a
bucket writer can rewrite MANIFEST.json and COMMITTED too; SIGNATURE (key outside the bucket,
infra/store/signing.py) is what they cannot forge. `check` verifies it before any rank downloads a file
and returns the verified {path: sha256} table that the ranks check their downloads against.
Readers of model/ (safetensors) and state.json (JSON) unpickle nothing and need no signature.

What is signed names where it belongs: MANIFEST.json holds the experiment and the step, and a
signature counts only for the checkpoint folder they name (<experiment>/checkpoints/iter_<step>,
wherever the storage root is). The keys that verify one experiment's checkpoints verify others'
too (one $REFLOW_CHECKPOINT_KEY for all, or every key file of this machine), so without that a
bucket writer could copy another experiment's signed checkpoint into this one's checkpoints/ and
have a run resume from it (issue 51). Another experiment's checkpoint is resumed by its own URL.
A manifest signed before it named its experiment is refused like an unsigned checkpoint
(checkpoint.trust_unsigned loads it, with a warning).
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import time
from dataclasses import dataclass

import fsspec

from reflow.engines.storage_access import UnsafeName, check_name
from reflow.infra.store import signing
from reflow.infra.store.storage import ExperimentStore, normalize_root

log = logging.getLogger("reflow.checkpoint")
ROOT = "checkpoints"
LATEST = f"{ROOT}/latest"
MARKER, MANIFEST, STATE, SIGNATURE = "COMMITTED", "MANIFEST.json", "state.json", "SIGNATURE"
HMAC_ALG = "HMAC-SHA256"
MAX_STEP_DIGITS = 18  # an iteration count; a longer number is no name reflow wrote


class CheckpointInvalid(RuntimeError):
    """A checkpoint is incomplete (no marker), inconsistent with its manifest, or unreadable."""


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint: files under `prefix` of `store` (prefix "" when opened by URL)."""

    store: ExperimentStore
    prefix: str
    step: int

    @property
    def url(self) -> str:
        return self.store.url(self.prefix)

    def rel(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name


def name_of(step: int) -> str:
    return f"iter_{step:06d}"


def step_of(name: str) -> int | None:
    """The step of a checkpoint name `iter_NNNNNN`, else None. Names come from storage (folder names,
    `latest`, resume URLs): only ASCII digits count (str.isdigit also takes superscripts, which int()
    refuses, and other scripts' digits, which it reads), and at most MAX_STEP_DIGITS of them (int()
    raises ValueError past 4300 digits)."""
    head, _, digits = name.partition("_")
    if head != "iter" or not 0 < len(digits) <= MAX_STEP_DIGITS or not (digits.isascii() and digits.isdigit()):
        return None
    return int(digits)


def experiment_name(ck: Checkpoint) -> str | None:
    """The experiment whose checkpoints/ folder holds `ck`, from where it is (never from what its files
    say); None when it is not in one (a URL not of the form …/<experiment>/checkpoints/iter_NNNNNN)."""
    if ck.prefix:
        return ck.store.experiment if ck.prefix.startswith(f"{ROOT}/") else None
    exp_url, _, folder = ck.store.root.rpartition("/")
    _, _, path = exp_url.partition("://")
    above, _, name = path.rpartition("/")
    return name if folder == ROOT and name and (above or path.startswith("/")) else None


def at_step(store: ExperimentStore, step: int) -> Checkpoint:
    return Checkpoint(store, f"{ROOT}/{name_of(step)}", step)


def from_url(url: str, like: ExperimentStore) -> Checkpoint:
    """An explicit checkpoint URL (…/checkpoints/iter_000003), with `like`'s endpoint and retries."""
    parent, _, name = url.rstrip("/").rpartition("/")
    step = step_of(name)
    if not parent or step is None:
        raise CheckpointInvalid(f"resume={url!r} is not a checkpoint URL (expected …/checkpoints/iter_NNNNNN)")
    store = dataclasses.replace(like, root=normalize_root(parent), experiment=name)  # every setting of `like`
    return Checkpoint(store, "", step)


def model_files(model_url: str, like: ExperimentStore) -> dict[str, dict] | None:
    """When `model_url` is the model/ folder of a checkpoint (…/checkpoints/iter_NNNNNN/model): its
    manifest entries, {name in model/: {sha256, bytes}}, which every load of it is checked against
    (reflow.engines.hf_io); the checkpoint must pass `check`. None for any other folder (a user's
    own). No signature needed: model/ is safetensors and JSON, nothing in it is unpickled."""
    parent, _, leaf = model_url.rstrip("/").rpartition("/")
    if leaf != "model" or step_of(parent.rpartition("/")[2]) is None:
        return None
    files = check(from_url(parent, like), signature=False)
    return {rel.removeprefix("model/"): meta for rel, meta in files.items() if rel.startswith("model/")}


# ---------------------------------------------------------------- writing


def begin(ck: Checkpoint) -> None:
    """Clear leftovers of an earlier attempt at this step: the marker goes first, so a half-deleted
    folder is never mistaken for a committed checkpoint."""
    ck.store.rm(ck.rel(MARKER))
    ck.store.rm(ck.prefix, recursive=True)


def commit(ck: Checkpoint, files: dict[str, dict], state: dict, config_yaml: str,
           keys: signing.Keyring | None = None, lineage: dict | None = None) -> str:
    """Write state + config (+ `lineage` as LINEAGE.json, infra/store/lineage.py), then MANIFEST and its
    SIGNATURE (with `keys`' signing key; default: the experiment's key from infra/signing.keyring),
    then COMMITTED, then move `latest`. The manifest names the experiment and step (see the module
    docstring: what the signature binds). Returns the URL."""
    experiment = experiment_name(ck)
    if experiment is None:
        raise CheckpointInvalid(f"{ck.url} is not inside an experiment's {ROOT}/ folder: a checkpoint is "
                                f"committed only as …/<experiment>/{ROOT}/iter_NNNNNN")
    kid, key = (keys or signing.keyring(ck.store.experiment)).signing_key()
    files = dict(files)
    docs = [(STATE, json.dumps(state, indent=2, sort_keys=True).encode()), ("config.yaml", config_yaml.encode())]
    if lineage is not None:
        docs.append(("LINEAGE.json", json.dumps(lineage, indent=2, sort_keys=True).encode()))
    for name, data in docs:
        ck.store.write_bytes(ck.rel(name), data)
        files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    manifest = json.dumps({"experiment": experiment, "step": ck.step, "files": files}, indent=2,
                          sort_keys=True).encode()
    ck.store.write_bytes(ck.rel(MANIFEST), manifest)
    mac = hmac.new(key, manifest, hashlib.sha256).hexdigest()
    ck.store.write_bytes(ck.rel(SIGNATURE), json.dumps({"alg": HMAC_ALG, "key_id": kid, "hmac": mac}).encode())
    ck.store.write_text(ck.rel(MARKER), hashlib.sha256(manifest).hexdigest())
    if ck.prefix:  # a checkpoint of this experiment: move the pointer
        ck.store.write_text(LATEST, ck.prefix.rsplit("/", 1)[-1])
    return ck.url


# ---------------------------------------------------------------- reading and validation


def check(ck: Checkpoint, keys: signing.Keyring | None = None, *, signature: bool = True) -> dict:
    """Cheap validation (marker, manifest digest, SIGNATURE, every file present with its size);
    returns the manifest's files. sha256 of the contents is checked by whoever downloads them.
    `keys` default: infra/signing.keyring (REFLOW_CHECKPOINT_KEY and this machine's key files).
    signature=False only for readers that unpickle nothing (model/ safetensors, state.json)."""
    manifest = _committed_manifest(ck)
    if signature:
        verify_signature(ck, manifest, keys or signing.keyring(ck.store.experiment))
    return _listed_files(ck, manifest)


@dataclass(frozen=True)
class Examined:
    """What `examine` found: the manifest's files, the sha256 of the manifest bytes they were read from,
    and the id of the key whose signature verified (None: not verified, `unverified` says why)."""

    files: dict
    manifest_sha256: str
    key_id: str | None
    unverified: str = ""


def examine(ck: Checkpoint, keys: signing.Keyring | None) -> Examined:
    """`check` for readers that unpickle nothing but say whether what they show is authentic (`reflow
    lineage`): the signature is reported, never required. `keys.trust_unsigned` does not apply here:
    an unsigned checkpoint is reported as not verified. keys=None: no key could be loaded."""
    manifest = _committed_manifest(ck)
    files, digest = _listed_files(ck, manifest), hashlib.sha256(manifest).hexdigest()
    if keys is None:
        return Examined(files, digest, None, "no checkpoint signing key could be loaded here")
    try:
        kid = verify_signature(ck, manifest, dataclasses.replace(keys, trust_unsigned=False))
    except (CheckpointInvalid, signing.SigningKeyError) as e:
        return Examined(files, digest, None, str(e))
    return Examined(files, digest, kid)


def _committed_manifest(ck: Checkpoint) -> bytes:
    """MANIFEST.json's bytes, once its COMMITTED marker holds their digest."""
    if not ck.store.exists(ck.rel(MARKER)):
        raise CheckpointInvalid(f"{ck.url}: no {MARKER} marker (the save did not finish)")
    manifest = ck.store.read_bytes(ck.rel(MANIFEST))
    if ck.store.read_text(ck.rel(MARKER)).strip() != hashlib.sha256(manifest).hexdigest():
        raise CheckpointInvalid(f"{ck.url}: {MANIFEST} does not match the digest in {MARKER}")
    return manifest


def _listed_files(ck: Checkpoint, manifest: bytes) -> dict:
    """The manifest's files, each a safe name, present with its size, for the step of `ck`'s folder."""
    doc = json.loads(manifest)
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, dict) or not all(isinstance(m, dict) for m in files.values()):
        raise CheckpointInvalid(f"{ck.url}: {MANIFEST} is not a reflow manifest ({{step, files: {{name: "
                                f"{{sha256, bytes}}}}}})")
    if doc.get("step") != ck.step:
        raise CheckpointInvalid(f"{ck.url}: {MANIFEST} is that of step {doc.get('step')}, not {ck.step} "
                                f"(copied from another checkpoint folder?)")
    for rel, meta in files.items():
        try:
            check_name(rel, f"{ck.url}: {MANIFEST}")
        except UnsafeName as e:
            raise CheckpointInvalid(str(e)) from None
        if not ck.store.exists(ck.rel(rel)):
            raise CheckpointInvalid(f"{ck.url}: {rel} is listed in the manifest but missing")
        if ck.store.size(ck.rel(rel)) != meta.get("bytes"):
            raise CheckpointInvalid(f"{ck.url}: {rel} has the wrong size")
    return files


def verify_signature(ck: Checkpoint, manifest: bytes, keys: signing.Keyring) -> str | None:
    """Raise CheckpointInvalid unless SIGNATURE is a valid HMAC of `manifest` under a key `keys` holds
    and the manifest names the experiment whose checkpoints/ folder holds `ck` (or the checkpoint is
    unsigned, or signed before manifests named their experiment, and `keys.trust_unsigned` allows
    that, with a warning). `check` compares the manifest's step with the folder's. Returns the id of
    the key that verified it (None: an unsigned one let through by trust_unsigned)."""
    if not ck.store.exists(ck.rel(SIGNATURE)):
        if keys.trust_unsigned:
            log.warning("%s is unsigned; loading it anyway because checkpoint.trust_unsigned is true: its "
                        "optimizer states are pickles whoever can write the bucket could have replaced", ck.url)
            return None
        raise CheckpointInvalid(
            f"{ck.url} is unsigned (no {SIGNATURE}): its optimizer states (optim/*.pt) are pickles that "
            f"anyone who can write the bucket could have replaced, so it is not loaded. If you saved it "
            f"yourself before checkpoint signing existed, resume once with checkpoint.trust_unsigned=true "
            f"(later saves are signed); its model/ weights (safetensors) load without a signature.")
    try:
        sig = json.loads(ck.store.read_bytes(ck.rel(SIGNATURE)))
        alg, kid, mac = str(sig["alg"]), str(sig["key_id"]), str(sig["hmac"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointInvalid(f"{ck.url}: {SIGNATURE} is unreadable ({e!r}); it was not written by reflow "
                                f"and the checkpoint is not loaded") from None
    if alg != HMAC_ALG:
        raise CheckpointInvalid(f"{ck.url}: {SIGNATURE} uses {alg!r}; only {HMAC_ALG} is accepted")
    held = keys.find(kid)
    if held is None:
        raise CheckpointInvalid(
            f"{ck.url} is signed with key id {kid}, which is not held here (held: {keys.held()}). Set "
            f"{signing.KEY_ENV} (or name a Prefect Secret block in checkpoint.signing_key_secret) to the key "
            f"the run was saved with, or copy that machine's key file into {keys.directory}.")
    key, where = held
    if not hmac.compare_digest(hmac.new(key, manifest, hashlib.sha256).hexdigest(), mac):
        raise CheckpointInvalid(
            f"{ck.url}: {SIGNATURE} does not match {MANIFEST} under key {kid} ({where}): the manifest was "
            f"changed after the save signed it, by someone without the key. Do not load it; resume from "
            f"another checkpoint and check who can write the bucket.")
    _check_experiment(ck, manifest, keys)
    return kid


def _check_experiment(ck: Checkpoint, manifest: bytes, keys: signing.Keyring) -> None:
    """The signed manifest's experiment is the one whose checkpoints/ folder holds `ck`."""
    doc = json.loads(manifest)
    if not isinstance(doc, dict):
        raise CheckpointInvalid(f"{ck.url}: {MANIFEST} is not a JSON object")
    here = experiment_name(ck)
    if "experiment" not in doc:
        if keys.trust_unsigned:
            log.warning("%s is signed, but its %s names no experiment; loading it anyway because "
                        "checkpoint.trust_unsigned is true: it could be another experiment's checkpoint "
                        "copied here", ck.url, MANIFEST)
            return
        raise CheckpointInvalid(
            f"{ck.url}: its {MANIFEST} names no experiment (signed by a reflow version before signatures "
            f"named it), so it could be another experiment's signed checkpoint that whoever can write the "
            f"bucket copied here; it is not loaded. If you saved it yourself in this experiment, resume once "
            f"with checkpoint.trust_unsigned=true (later saves name their experiment).")
    signed_for = doc["experiment"]
    if signed_for != here:
        where = f"experiment {here!r}'s {ROOT}/" if here else f"a folder outside any experiment's {ROOT}/"
        step = doc.get("step")
        named = name_of(step) if isinstance(step, int) else f"step {step!r}"
        raise CheckpointInvalid(
            f"{ck.url}: {MANIFEST} is signed as {named} of experiment {signed_for!r}, but it lies in {where} "
            f"(copied there from experiment {signed_for!r}?). A signature counts only where it was made, so "
            f"it is not loaded here; to continue from that checkpoint, resume from its own URL "
            f"(…/{signed_for}/{ROOT}/{named}).")


def read_state(ck: Checkpoint, files: dict[str, dict]) -> dict:
    data = ck.store.read_bytes(ck.rel(STATE))
    if hashlib.sha256(data).hexdigest() != files[STATE]["sha256"]:
        raise CheckpointInvalid(f"{ck.url}: {STATE} does not match its sha256 in the manifest")
    return json.loads(data)


def latest_step(store: ExperimentStore) -> int | None:
    """The step `latest` names; None when there is no pointer, or (with a warning) when it holds no
    checkpoint name: a bucket writer can put anything there, and readers then go by the listing."""
    if not store.exists(LATEST):
        return None
    text = store.read_bytes(LATEST).decode("utf-8", errors="replace").strip()
    step = step_of(text)
    if step is None:
        shown = repr(text[:40]) + (f" (+{len(text) - 40} characters)" if len(text) > 40 else "")
        log.warning("%s holds %s, which is not a checkpoint name (iter_NNNNNN); ignoring it and going by "
                    "the committed checkpoints", store.url(LATEST), shown)
    return step


def committed(store: ExperimentStore) -> list[Checkpoint]:
    """Checkpoints of the experiment that have a marker, newest first (contents not checked)."""
    steps = sorted((s for n in store.listdir(ROOT) if (s := step_of(n)) is not None), reverse=True)
    cks = [at_step(store, s) for s in steps]
    return [ck for ck in cks if store.exists(ck.rel(MARKER))]


def candidates(store: ExperimentStore) -> list[Checkpoint]:
    """What `resume: auto` tries, in order: the one `latest` names, then older committed ones."""
    cks, latest = committed(store), latest_step(store)
    if latest is not None:
        if not any(ck.step == latest for ck in cks):
            log.warning("checkpoints/latest names %s, which is not committed; falling back", name_of(latest))
        cks = [ck for ck in cks if ck.step <= latest]
    return cks


def valid_candidates(store: ExperimentStore, keys: signing.Keyring | None = None, *,
                     signature: bool = True) -> list[tuple[Checkpoint, dict, dict]]:
    """(checkpoint, manifest files, state) of each candidate that passes `check`, newest first."""
    out = []
    keys = keys or (signing.keyring(store.experiment) if signature else None)
    for ck in candidates(store):
        try:
            files = check(ck, keys, signature=signature)
            out.append((ck, files, read_state(ck, files)))
        except (CheckpointInvalid, KeyError, ValueError, FileNotFoundError) as e:
            log.warning("skipping checkpoint %s: %s", ck.url, e)
    return out


# ---------------------------------------------------------------- retention and sentinel


def apply_retention(store: ExperimentStore, keep_last: int) -> list[str]:
    """Delete committed checkpoints beyond the newest `keep_last` (never the one `latest` names),
    and unfinished ones older than the newest committed one. Returns the deleted URLs."""
    cks, latest = committed(store), latest_step(store)
    keep = {ck.step for ck in cks[:keep_last]} | ({latest} if latest is not None else set())
    doomed = [ck for ck in cks if ck.step not in keep]
    newest = cks[0].step if cks else -1
    done = {ck.step for ck in cks}
    for n in store.listdir(ROOT):
        s = step_of(n)
        if s is not None and s not in done and s < newest:
            doomed.append(at_step(store, s))
    for ck in doomed:
        begin(ck)  # marker first, then the files
        log.info("retention: deleted %s", ck.url)
    return [ck.url for ck in doomed]


def sentinel_present(path: str | None) -> bool:
    if not path:
        return False
    fs, p = fsspec.core.url_to_fs(path)
    return fs.exists(p)


def remove_sentinel(path: str) -> None:
    fs, p = fsspec.core.url_to_fs(path)
    try:
        fs.rm(p)
    except FileNotFoundError:  # removed by the user meanwhile: nothing left to do
        pass


def state_for(step: int, prompts_per_iteration: int, data_seed: int, num_ranks: int) -> dict:
    """state.json: the data cursor is (seed, next iteration) because each iteration's prompts are a
    pure function of them (reflow.tasks.rollout.prompts_for_iteration)."""
    return {"step": step, "next_iteration": step, "policy_version": step, "num_trainer_ranks": num_ranks,
            "data_cursor": {"seed": data_seed, "next_iteration": step,
                            "prompts_consumed": step * prompts_per_iteration,
                            "prompts_per_iteration": prompts_per_iteration},
            "saved_at_unix": time.time()}
