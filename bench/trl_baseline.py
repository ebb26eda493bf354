"""TRL's GRPOTrainer on a demo task, side by side with reflow (issue 17: same GPU, task, initial policy
and wall-clock budget, matched group size; issue 56: the long-response scratchpad task too).

    python bench/trl_baseline.py --policy .reflow/models/gpu-demo-policy --digits 3 --seconds 200 \\
        --reflow-model <reflow's final checkpoint>/model --out bench/results/trl.json
    python bench/trl_baseline.py --task scratchpad --policy .reflow/models/scratchpad-gpu-s0 \\
        --data .reflow/data/scratchpad-gpu-s0 --seconds 300 --reflow-model <checkpoint>/model

Trains the initial policy with TRL (HF `generate` rollouts, no vLLM: the GPU machine has none; GRPO with
beta=0, clip 0.2, group-normalised rewards, constant learning rate) until `--seconds` have passed, then
scores the held-out split greedily. `--task addition` (the default) is configs/gpu-demo.yaml's task: 3-digit
sums drawn by seed, 512 completions (64 prompts x 8) generated and trained on a step. `--task scratchpad` is
configs/gpu-scratchpad.yaml's (reflow.rl.scratchpad_task: long multiplication worked out step by step, up to
1000 new tokens): the train and held-out files `reflow bootstrap --task scratchpad` writes (`--data`), 512
completions (64 prompts x 8) generated at a time and two optimizer steps of 256 on them, as that config's
minibatches_per_iteration: 2, each step's rows in micro-batches of 32 (`--micro`: at most 32 x 1016 tokens a
forward, within reflow's 32768-token packing budget). `--clock training` (the default) starts
those seconds at TRL's first step; `--clock command` at this process's start, as reflow's `seconds=` counts
its whole command (imports, servers, model loading and evals included), so TRL's own start-up counts too.
The reward TRL optimises is the task's own reward function (the one the reflow config names), and
`--reflow-model` scores reflow's trained policy with the same evaluator as TRL's (addition:
rl/demo_policy.greedy_accuracy; scratchpad: rl/scratchpad_demo.accuracy), so both accuracies come from one
evaluator. Samples/s counts the completions TRL's reward function scored, over its training time;
mean_response_tokens is their mean length in tokens (eos included), from the ids TRL generated.
Ends with `trl: samples_per_s=<x> accuracy=<a> reflow_accuracy=<b> seconds=<s> steps=<n> ...
mean_response_tokens=<t>`.
TRL, datasets, dill and multiprocess are bench-only dependencies (carried to the GPU machine, not in
pyproject).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import psutil
import torch

PROCESS_START = psutil.Process().create_time()  # wall-clock seconds (epoch) at which this process started

# Per task: its reward function (the reflow config's data.reward_fn) and the defaults that match its GPU config.
# batch: completions per optimizer step; generation_batch: completions generated at a time (None: batch);
# micro: rows per forward/backward (None: batch), so batch / micro gradient-accumulation steps a step.
# addition (configs/gpu-demo.yaml: lr 3e-5, group 8, clip 0.2, beta 0; its optimizer steps are of 512): 64 x 8
# generated and trained on as one step of 512, as bench/RESULTS.md 29 ran it. scratchpad (configs/gpu-scratchpad.yaml:
# the same group, clip and beta, its lr of 3e-6; 64 prompts x 8 an iteration, 2 optimizer steps of 256 on it).
TASKS = {
    "addition": {"reward_fn": "reflow.rl.demo_task:reward", "max_new": 6, "batch": 512, "generation_batch": None,
                 "micro": None, "lr": 3e-5},
    "scratchpad": {"reward_fn": "reflow.rl.scratchpad_task:reward", "max_new": 1000, "batch": 256,
                   "generation_batch": 512, "micro": 32, "lr": 3e-6},
}


def _budget_callback(seconds: float, clock: str):
    from transformers import TrainerCallback

    class Budget(TrainerCallback):
        """Stop once `seconds` have passed since training began (`clock` training) or since this process
        started (`clock` command)."""

        def on_train_begin(self, args, state, control, **kw):
            self.began = time.time()
            self.t0 = PROCESS_START if clock == "command" else self.began

        def on_step_end(self, args, state, control, **kw):
            if time.time() - self.t0 >= seconds:
                control.should_training_stop = True

    return Budget()


def train_trl(a, train_rows: list[dict], tokenizer) -> tuple[object, dict]:
    """TRL GRPO from `a.policy` for `a.seconds`; returns (model, stats)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from reflow.rl.rewards import load_reward_fn

    task_reward = load_reward_fn(a.reward_fn)
    seen = {"samples": 0, "tokens": 0, "trace_exact": 0.0}

    def reward(prompts, completions, label, completion_ids=None, **_):
        """The task's reward per completion; a reward given as {"score": ..., <metric>: ...} (the scratchpad
        task's) gives its score, and its trace_exact metric is summed for the record."""
        seen["samples"] += len(completions)
        seen["tokens"] += sum(len(ids) for ids in completion_ids or [])
        out = []
        for p, c, y in zip(prompts, completions, label):
            r = task_reward(p, c, y)
            if isinstance(r, dict):
                seen["trace_exact"] += float(r.get("trace_exact", 0.0))
                r = r["score"]
            out.append(float(r))
        return out

    cuda = torch.cuda.is_available()
    micro = a.micro or a.batch
    generation = a.generation_batch or a.batch
    if a.batch % micro or generation % micro or generation % a.batch or generation % a.generations:
        raise SystemExit(f"trl_baseline: --batch {a.batch} and --generation-batch {generation} must be multiples of "
                         f"--micro {micro}, the generation batch a multiple of --batch and of --generations")
    # per_device_train_batch_size rows a forward; an optimizer step every `gradient_accumulation_steps` of them;
    # `generation` completions generated every `steps_per_generation` forwards (TRL: one generation batch of
    # per_device_train_batch_size x steps_per_generation). The addition defaults give TRL's defaults (1 and 1).
    cfg = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="trl-"), per_device_train_batch_size=micro,
                     gradient_accumulation_steps=a.batch // micro, steps_per_generation=generation // micro,
                     num_generations=a.generations, max_completion_length=a.max_new, learning_rate=a.lr,
                     lr_scheduler_type="constant", beta=0.0, epsilon=0.2, temperature=a.temperature, bf16=cuda,
                     use_cpu=not cuda, logging_steps=10, max_steps=a.steps or 10**6, save_strategy="no", report_to=[],
                     seed=a.seed, disable_dropout=True)
    data = Dataset.from_list([{"prompt": r["prompt"], "label": str(r["label"])} for r in train_rows])
    budget = _budget_callback(a.seconds, a.clock)
    trainer = GRPOTrainer(model=a.policy, reward_funcs=reward, args=cfg, train_dataset=data,
                          processing_class=tokenizer, callbacks=[budget])
    trainer.train()
    seconds = time.time() - budget.began
    n = max(seen["samples"], 1)
    stats = {"trl_samples": seen["samples"], "trl_seconds": seconds, "trl_steps": trainer.state.global_step,
             "trl_samples_per_s": seen["samples"] / seconds, "mean_response_tokens": seen["tokens"] / n,
             "trl_startup_s": budget.began - PROCESS_START, "trl_command_s": time.time() - PROCESS_START}
    if a.task == "scratchpad":
        stats["trl_trace_exact"] = seen["trace_exact"] / n
    return trainer.model, stats


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def problems(a) -> tuple[list[dict], list[dict], object]:
    """(train rows, held-out rows, accuracy(model, tokenizer, rows)): the one evaluator both policies get."""
    if a.task == "scratchpad":
        from reflow.rl.scratchpad_demo import accuracy

        folder = Path(a.data)
        train, held = (_rows(folder / f"{name}.jsonl") for name in ("train", "heldout"))
        return train, held[: a.num_eval] if a.num_eval else held, accuracy
    from reflow.rl.demo_policy import greedy_accuracy
    from reflow.rl.demo_task import make_problems

    train, held = make_problems(a.seed, a.num_train, a.num_eval or 500, a.digits)
    return train, held, lambda model, tokenizer, rows: greedy_accuracy(model, tokenizer, rows, a.max_new)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=tuple(TASKS), default="addition",
                   help="addition: configs/gpu-demo.yaml's sums; scratchpad: configs/gpu-scratchpad.yaml's long "
                        "multiplication (the files in --data)")
    p.add_argument("--policy", required=True, help="initial policy (HF folder), the one reflow started from")
    p.add_argument("--reflow-model", default=None, help="reflow's trained policy (HF folder), scored alike")
    p.add_argument("--data", default=".reflow/data/scratchpad-gpu-s0",
                   help="scratchpad: the folder with train.jsonl and heldout.jsonl (`reflow bootstrap --task "
                        "scratchpad` writes them; the default is --size gpu's)")
    p.add_argument("--digits", type=int, default=3, help="addition: digits per operand")
    p.add_argument("--num-train", type=int, default=50000, help="addition: train problems drawn")
    p.add_argument("--num-eval", type=int, default=None,
                   help="held-out problems scored (addition: drawn, default 500; scratchpad: the file's first N, "
                        "default all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seconds", type=float, default=200.0, help="wall-clock budget (see --clock)")
    p.add_argument("--clock", choices=("training", "command"), default="training",
                   help="training: the seconds start at TRL's first step; command: at this process's start, "
                        "as reflow's seconds= (its whole command) does")
    p.add_argument("--steps", type=int, default=None, help="stop after this many optimizer steps (or at the "
                   "--seconds budget, whichever comes first): learning per step against reflow's")
    p.add_argument("--batch", type=int, default=None,
                   help="completions per optimizer step (addition: 512; scratchpad: 256, two steps a generation)")
    p.add_argument("--generation-batch", type=int, default=None,
                   help="completions generated at a time, prompts x generations (addition: --batch; scratchpad: 512)")
    p.add_argument("--micro", type=int, default=None,
                   help="rows per forward/backward, --batch / --micro accumulated a step (addition: --batch; "
                        "scratchpad: 32)")
    p.add_argument("--generations", type=int, default=8, help="group size (reflow's n_samples_per_prompt)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the task's config's: addition 3e-5, "
                   "scratchpad 3e-6)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature of the completions TRL trains on (reflow's rollout.temperature)")
    p.add_argument("--max-new", type=int, default=None,
                   help="completion token limit, reflow's max_new_tokens (addition: 6; scratchpad: 1000)")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    a = p.parse_args()
    for key, value in TASKS[a.task].items():  # the task's defaults where not given
        if getattr(a, key, None) is None:
            setattr(a, key, value)

    from reflow.engines.hf_io import load_causal_lm, load_tokenizer

    train_rows, held_out, accuracy = problems(a)
    tokenizer = load_tokenizer(a.policy)
    model, stats = train_trl(a, train_rows, tokenizer)
    stats["trl_accuracy"] = accuracy(model.float().eval(), tokenizer, held_out)
    stats["num_eval"] = len(held_out)
    if a.reflow_model:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        stats["reflow_accuracy"] = accuracy(load_causal_lm(a.reflow_model).to(device).eval(), tokenizer, held_out)
    if a.out:
        Path(a.out).write_text(json.dumps({**vars(a), **stats}, indent=2))
    print(f"trl: samples_per_s={stats['trl_samples_per_s']:.1f} accuracy={stats['trl_accuracy']:.3f} "
          f"reflow_accuracy={stats.get('reflow_accuracy', float('nan')):.3f} seconds={stats['trl_seconds']:.0f} "
          f"steps={stats['trl_steps']} clock={a.clock} startup_s={stats['trl_startup_s']:.1f} task={a.task} "
          f"mean_response_tokens={stats['mean_response_tokens']:.1f}")


if __name__ == "__main__":
    main()
