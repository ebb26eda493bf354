"""`reflow` command line: bootstrap the demo policy, train, run the demo, check a config."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
OVERRIDES_HELP = ("config overrides as dotted key=value pairs, validated like the file, "
                  "e.g. trainer.lr=1e-4 rollout.n_samples_per_prompt=8 num_iterations=5")


def _config(path: str | None, overrides: list[str]):
    from infra.config import ConfigError, load_config

    try:
        return load_config(path, overrides)
    except ConfigError as e:
        sys.exit(f"reflow: {e}")


def cmd_config(args) -> None:
    from infra.config import dump_config

    print(dump_config(_config(args.config, args.overrides)), end="")


def cmd_bootstrap(args) -> None:
    from rl.demo_policy import bootstrap

    kw = {"steps": args.steps} if args.steps is not None else {}
    report = bootstrap(args.out, seed=args.seed, digits=args.digits, **kw)
    print(json.dumps(report, indent=2))


def cmd_train(args) -> None:
    from flows.train import train

    cfg = _config(args.config, args.overrides)
    summary = train(cfg)
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=2, default=str))


def _demo_policy(seed: int, digits: int) -> Path:
    from rl.demo_policy import bootstrap

    out = Path(".reflow/models") / f"demo-policy-d{digits}-s{seed}"
    if not (out / "config.json").is_file():
        logging.getLogger("reflow").info("bootstrapping the demo policy into %s", out)
        bootstrap(out, seed=seed, digits=digits)
    return out


def cmd_demo(args) -> None:
    from flows.train import train

    t0 = time.perf_counter()
    base = _config(str(DEMO_CONFIG), [])
    overrides = [f"seed={args.seed}", f"data.seed={args.seed}", f"experiment=demo-s{args.seed}"]
    policy = _demo_policy(args.seed, base.data.digits)
    cfg = _config(str(DEMO_CONFIG), overrides + [f"model.path={policy}"] + args.overrides)
    summary = train(cfg)
    evals = summary["evals"]
    before, after = evals[min(evals)], evals[max(evals)]
    print(f"demo: accuracy_before={before:.3f} accuracy_after={after:.3f} "
          f"iterations={summary['iterations']} seconds={time.perf_counter() - t0:.0f}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="reflow",
        description="RL post-training of LLMs: each rollout iteration is a Prefect flow run driving "
                    "Ray actors (DeepSpeed trainers, SGLang-API rollout engines).")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("demo", help="bootstrap the tiny demo policy and train it with GRPO (no GPU needed)",
                       description="Build (once) a tiny warmed-up policy for 2-digit addition, train it with "
                                   "GRPO using configs/demo.yaml, and print held-out accuracy before and after.")
    d.add_argument("--seed", type=int, default=0, help="seed of the task, the policy and the run (default 0)")
    d.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    d.set_defaults(fn=cmd_demo)

    t = sub.add_parser("train", help="run the train flow for an experiment file",
                       description="Run the `train` Prefect flow in this process: one flow run per iteration.")
    t.add_argument("--config", "-c", required=True, help="experiment YAML (see configs/)")
    t.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    t.set_defaults(fn=cmd_train)

    b = sub.add_parser("bootstrap", help="build the demo policy: tiny Llama + char tokenizer, warmed up, HF format",
                       description="Build a tiny causal LM and tokenizer, warm it up on the synthetic addition "
                                   "task and save it as an HF checkpoint folder (config, safetensors, tokenizer).")
    b.add_argument("--out", default=".reflow/models/demo-policy", help="output folder (default %(default)s)")
    b.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    b.add_argument("--digits", type=int, default=2, help="digits per operand (default 2)")
    b.add_argument("--steps", type=int, default=None, help="warm-up optimizer steps (default: tuned value)")
    b.set_defaults(fn=cmd_bootstrap)

    c = sub.add_parser("config", help="validate a config (file + overrides) and print it resolved",
                       description="Validate an experiment file plus overrides and print the full resolved config.")
    c.add_argument("--config", "-c", default=None, help="experiment YAML (default: built-in defaults)")
    c.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    c.set_defaults(fn=cmd_config)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("reflow").setLevel(logging.INFO)
    args.fn(args)


if __name__ == "__main__":
    main()
