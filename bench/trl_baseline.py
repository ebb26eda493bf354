"""TRL's GRPOTrainer on the demo task, side by side with reflow (issue 17: same GPU, task, initial policy
and wall-clock budget, matched group size).

    python bench/trl_baseline.py --policy .reflow/models/gpu-demo-policy --digits 3 --seconds 200 \\
        --reflow-model <reflow's final checkpoint>/model --out bench/results/trl.json

Trains the initial policy with TRL (HF `generate` rollouts, no vLLM: the GPU machine has none; GRPO with
beta=0, clip 0.2, group-normalised rewards, constant learning rate, as configs/gpu-demo.yaml) until
`--seconds` have passed, then scores the held-out split greedily. `--clock training` (the default) starts
those seconds at TRL's first step; `--clock command` at this process's start, as reflow's `seconds=` counts
its whole command (imports, servers, model loading and evals included), so TRL's own start-up counts too.
`--reflow-model` scores reflow's trained policy with the same function (rl/demo_policy.greedy_accuracy), so both accuracies come
from one evaluator. Samples/s counts the completions TRL's reward function scored, over its training time.
Ends with `trl: samples_per_s=<x> accuracy=<a> reflow_accuracy=<b> seconds=<s> steps=<n>`.
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

    from reflow.rl.demo_task import reward as demo_reward

    scored = [0]

    def reward(prompts, completions, label, **_):
        scored[0] += len(completions)
        return [demo_reward(p, c, y) for p, c, y in zip(prompts, completions, label)]

    cuda = torch.cuda.is_available()
    cfg = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="trl-"), per_device_train_batch_size=a.batch,
                     num_generations=a.generations, max_completion_length=a.max_new, learning_rate=a.lr,
                     lr_scheduler_type="constant", beta=0.0, epsilon=0.2, temperature=1.0, bf16=cuda,
                     use_cpu=not cuda, logging_steps=10, max_steps=a.steps or 10**6, save_strategy="no", report_to=[],
                     seed=a.seed, disable_dropout=True)
    data = Dataset.from_list([{"prompt": r["prompt"], "label": str(r["label"])} for r in train_rows])
    budget = _budget_callback(a.seconds, a.clock)
    trainer = GRPOTrainer(model=a.policy, reward_funcs=reward, args=cfg, train_dataset=data,
                          processing_class=tokenizer, callbacks=[budget])
    trainer.train()
    seconds = time.time() - budget.began
    return trainer.model, {"trl_samples": scored[0], "trl_seconds": seconds, "trl_steps": trainer.state.global_step,
                           "trl_samples_per_s": scored[0] / seconds,
                           "trl_startup_s": budget.began - PROCESS_START, "trl_command_s": time.time() - PROCESS_START}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", required=True, help="initial policy (HF folder), the one reflow started from")
    p.add_argument("--reflow-model", default=None, help="reflow's trained policy (HF folder), scored alike")
    p.add_argument("--digits", type=int, default=3)
    p.add_argument("--num-train", type=int, default=50000)
    p.add_argument("--num-eval", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seconds", type=float, default=200.0, help="wall-clock budget (see --clock)")
    p.add_argument("--clock", choices=("training", "command"), default="training",
                   help="training: the seconds start at TRL's first step; command: at this process's start, "
                        "as reflow's seconds= (its whole command) does")
    p.add_argument("--steps", type=int, default=None, help="stop after this many optimizer steps (or at the "
                   "--seconds budget, whichever comes first): learning per step against reflow's")
    p.add_argument("--batch", type=int, default=512, help="completions per optimizer step (prompts x generations)")
    p.add_argument("--generations", type=int, default=8, help="group size (reflow's n_samples_per_prompt)")
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--max-new", type=int, default=6, help="completion token limit (reflow's max_new_tokens)")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    a = p.parse_args()

    from reflow.engines.hf_io import load_causal_lm, load_tokenizer
    from reflow.rl.demo_policy import greedy_accuracy
    from reflow.rl.demo_task import make_problems

    train_rows, held_out = make_problems(a.seed, a.num_train, a.num_eval, a.digits)
    tokenizer = load_tokenizer(a.policy)
    model, stats = train_trl(a, train_rows, tokenizer)
    stats["trl_accuracy"] = greedy_accuracy(model.float().eval(), tokenizer, held_out, a.max_new)
    if a.reflow_model:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        stats["reflow_accuracy"] = greedy_accuracy(load_causal_lm(a.reflow_model).to(device).eval(), tokenizer,
                                                   held_out, a.max_new)
    if a.out:
        Path(a.out).write_text(json.dumps({**vars(a), **stats}, indent=2))
    print(f"trl: samples_per_s={stats['trl_samples_per_s']:.1f} accuracy={stats['trl_accuracy']:.3f} "
          f"reflow_accuracy={stats.get('reflow_accuracy', float('nan')):.3f} seconds={stats['trl_seconds']:.0f} "
          f"steps={stats['trl_steps']} clock={a.clock} startup_s={stats['trl_startup_s']:.1f}")


if __name__ == "__main__":
    main()
