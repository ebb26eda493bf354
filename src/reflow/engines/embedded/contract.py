"""The /generate request contract of the embedded engine, and its response shape.

Validation runs SGLang's own code when sglang is installed (reflow.engines.sglang.contract): the schema
gate of its HTTP server (unknown keys, wrong types: serde's texts), then its SamplingParams
normalize() + verify() (range checks: SGLang's messages). Without sglang, a local table of the
same schema gives the same texts for the common cases. Keys SGLang accepts but this engine does
not implement are refused unless they hold their neutral value (never silently ignored).
"""
from __future__ import annotations

import uuid

from reflow.engines.embedded.generator import Generator, SamplingConfig
from reflow.engines.embedded.state import _Job
from reflow.engines.sglang import contract as sglang_contract


class ContractError(ValueError):
    """The request body breaks the /generate JSON contract (answered with 400)."""


NO_INPUT = "Either text, input_ids or input_embeds should be provided."  # GenerateReqInput's text


_INT, _NUM, _BOOL, _STR, _ANY = "i64", "f64", "a boolean", "a string", "any"
_SAMPLING_TYPES = {
    "max_new_tokens": _INT, "stop": "str_or_list", "stop_token_ids": "int_list", "stop_regex": "str_or_list",
    "temperature": _NUM, "top_p": _NUM, "top_k": _INT, "min_p": _NUM, "frequency_penalty": _NUM,
    "presence_penalty": _NUM, "repetition_penalty": _NUM, "min_new_tokens": _INT, "n": _INT,
    "json_schema": _STR, "regex": _STR, "ebnf": _STR, "structural_tag": _STR, "ignore_eos": _BOOL,
    "skip_special_tokens": _BOOL, "spaces_between_special_tokens": _BOOL, "no_stop_trim": _BOOL,
    "stream_interval": _INT, "logit_bias": "map", "sampling_seed": _INT, "custom_params": _ANY,
    "beam_width": _INT, "watermark": "map", "choice": "str_list",
}
_NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": {},
            "choice": [], "beam_width": 1, "stop_regex": [], "json_schema": "", "regex": "", "ebnf": "",
            "structural_tag": "", "watermark": {}}
_NOT_CONFIG = {"n", "stream_interval", "custom_params"} | set(_NEUTRAL)  # custom_params: ignored


def _unexpected(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{str(v).lower()}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return "sequence" if isinstance(v, list) else "map"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _type_ok(kind: str, v) -> bool:
    return {
        _INT: lambda: _is_int(v), _NUM: lambda: _is_int(v) or isinstance(v, float),
        _BOOL: lambda: isinstance(v, bool), _STR: lambda: isinstance(v, str), _ANY: lambda: True,
        "map": lambda: isinstance(v, dict),
        "str_or_list": lambda: isinstance(v, str) or (isinstance(v, list) and all(isinstance(e, str) for e in v)),
        "int_list": lambda: isinstance(v, list) and all(_is_int(e) for e in v),
        "str_list": lambda: isinstance(v, list) and all(isinstance(e, str) for e in v),
    }[kind]()


def check_sampling_params(sp, own_types: bool = True) -> dict:
    """Contract check of one sampling_params object; returns it without null values.

    own_types=False when SGLang's gate has already checked keys and types."""
    if not isinstance(sp, dict):
        raise ContractError(f"invalid type: {_unexpected(sp)}, expected struct SamplingParams")
    for key, v in sp.items():
        kind = _SAMPLING_TYPES.get(key)
        if own_types and kind is None:
            listed = ", ".join(f"`{k}`" for k in _SAMPLING_TYPES)
            raise ContractError(f"unknown field `{key}`, expected one of {listed}")
        if own_types and v is not None and not _type_ok(kind, v):
            raise ContractError(f"invalid type: {_unexpected(v)}, expected {kind} (sampling_params.{key})")
        if key in _NEUTRAL and v is not None and v != _NEUTRAL[key]:
            raise ContractError(f"sampling_params.{key}={v!r} is not supported by the embedded engine "
                                f"(it implements temperature/top_p/top_k/min_p/stop/min_new_tokens/seed); "
                                f"use the sglang backend for it")
    return {k: v for k, v in sp.items() if v is not None}


def _sglang_verify(sps: list[dict], gen: Generator) -> None:
    """SGLang's SamplingParams normalize() + verify(vocab_size), as its tokenizer manager runs them."""
    contract = sglang_contract.load()
    if contract is None:
        return  # SamplingConfig.verify below carries the same range checks and messages
    fields = set(contract.SamplingParams.__struct_fields__)
    for sp in sps:
        # Keys the schema knows but SGLang's runtime class lacks (`choice`) only pass when neutral.
        contract.sampling_params({k: v for k, v in sp.items() if k in fields}, gen.tokenizer, gen.vocab_size)


def _prompts_of(body: dict, tokenizer) -> tuple[list[list[int]], bool]:
    """(prompts, is_batch) from input_ids or text."""
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise ContractError(NO_INPUT)
    if text is not None:
        if isinstance(text, str):
            return [tokenizer.encode(text)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [tokenizer.encode(t) for t in text], True
        raise ContractError(f"invalid type: {_unexpected(text)}, expected a string or a list of strings (text)")
    if isinstance(ids, list) and ids and all(_is_int(t) for t in ids):
        return [ids], False
    if isinstance(ids, list) and ids and all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in ids):
        return ids, True
    raise ContractError("input_ids must be a non-empty list of token ids or a non-empty list of such lists")


def _per_prompt(value, n_prompts: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n_prompts:
            raise ContractError(f"{name} has {len(value)} entries for {n_prompts} prompts")
        return value
    return [value] * n_prompts


def parse_generate(body, gen: Generator) -> tuple[_Job, bool, list[bool]]:
    """Validate a /generate body into a job; returns (job, is_single, return_logprob per prompt)."""
    if not isinstance(body, dict):
        raise ContractError(f"invalid type: {_unexpected(body)}, expected struct GenerateRequest")
    contract = sglang_contract.load()
    if contract is not None and (err := contract.generate_contract_error(body)) is not None:
        raise ContractError(err)  # SGLang's schema gate: same check, same text as its server
    if body.get("stream"):
        raise ContractError("stream=true is not supported by the embedded engine; send stream=false")
    for key in ("top_logprobs_num", "token_ids_logprob", "return_hidden_states", "image_data"):  # lora_path: lora.py
        if body.get(key):
            raise ContractError(f"{key} is not supported by the embedded engine")
    prompts, batch = _prompts_of(body, gen.tokenizer)
    for p in prompts:
        gen.check_prompt(p)  # here, so one bad prompt cannot fail a merged batch
    sps = [check_sampling_params(sp, own_types=contract is None)
           for sp in _per_prompt(body.get("sampling_params") or {}, len(prompts), "sampling_params")]
    _sglang_verify(sps, gen)
    lps = [bool(x) for x in _per_prompt(body.get("return_logprob") or False, len(prompts), "return_logprob")]
    starts = _input_logprob_starts(body, prompts, lps)
    rid = body.get("rid")
    if batch and isinstance(rid, str):
        raise ContractError("rid must be a list with one id per prompt for a batch request")
    rids = [r if r is not None else uuid.uuid4().hex for r in _per_prompt(rid, len(prompts), "rid")]
    ns = [sp.get("n", 1) for sp in sps]
    if any(k < 1 for k in ns):
        raise ContractError("sampling_params.n must be at least 1")
    if len(set(ns)) > 1:  # SGLang's rules for parallel sampling, kept so callers see one behaviour
        raise ValueError("The parallel_sample_num should be the same for all samples in sample params.")
    if ns[0] > 1 and isinstance(body.get("return_logprob"), list):
        raise ValueError("Cannot use list return_logprob with parallel_sample_num > 1")
    cfgs = [SamplingConfig.from_dict({k: v for k, v in sp.items() if k not in _NOT_CONFIG}) for sp in sps]
    job = _Job(prompts=prompts, cfgs=cfgs, ns=ns, rids=rids, logprob_starts=starts)
    return job, not batch and ns[0] == 1, [lp for lp, k in zip(lps, ns) for _ in range(k)]


def _input_logprob_starts(body: dict, prompts: list[list[int]], lps: list[bool]) -> list[int | None]:
    """Per prompt, where its input_token_logprobs start (None: not asked for). As in SGLang, only with
    return_logprob; a start past the prompt is refused (SGLang aborts the request with this text)."""
    starts = _per_prompt(body.get("logprob_start_len", -1), len(prompts), "logprob_start_len")
    out: list[int | None] = []
    for p, lp, s in zip(prompts, lps, starts):
        if s is not None and not _is_int(s):
            raise ContractError(f"invalid type: {_unexpected(s)}, expected i64 (logprob_start_len)")
        if lp and s is not None and s > len(p):
            raise ContractError(f"req.logprob_start_len={s} is higher than the number of input tokens "
                                f"len(req.origin_input_ids)={len(p)}. Please use a smaller logprob_start_len.")
        out.append(s if lp and s is not None and s >= 0 else None)
    return out


def make_response(rec: dict, with_logprobs: bool, version: str, latency: float) -> dict:
    """One /generate result item; checked against SGLang's GenerateResponse when installed."""
    meta = {"id": rec["id"], "finish_reason": rec["finish_reason"], "prompt_tokens": rec["prompt_tokens"],
            "completion_tokens": rec["completion_tokens"], "cached_tokens": 0, "weight_version": version,
            "e2e_latency": latency}
    if with_logprobs:
        meta["output_token_logprobs"] = rec["output_token_logprobs"]
        meta["input_token_logprobs"] = rec.get("input_token_logprobs", [])  # SGLang: [] unless asked for
    return {"text": rec["text"], "output_ids": rec["output_ids"], "meta_info": meta}


def check_responses(items: list[dict]) -> None:
    """Raise ResponseContractError if an item breaks SGLang's response schema (a bug here, not the caller's)."""
    contract = sglang_contract.load()
    if contract is None:
        for it in items:  # the minimal shape every caller relies on
            if not isinstance(it.get("text"), str) or not isinstance(it.get("meta_info"), dict):
                raise ResponseContractError(f"response item lacks text/meta_info: {sorted(it)}")
        return
    for it in items:
        try:
            contract.check_response(it)
        except contract.JsonContractError as e:
            raise ResponseContractError(f"the engine built a response SGLang's schema rejects: {e}") from e


class ResponseContractError(RuntimeError):
    """The engine's own response broke SGLang's GenerateResponse schema (answered with 500)."""
