"""Bootstrap of the scratchpad task (`reflow bootstrap --task scratchpad`, `reflow demo --task scratchpad`): the
demo's character-level policy warmed up on worked traces (reflow.rl.scratchpad_task.trace) of the train
file, with the loss on the whole response (scratchpad, answer, eos), and the task's data files.

Two settings, as the addition demo's sizes: `tiny` (CPU: the ~1M-parameter model, 1-2 digit operands,
responses of 16-97 tokens) and `gpu` (the ~113M GPU demo shape, 2-6 digit operands, responses of
83-913 tokens). Accuracy (the warm-up's target check and bootstrap.json) is greedy with the task's
reward: the response ends with ")=<product>" then eos, whatever its scratchpad says.
"""
from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path
from typing import Any

from reflow.rl import scratchpad_task
from reflow.rl.demo_policy import SIZES, answer_batch, greedy_accuracy, one_thread, train_policy

# Per size: the problems (shape, train rows), the model's context, and the warm-up (bootstrap's defaults).
# tiny, measured (seed 0, 2 shared cores): the target reached at the check of step 225, 151 s, held-out 0.415.
# gpu, measured once (seed 0, an H100, TF32 products; bench/RESULTS.md 41): 1.6 steps a second (64 rows padded to up
# to ~900 tokens), loss 3.24 -> 0.011, check accuracy 0 at step 250 and 0.515 at 500 (the stop), held-out 0.45;
# 534 s in all, ~220 s of it in greedy checks grouped by prompt length. The checks now decode in one left-padded
# batch (accuracy below), so they are checked every 100 steps: the stop lands nearer the target band (0.2-0.4).
# Session 41 (an H100, bench/gpu_bootstrap.py, RESULTS 44): under bf16 autocast 0.41 s a step against 0.61 (fp32 + TF32),
# peak 41.6 GiB against 58.4; the whole bootstrap at ~3.1 steps a second with a ~16 s check every 100: step 383 (loss
# 0.16) in 2 m 51 s, where fp32 + TF32 had reached step 300 (loss 0.24) in 3 m 33 s. So the warm-up runs under autocast.
# Session 42's bootstrap (RESULTS 45): checks at 100-500 scored 0 (0.06 at 400-500; loss ~1 at step 455, 0.18 at 500),
# 0.34 at 600 with the loss at 0.015: a check waits until the last 10 steps' mean loss is at most 0.2 (check_below_loss).
# Session 45: each step's 64 rows in 4 forwards cut by length (micro_batches; the same step to float rounding): 32.7k
# padded tokens a step on average instead of 57.9k. Timed in session 46 (an H100, bench/gpu_bootstrap.py, each in its
# own process): 0.449 s a step against 0.380 in one forward (0.85x; peak 12.0 GiB against 41.2), so one forward stays.
# Session 46's bootstrap (checks every 100 steps behind the loss gate) stopped at step 600 with held-out 0.705, far
# above the band: the check before it was under 0.3, so accuracy crossed most of the band in 100 steps. Behind the
# gate (no check runs while the loss is above 0.2) checks now come every 25 steps, as the tiny size's do.
# Session 47's (an H100, RESULTS 49): checks at (step, accuracy on the check rows, loss) 425: 0.03, 0.082; 450: 0.165,
# 0.045; 475: 0.0, 0.11 (a loss spike); 500: 0.275, 0.033; 525: 0.215, 0.021; 550: 0.49, 0.014 -> held-out 0.44, just
# above the band, and ten checks (~17 s each) were ~170 s of its 366 warm-up seconds, all at losses above 0.08 scoring
# ~0. So the gate is 0.05 (it would have checked at 450, 500, 525 and 550) and the target 0.25 (it would have stopped
# at step 500, with 0.275 on the check rows).
SETTINGS: dict[str, dict[str, Any]] = {
    "tiny": {"num_train": 4000, "max_positions": 256,
             "warmup": {"steps": 600, "batch": 32, "lr": 1e-3, "target_accuracy": 0.3, "check_every": 25}},
    "gpu": {"num_train": 50000, "max_positions": 1024,
            "warmup": {"steps": 4000, "batch": 64, "lr": 3e-4, "target_accuracy": 0.25, "check_every": 25,
                       "tf32": True, "autocast": True, "check_below_loss": 0.05, "micro_batches": 1}},
}


def _solved(row: dict, text: str) -> bool:
    return scratchpad_task.reward(row["prompt"], text, row["label"])["score"] == 1.0


def accuracy(model, tokenizer, rows: list[dict]) -> float:
    """Greedy share of `rows` answered right (scratchpad_task.reward), with room for the longest worked trace. On a
    GPU in one left-padded batch (responses of up to ~900 tokens: grouped by prompt length, the GPU setting's
    check decoded ~900 steps for each of its 9 prompt lengths, 73 s of a 534 s bootstrap on an H100)."""
    longest = max((len(scratchpad_task.row_trace(r)) for r in rows), default=0)
    return greedy_accuracy(model, tokenizer, rows, max_new_tokens=longest + 1, correct=_solved,
                           left_pad=model.device.type == "cuda")


def write_scratchpad_data(folder: str | Path, seed: int = 0, size: str = "tiny", num_eval: int = 200) -> dict[str, str]:
    """The `size`'s train and held-out files (scratchpad_task.write_data with its shape and train rows)."""
    return scratchpad_task.write_data(folder, seed, scratchpad_task.SHAPES[size], SETTINGS[size]["num_train"],
                                      num_eval)


def bootstrap_scratchpad(out_dir: str | Path, data: dict[str, str], seed: int = 0, size: str = "tiny",
                         device: str = "cpu", progress: bool = True, **overrides: Any) -> dict:
    """Build the `size`'s policy, warm it up on worked traces of data["train"] until greedy accuracy on the
    first train rows reaches the target (at most `steps`), save it + bootstrap.json with its held-out
    (data["heldout"]) accuracy and the traces' length statistics. `overrides`: any model or warm-up
    argument of demo_policy.train_policy (hidden, layers, steps, lr, batch, target_accuracy, ...)."""
    rows, held = (_read(data[k]) for k in ("train", "heldout"))
    setting = SETTINGS[size]
    kw = {**SIZES[size], "max_positions": setting["max_positions"], **setting["warmup"], **overrides}
    report = {"task": "scratchpad", "size": size, "seed": seed, "shape": vars(scratchpad_task.SHAPES[size]),
              "data": data, "heldout_response_tokens": scratchpad_task.length_stats(held)}
    with one_thread() if device == "cpu" else contextlib.nullcontext():
        return train_policy(out_dir, rows, held, accuracy, report, seed=seed, progress=progress, device=device,
                            batch_fn=functools.partial(answer_batch, target=scratchpad_task.row_trace), **kw)


def _read(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]
