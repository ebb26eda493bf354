"""Proof that a weight push landed: what each `verify` mode reads back, and what it proves.

- off: nothing read back; the push stats only say that every engine accepted every bucket.
- weights (verify=sample|full): tensors read back through /get_weights_by_name and compared with
  the pushed copy cast to the engine's dtype; atol=0 demands bit-equality. Proves the values of the
  tensors read (all of them, or a sample / their first rows). SGLang answers it only for model
  classes that implement `get_weights_by_name` (Llama, Granite, OPT, ...; not Qwen2/Qwen3: a 400),
  at TP > 1 with rank 0's shard only, and with the base weights where a LoRA adapter is applied per
  request (SGLang's `enable_lora`; the embedded engine merges adapters, so it answers effective ones).
- logprobs (verify=logprobs, and what sample|full fall back to where the weights cannot be read
  back whole): every engine scores a fixed probe batch teacher-forced (/generate with
  `return_logprob` and `logprob_start_len=0` -> `meta_info.input_token_logprobs`) and its logprobs
  are compared with the trainer's at the pushed weights (`LogprobProbe`, computed by the trainer
  before the push). Proves, for any model class and TP size, that the engine computes what the
  pushed model computes on those tokens, to within the noise of the coarser of the two dtypes
  (`LOGPROB_TOLERANCE`): it catches missing, misnamed, mis-laid-out or mis-sharded tensors, but not
  a difference below that noise (one small optimizer step in bf16 may be), nor weights the probe
  does not reach (embedding rows of tokens absent from it).
Every mode but off also checks each engine's `weight_version`. Any failure raises `WeightSyncError`:
a silent mismatch would make every later importance ratio wrong.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from reflow.engines.rollout_client import EngineClient, EngineError, lora_fields
from reflow.engines.weights.settings import PushSettings

VERIFY_MODES = ("off", "sample", "full", "logprobs")


class WeightSyncError(RuntimeError):
    """Weights on an engine are not the weights that were pushed (or the push failed)."""


Named = list[tuple[str, torch.Tensor]]

# Mean |engine - trainer| logprob over the probe tokens allowed at each dtype (the coarser of the
# engine's and the trainer's counts). float32: kernels differ in summation order only (CPU engines
# here agree to ~1e-6); 16-bit: every activation is rounded, and random probe tokens have low
# logprobs whose logits sit where bf16's spacing is 0.06-0.125. Set from that arithmetic, not
# measured on GPUs (PushSettings.verify_logprob_tol overrides). A wrong, missing or mis-laid-out
# tensor moves the logprobs of a random-token probe by O(1).
LOGPROB_TOLERANCE = {torch.float64: 1e-4, torch.float32: 1e-3, torch.float16: 5e-2, torch.bfloat16: 1e-1}
PROBE_PROMPTS, PROBE_TOKENS = 4, 16


def probe_prompts(vocab_size: int, prompts: int = PROBE_PROMPTS, tokens: int = PROBE_TOKENS) -> list[list[int]]:
    """The fixed probe batch: the same token ids on every rank and every push (seeded). The last id
    is left out: SGLang reports ids >= vocab_size - 1 in input_token_logprobs as 0."""
    rng = random.Random(0)
    return [[rng.randrange(vocab_size - 1) for _ in range(tokens)] for _ in range(prompts)]


@dataclass(frozen=True)
class LogprobProbe:
    """The trainer's side of the logprob check, at the pushed weights: `reference[i][t]` is the
    logprob of prompts[i][t + 1] given prompts[i][:t + 1] (plain log_softmax, temperature 1), as
    float32 [len(prompts[i]) - 1]; `dtype` is the dtype the trainer computed them in."""

    prompts: list[list[int]]
    reference: list[torch.Tensor]
    dtype: torch.dtype = torch.float32


ProbeSource = LogprobProbe | Callable[[], LogprobProbe] | None  # a probe, or what makes it when needed


# /server_info's "dtype" -> what the engine holds: SGLang's --dtype choices and torch's names (the embedded
# engine reports its own dtype, e.g. "float32").
_ENGINE_DTYPES = {"half": torch.float16, "float16": torch.float16, "float": torch.float32,
                  "float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
# Under SGLang's --dtype auto the engine holds the checkpoint's dtype, except float32, which it loads as
# float16 (bfloat16 for Gemma), and /server_info still says "auto": the check accepts any of these.
_AUTO_CANDIDATES = (torch.float16, torch.bfloat16)


def _engine_dtype(client: EngineClient, info: dict | None = None) -> torch.dtype | None:
    """The dtype the engine holds weights in, from /server_info; None for SGLang's "auto" (unknown:
    reflow's launcher pins it, an engine launched otherwise may not)."""
    name = str((info or client.server_info()).get("dtype", "auto")).removeprefix("torch.")
    if name == "auto":
        return None
    if name not in _ENGINE_DTYPES:
        raise WeightSyncError(f"engine {client.url} reports dtype {name!r}, which the weight check cannot compare "
                              f"in (known: {sorted(_ENGINE_DTYPES)}); launch it with one of those or verify=off")
    return _ENGINE_DTYPES[name]


def _check_version(client: EngineClient, version: str) -> None:
    got = client.model_info().get("weight_version")
    if str(got) != str(version):
        raise WeightSyncError(f"engine {client.url} reports weight_version {got!r}, expected {version!r}")


def verify_due(version: str, every: int) -> bool:
    """weight_sync.verify_every: check versions divisible by `every` (numeric ones; others always)."""
    return every <= 1 or not str(version).isdigit() or int(version) % every == 0


def check_pushed(clients: list[EngineClient], named_tensors: Named, version: str, s: PushSettings,
                 probe: ProbeSource = None, lora_path: str | None = None) -> dict:
    """After any push (full, adapter): `s.verify` when this version is due (verify_every), else every
    engine's weight_version only. `lora_path`: the adapter an adapter push loaded (see `verify_push`)."""
    if verify_due(version, s.verify_every):
        return verify_push(clients, named_tensors, version, s.verify, s.verify_sample, s.verify_atol, s.verify_rows,
                           probe, s.verify_logprob_tol, lora_path)
    return versions_only(clients, version)


def versions_only(clients: list[EngineClient], version: str) -> dict:
    """A push whose full check is not due (weight_sync.verify_every): every engine's weight_version still."""
    for c in clients:
        _check_version(c, version)
    return {"verified_tensors": 0, "verify_method": "version"}


def sharded_readback(server_info: dict) -> str | None:
    """Why /get_weights_by_name cannot prove a push on this engine (None: it can): at TP > 1 SGLang
    answers rank 0's shard of every split tensor."""
    tp = int(server_info.get("tp_size", 1) or 1)
    return f"tp_size={tp}: get_weights_by_name answers rank 0's shard only" if tp > 1 else None


def unmerged_adapter(server_info: dict, lora_path: str | None) -> str | None:
    """Why /get_weights_by_name cannot prove an adapter push (None: it can): an engine launched with
    `enable_lora` (SGLang) applies adapters per request and answers the base weights there."""
    if lora_path and server_info.get("enable_lora"):
        return f"enable_lora: adapter {lora_path!r} is applied per request, get_weights_by_name answers base weights"
    return None


def verify_push(clients: list[EngineClient], named_tensors: Named, version: str, mode: str = "full",
                sample: int = 4, atol: float = 0.0, rows: int | None = None,
                probe: ProbeSource = None, logprob_tol: float | None = None,
                lora_path: str | None = None) -> dict:
    """Verify every engine by `mode` (see the module docstring); returns the stats a push reports:
    verified_tensors, verify_method ("off", "weights", "logprobs" or "weights+logprobs" when engines
    differ), verify_fallback (engine -> why its weights were not read back) and, when logprobs were
    compared, logprob_engines (how many engines were checked that way: the numeric trace the flow's
    metrics keep) and logprob_max_diff (the largest mean |engine - trainer| over those engines).
    `lora_path` (adapter pushes): the probe's requests name that adapter, as rollout requests do, and an
    engine that does not merge it (`unmerged_adapter`) is checked by logprobs. `probe` may be a function
    that makes it: called once, when the first engine is to be checked by logprobs."""
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {mode!r}")
    stats: dict = {"verified_tensors": 0, "verify_method": "off"}
    if mode == "off":
        return stats
    methods, fallback, diffs = set(), {}, []
    for c in clients:
        _check_version(c, version)
        info = c.server_info()
        why = "verify=logprobs" if mode == "logprobs" else sharded_readback(info) or unmerged_adapter(info, lora_path)
        if why is None:
            try:
                stats["verified_tensors"] += verify_weights([c], named_tensors, version, mode, sample, atol, rows,
                                                            info=info)
                methods.add("weights")
                continue
            except _ReadbackRefused as e:  # this model class has no get_weights_by_name: prove it by logprobs
                why = str(e)
        if callable(probe):  # the trainer's, made only now that an engine needs it (a forward: TrainerRank.push_weights)
            probe = probe()
        if probe is None:
            reason = "verify=logprobs needs the trainer's logprobs" if mode == "logprobs" else \
                f"engine {c.url} cannot be verified by reading weights back ({why})"
            raise WeightSyncError(f"{reason} and no logprob probe was given: pass probe= (TrainerRank.push_weights "
                                  f"does) or set weight_sync.verify=off")
        if mode != "logprobs":
            fallback[c.url] = why
        diffs.append(compare_logprobs(c, probe, _engine_dtype(c, info), logprob_tol, lora_path))
        methods.add("logprobs")
    stats["verify_method"] = "+".join(sorted(methods, key=("weights", "logprobs").index))
    if fallback:
        stats["verify_fallback"] = fallback
    if diffs:
        stats["logprob_engines"], stats["logprob_max_diff"] = len(diffs), max(diffs)
    return stats


class _ReadbackRefused(WeightSyncError):
    """The engine refused /get_weights_by_name for the first tensor (SGLang: 400 "Get parameter by name
    failed" for model classes without the method)."""


def verify_weights(clients: list[EngineClient], named_tensors: Named, version: str, mode: str = "full",
                   sample: int = 4, atol: float = 0.0, rows: int | None = None, *, info: dict | None = None) -> int:
    """Read tensors back through /get_weights_by_name and compare; returns how many were compared.

    mode="sample" with `rows` compares the first `rows` rows of each sampled tensor (SGLang's
    `truncate_size`): the answer is JSON, so whole embedding matrices cost seconds per push.

    atol=0 demands bit-equality after casting to the dtype the engine reports in /server_info; a
    quantised engine (fp8, int4) cannot reproduce the pushed values exactly, so give it the tolerance its
    format needs. An engine that reports SGLang's "auto" passes when it holds the pushed values cast to
    the pushed dtype, float16 or bfloat16 (what "auto" can load them as); the launcher pins --dtype."""
    if mode == "off":
        return 0
    names = [n for n, _ in named_tensors]
    if mode == "sample":  # deterministic per version, so a rerun checks the same tensors
        names = sorted(random.Random(version).sample(sorted(names), min(sample, len(names))))
    pushed = dict(named_tensors)
    count = 0
    for c in clients:
        _check_version(c, version)
        dtype = _engine_dtype(c, info)
        for i, name in enumerate(names):
            candidates = (dtype,) if dtype is not None else (pushed[name].dtype, *_AUTO_CANDIDATES)
            try:
                _compare(c, name, pushed[name], candidates, atol, rows if mode == "sample" else None)
            except EngineError as e:
                if i == 0 and e.status in (400, 404):  # refused outright, not one tensor among many
                    raise _ReadbackRefused(f"get_weights_by_name refused: {e.message}") from e
                raise
            count += 1
    return count


def _compare(client: EngineClient, name: str, pushed: torch.Tensor, dtypes: tuple[torch.dtype, ...],
             atol: float = 0.0, rows: int | None = None) -> None:
    """Pass when the engine's values equal `pushed` cast to one of `dtypes` (what the engine may hold)."""
    src = pushed.detach()
    if rows is not None and src.dim() and src.shape[0] > rows:
        src, size = src[:rows], rows  # the engine truncates along dim 0 the same way
    else:
        size = max(src.shape[0] if src.dim() else 1, src.numel())
    src = src.to("cpu")  # after slicing: only the rows compared leave the GPU
    got = torch.tensor(client.get_weights_by_name(name, truncate_size=size), dtype=torch.float32)
    src = src.reshape(1) if src.dim() == 0 else src
    if tuple(got.shape) != tuple(src.shape):
        raise WeightSyncError(f"engine {client.url} tensor {name!r}: shape {tuple(got.shape)} "
                              f"!= pushed {tuple(src.shape)}")
    diffs = []
    for dt in dtypes:
        want = src.to(dt).float()  # what an engine holding `dt` must answer
        if torch.equal(got, want) if atol == 0 else torch.allclose(got, want, rtol=0.0, atol=atol):
            return  # NaN never passes either way
        diffs.append(f"{str(dt).removeprefix('torch.')}: max abs diff {(got - want).abs().max().item():.3g}")
    held = ("engine dtype 'auto', so any of these" if len(dtypes) > 1 else "engine dtype")
    raise WeightSyncError(f"engine {client.url} tensor {name!r} differs from the pushed weights cast to the "
                          f"{held}: {'; '.join(diffs)} (tolerance {atol:g})")


# ---------------------------------------------------------------- logprobs


def engine_input_logprobs(client: EngineClient, prompts: list[list[int]],
                          lora_path: str | None = None) -> list[torch.Tensor]:
    """The engine's teacher-forced logprobs of each prompt's tokens 1.., float32 [len(p) - 1] each
    (with the LoRA adapter `lora_path` when given).

    SGLang's input_token_logprobs with logprob_start_len=0 are [logprob, token_id, text] per prompt
    token, the first logprob null (no context); greedy, so they are plain log_softmax values."""
    extra = lora_fields(lora_path)
    out = client.generate(input_ids=prompts, return_logprob=True, logprob_start_len=0,
                          sampling_params={"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}, **extra)
    result = []
    for p, item in zip(prompts, out):
        entries = item["meta_info"].get("input_token_logprobs") or []
        if [e[1] for e in entries] != p or entries[0][0] is not None:
            raise WeightSyncError(f"engine {client.url} answered input_token_logprobs for other tokens than the probe "
                                  f"prompt (token ids {[e[1] for e in entries][:8]}..., expected {p[:8]}...)")
        result.append(torch.tensor([e[0] for e in entries[1:]], dtype=torch.float32))
    return result


def compare_logprobs(client: EngineClient, probe: LogprobProbe, engine_dtype: torch.dtype | None,
                     tol: float | None = None, lora_path: str | None = None) -> float:
    """Mean |engine - trainer| logprob over the probe; raises WeightSyncError above `tol` (default: by
    the coarser dtype; an engine under SGLang's "auto" counts as float16)."""
    coarse = max((engine_dtype or torch.float16, probe.dtype), key=lambda d: LOGPROB_TOLERANCE.get(d, 1e-2))
    tol = LOGPROB_TOLERANCE.get(coarse, 1e-2) if tol is None else tol
    got = torch.cat(engine_input_logprobs(client, probe.prompts, lora_path))  # [N]
    want = torch.cat([r.float() for r in probe.reference])  # [N]
    diff = (got - want).abs()  # [N]
    mean = float(diff.mean())
    if not mean <= tol:  # NaN fails too
        raise WeightSyncError(f"engine {client.url}: logprobs of the probe batch differ from the trainer's at the "
                              f"pushed weights by {mean:.3g} on average (max {float(diff.max()):.3g}; tolerance "
                              f"{tol:g} for {str(coarse).removeprefix('torch.')}): the engine does not compute with "
                              f"the pushed weights")
    return mean
