"""Built-in reward functions (`reward.type: builtin`, `reward.builtin`): exact match and a math-answer
verifier. Both follow the reward contract of `reflow.rl.rewards`: (prompt, response, label) -> float.

`math_answer` uses the `math-verify` package (HuggingFace's verifier: extracts the last LaTeX or
plain expression of each side and compares them symbolically with sympy); install it with
`pip install 'reflow[math]'`. Its own time limits are SIGALRM-based, which works on the main thread
only, and reward functions run in a worker thread (reflow.rl.rewards); so the comparison runs in a
thread of its own instead (reflow.rl.deadline) and one that takes longer than MATH_LIMIT_S scores 0,
as math-verify's own limit would have it.
"""
from __future__ import annotations

from concurrent.futures import wait
from typing import Any

from reflow.rl.deadline import Call

MATH_LIMIT_S = 5.0  # math-verify's own default limit of one parse or comparison


def _text(label: Any) -> str:
    return str(label).strip()


def exact_match(prompt: str, response: str, label: Any) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals str(label), else 0.0."""
    return float(response.strip() == _text(label))


def _math_verify():
    try:
        import math_verify
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "reward.builtin=math needs the math-verify package: pip install 'reflow[math]' "
            "(or pip install math-verify) on every node that scores rollouts", name=e.name) from e
    for part in ("parser", "grader"):  # its warning that no time limit is set: math_answer sets one (MATH_LIMIT_S)
        if hasattr(math_verify, part):
            getattr(math_verify, part).TIMEOUT_WARNING_SHOWN = True
    return math_verify


def math_answer(prompt: str, response: str, label: Any) -> float:
    """1.0 when the response's final answer equals the label mathematically (math-verify), else 0.0.
    A label without `$` is read as a bare answer (wrapped in $...$ so LaTeX like \\frac{1}{2} parses)."""
    mv = _math_verify()
    gold = _text(label)
    if "$" not in gold and "\\boxed" not in gold:
        gold = f"${gold}$"
    parsed_gold = mv.parse(gold, parsing_timeout=None)  # a label: bounded by reward.fn_timeout_s, as the data's fault
    if not parsed_gold:
        raise ValueError(f"math-verify could not parse the label {str(label)[:80]!r} as an answer")

    def compare() -> float:
        answer = mv.parse(response, parsing_timeout=None)
        return float(bool(answer) and mv.verify(parsed_gold, answer, timeout_seconds=None))

    call = Call(compare, "math-verify")
    if not wait([call.future], MATH_LIMIT_S).done:  # sympy on a pathological answer: scored 0, as math-verify does
        call.abandon()
        return 0.0
    return call.future.result()


BUILTINS = {"exact_match": "reflow.rl.verifiers:exact_match", "math": "reflow.rl.verifiers:math_answer"}
