"""Pluggable rollout functions (`rollout.generate_fn`): one sample in, one trajectory out.

Contract: `async def fn(request: RolloutRequest, engine: AsyncEngine) -> Trajectory`. The request
holds one sample (its prompt token ids and text, label, the row's metadata, the sampling params with
its own `sampling_seed` when seeded); `engine` speaks SGLang's `/generate` (the same wire contract
as `EngineClient`). The function may call the engine several times — generate, run a tool, append
the tool's output tokens, generate again — and returns the response token ids *as generated* (no
decode and re-tokenize: the trainer scores exactly these ids), a loss mask (1 on tokens the policy
generated, 0 on tool/environment tokens), the engine's log-probs of the generated tokens and any
extra information for the reward function (`Sample.reward_info`).

`single_turn` is the default and the plain single-response rollout; the rollout stage serves it with
one batched request per engine (`rollout_client.generate_batch`), which samples the same tokens
(tests/test_rollout_fns.py compares them), so the default path keeps its speed.

A function that raises fails the rollout with `RolloutFnError` naming the function and the sample;
an `EngineError` (an engine lost or overloaded) passes through unchanged, with a note naming both,
so the generate task's retries for transient engine faults still apply.
"""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from reflow.engines.http_serve import bearer
from reflow.engines.partial_rollout import PartialSettings
from reflow.engines.rollout_client import EngineError, _server_message, lora_fields, result_logprobs
from reflow.rl.rewards import _fn_name, _run_coroutine, _short, load_reward_fn
from reflow.rl.types import Prompt, RolloutBatch

FINISH_REASONS = ("stop", "length", "abort")
DEFAULT = "reflow.engines.rollout_fns:single_turn"


class RolloutFnError(RuntimeError):
    """A rollout function raised or returned something that is not a valid `Trajectory`."""


@dataclass(frozen=True)
class TurnLimits:
    """Bounds of a multi-turn rollout (rollout.max_turns, rollout.max_response_tokens,
    rollout.tool_timeout_s); one turn's own token limit is the sampling params' max_new_tokens."""

    max_turns: int = 1
    max_response_tokens: int | None = None  # policy and tool tokens after the prompt; None: no total limit
    tool_timeout_s: float = 10.0


ONE_TURN = TurnLimits()  # the default: single-turn functions ignore the limits


@dataclass(frozen=True)
class RolloutSettings:
    """How a run (or one eval set) asks the engines for samples: the same for each of its batches."""

    urls: list[str]  # where /generate goes: the engines, or a router URL per engine
    sampling: dict[str, Any]  # SGLang's sampling_params (rollout_stages.sampling_params)
    n: int  # samples per prompt
    timeout_s: float  # per request
    api_key: str | None = None  # the runtime's bearer token
    generate_fn: str = DEFAULT  # rollout.generate_fn
    max_concurrent: int = 256  # per-sample requests in flight (a rollout function's)
    limits: TurnLimits = ONE_TURN
    adapter: bool = False  # the engines hold each policy version as a LoRA adapter that requests name
    seed: int | None = None  # per-sample sampling seeds derive from it (None: the engines' own random state)
    partial: PartialSettings | None = None  # rollout.partial carry|drop (engines/partial_rollout.py); None: off


@dataclass(frozen=True)
class BatchRequest:
    """One batch: `prompts` (n samples each, prompt-major) by the engines' policy `version`. Per-sample
    seeds are keyed by `seed_key` (default `version`: an asynchronous run keys them by the batch's
    iteration, as several batches may share a version)."""

    prompts: list[Prompt]
    version: int
    seed_key: int | None = None


@dataclass(frozen=True)
class RolloutRequest:
    """One sample to roll out: sample `sample_index` of the batch, drawn for prompt `prompt.index`."""

    prompt_ids: list[int]
    prompt_text: str
    label: Any
    metadata: dict[str, Any]
    sampling_params: dict[str, Any]  # SGLang's, n=1; `sampling_seed` set when rollout.seeded_sampling
    sample_index: int
    prompt_index: int
    limits: TurnLimits = ONE_TURN


@dataclass
class Trajectory:
    """What a rollout function returns. `response_ids`: every token after the prompt, generated and
    tool tokens in order; `loss_mask`: one 0/1 per response token (None: all generated);
    `rollout_logprobs`: one per generated token (mask 1), in order."""

    response_ids: list[int]
    rollout_logprobs: list[float]
    response_text: str
    loss_mask: list[int] | None = None
    finish_reason: str = "stop"  # "stop" | "length" | "abort"
    reward_info: dict[str, Any] = field(default_factory=dict)


class AsyncEngine:
    """Async client of one engine's `/generate` (SGLang's native API), for rollout functions."""

    def __init__(self, url: str, timeout: float, api_key: str | None, limit: asyncio.Semaphore,
                 lora_path: str | None = None):
        self.url = url.rstrip("/")
        self._lora = lora_fields(lora_path)  # the policy's adapter, on every request
        self._http = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(timeout, connect=10.0),
                                       headers=bearer(api_key), verify=not self.url.startswith("http://"))
        self._limit = limit  # requests in flight over all engines (rollout.max_concurrent_requests)
        self._tokenizer: Any = None

    def __repr__(self) -> str:  # never the key
        return f"AsyncEngine({self.url!r})"

    async def tokenizer(self) -> Any:
        """The engine's tokenizer (its /model_info `tokenizer_path`), loaded once per process: what a
        rollout function tokenizes tool output with."""
        if self._tokenizer is None:  # asked once per engine and batch, not once per sample
            r = await self._http.get("/model_info")
            if r.status_code >= 300:
                raise EngineError(self.url, "/model_info", r.status_code, _server_message(r))
            self._tokenizer = _load_tokenizer(r.json().get("tokenizer_path") or r.json()["model_path"])
        return self._tokenizer

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any],
                       return_logprob: bool = True, **extra: Any) -> dict[str, Any]:
        """One POST /generate of one prompt: SGLang's result dict (text, output_ids, meta_info)."""
        body = {"input_ids": list(input_ids), "sampling_params": {**sampling_params, "n": 1},
                "return_logprob": return_logprob, **self._lora, **extra}
        async with self._limit:
            try:
                r = await self._http.post("/generate", json=body)
            except httpx.HTTPError as e:
                raise EngineError(self.url, "/generate", None, f"{type(e).__name__}: {e}") from e
        if r.status_code >= 300:
            raise EngineError(self.url, "/generate", r.status_code, _server_message(r))
        return r.json()

    async def aclose(self) -> None:
        await self._http.aclose()


@functools.cache
def _load_tokenizer(path: str) -> Any:
    from reflow.engines.hf_io import load_tokenizer

    return load_tokenizer(path)


async def single_turn(request: RolloutRequest, engine: AsyncEngine) -> Trajectory:
    """The default rollout: one response to the prompt, every token the policy's."""
    out = await engine.generate(request.prompt_ids, request.sampling_params)
    ids = list(out["output_ids"])
    return Trajectory(ids, result_logprobs(out), out["text"], [1] * len(ids),
                      out["meta_info"]["finish_reason"]["type"])


RolloutFn = Callable[[RolloutRequest, AsyncEngine], Awaitable[Trajectory]]


def load_rollout_fn(spec: str) -> RolloutFn:
    """Import `module:function` named by rollout.generate_fn; it must be an `async def`."""
    fn = load_reward_fn(spec, field="rollout.generate_fn")
    if not asyncio.iscoroutinefunction(fn):
        raise ValueError(f"rollout.generate_fn={spec!r} must be an `async def` function "
                         f"(request, engine) -> Trajectory (reflow.engines.rollout_fns)")
    return fn


def _where(fn: Callable, req: RolloutRequest) -> str:
    return (f"rollout function {_fn_name(fn)} on sample {req.sample_index} "
            f"(prompt {req.prompt_index}: {_short(req.prompt_text)!r})")


def _problem(t: Any) -> str | None:
    """What is wrong with a rollout function's return value, or None."""
    if not isinstance(t, Trajectory):
        return f"returned {type(t).__name__}, expected a reflow.engines.rollout_fns.Trajectory"
    mask = t.loss_mask if t.loss_mask is not None else [1] * len(t.response_ids)
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in t.response_ids):
        return "returned response_ids that are not all ints"
    if len(mask) != len(t.response_ids) or any(m not in (0, 1) for m in mask):
        return f"returned a loss_mask of {len(mask)} entries that are not all 0/1 for {len(t.response_ids)} tokens"
    if len(t.rollout_logprobs) != sum(mask):
        return f"returned {len(t.rollout_logprobs)} rollout_logprobs for {sum(mask)} generated tokens (loss_mask 1)"
    if t.finish_reason not in FINISH_REASONS:
        return f"returned finish_reason {t.finish_reason!r}, expected one of {FINISH_REASONS}"
    if not isinstance(t.response_text, str) or not isinstance(t.reward_info, dict):
        return "returned a response_text that is not a str or reward_info that is not a dict"
    return None


async def _one(fn: RolloutFn, req: RolloutRequest, engine: AsyncEngine) -> Trajectory:
    try:
        t = await fn(req, engine)
    except EngineError as e:  # an engine fault stays itself (transient ones are retried by the task)
        e.add_note(f"raised inside {_where(fn, req)}")
        raise
    except Exception as e:  # deliberate: re-raised with the function and sample named
        raise RolloutFnError(f"{_where(fn, req)} raised {type(e).__name__}: {e}") from e
    if (problem := _problem(t)) is not None:
        raise RolloutFnError(f"{_where(fn, req)} {problem}")
    return t


async def _run_all(fn: RolloutFn, urls: list[str], requests: list[RolloutRequest], timeout: float,
                   api_key: str | None, max_concurrent: int, lora_path: str | None = None) -> list[Trajectory]:
    limit = asyncio.Semaphore(max_concurrent)
    engines = [AsyncEngine(u, timeout, api_key, limit, lora_path) for u in urls]
    try:
        results = await asyncio.gather(*(_one(fn, r, engines[r.prompt_index % len(engines)]) for r in requests),
                                       return_exceptions=True)
    finally:
        await asyncio.gather(*(e.aclose() for e in engines))
    for res in results:  # the first failure in sample order, so the message does not depend on timing
        if isinstance(res, BaseException):
            raise res
    return results  # type: ignore[return-value]


def requests_for(prompts: list[Prompt], sp: dict[str, Any], n: int, seeds: list[int] | None,
                 limits: TurnLimits = ONE_TURN) -> list[RolloutRequest]:
    """n requests per prompt, prompt-major; with `seeds` each carries its own sampling_seed."""
    return [RolloutRequest(p.input_ids, p.text, p.label, dict(p.metadata),
                           {**sp, "n": 1, **({"sampling_seed": int(seeds[j])} if seeds is not None else {})},
                           j, p.index, limits)
            for j, p in enumerate(p for p in prompts for _ in range(n))]


def rollout_with_fn(settings: RolloutSettings, batch: BatchRequest, seeds: list[int] | None = None,
                    lora_path: str | None = None) -> RolloutBatch:
    """n trajectories per prompt from the rollout function `settings.generate_fn`, as a RolloutBatch with
    a response_mask; the generated tokens' log-probs are spread over the response (0.0 on tool tokens).
    `seeds`: one sampling_seed per sample; `lora_path`: the LoRA adapter every request names."""
    s = settings
    if not s.urls:
        raise ValueError("a rollout needs at least one engine URL")
    fn = load_rollout_fn(s.generate_fn)
    reqs = requests_for(batch.prompts, s.sampling, s.n, seeds, s.limits)
    trajs = _run_coroutine(_run_all(fn, s.urls, reqs, s.timeout_s, s.api_key, s.max_concurrent, lora_path))
    masks = [t.loss_mask if t.loss_mask is not None else [1] * len(t.response_ids) for t in trajs]
    gi = [i // s.n for i in range(len(reqs))]
    return RolloutBatch(
        group_index=gi, prompt_text=[r.prompt_text for r in reqs], prompt_ids=[list(r.prompt_ids) for r in reqs],
        response_text=[t.response_text for t in trajs], response_ids=[list(t.response_ids) for t in trajs],
        rollout_logprobs=[_spread(t.rollout_logprobs, m) for t, m in zip(trajs, masks)],
        finish_reason=[t.finish_reason for t in trajs], label=[r.label for r in reqs], policy_version=batch.version,
        response_mask=[list(m) for m in masks], reward_info=[dict(t.reward_info) for t in trajs])


def _spread(logprobs: list[float], mask: list[int]) -> list[float]:
    """One log-prob per response token: the generated tokens' in order, 0.0 on tool tokens."""
    it = iter(logprobs)
    return [float(next(it)) if m else 0.0 for m in mask]
