"""The demo's verifiable task: integer addition, "12+34=" -> "46" then eos.

Reward contract (every reward function, built-in or user-supplied via `data.reward_fn`):

    fn(prompt: str, response: str, label) -> float                 # or `async def`
    fn(prompt: str, response: str, label, *, sample) -> float      # also gets a reflow.rl.types.Sample

`prompt` is the prompt text, `response` the generated text after the prompt (by default with special
tokens dropped and the stop token trimmed: rollout.skip_special_tokens, rollout.no_stop_trim), `label`
the row's ground truth as loaded. A function with a `sample` parameter also gets the finish reason
("stop": it ended with eos; "length": it hit rollout.max_new_tokens) and the token counts. Return a
finite float; raising or returning a non-number is an error that stops the run (see
`reflow.rl.rewards.compute_rewards`).
"""
from __future__ import annotations

import json
import random
from pathlib import Path


def _operand_range(digits: int) -> tuple[int, int]:
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    return (10 ** (digits - 1) if digits > 1 else 0), 10**digits - 1


def format_prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def make_problems(seed: int, num_train: int, num_eval: int, digits: int = 2) -> tuple[list[dict], list[dict]]:
    """Disjoint train / held-out splits of distinct "a+b=" problems, deterministic in `seed`.

    Operands have exactly `digits` digits (10..99 for 2). Distinct ordered pairs are drawn without
    replacement, so no (a, b) appears twice; the held-out split is drawn first so that it does not
    change when `num_train` does. Rows are `{"prompt": "12+34=", "label": "46"}`.
    """
    lo, hi = _operand_range(digits)
    span = hi - lo + 1
    total = num_train + num_eval
    if total > span * span:
        raise ValueError(f"{digits}-digit addition has only {span * span} distinct problems; "
                         f"asked for num_train + num_eval = {total}")
    rng = random.Random(seed)
    codes = rng.sample(range(span * span), total)  # distinct pair codes a_idx * span + b_idx
    rows = []
    for code in codes:
        a, b = lo + code // span, lo + code % span
        rows.append({"prompt": format_prompt(a, b), "label": str(a + b)})
    return rows[num_eval:], rows[:num_eval]


def reward(prompt: str, response: str, label) -> float:
    """1.0 when the response is exactly the label (no spaces, nothing after), else 0.0.

    Whether the model also emitted eos is the engine's `finish_reason`; a response cut at the
    length limit can only be correct if it equals the label exactly.
    """
    return 1.0 if response == str(label) else 0.0


def write_demo_data(folder: str | Path, seed: int = 0, num_train: int = 5000, num_eval: int = 200, digits: int = 2,
                    new_rows: int = 256) -> dict[str, str]:
    """The files the README's `retrain` walkthrough uses (configs/demo-retrain.yaml names them):
    `heldout.jsonl`, the task's held-out split as a fixed eval file (the same problems as the `heldout`
    set of configs/demo.yaml), and `incoming/batch-000.jsonl`, `new_rows` problems that are in neither
    split (make_problems draws its held-out split first and its pairs in a fixed order, so the rows
    after the first `num_train` of a longer draw are new). Returns {"heldout": file, "incoming": folder}."""

    out = Path(folder)
    train, heldout = make_problems(seed, num_train + new_rows, num_eval, digits)
    write_jsonl(out / "incoming" / "batch-000.jsonl", train[num_train:])
    return {"heldout": str(write_jsonl(out / "heldout.jsonl", heldout)), "incoming": str(out / "incoming")}


def write_jsonl(path: str | Path, rows: list[dict]) -> Path:
    """`rows` as a jsonl file (one object a line; its folder is made)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def write_splits(folder: str | Path, **splits: list[dict]) -> dict[str, str]:
    """Each split as `<folder>/<name>.jsonl` (a task's data.path and data.eval_path); {name: file}."""
    return {name: str(write_jsonl(Path(folder, f"{name}.jsonl"), rows)) for name, rows in splits.items()}
