"""A multi-turn tool-calling rollout (a `rollout.generate_fn`): generate, call a tool, append its
output, generate again, within the request's `TurnLimits`.

A turn ends at eos (the answer: the trajectory is done), at the turn's token limit, or at a
tool-call stop token; then the tool runs on the turn's text and its output is tokenized with the
engine's own tokenizer and appended as masked tokens (loss mask 0). A tool that raises or runs past
`tool_timeout_s` ends the trajectory with `reward_info["tool_error"]` for the reward function to
score, instead of failing the run. The calculator demo (`calculator_rollout`) is one instance; a
user's tool loop can call `tool_loop` with its own `call_tool` and stop token.

A tool, sync or async, runs in a worker thread of its own (an async one on that thread's own event
loop: create its clients inside it), so one that blocks instead of awaiting stalls neither the
rollout's loop nor its deadline; an answer that comes after the deadline is never used
(reflow.rl.deadline says what becomes of the abandoned call).
"""
from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

from reflow.engines.rollout_fns import AsyncEngine, RolloutRequest, Trajectory, result_logprobs
from reflow.rl import tool_task
from reflow.rl.deadline import Call

# turn text -> text to append, or None: no call, done (sync, or async)
ToolCall = Callable[[str], Awaitable[str | None] | str | None]


class _Turns:
    """The trajectory being built: token ids, loss mask, log-probs of generated tokens, texts."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.texts: list[str] = []
        self.info: dict[str, Any] = {"turns": 0, "tool_calls": []}

    def add(self, ids: list[int], text: str, logprobs: list[float] | None) -> None:
        self.ids += ids
        self.mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += logprobs or []
        self.texts.append(text)

    def result(self, finish: str) -> Trajectory:
        return Trajectory(self.ids, self.logprobs, "".join(self.texts), self.mask, finish, self.info)


async def tool_loop(request: RolloutRequest, engine: AsyncEngine, call_tool: ToolCall, call_stop_id: int) -> Trajectory:
    """Turns of generation and tool calls; see the module docstring."""
    tok = await engine.tokenizer()
    limits, t = request.limits, _Turns()
    total = limits.max_response_tokens or 10**9
    stops = [*request.sampling_params.get("stop_token_ids", []), call_stop_id]
    for _ in range(limits.max_turns):
        budget = min(int(request.sampling_params["max_new_tokens"]), total - len(t.ids))
        if budget <= 0:
            return t.result("length")
        out = await engine.generate(request.prompt_ids + t.ids, {**request.sampling_params, "max_new_tokens": budget,
                                                                  "stop_token_ids": stops})
        ids = list(out["output_ids"])
        text = tok.decode(ids, skip_special_tokens=True)
        t.add(ids, text, result_logprobs(out))
        t.info["turns"] += 1
        if not ids or ids[-1] != call_stop_id:  # eos or the turn's limit: this turn is the answer
            t.info["answer"] = text
            return t.result(out["meta_info"]["finish_reason"]["type"])
        try:
            reply = await _call_tool(call_tool, text, limits.tool_timeout_s)
        except TimeoutError:
            t.info["tool_error"] = f"timeout after {limits.tool_timeout_s}s"
            return t.result("stop")
        except tool_task.ToolError as e:  # the policy's malformed call: scored, not a crash
            t.info["tool_error"] = str(e)
            return t.result("stop")
        if reply is None:
            t.info["answer"] = text
            return t.result("stop")
        t.info["tool_calls"].append(tool_task.last_call(text) or text)
        reply_ids = tok(reply, add_special_tokens=False)["input_ids"]
        if len(t.ids) + len(reply_ids) >= total:  # no room left for an answer: cut the reply at the budget
            t.add(reply_ids[: total - len(t.ids)], reply, None)
            return t.result("length")
        t.add(reply_ids, reply, None)
    return t.result("length")  # out of turns while still calling tools


async def _call_tool(call_tool: ToolCall, text: str, timeout_s: float) -> str | None:
    """`call_tool(text)` in a worker thread, awaited for at most `timeout_s` (TimeoutError past it)."""
    def run() -> str | None:
        try:
            reply = call_tool(text)
            return asyncio.run(_awaited(reply)) if inspect.isawaitable(reply) else reply
        except Exception:
            raise
        except BaseException as e:  # SystemExit or KeyboardInterrupt raised by a tool: its failure, not the process's end
            raise RuntimeError(f"the tool raised {type(e).__name__}: {e}") from e

    t0 = time.monotonic()
    call = Call(run, "tool call")
    try:
        reply = await asyncio.wait_for(asyncio.wrap_future(call.future), timeout_s)
    except TimeoutError:
        call.abandon()
        raise
    if time.monotonic() - t0 > timeout_s:  # came in as the deadline passed: late all the same
        raise TimeoutError
    return reply


async def _awaited(reply: Awaitable[str | None]) -> str | None:
    return await reply


async def _calculator(text: str) -> str | None:
    call = tool_task.last_call(text)
    if call is None:
        raise tool_task.ToolError(f"the turn ended at {tool_task.CALL_CLOSE!r} without a call: {text[-40:]!r}")
    return tool_task.calculator(call)


async def calculator_rollout(request: RolloutRequest, engine: AsyncEngine) -> Trajectory:
    """The tools demo's rollout: `tool_loop` with the calculator, a call closing at ")"."""
    tok = await engine.tokenizer()
    return await tool_loop(request, engine, _calculator, tok.convert_tokens_to_ids(tool_task.CALL_CLOSE))
