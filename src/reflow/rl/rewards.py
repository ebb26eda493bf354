"""Loading and calling reward functions (the `data.reward_fn` extension point).

Contract (see `reflow.rl.demo_task`): `fn(prompt: str, response: str, label) -> float`, sync or
`async def`; or a dict with a `score` (the reward) and other numbers, reported as the iteration's
`reward/<key>` metrics. A function that also declares a parameter named `sample` (keyword-only, or with a
default) is called with `sample=` a `reflow.rl.types.Sample`: the same three plus the finish reason
("stop" or "length": did the response end with eos or hit rollout.max_new_tokens?), the prompt and
response token counts and the response's token ids. Plain three-argument functions keep working.
Async functions of one batch run concurrently (asyncio.gather), so a verifier that
calls out to a sandbox or a judge does not serialise the batch. Any failure — the function
raising (SystemExit and KeyboardInterrupt too), returning a non-number, a bool, NaN, inf or an int
too large for a float, or not returning within `timeout_s` (reward.fn_timeout_s) — raises
`RewardError` naming the function, the sample index and the (truncated) prompt and response; the
original exception is chained.

Deadlines: the calls run in a worker thread (reflow.rl.deadline), sync ones one after another with
`timeout_s` each, async ones on that thread's event loop, all started together, so the batch gets
`timeout_s` in all. A call past it is abandoned, and its answer is never used.
"""
from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from reflow.rl.deadline import Call, Terminated

if TYPE_CHECKING:  # annotations only: loading a reward function imports no torch
    from reflow.rl.types import Sample

RewardFn = Callable[..., Any]  # (prompt, response, label[, *, sample]) -> float, or a coroutine of one
DEFAULT_FN_TIMEOUT_S = 60.0  # reward.fn_timeout_s's default


class RewardError(RuntimeError):
    """A reward function failed or returned something that is not a finite number."""


def _short(text: str, limit: int = 120) -> str:
    text = str(text)
    return text if len(text) <= limit else text[:limit] + f"...(+{len(text) - limit} chars)"


def _repr(value: Any, limit: int = 60) -> str:
    try:
        return _short(repr(value), limit)
    except Exception:  # deliberate: a repr that fails (an int past str()'s digit limit, a user's __repr__) names the type
        return f"<{type(value).__name__}>"


def _fn_name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def load_reward_fn(spec: str, field: str = "data.reward_fn") -> RewardFn:
    """Import `module:function` (e.g. "reflow.rl.demo_task:reward"); errors name `field` (the config
    field that named it) and say what to do."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"{field} must look like 'package.module:function', got {spec!r}")
    return load_callable(spec, field, "a function")


def load_callable(spec: str, field: str, kind: str) -> Any:
    """The callable `module:attr[.attr...]` names (imported); errors name `field` and say it is not `kind`."""
    mod_name, attr = spec.split(":")
    obj: object = _import(spec, mod_name, field)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{field}={spec!r}: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{field}={spec!r}: {attr!r} is a {type(obj).__name__}, not {kind}")
    return obj


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
    except Terminated:  # SIGTERM arrived while the module imported: the command stops, the module did not fail
        raise
    except (Exception, SystemExit) as e:  # deliberate: any failure inside the user's module becomes one message
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise ValueError(f"{field}={spec!r}: importing module {mod_name!r} raised {type(e).__name__}: {first}; "
                         f"fix that module (run `python -c 'import {mod_name}'` to see where)") from e


def reward_failure(error: BaseException | None) -> RewardError | None:
    """The RewardError behind `error`, however it came: raised, chained, or as Ray hands over a task's
    error (RayTaskError(RewardError), whose text holds the remote traceback and whose `cause` is the
    error itself); None when there is none."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        cause = getattr(error, "cause", None)
        if isinstance(error, RewardError) and not isinstance(cause, BaseException):
            return error
        error = cause if isinstance(cause, BaseException) else error.__cause__
    return None


def _check_value(who: str, i: int, prompt: str, response: str, value: Any, what: str = "") -> float:
    bad = None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        bad = f"returned {what}{type(value).__name__} {_repr(value)}, expected a float"
    else:
        try:
            number = float(value)
        except OverflowError:
            bad = f"returned {what}{type(value).__name__} {_repr(value)}, too large for a float"
        else:
            if not math.isfinite(number):
                bad = f"returned {what}{number}, expected a finite float"
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


def _late(fn: Callable, i: int, prompt: str, response: str, timeout_s: float) -> RewardError:
    return RewardError(f"reward function {_fn_name(fn)} did not return within {timeout_s:g} s on sample {i} "
                       f"(prompt={_short(prompt)!r}, response={_short(response)!r}); reward.fn_timeout_s bounds each "
                       f"call (this one was abandoned): raise it if the function needs longer")


Calls = list[tuple[str, str, Any, dict]]  # (prompt, response, label, keyword arguments) of each call


def _call_each(fn: Callable, calls: Calls, timeout_s: float) -> list:
    """A sync function's calls, one after another in one worker thread; each gets `timeout_s` from when the
    previous one returned (the caller waits for their futures in order)."""
    futures: list[Future] = [Future() for _ in calls]

    def each() -> None:
        for fut, (p, r, lab, kw) in zip(futures, calls):
            if not fut.set_running_or_notify_cancel():  # the caller gave up on the batch
                return
            try:
                fut.set_result(fn(p, r, lab, **kw))
            except BaseException as e:  # deliberate: SystemExit too; the caller raises it, naming the sample
                fut.set_exception(e)
                return

    worker = Call(each, f"reward {_fn_name(fn)}")
    values = []
    for i, (fut, (p, r, _, _)) in enumerate(zip(futures, calls)):
        if not wait([fut], timeout_s).done:
            for later in futures:
                later.cancel()
            worker.abandon()
            raise _late(fn, i, p, r, timeout_s)
        if (e := fut.exception()) is not None:
            raise _wrap_error(fn, i, p, r, e) from e
        values.append(fut.result())
    return values


def _call_concurrently(fn: Callable, calls: Calls, timeout_s: float) -> list:
    """An async function's calls, gathered on a worker thread's own event loop (so one that blocks instead of
    awaiting stalls no loop of the caller's); all start together, so the batch gets `timeout_s` in all."""
    finished: set[int] = set()
    running: dict[str, Any] = {}  # the loop and the gathering task, for a cancel from this thread

    async def one(i: int, p: str, r: str, lab: Any, kw: dict) -> Any:
        try:
            value = await fn(p, r, lab, **kw)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # deliberate: SystemExit too; re-raised naming the sample
            raise _wrap_error(fn, i, p, r, e) from e
        finished.add(i)
        return value

    async def gather() -> list:
        running.update(loop=asyncio.get_running_loop(), task=asyncio.current_task())
        return await asyncio.gather(*(one(i, *call) for i, call in enumerate(calls)))

    worker = Call(lambda: asyncio.run(gather()), f"reward {_fn_name(fn)}")
    if not wait([worker.future], timeout_s).done:
        i = min(set(range(len(calls))) - finished, default=0)
        if running:
            try:
                running["loop"].call_soon_threadsafe(running["task"].cancel)
            except RuntimeError:  # deliberate: the loop closed meanwhile (the batch just finished, too late)
                pass
        worker.abandon(grace_s=0.1)  # awaiting calls end by the cancel; one blocking the loop is stopped
        raise _late(fn, i, calls[i][0], calls[i][1], timeout_s)
    return worker.future.result()  # a failed call's RewardError, named in `one`


def _run_coroutine(coro):
    """asyncio.run, or a worker thread's loop when called from inside a running loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _is_async(fn: Callable) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004 (an async __call__, not callability)


def compute_rewards(fn: RewardFn, prompts: Sequence[str], responses: Sequence[str],
                    labels: Sequence[Any], samples: Sequence[Sample] | None = None,
                    timeout_s: float = DEFAULT_FN_TIMEOUT_S) -> list[float]:
    """Score each (prompt, response, label); one float per sample, in order. `samples` (one per
    response) are what a function with a `sample` parameter receives; required for such a function.
    `timeout_s`: each call's deadline (the module docstring says how async batches count it)."""
    return score_with_metrics(fn, prompts, responses, labels, samples, timeout_s)[0]


def score_with_metrics(fn: RewardFn, prompts: Sequence[str], responses: Sequence[str], labels: Sequence[Any],
                       samples: Sequence[Sample] | None = None,
                       timeout_s: float = DEFAULT_FN_TIMEOUT_S) -> tuple[list[float], dict[str, float]]:
    """`compute_rewards`, plus the means of the extra metrics of functions that return dicts."""
    if not (len(prompts) == len(responses) == len(labels)) or (samples is not None and len(samples) != len(prompts)):
        raise ValueError(f"compute_rewards: {len(prompts)} prompts, {len(responses)} responses, {len(labels)} labels"
                         f"{'' if samples is None else f', {len(samples)} samples'}; expected equal lengths")
    if wants_sample(fn) and samples is None:
        raise ValueError(f"compute_rewards: {_fn_name(fn)} takes a `sample` parameter; pass samples=")
    kws = [{"sample": s} for s in samples] if wants_sample(fn) and samples is not None else [{}] * len(prompts)
    calls = list(zip(prompts, responses, labels, kws))
    values = (_call_concurrently if _is_async(fn) else _call_each)(fn, calls, timeout_s) if calls else []
    who = f"reward function {_fn_name(fn)}"
    split = [split_value(who, i, p, r, v) for i, (p, r, v) in enumerate(zip(prompts, responses, values))]
    return [s for s, _ in split], metric_means([e for _, e in split])
