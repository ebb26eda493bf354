"""A task with long, checkable responses (issue 56): long multiplication written out on a scratchpad.

A prompt is "47*36="; the response works it out digit by digit and ends with the product:

    (7*6+0=42 4*6+4=28 =282)(7*3+0=21 4*3+2=14 =141)(2+0+0=02 8+1+0=09 2+4+0=06 0+1+0=01 =1692)=1692

One block per digit of the second operand (least significant first): each step multiplies one digit of
the first operand (least significant first) by it and adds the carry, written as two digits (tens =
the next carry, units = the digit of the partial product), and the block ends with the partial product.
Then one block per partial product after the first adds it, shifted, to the running total column by
column the same way. The last characters, ")=<product>", are the answer. Every character is in the demo
tokenizer's alphabet (reflow.rl.demo_policy.CHARS), one token each.

Lengths: an n-digit by m-digit problem takes ~10nm + 10(m-1)(n + m/2 + 1) characters, so drawing n and m
independently gives lengths that vary with the problem and a tail of long ones (`length_stats`).

Reward: 1.0 when the response ends with ")=<label>", else 0.0: the answer only, however the scratchpad
was written. Whether the scratchpad is the exact one above is reported beside it as the metric
`reward/trace_exact` (it is not part of the reward).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reflow.rl.demo_task import write_splits

_ANSWER = re.compile(r"\)=(\d+)")  # the response's tail, matched with fullmatch on its last characters
_PROMPT = re.compile(r"(\d+)\*(\d+)=")


@dataclass(frozen=True)
class Shape:
    """Digits per operand, each drawn uniformly and independently from [min_digits, max_digits]."""
    min_digits: int
    max_digits: int

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"scratchpad shape needs 1 <= min_digits <= max_digits, got {self}")


# `reflow demo --task scratchpad` (tiny, CPU: 1-2 digits, responses of 16-97 tokens) and `--gpu` (2-6 digits:
# responses of 83-913 tokens; seed 0's held-out split: mean 379, median 334, p90 677, p99 902).
SHAPES = {"tiny": Shape(1, 2), "gpu": Shape(2, 6)}


def _digits(x: int) -> list[int]:
    """Decimal digits, least significant first."""
    return [int(c) for c in reversed(str(x))]


def _steps(terms: list[list[int]], mul: bool) -> tuple[str, int]:
    """Column steps "x*y+c=vv" (mul) or "x+y+c=vv" over `terms` (one [x, y] per column, least
    significant first), joined by spaces; and the number they spell (the last carry, then the units)."""
    out, units, carry = [], [], 0
    for x, y in terms:
        v = x * y + carry if mul else x + y + carry
        out.append(f"{x}{'*' if mul else '+'}{y}+{carry}={v:02d}")
        units.append(v % 10)
        carry = v // 10
    value = int(str(carry) + "".join(str(u) for u in reversed(units)))
    return " ".join(out), value


def trace(a: int, b: int) -> str:
    """The worked response to "a*b=" (module docstring), ending with ")=<a*b>"."""
    if a < 0 or b < 0:
        raise ValueError(f"scratchpad multiplication takes non-negative operands, got {a}*{b}")
    da, blocks, partials = _digits(a), [], []
    for d in _digits(b):
        steps, p = _steps([[x, d] for x in da], mul=True)
        blocks.append(f"({steps} ={p})")
        partials.append(p)
    total = partials[0]
    for j, p in enumerate(partials[1:], start=1):
        dt, dp = _digits(total), [0] * j + _digits(p)
        width = max(len(dt), len(dp))
        steps, total = _steps([[(dt + [0] * width)[k], (dp + [0] * width)[k]] for k in range(width)], mul=False)
        blocks.append(f"({steps} ={total})")
    assert total == a * b, (a, b, total)  # the scratchpad's arithmetic is the product's
    return "".join(blocks) + f"={total}"


def operands(prompt: str) -> tuple[int, int]:
    """(a, b) of a prompt "a*b="; a ValueError naming the prompt otherwise."""
    m = _PROMPT.fullmatch(prompt)
    if m is None:
        raise ValueError(f"not a scratchpad prompt (want 'a*b='): {prompt[:40]!r}")
    return int(m.group(1)), int(m.group(2))


def row_trace(row: dict) -> str:
    """The worked response of a data row {"prompt": "a*b=", ...} (the bootstrap's target)."""
    return trace(*operands(row["prompt"]))


def answer(response: str) -> str | None:
    """The final answer: the digits after the response's last ")=", when the response ends there; else None."""
    cut = response.rfind(")=")
    if cut < 0 or not _ANSWER.fullmatch(response[cut:]):
        return None
    return response[cut + 2:]


def reward(prompt: str, response: str, label: Any) -> dict[str, float]:
    """score 1.0 when the final answer (`answer`) is the label, else 0.0; `trace_exact` (a metric, not
    rewarded): 1.0 when the whole response is the worked trace of the prompt."""
    exact = float(_PROMPT.fullmatch(prompt) is not None and response == trace(*operands(prompt)))
    return {"score": float(answer(response) == str(label)), "trace_exact": exact}


def make_problems(seed: int, num_train: int, num_eval: int, shape: Shape) -> tuple[list[dict], list[dict]]:
    """Disjoint train / held-out splits of distinct "a*b=" problems, deterministic in `seed`; the
    held-out split is drawn first, so it does not change with `num_train`. Rows: {"prompt", "label"}. A pair
    drawn again is drawn anew, so where a digit class has few pairs (1 x 1 digits: 100) the train split holds
    fewer of it than the held-out split."""
    span = sum(9 * 10 ** (d - 1) + (d == 1) for d in range(shape.min_digits, shape.max_digits + 1))  # operands
    if num_train + num_eval > span * span // 2:  # leave room, or drawing distinct pairs crawls
        raise ValueError(f"scratchpad {shape}: {num_train} + {num_eval} problems asked, but it has only "
                         f"~{span * span} distinct ones: widen the shape or ask for fewer")
    rng, seen, rows = random.Random(seed), set[tuple[int, int]](), list[dict]()
    while len(rows) < num_train + num_eval:
        a, b = (_operand(rng, rng.randint(shape.min_digits, shape.max_digits)) for _ in range(2))
        if (a, b) not in seen:
            seen.add((a, b))
            rows.append({"prompt": f"{a}*{b}=", "label": str(a * b)})
    return rows[num_eval:], rows[:num_eval]


def _operand(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)


def length_stats(rows: list[dict]) -> dict[str, float]:
    """Response lengths in tokens of the demo's character tokenizer (one per character, plus eos) of the
    rows' worked traces: mean, median, p90, p99, max (nearest-rank percentiles)."""
    if not rows:
        raise ValueError("length_stats needs at least one row")
    n = sorted(len(row_trace(r)) + 1 for r in rows)

    def pct(q: int) -> int:
        return n[min(len(n) - 1, max(0, -(-len(n) * q // 100) - 1))]

    return {"mean": sum(n) / len(n), "median": pct(50), "p90": pct(90), "p99": pct(99), "max": n[-1]}


def write_data(folder: str | Path, seed: int, shape: Shape, num_train: int, num_eval: int = 200) -> dict[str, str]:
    """The task's train and held-out files, {"train": file, "heldout": file} (jsonl: data.path and
    data.eval_path of the scratchpad configs)."""
    train, held = make_problems(seed, num_train, num_eval, shape)
    return write_splits(folder, train=train, heldout=held)
