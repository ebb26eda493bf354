"""Preflight: what `reflow config --check` and `reflow train` check before anything starts (no Ray,
no Prefect), so a mistake in the inputs costs seconds and one line, not a cluster start-up and a
wall of tracebacks.

Each check goes through the code the run itself uses (the model folder through engines/hf_io, prompt
files through rl/data, reward functions through rl/rewards, storage through ExperimentStore.preflight)
but reads only a little: the model's config and tokenizer, the first rows of each file. Storage comes
last, so a run that fails an earlier check writes nothing; its own probe removes what it created.
Reads use no retries: a location that does not answer now is reported now.

A failure is a PreflightError: one line naming the config field, the file or URL, and the fix.
"""
from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from reflow.engines.hf_io import model_bytes
from reflow.engines.storage_access import StorageAccess, StorageError, UnsafeName
from reflow.infra.config.schema import RunConfig
from reflow.infra.config.settings import resolve_precision, storage_access
from reflow.infra.store.storage import ExperimentStore
from reflow.rl.rewards import RewardError
from reflow.rl.types import Sample

FIRST_ROWS = 16  # rows of each file that are validated and tokenized (the run checks them all)


class PreflightError(ValueError):
    """A run input the user must fix; the message is one line naming the field and the fix."""


def one_line(text: object, limit: int = 600) -> str:
    """`text` with its line breaks folded (transformers' and pyarrow's messages span lines)."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[:limit] + "…"


def warnings_for(cfg: RunConfig) -> list[str]:
    """What a run can do but probably should not: one line each, naming the field and the fix. The
    train flow logs them as warnings; `reflow config --check` lists them."""
    d, out = cfg.data, []
    if d.task == "file" and not d.eval_path:
        users = [s.name for s in cfg.eval.sets if s.source == "heldout"]
        out.append(f"data.eval_path is not set: the last data.num_eval={d.num_eval} rows of data.path={d.path!r} "
                   f"are held out of training" + (f" and are the eval set(s) {users}" if users else "")
                   + "; give data.eval_path a held-out file of its own (then every row of data.path is trained on)")
    return out


def preflight(cfg: RunConfig) -> list[str]:
    """Every check, in the order a run needs its inputs; one line per check that passed."""
    access = dataclasses.replace(storage_access(cfg), retries=0)
    tokenizer, done = check_model(cfg, access)
    heldout, line = check_data(cfg, tokenizer, access)
    done += [line]
    for i in range(len(cfg.eval.sets)):
        done.append(check_eval_set(cfg, i, tokenizer, heldout, access))
    if line := check_tracking(cfg):
        done.append(line)
    done.append(check_storage(cfg))
    if line := check_disk(cfg, access):
        done.append(line)
    if line := check_gpu_memory(cfg, access):
        done.append(line)
    if line := check_resume(cfg):
        done.append(line)
    return done


# ---------------------------------------------------------------- model


def _model_location(cfg: RunConfig, field: str, path: str, access: StorageAccess):
    """Local folder of `path` (a remote one is fetched into the cache the run uses too)."""
    from reflow.engines.hf_io import CheckpointError, resolve_checkpoint
    from reflow.infra.store import checkpoint as ckpt

    try:
        files = ckpt.model_files(path, ExperimentStore.from_config(cfg.storage, cfg.experiment))
        return resolve_checkpoint(path, access, files)
    except CheckpointError as e:
        text = one_line(e).replace("model.path", field)  # hf_io's advice names the policy's field
        fix = "" if field in text else (f". Point {field} at a folder written by save_pretrained (config.json, "
                                        f"*.safetensors, tokenizer files)")
        raise PreflightError(f"{field}: {text}{fix}") from e
    except ckpt.CheckpointInvalid as e:
        raise PreflightError(f"{field}={path!r}: {one_line(e, 400)}; point {field} at a valid checkpoint") from e
    except UnsafeName as e:  # a planted object key: the URL and endpoint are fine, the folder's content is not
        raise PreflightError(f"{field}={path!r}: {one_line(e, 500)}") from e
    except (StorageError, OSError, ValueError) as e:
        raise PreflightError(f"{field}={path!r}: cannot fetch it ({type(e).__name__}: {one_line(e, 300)}); "
                             f"check the URL and storage.endpoint_url") from e


def check_model(cfg: RunConfig, access: StorageAccess):
    """(tokenizer of model.path, passed lines): each model folder has a config transformers reads; the
    policy's tokenizer loads (the engines and trainers load both the same way)."""
    from transformers import AutoConfig, AutoTokenizer

    folders = [("model.path", cfg.model.path), ("model.ref_path", cfg.model.ref_path), ("critic.path", cfg.critic.path)]
    done, tokenizer = [], None
    for field, path in [(f, p) for f, p in folders if p]:
        local = _model_location(cfg, field, path, access)
        try:
            AutoConfig.from_pretrained(local)
        except Exception as e:  # deliberate: transformers raises several types for a bad config.json
            raise PreflightError(f"{field}={path!r}: transformers cannot read its config.json ({type(e).__name__}: "
                                 f"{one_line(e, 300)}); save the model with save_pretrained") from e
        if tokenizer is None:
            try:
                tokenizer = AutoTokenizer.from_pretrained(local)
            except Exception as e:  # deliberate: as above, for the tokenizer files
                raise PreflightError(f"{field}={path!r}: its tokenizer does not load ({type(e).__name__}: "
                                     f"{one_line(e, 300)}); save it into the folder with "
                                     f"tokenizer.save_pretrained") from e
        done.append(f"{field}: {path} (config and tokenizer load)" if field == "model.path" else f"{field}: {path}")
    return tokenizer, done


# ---------------------------------------------------------------- data and rewards


def _reader(access: StorageAccess, field: str) -> Callable[[str], bytes]:
    """`access.read_bytes`, with a missing or unreadable file named by `field`."""
    def read(url: str) -> bytes:
        try:
            return access.read_bytes(url)
        except FileNotFoundError as e:
            raise PreflightError(f"{field}={url!r}: no such file; point {field} at an existing jsonl or parquet "
                                 f"file (a local path or a URL)") from e
        except (StorageError, OSError) as e:
            raise PreflightError(f"{field}={url!r}: cannot read it ({type(e).__name__}: {one_line(e, 300)})") from e
    return read


def _first_prompts(rows: list[dict], tokenizer, data, where: str) -> list:
    from reflow.rl.data import PromptFormat, tokenize_prompts

    try:
        return tokenize_prompts(rows[:FIRST_ROWS], tokenizer, data.max_prompt_len, PromptFormat.of(data))
    except ValueError as e:
        raise PreflightError(f"{where}: {one_line(e)}") from e


def check_data(cfg: RunConfig, tokenizer, access: StorageAccess):
    """(first held-out prompts, passed line): data.path (and data.eval_path) read with the named columns,
    the split leaves rows to train on, the first rows are valid prompts, the run's reward scores one."""
    from reflow.rl.data import load_prompt_rows

    d = cfg.data
    fields = {d.path: "data.path", d.eval_path: "data.eval_path"}
    try:
        train_rows, eval_rows = load_prompt_rows(
            d.task, d.path, d.prompt_key, d.label_key, d.seed, d.num_train, d.num_eval, d.digits, d.eval_path,
            read=lambda url: _reader(access, fields.get(url, "data.path"))(url), metadata_keys=d.metadata_keys)
    except PreflightError:
        raise
    except ValueError as e:  # rl/data's messages name the file and the field
        raise PreflightError(one_line(e)) from e
    where = f"data.path={d.path!r}" if d.task == "file" else f"data.task={d.task!r}"
    prompts = _first_prompts(train_rows, tokenizer, d, where)
    heldout = _first_prompts(eval_rows, tokenizer, d, f"data.eval_path={d.eval_path!r}"
                             if d.eval_path else where + " (held-out rows)")
    if not prompts:
        raise PreflightError(f"{where} holds no prompts; give data.path a file with rows")
    scorer = check_reward_source(cfg, prompts[0], where)
    return heldout, (f"data: {d.path or d.task} ({len(train_rows)} train / {len(eval_rows)} held-out rows; "
                     f"first rows valid); {scorer} (scores a row)")


def check_reward_source(cfg: RunConfig, prompt, source: str) -> str:
    """The `reward:` section's scorer (data.reward_fn, a built-in verifier, the reward server asked once
    without retries, or reward.scorer's) scores `prompt` with an empty response; returns what it is."""
    from reflow.rl.scorers import reward_source

    try:
        scorer = reward_source(cfg.reward, cfg.data.reward_fn)
    except ValueError as e:  # reward.token_env not set; reward.scorer not found
        raise PreflightError(one_line(e)) from e
    check_scorer(scorer, prompt, source, cfg.reward.fn_timeout_s)
    return scorer.describe()


def check_scorer(scorer, prompt, source: str, timeout_s: float) -> None:
    """`scorer` returns a finite float for `prompt` with an empty response (a policy can answer with nothing
    at all, so a reward must handle it) within `timeout_s` (reward.fn_timeout_s, for functions)."""

    try:
        scorer.check(_empty_answer(prompt), timeout_s)
    except ValueError as e:  # a function that does not import: the message names the field
        raise PreflightError(one_line(e)) from e
    except RewardError as e:
        raise PreflightError(scorer.check_failed(source, one_line(e, 400))) from e


def _empty_answer(prompt):

    return Sample(prompt.text, "", prompt.label, "stop", len(prompt.input_ids), 0)  # an immediate eos


def check_reward(spec: str, field: str, prompt, source: str, timeout_s: float) -> None:
    """`spec` (a `module:function` named by `field`) imports and returns a finite float for `prompt` with an
    empty response within `timeout_s` (reward.fn_timeout_s)."""
    from reflow.rl.scorers import FunctionScorer

    check_scorer(FunctionScorer(spec, field), prompt, source, timeout_s)


def check_eval_set(cfg: RunConfig, i: int, tokenizer, heldout: list, access: StorageAccess) -> str:
    """One eval set: its source read with its columns, first rows valid, its reward function scores one."""
    from reflow.rl.data import read_rows

    s, where = cfg.eval.sets[i], f"eval.sets.{i}"
    if s.source == "heldout":
        prompts, source = heldout, f"the held-out split ({where}: {s.name})"
    else:
        try:
            rows = read_rows(s.source, s.prompt_key or cfg.data.prompt_key, s.label_key or cfg.data.label_key,
                             where, _reader(access, f"{where}.source"), cfg.data.metadata_keys)
        except PreflightError:
            raise
        except ValueError as e:
            raise PreflightError(f"{where}.source: {one_line(e)}") from e
        source = f"{where}.source={s.source!r}"
        prompts = _first_prompts(rows, tokenizer, cfg.data, source)
    if not prompts:
        raise PreflightError(f"{source} holds no prompts; give {where}.source a file with rows")
    if s.reward_fn or cfg.reward.type == "function":
        field = f"{where}.reward_fn" if s.reward_fn else f"data.reward_fn (used by {where}: {s.name})"
        check_reward(s.reward_fn or cfg.data.reward_fn, field, prompts[0], source, cfg.reward.fn_timeout_s)
    else:  # the run's built-in verifier or reward server, as the eval uses (infra/inputs/eval_sets.py)
        check_reward_source(cfg, prompts[0], source)
    return f"eval set {s.name}: {s.source} (first rows valid, reward scores a row)"


# ---------------------------------------------------------------- tracking and storage


def check_tracking(cfg: RunConfig) -> str | None:
    """Each tracker `tracking:` turns on has its package (imported only when the run starts)."""
    from reflow.infra.store.tracking import PACKAGES, missing_packages

    for name in missing_packages(cfg.tracking):
        pip = "mlflow-skinny" if name == "mlflow" else PACKAGES[name]
        raise PreflightError(f"tracking.{name}=true but the package {PACKAGES[name]!r} is not installed: "
                             f"pip install {pip} (or: pip install 'reflow[tracking]'), or set tracking.{name}=false")
    on = [name for name in PACKAGES if getattr(cfg.tracking, name)]
    return f"tracking: {', '.join(on)} (installed)" if on else None


def check_storage(cfg: RunConfig) -> str:
    """A probe object written, read back and deleted under the experiment (the folders it made removed)."""
    store = ExperimentStore.from_config(cfg.storage, cfg.experiment)
    try:
        store.preflight()
    except StorageError as e:
        where = [f"storage.root={cfg.storage.root!r}"] + (
            [f"storage.endpoint_url={cfg.storage.endpoint_url!r}"] if cfg.storage.endpoint_url else [])
        hint = "" if "storage.root" in str(e) else f" (set by {', '.join(where)})"
        raise PreflightError(f"{one_line(e)}{hint}") from e
    return f"storage: {store.url()} (writable)"


# A checkpoint holds the HF weights as saved plus DeepSpeed's optimizer state: an fp32 copy of every parameter and
# Adam's two moments (the tiny test policy's: 90 kB of weights and 292 kB of optimizer state for 22.5k parameters).
OPTIMIZER_BYTES_PER_PARAM = 12


def checkpoint_bytes(cfg: RunConfig, params: int) -> int:
    """What one full checkpoint of this run takes: the policy's weights as the trainer saves them (fp32 unless
    trainer.precision=bf16) and its optimizer state, and the same again for a critic (taken as large as the policy)."""
    weights = params * (2 if cfg.trainer.precision == "bf16" else 4)  # auto: as fp32, the larger
    one = weights + params * OPTIMIZER_BYTES_PER_PARAM
    return one * (2 if cfg.algorithm.spec.needs_critic else 1)


def check_disk(cfg: RunConfig, access: StorageAccess) -> str | None:
    """On a file:// root: room for checkpoint.keep_last checkpoints and the one being written (a 1.5B policy's is
    ~25 GB). A 3B run once learned only at its final save that the disk was full (issue 54). None elsewhere (a
    bucket has no free-space figure) and with LoRA (adapters only)."""

    store = ExperimentStore.from_config(cfg.storage, cfg.experiment)
    if not store.is_local or cfg.trainer.lora.rank:
        return None
    c = cfg.checkpoint
    if not (c.save_last or c.save_interval or c.save_every_minutes or c.sentinel):
        return ("disk: no checkpoint scheduled (checkpoint.save_last=false, no save_interval, save_every_minutes "
                "or sentinel): not checked")
    params, _ = model_bytes(str(_model_location(cfg, "model.path", cfg.model.path, access)))
    one = checkpoint_bytes(cfg, params)
    folder = Path(store._path("checkpoints"))
    kept = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.exists() else 0
    need = (cfg.checkpoint.keep_last + 1) * one - kept  # what is there now is replaced as the run saves
    root = Path(store._path())
    while not root.exists():
        root = root.parent
    free = shutil.disk_usage(root).free
    if need > free:
        raise PreflightError(
            f"storage.root={cfg.storage.root!r} has {_gib(free)} free, but checkpoint.keep_last={cfg.checkpoint.keep_last} "
            f"checkpoints and the one being written need ~{_gib(need + kept)} ({_gib(one)} each: {params:,} parameters, "
            f"weights and optimizer state{', policy and critic' if cfg.algorithm.spec.needs_critic else ''})"
            + (f", {_gib(kept)} of it there already" if kept else "")
            + "; free space there, lower checkpoint.keep_last, or point storage.root at a larger disk or a bucket")
    return f"disk: {_gib(free)} free for ~{_gib(need + kept)} of checkpoints ({cfg.checkpoint.keep_last} kept + 1)"


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**27 else f"{b / 2**20:.1f} MiB"


def check_gpu_memory(cfg: RunConfig, access: StorageAccess) -> str | None:
    """A trainer rank's estimated GPU peak (engines/train/memory.py) against cluster.gpu_memory_gib, or the memory of
    the GPU this process sees; None where neither is known or the run is on CPU (cluster.gpus=off)."""
    from transformers import AutoConfig

    from reflow.engines.train.memory import activation_bytes, rank_memory

    gpu = cfg.cluster.gpu_memory_gib * 2**30 if cfg.cluster.gpu_memory_gib else None
    if gpu is None and cfg.cluster.gpus != "off":
        try:

            if torch.cuda.is_available():
                gpu = torch.cuda.get_device_properties(0).total_memory
        except Exception:  # deliberate: no usable GPU here is "unknown", not a failed check
            gpu = None
    if gpu is None or cfg.cluster.gpus == "off":
        return None
    local = str(_model_location(cfg, "model.path", cfg.model.path, access))
    params, _ = model_bytes(local)
    model_cfg = AutoConfig.from_pretrained(local)
    t = cfg.trainer
    precision, _ = resolve_precision(t, True, lambda: params)  # auto: what the ranks will take on these GPUs
    tokens = t.max_tokens_per_micro_batch or t.micro_batch_size * (cfg.data.max_prompt_len + cfg.rollout.max_new_tokens)
    low = 2 if precision == "bf16" else 4
    checkpointing = t.activation_checkpointing == "on" or (
        t.activation_checkpointing == "auto" and activation_bytes(model_cfg, tokens, low) > gpu / 2)  # as the rank decides
    est = rank_memory(model_cfg, params, precision=precision, zero_stage=t.zero_stage, world=t.num_ranks,
                      tokens=tokens, checkpointing=checkpointing)
    engine, beside = 0, ""
    if cfg.cluster.colocate and not cfg.cluster.hand_over:  # the engine keeps its memory while the trainer trains
        r = cfg.rollout  # SGLang's static fraction, the embedded engine's KV budget, else its weights alone
        fraction = r.mem_fraction_static if r.backend == "sglang" else r.kv_mem_fraction
        engine = int(fraction * gpu) if fraction is not None else params * low
        beside = f", a colocated engine {_gib(engine)}"
    need = est.total + engine
    parts = (f"weights {_gib(est.weights)}, gradients {_gib(est.gradients)}, optimizer state {_gib(est.optimizer)}, "
             f"activations of a {tokens}-token micro-batch {_gib(est.activations)}"
             f"{' (checkpointed)' if checkpointing else ''}{beside}")
    if need > gpu:
        fix = ("lower trainer.max_tokens_per_micro_batch" if t.max_tokens_per_micro_batch else
               "lower trainer.micro_batch_size (or set trainer.max_tokens_per_micro_batch)")
        more = [] if checkpointing else ["set trainer.activation_checkpointing=on"]
        more += [] if t.zero_stage == 3 else ["raise trainer.zero_stage"]
        raise PreflightError(f"a trainer rank needs ~{_gib(need)} of a {_gib(gpu)} GPU ({parts}): {fix}, "
                             + ", ".join(more + ["or add trainer.num_ranks"])
                             + ("" if cfg.cluster.gpu_memory_gib else " (cluster.gpu_memory_gib overrides the size)"))
    return f"gpu memory: a trainer rank ~{_gib(need)} of {_gib(gpu)} ({parts})"


def check_resume(cfg: RunConfig) -> str | None:
    """resume=never on an experiment with committed checkpoints, or resume=URL not at a committed
    checkpoint, is refused by the run after it started its cluster: say so now. (resume=auto needs no
    check: it starts fresh when there is nothing to resume.)"""
    from reflow.infra.store import checkpoint as ckpt

    store = dataclasses.replace(ExperimentStore.from_config(cfg.storage, cfg.experiment), retries=0)
    if cfg.resume == "never":
        if ckpt.committed(store):
            raise PreflightError(f"resume=never but {store.url(ckpt.ROOT)} already holds committed checkpoints; "
                                 f"use resume=auto to continue, or a new experiment name to start over")
        return None
    if cfg.resume == "auto":
        return None
    try:
        ckpt.check(ckpt.from_url(cfg.resume, store), signature=False)  # the signature: checked by the run
    except (ckpt.CheckpointInvalid, StorageError, OSError, KeyError, ValueError) as e:
        raise PreflightError(f"resume: {one_line(e, 400)}; give the URL of a committed checkpoint "
                             f"(…/checkpoints/iter_NNNNNN) or resume=auto") from e
    return f"resume: {cfg.resume} (committed)"
