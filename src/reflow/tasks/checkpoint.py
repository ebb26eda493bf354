"""Prefect tasks around checkpoints: storage preflight, choosing a resume point, save, restore.

The trainer ranks upload and download their own files (engines/train/checkpoint.py); the driver only
merges their manifests, commits, and decides which checkpoint to load (infra/store/checkpoint.py). With
PPO the critic ranks do the same under `critic/` of the same checkpoint, inside the same manifest.
The driver signs each manifest and verifies the signature before any rank fetches a file; the ranks
get the verified {path: sha256} table, never the key (infra/store/signing.py). The keyring is built inside
each task from the config, so the key is never a Prefect parameter or result.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import ray
from prefect import get_run_logger, runtime, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture

from reflow.engines.partial_rollout import check_carry
from reflow.infra.cluster.runtime import get_runtime, recreate_trainers
from reflow.infra.config.schema import RunConfig, dump_config
from reflow.infra.config.settings import storage_access
from reflow.infra.store import checkpoint as ckpt
from reflow.infra.store import lineage, signing
from reflow.infra.store.storage import ExperimentStore
from reflow.tasks import report
from reflow.tasks.faults import fault_point, fault_raise
from reflow.tasks.rollout import carry_in
from reflow.tasks.state import RunState, run_state

CRITIC = "critic/"  # PPO: the critic ranks' files, under this folder of a checkpoint
CARRY = "rollout_carry"  # state.json: the partial rollouts the next iteration continues (rollout.partial=carry)


class CheckpointSaveError(RuntimeError):
    """A checkpoint saved in the background could not be committed."""


class ResumeError(RuntimeError):
    """The requested resume cannot be honoured (no valid checkpoint, or resume=never on a used prefix)."""


def experiment_store(cfg: RunConfig) -> ExperimentStore:
    return ExperimentStore.from_config(cfg.storage, cfg.experiment)


def keyring(cfg: RunConfig) -> signing.Keyring:
    """The keys that sign and verify this run's checkpoints (checkpoint.signing_key_secret, else
    $REFLOW_CHECKPOINT_KEY, else this machine's key for the experiment)."""
    return signing.keyring(cfg.experiment, cfg.checkpoint.signing_key_secret, cfg.checkpoint.trust_unsigned)


@task(name="check-storage", cache_policy=NO_CACHE)
def check_storage(cfg: RunConfig) -> str:
    store = experiment_store(cfg)
    store.preflight()
    return store.url()


@task(name="find-checkpoint", cache_policy=NO_CACHE)
def find_checkpoints(cfg: RunConfig) -> list[tuple[ckpt.Checkpoint, dict]]:
    """Resume candidates (checkpoint, verified manifest files), best first; [] = start from model.path."""
    store, keys = experiment_store(cfg), keyring(cfg)  # a bad key setting fails here, before any work
    if cfg.resume == "never":
        if ckpt.committed(store):
            raise ResumeError(f"resume=never but {store.url(ckpt.ROOT)} already holds committed checkpoints; "
                              f"use resume=auto, a new experiment name, or delete that prefix")
        return []
    if cfg.resume != "auto":
        ck = ckpt.from_url(cfg.resume, store)
        return [(ck, ckpt.check(ck, keys))]  # explicit: no fallback, a bad one is an error
    found = ckpt.valid_candidates(store, keys)
    if not found and (cks := ckpt.candidates(store)):
        raise ResumeError(f"{store.url(ckpt.ROOT)} holds checkpoints but none is valid (see the warnings "
                          f"above; the newest: {_why_invalid(cks[0], keys)}); refusing to silently start "
                          f"over. Fix that, or use resume=never with a new experiment.")
    return [(ck, files) for ck, files, _ in found]


def _why_invalid(ck: ckpt.Checkpoint, keys: signing.Keyring) -> str:
    try:
        ckpt.check(ck, keys)
    except (ckpt.CheckpointInvalid, KeyError, ValueError, FileNotFoundError) as e:  # deliberate: only reported
        return str(e)
    return "valid now (it changed meanwhile)"


def _parts(ck: ckpt.Checkpoint, files: dict, trainers, critic=None) -> list[tuple[object, str, dict]]:
    """(rank group, prefix, files) to fetch: the policy everything outside critic/, the PPO critic
    its own subtree (the one manifest covers both, so neither half can be missing from a commit)."""
    parts = [(trainers, ck.prefix, {k: v for k, v in files.items() if not k.startswith(CRITIC)})]
    if critic is not None:
        own = {k[len(CRITIC):]: v for k, v in files.items() if k.startswith(CRITIC)}
        if not own:
            raise ResumeError(f"{ck.url} holds no critic (saved by a run without algorithm.type=ppo); "
                              f"resume it with that run's algorithm, or start a new experiment")
        parts.append((critic, ck.rel(CRITIC.rstrip("/")), own))
    return parts


def _try_fetch(ck: ckpt.Checkpoint, parts: list[tuple[object, str, dict]]) -> str | None:
    """None if every rank of every group downloaded and verified its files, else why not."""
    errors = []
    refs = [ref for group, prefix, files in parts for ref in group.fetch_checkpoint(ck.store, prefix, files)]
    for ref in refs:  # every ref is read: no unhandled errors
        try:
            ray.get(ref)
        except ray.exceptions.RayTaskError as e:  # deliberate: a bad checkpoint means trying the next one
            errors.append(str(e.cause if getattr(e, "cause", None) else e).splitlines()[0][:500])
    if not errors:
        return None
    ray.get([ref for group, _, _ in parts for ref in group.drop_fetched_checkpoint()])
    return errors[0]


def _load(ck: ckpt.Checkpoint, parts: list[tuple[object, str, dict]]) -> str | None:
    """Fetch then load every group's part; None on success, else why the checkpoint was skipped."""
    why = _try_fetch(ck, parts)
    if why is None:
        ray.get([ref for group, _, _ in parts for ref in group.load_checkpoint()])
    return why


def load_first_valid(trainers, found: list[tuple[ckpt.Checkpoint, dict]], num_ranks: int,
                     critic=None) -> ckpt.Checkpoint:
    """Load into every rank (policy, and the PPO critic when given) the first candidate whose files
    all verify; warn about each one skipped."""
    for ck, files in found:
        state = ckpt.read_state(ck, files)
        if state["num_trainer_ranks"] != num_ranks:
            raise ResumeError(f"{ck.url} was saved by {state['num_trainer_ranks']} trainer ranks; resume "
                              f"with trainer.num_ranks={state['num_trainer_ranks']}")
        why = _load(ck, _parts(ck, files, trainers, critic))
        if why is not None:
            ckpt.log.warning("skipping checkpoint %s: %s", ck.url, why)
            continue
        return ck
    raise ResumeError("no checkpoint could be loaded: " + ", ".join(ck.url for ck, _ in found))


def _holds(trainers, ck: ckpt.Checkpoint, files: dict) -> bool:
    """Whether reused trainer ranks already hold exactly this checkpoint's weights (the checksum
    recorded at save time), so loading it again can be skipped."""
    want = ckpt.read_state(ck, files).get("weights_sha256")
    return want is not None and ray.get(trainers.weights_checksum())[0] == want


@task(name="restore-checkpoint", cache_policy=NO_CACHE)
def restore(cfg: RunConfig, found: list[tuple[ckpt.Checkpoint, dict]]) -> dict[str, object]:
    """Bring the trainer ranks to the newest loadable checkpoint (or to `model.path` when there is
    none); returns {"step": iterations done, "loaded": whether anything had to be (re)loaded}.
    Ranks reused from an earlier flow run are kept as they are when they hold its weights."""
    rt, log = get_runtime(cfg), get_run_logger()
    reused = any(n.startswith("policy-trainer-") for n in rt.reused)
    if reused and found and _holds(rt.trainers, *found[0]):
        log.info("trainer ranks from the previous flow run hold %s exactly: not loading it again", found[0][0].url)
        run_state(cfg).parent = lineage.parent_of(*found[0])
        _restore_carry(cfg, *found[0])
        if rt.critic is not None:  # the critic is never reused: load it alone
            ck, files = found[0]
            if (why := _load(ck, _parts(ck, files, rt.trainers, rt.critic)[1:])) is not None:
                raise ResumeError(f"the critic of {ck.url} could not be loaded: {why}")
        return {"step": found[0][0].step, "loaded": False}
    if not found:
        if reused:  # they trained past the (missing) checkpoint: start them again from model.path
            recreate_trainers(cfg)
        run_state(cfg).parent = None
        return {"step": 0, "loaded": reused}
    ck = load_first_valid(rt.trainers, found, cfg.trainer.num_ranks, rt.critic)
    files = next(files for c, files in found if c == ck)
    run_state(cfg).parent = lineage.parent_of(ck, files)
    _restore_carry(cfg, ck, files)
    log.info("resumed from %s: %d iterations done", ck.url, ck.step)
    return {"step": ck.step, "loaded": True}


def _restore_carry(cfg: RunConfig, ck: ckpt.Checkpoint, files: dict) -> None:
    """rollout.partial=carry: the partial rollouts checkpoint `ck` holds are what its next iteration continues
    (none in a checkpoint saved without carry: that iteration starts a fresh pool, and says so)."""
    if cfg.rollout.partial != "carry":
        return
    saved = ckpt.read_state(ck, files).get(CARRY)
    if saved is None:
        get_run_logger().warning("%s holds no carried rollouts (saved with rollout.partial=%s?): iteration %d starts "
                                 "a fresh pool", ck.url, "off or drop", ck.step)
    where = f"{ck.url}/{ckpt.STATE} ({CARRY})"
    run_state(cfg).carry[ck.step] = check_carry([] if saved is None else saved, cfg.rollout.n_samples_per_prompt, where)


def save(trainers, store: ExperimentStore, step: int, state: dict, config_yaml: str,
         keep_last: int, critic=None, keys: signing.Keyring | None = None, lineage_doc: dict | None = None) -> str:
    """Every rank uploads its part (the PPO critic's ranks under critic/, alongside), then
    MANIFEST -> SIGNATURE (with `keys`, default the experiment's key) -> COMMITTED -> latest; then retention."""
    return commit_queued(queue_save(trainers, store, step, critic), store, state, config_yaml, keep_last, keys,
                         lineage_doc)


@dataclass
class QueuedSave:
    """A checkpoint whose rank writes are queued on the actors: `queue_save` submitted them, in order,
    before any later call to the same actors (Ray runs one caller's calls to an actor in submission
    order), so it holds the weights of exactly `step` iterations whatever the driver does next."""
    ck: ckpt.Checkpoint
    checksum: list  # ObjectRefs: each policy rank's weights_checksum (rank 0's is recorded)
    policy: list  # ObjectRefs: each policy rank's {relative path: sha256/bytes}
    critic: list  # the same for the PPO critic's ranks (under critic/)
    carry: object = None  # rollout.partial=carry: the groups the next iteration continues (an ObjectRef or a list)


def queue_save(trainers, store: ExperimentStore, step: int, critic=None, checksum: bool = False) -> QueuedSave:
    """Clear leftovers at `step`, then queue every rank's save (and, with `checksum`, the policy weights'
    checksum just before it) without waiting for any of them."""
    ck = ckpt.at_step(store, step)
    ckpt.begin(ck)
    sums = trainers.weights_checksum() if checksum else []
    critic_refs = critic.save_checkpoint(store, ck.rel(CRITIC.rstrip("/"))) if critic is not None else []
    return QueuedSave(ck, sums, trainers.save_checkpoint(store, ck.prefix), critic_refs)


def commit_queued(queued: QueuedSave, store: ExperimentStore, state: dict, config_yaml: str, keep_last: int,
                  keys: signing.Keyring | None = None, lineage_doc: dict | None = None) -> str:
    """Wait for a queued save's rank files, then commit it (nothing is marked complete unless every rank's
    files are uploaded) and apply retention. Returns the checkpoint's URL."""
    files: dict[str, dict] = {}
    for rank_files in ray.get(queued.policy):
        files.update(rank_files)
    for rank_files in ray.get(queued.critic):
        files.update({CRITIC + rel: meta for rel, meta in rank_files.items()})
    fault_point("KILL_DURING_SAVE", queued.ck.step)
    fault_raise("FAIL_COMMIT", queued.ck.step)
    url = ckpt.commit(queued.ck, files, state, config_yaml, keys, lineage_doc)
    fault_point("KILL_AFTER_COMMIT", queued.ck.step)
    ckpt.apply_retention(store, keep_last)
    return url


@dataclass
class SaveInFlight:
    """A checkpoint queued on the ranks whose commit runs as the `save-checkpoint` task in the background
    (flows/train.py): the next save, a recovery and the end of the run wait for it first."""
    step: int
    future: PrefectFuture


def start_save(cfg: RunConfig, step: int) -> None:
    """Queue the ranks' writes of checkpoint `step` now, then commit it in a background task run; a save
    still in flight is finished first (the run's `parent` then names the checkpoint this one continues)."""
    finish_save(cfg)
    rt, state = get_runtime(cfg), run_state(cfg)
    queued = queue_save(rt.trainers, rt.store, step, rt.critic, checksum=True)
    if cfg.rollout.partial == "carry":  # taken now: the run's state forgets it a few iterations on
        queued.carry = carry_in(rt, step)
    runs = _flow_runs(state, 0 if state.parent is None else state.parent.step, step)  # this flow run's context
    state.save_in_flight = SaveInFlight(step, save_checkpoint.submit(cfg, step, queued, runs))


def save_pending(cfg: RunConfig) -> int | None:
    """The step of the run's save in flight, or None (none, or one already finished: see `finish_save`)."""
    f = run_state(cfg).save_in_flight
    return None if f is None or f.future.wrapped_future.done() else f.step


def finish_save(cfg: RunConfig, raise_errors: bool = True) -> tuple[int, str] | None:
    """Wait for the run's save in flight: (step, URL) once committed, None when there was none. Its
    error is raised (`raise_errors=False`: logged, and None returned: the checkpoint stays uncommitted)."""
    state = run_state(cfg)
    f, state.save_in_flight = state.save_in_flight, None
    if f is None:
        return None
    try:
        return f.step, f.future.result()
    except Exception as e:  # deliberate: raised as the run's error unless the caller only needs the save settled
        why = f"checkpoint {ckpt.name_of(f.step)} was not committed ({type(e).__name__}: {e})"
        if raise_errors:
            raise CheckpointSaveError(f"{why}; the run stops here. resume=auto continues from the latest committed "
                                      f"checkpoint; checkpoint.background_commit=false saves before going on") from e
        ckpt.log.warning(why)
        return None


@task(name="save-checkpoint", cache_policy=NO_CACHE)
def save_checkpoint(cfg: RunConfig, step: int, queued: QueuedSave, runs: dict[str, object]) -> str:
    """Wait for the ranks' files of a queued save, then sign and commit it (MANIFEST, SIGNATURE, COMMITTED,
    latest), apply retention, and link the checkpoint and the flow runs that made it both ways."""
    rt = get_runtime(cfg)
    state = ckpt.state_for(step, cfg.rollout.prompts_per_iteration, cfg.data.seed, cfg.trainer.num_ranks)
    state["weights_sha256"] = ray.get(queued.checksum)[0]  # lets a reused trainer skip a reload
    if queued.carry is not None:  # JSON in state.json, under the manifest's sha256 and signature
        state[CARRY] = ray.get(queued.carry) if isinstance(queued.carry, ray.ObjectRef) else queued.carry
    config_yaml, parent = dump_config(cfg), run_state(cfg).parent
    initial = cfg.model.path if "://" in cfg.model.path else os.path.abspath(cfg.model.path)
    doc = lineage.record(parent, initial, config_yaml, _data_lineage(cfg, parent, step), runs)
    url = commit_queued(queued, rt.store, state, config_yaml, cfg.checkpoint.keep_last, keys=keyring(cfg),
                        lineage_doc=doc)
    run_state(cfg).parent = lineage.Parent(url, step, lineage.manifest_sha256(ckpt.at_step(rt.store, step)), doc)
    _link_runs(cfg.experiment, url, step, runs)
    return url


def _data_lineage(cfg: RunConfig, parent: lineage.Parent | None, step: int) -> dict[str, object]:
    """The training data since the parent: the prompt file (task=file) with its digest, and the cursor."""
    files = []
    if cfg.data.task == "file" and cfg.data.path:
        path = cfg.data.path if "://" in cfg.data.path else os.path.abspath(cfg.data.path)
        files.append(lineage.file_digest(path, storage_access(cfg)))
    return lineage.data_record(cfg.data.task, files, cfg.data.seed, 0 if parent is None else parent.step, step,
                               cfg.rollout.prompts_per_iteration)


def _flow_runs(state: RunState, first: int, step: int) -> dict[str, object]:
    """The Prefect runs that made a checkpoint: this `train` flow run and the `iteration` flow runs of
    iterations [first, step) that ran in it (earlier ones belong to the parent's runs)."""
    its = {str(i): state.iteration_runs[i] for i in range(first, step) if i in state.iteration_runs}
    return {"train": str(runtime.flow_run.id) if runtime.flow_run.id else None, "iterations": its}


def _link_runs(experiment: str, url: str, step: int, runs: dict) -> None:
    """The other direction: a markdown artifact naming the checkpoint on the train flow run and on the
    iteration flow run whose update it holds last."""
    text = f"# {experiment}: checkpoint {ckpt.name_of(step)}\n\n`{url}`\n\nIts chain: `reflow lineage {url}`"
    last = runs["iterations"].get(str(step - 1))
    for run_id in dict.fromkeys(r for r in (last, runs["train"]) if r):
        report.create_artifact("markdown", report.artifact_key(experiment, "checkpoint"), text,
                               f"{experiment}: checkpoint {ckpt.name_of(step)} (policy version {step})", run_id)


@task(name="resolve-checkpoint", cache_policy=NO_CACHE)
def resolve_checkpoint(config: RunConfig, checkpoint: str) -> dict[str, object]:
    """{url, step, model}: the newest valid committed checkpoint (`latest`) or the one at a URL.
    Evaluation reads only model/ (safetensors, no pickle), so the signature is not required here."""
    store = experiment_store(config)
    if checkpoint == "latest":
        found = ckpt.valid_candidates(store, signature=False)
        if not found:
            raise ckpt.CheckpointInvalid(f"no valid committed checkpoint under {store.url(ckpt.ROOT)}; "
                                         f"train first, or pass checkpoint=<URL of …/checkpoints/iter_NNNNNN>")
        ck, files = found[0][0], found[0][1]
    else:
        ck = ckpt.from_url(checkpoint, store)
        files = ckpt.check(ck, signature=False)  # committed, and every file the manifest lists is there with its size
    if "adapter/adapter_config.json" in files:  # a LoRA run's: evaluated merged (infra/store/export.py)
        return {"url": ck.url, "step": ck.step, "model": _merged(config, ck)}
    return {"url": ck.url, "step": ck.step, "model": ck.store.url(ck.rel("model"))}


_MERGED: dict[str, str] = {}  # manifest digest of a LoRA checkpoint -> this process's merged copy
_MERGED_LOCK = threading.Lock()


def _merged(config: RunConfig, ck: ckpt.Checkpoint) -> str:
    """A local merged copy of a LoRA checkpoint, made once per checkpoint (by its manifest digest) in this
    process, in a folder only this user can enter (mkdtemp, 0700), removed when the process exits. A name
    fixed by the digest (it was /tmp/reflow-merged-<digest>, reused when it existed) could be made first by
    another local user, whose folder would then be evaluated as the model."""

    from reflow.infra.store.export import export_merged

    digest = lineage.manifest_sha256(ck)
    with _MERGED_LOCK:  # two evaluations of one checkpoint at once merge it once
        out = _MERGED.get(digest)
        if out is None or not Path(out).is_dir():
            private = Path(tempfile.mkdtemp(prefix="reflow-merged-"))
            atexit.register(shutil.rmtree, private, True)
            export_merged(ck.url, private / "model", ck.store, storage=storage_access(config))
            out = _MERGED[digest] = str(private / "model")
    return out
