"""Built-in reward functions (`reward.type: builtin`, `reward.builtin`): exact match and a math-answer
verifier. Both follow the reward contract of `reflow.rl.rewards`: (prompt, response, label) -> float.

`math_answer` uses the `math-verify` package (HuggingFace's verifier: extracts the last LaTeX or
plain expression of each side and compares them symbolically with sympy); install it with
`pip install 'reflow[math]'`. Its time limits are SIGALRM-based, so they apply only on the main
thread (a Ray task's thread is); elsewhere the comparison runs without one.
"""
from __future__ import annotations

import threading
from typing import Any


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
    return math_verify


def math_answer(prompt: str, response: str, label: Any) -> float:
    """1.0 when the response's final answer equals the label mathematically (math-verify), else 0.0.
    A label without `$` is read as a bare answer (wrapped in $...$ so LaTeX like \\frac{1}{2} parses)."""
    mv = _math_verify()
    gold = _text(label)
    if "$" not in gold and "\\boxed" not in gold:
        gold = f"${gold}$"
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    parsed_gold = mv.parse(gold, parsing_timeout=limit)
    if not parsed_gold:
        raise ValueError(f"math-verify could not parse the label {str(label)[:80]!r} as an answer")
    answer = mv.parse(response, parsing_timeout=limit)
    return float(bool(answer) and mv.verify(parsed_gold, answer, timeout_seconds=limit))


BUILTINS = {"exact_match": "reflow.rl.verifiers:exact_match", "math": "reflow.rl.verifiers:math_answer"}
