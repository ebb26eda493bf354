"""The tools demo's task (`reflow demo --task tools`): multiplication with a calculator tool.

A prompt is "23*47="; the label its product. The policy may call the calculator by writing an
expression in parentheses, "(23*47)": generation stops at ")" (a stop token), the environment
appends "=1081 " (tool tokens, masked out of the loss), and the policy goes on; its last turn is
the answer, "1081" then eos. Every character is in the demo tokenizer's alphabet
(reflow.rl.demo_policy.CHARS), so the tiny character-level policy can learn the protocol from a
few traces (`trace`). The multi-turn loop itself is reflow.engines.tool_rollout.
"""
from __future__ import annotations

import random
import re
from typing import Any

CALL_OPEN, CALL_CLOSE = "(", ")"
_EXPR = re.compile(r"\d{1,6}([+\-*]\d{1,6}){0,3}")


class ToolError(ValueError):
    """The calculator could not evaluate what the policy wrote."""


def make_problems(seed: int, num_train: int, num_eval: int, digits: int = 2) -> tuple[list[dict], list[dict]]:
    """Disjoint train / held-out splits of distinct "a*b=" problems with `digits`-digit operands
    (held-out drawn first), deterministic in `seed`. Rows: {"prompt": "23*47=", "label": "1081"}."""
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    span = hi - lo + 1
    if num_train + num_eval > span * span:
        raise ValueError(f"{digits}-digit multiplication has only {span * span} distinct problems")
    codes = random.Random(seed).sample(range(span * span), num_train + num_eval)
    rows = [{"prompt": f"{lo + c // span}*{lo + c % span}=", "label": str((lo + c // span) * (lo + c % span))}
            for c in codes]
    return rows[num_eval:], rows[:num_eval]


def calculator(call: str) -> str:
    """The tool's answer to one call "(expr)" — "=<value> " — for up to four integers joined by
    + - *; anything else is a ToolError (the trajectory ends there)."""
    expr = call.strip()
    if not (expr.startswith(CALL_OPEN) and expr.endswith(CALL_CLOSE)):
        raise ToolError(f"not a call: {call[:40]!r}")
    body = expr[1:-1]
    if not _EXPR.fullmatch(body):
        raise ToolError(f"cannot evaluate {body[:40]!r}")
    return f"={_evaluate(body)} "


def _evaluate(body: str) -> int:
    """+ - * over integers with the usual precedence, without eval()."""
    total = 0
    for sign, term in re.findall(r"([+\-]?)([^+\-]+)", body):
        value = 1
        for factor in term.split("*"):
            value *= int(factor)
        total += -value if sign == "-" else value
    return total


def last_call(text: str) -> str | None:
    """The call a turn ended with ("(23*47)" in "(23*47)"), or None when the turn made none."""
    if not text.endswith(CALL_CLOSE) or CALL_OPEN not in text:
        return None
    return text[text.rindex(CALL_OPEN):]


def trace(row: dict, tool: bool = True) -> list[tuple[str, bool]]:
    """A demonstration for the warm-up: (text, written by the policy?) segments. With the calculator,
    or (tool=False) the answer written straight away, which the tiny policy cannot compute and so
    mostly gets wrong: what GRPO then teaches is to call the tool."""
    if not tool:
        return [(str(row["label"]), True)]
    a, b = row["prompt"].rstrip("=").split("*")
    call = f"({a}*{b})"
    return [(call, True), (calculator(call), False), (str(row["label"]), True)]


def reward(prompt: str, response: str, label: Any, *, sample) -> float:
    """1.0 when the final turn's answer (reward info `answer`, from the rollout) is the label and
    no tool call failed; else 0.0."""
    info = sample.reward_info
    return float(not info.get("tool_error") and str(info.get("answer", "")).strip() == str(label))
