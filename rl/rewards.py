"""Loading and calling reward functions (the `data.reward_fn` extension point).

Contract (see `reflow.rl.demo_task`): `fn(prompt: str, response: str, label) -> float`, sync or
`async def`; or a dict with a `score` (the reward) and other numbers, reported as the iteration's
`reward/<key>` metrics. A function that also declares a parameter named `sample` (keyword-only, or with a
default) is called with `sample=` a `reflow.rl.types.Sample`: the same three plus the finish reason
("stop" or "length": did the response end with eos or hit rollout.max_new_tokens?), the prompt and
response token counts and the response's token ids. Plain three-argument functions keep working.
Async functions of one batch run concurrently (asyncio.gather), so a verifier that
calls out to a sandbox or a judge does not serialise the batch. Any failure — the function
raising, returning a non-number, a bool, NaN or inf — raises `RewardError` naming the function,
the sample index and the (truncated) prompt and response; the original exception is chained.
"""
from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: loading a reward function imports no torch
    from reflow.rl.types import Sample

RewardFn = Callable[..., Any]  # (prompt, response, label[, *, sample]) -> float, or a coroutine of one


class RewardError(RuntimeError):
    """A reward function failed or returned something that is not a finite number."""


def _short(text: str, limit: int = 120) -> str:
    text = str(text)
    return text if len(text) <= limit else text[:limit] + f"...(+{len(text) - limit} chars)"


def _fn_name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def load_reward_fn(spec: str, field: str = "data.reward_fn") -> RewardFn:
    """Import `module:function` (e.g. "reflow.rl.demo_task:reward"); errors name `field` (the config
    field that named it) and say what to do."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"{field} must look like 'package.module:function', got {spec!r}")
    mod_name, attr = spec.split(":")
    module = _import(spec, mod_name, field)
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"{field}={spec!r}: module {mod_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"{field}={spec!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


def _import(spec: str, mod_name: str, field: str):
    """The module, or a ValueError that tells a missing module from one whose own import fails (a
    missing dependency inside it would otherwise read as the module itself being absent)."""
    try:
        return importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name is not None and not (mod_name == e.name or mod_name.startswith(e.name + ".")):
            raise ValueError(f"{field}={spec!r}: module {mod_name!r} imports {e.name!r}, which is not "
                             f"installed; install it where rollouts are scored") from e
        raise ValueError(f"{field}={spec!r}: module {mod_name!r} not found ({e}); "
                         f"is it on PYTHONPATH of every process that scores rollouts?") from e
    except Exception as e:  # deliberate: any failure inside the user's module becomes one message naming it
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise ValueError(f"{field}={spec!r}: importing module {mod_name!r} raised {type(e).__name__}: {first}; "
                         f"fix that module (run `python -c 'import {mod_name}'` to see where)") from e


def _check_value(who: str, i: int, prompt: str, response: str, value: Any, what: str = "") -> float:
    bad = None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        bad = f"returned {what}{type(value).__name__} {_short(repr(value), 60)}, expected a float"
    elif not math.isfinite(float(value)):
        bad = f"returned {what}{value}, expected a finite float"
    if bad:
        raise RewardError(f"{who} {bad} for sample {i} "
                          f"(prompt={_short(prompt)!r}, response={_short(response)!r})")
    return float(value)


def split_value(who: str, i: int, prompt: str, response: str, value: Any) -> tuple[float, dict[str, float]]:
    """(reward, extra metrics) of one returned value: a float, or a dict with a `score` and other
    numbers that become the iteration's `reward/<key>` metrics (means over the samples reporting them).
    `who` names the scorer in errors ("reward function m:f", "reward server URL")."""
    if not isinstance(value, Mapping):
        return _check_value(who, i, prompt, response, value), {}
    if "score" not in value:
        raise RewardError(f"{who} returned a dict without a 'score' key (keys: "
                          f"{sorted(map(str, value))[:8]}) for sample {i} (prompt={_short(prompt)!r})")
    extra = {str(k): _check_value(who, i, prompt, response, v, f"{k!r} = ") for k, v in value.items() if k != "score"}
    return _check_value(who, i, prompt, response, value["score"], "score "), extra


def metric_means(extras: Sequence[dict[str, float]]) -> dict[str, float]:
    """{"reward/<key>": mean over the samples that reported <key>}."""
    sums: dict[str, list[float]] = {}
    for e in extras:
        for k, v in e.items():
            sums.setdefault(k, []).append(v)
    return {f"reward/{k}": sum(v) / len(v) for k, v in sorted(sums.items())}


def _wrap_error(fn: Callable, i: int, prompt: str, response: str, exc: BaseException) -> RewardError:
    return RewardError(f"reward function {_fn_name(fn)} raised {type(exc).__name__}: {exc} on sample {i} "
                       f"(prompt={_short(prompt)!r}, response={_short(response)!r})")


def wants_sample(fn: Callable) -> bool:
    """Whether `fn` declares a `sample` parameter that can be passed by keyword."""
    try:
        param = inspect.signature(fn).parameters.get("sample")
    except (TypeError, ValueError):  # builtins and some C callables have no signature: the plain contract
        return False
    return param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)


async def _gather_async(fn, calls: list[tuple[str, str, Any, dict]]) -> list:
    async def one(i, p, r, lab, kw):
        try:
            return await fn(p, r, lab, **kw)
        except Exception as e:  # re-raised with the sample named; not swallowed
            raise _wrap_error(fn, i, p, r, e) from e
    return await asyncio.gather(*(one(i, *call) for i, call in enumerate(calls)))


def _run_coroutine(coro):
    """asyncio.run, or a worker thread's loop when called from inside a running loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _is_async(fn: Callable) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004 (an async __call__, not callability)


def compute_rewards(fn: RewardFn, prompts: Sequence[str], responses: Sequence[str],
                    labels: Sequence[Any], samples: Sequence[Sample] | None = None) -> list[float]:
    """Score each (prompt, response, label); one float per sample, in order. `samples` (one per
    response) are what a function with a `sample` parameter receives; required for such a function."""
    return score_with_metrics(fn, prompts, responses, labels, samples)[0]


def score_with_metrics(fn: RewardFn, prompts: Sequence[str], responses: Sequence[str], labels: Sequence[Any],
                       samples: Sequence[Sample] | None = None) -> tuple[list[float], dict[str, float]]:
    """`compute_rewards`, plus the means of the extra metrics of functions that return dicts."""
    if not (len(prompts) == len(responses) == len(labels)) or (samples is not None and len(samples) != len(prompts)):
        raise ValueError(f"compute_rewards: {len(prompts)} prompts, {len(responses)} responses, {len(labels)} labels"
                         f"{'' if samples is None else f', {len(samples)} samples'}; expected equal lengths")
    if wants_sample(fn) and samples is None:
        raise ValueError(f"compute_rewards: {_fn_name(fn)} takes a `sample` parameter; pass samples=")
    kws = [{"sample": s} for s in samples] if wants_sample(fn) and samples is not None else [{}] * len(prompts)
    calls = list(zip(prompts, responses, labels, kws))
    if _is_async(fn):
        values = _run_coroutine(_gather_async(fn, calls))
    else:
        values = []
        for i, (p, r, lab, kw) in enumerate(calls):
            try:
                values.append(fn(p, r, lab, **kw))
            except Exception as e:  # re-raised with the sample named; not swallowed
                raise _wrap_error(fn, i, p, r, e) from e
    who = f"reward function {_fn_name(fn)}"
    split = [split_value(who, i, p, r, v) for i, (p, r, v) in enumerate(zip(prompts, responses, values))]
    return [s for s, _ in split], metric_means([e for _, e in split])
