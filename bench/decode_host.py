"""The host's share of the static decoder's continuous-batching loop: the Python bookkeeping a decode step costs per
batch row (finish checks, positions, seeded draws, admissions, records), this tree against another, on CPU.

    .venv/bin/python bench/decode_host.py --baseline /tmp/base      # /tmp/base: git archive <commit> | tar -x -C
    .venv/bin/python bench/decode_host.py --rows 512 --scale 0.25 --rounds 2

On a GPU the loop launches step k+1 before it reads step k's tokens, so its bookkeeping hides behind the device's
work only while that work takes longer; at the scratchpad config's shape (a ~113M policy, 512 rows of ~400 tokens)
the two are close. Here a tiny policy (one layer, hidden 32) decodes on CPU, where the step runs synchronously, and
the time inside the step (StaticDecoder.decode) and inside admissions (Generator._admit, the prefills) is taken
out of the loop's wall: what is left is the host's own work, `host_us_per_step`, and per batch row,
`host_us_per_row_step`. Rows: `--prompts` scratchpad problems (the GPU task's 2-6 digit operands) x 8 samples, each
its own request with its own seed as a rollout sends them, ending at their worked trace's length x `--scale` (ignore_eos). Each tree runs in
a process of its own, ABBA rounds, after `gc.freeze()` of the set-up (as the engine actor is frozen once ready).
Ends with `decode_host: host_ratio=<this/baseline>` (below 1: less host time a step here).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _trees import importable  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def one(rows: int, prompts: int, scale: float) -> dict:
    """One run in this process (the `reflow` on sys.path): seconds of the loop, of its steps and of its prefills."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from reflow.engines.embedded import generator as g
    from reflow.engines.embedded import static_decode as sd
    from reflow.rl import scratchpad_task as st
    from reflow.rl.demo_policy import build_tokenizer

    torch.manual_seed(0)
    torch.set_num_threads(1)
    tok = build_tokenizer()
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=1100, pad_token_id=0, eos_token_id=2,
        attn_implementation="sdpa")).eval()
    gen = g.Generator(model, tok, max_batch_size=rows, decoder="static", kv_tokens=rows * 1024, kv_reserve=0.5)
    train, _ = st.make_problems(0, max(4 * prompts, 500), 200, st.SHAPES["gpu"])
    picked = random.Random(0).sample(train, prompts)
    # as a rollout sends them: each sample its own request (n=1) with its own seed, a group's 8 side by side
    ids = [tok.encode(r["prompt"]) for r in picked for _ in range(8)]
    sps = [{"temperature": 1.0, "ignore_eos": True, "sampling_seed": 1000 + i,
            "max_new_tokens": max(1, round((len(st.row_trace(picked[i // 8])) + 1) * scale))} for i in range(len(ids))]
    spent = {"loop": 0.0, "step": 0.0, "admit": 0.0, "steps": 0}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t
                if name == "step":
                    spent["steps"] += 1
        return wrapper

    sd.StaticDecoder.decode = timed("step", sd.StaticDecoder.decode)
    g.Generator._admit = timed("admit", g.Generator._admit)
    g.Generator._run_static = timed("loop", g.Generator._run_static)
    gen.generate(ids[:2], sps[:2])  # the pool and the first shapes, outside the count
    for k in spent:
        spent[k] = 0
    gc.collect()
    gc.freeze()
    out = gen.generate(ids, sps)
    tokens = sum(len(r["output_ids"]) for r in out)
    host = spent["loop"] - spent["step"] - spent["admit"]
    return {"loop_s": spent["loop"], "step_s": spent["step"], "admit_s": spent["admit"], "steps": spent["steps"],
            "tokens": tokens, "host_s": host, "host_us_per_step": host / spent["steps"] * 1e6,
            "host_us_per_row_step": host / tokens * 1e6}


def run_tree(path: Path, args) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    res = subprocess.run([sys.executable, __file__, "--one", "--rows", str(args.rows), "--prompts", str(args.prompts),
                          "--scale", str(args.scale)], env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"the run under {path} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, help="another commit's tree (its top folder) to compare against")
    ap.add_argument("--rows", type=int, default=512, help="max_batch_size: the batch rows decoding at once")
    ap.add_argument("--prompts", type=int, default=128, help="problems, each sampled 8 times")
    ap.add_argument("--scale", type=float, default=0.25,
                    help="each sample's length as this share of its worked trace's (CPU steps are slow)")
    ap.add_argument("--rounds", type=int, default=1, help="ABBA rounds (each tree twice a round; one tree: once)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.rows, args.prompts, args.scale)))
        return
    trees = {"this": REPO / "src"}
    if args.baseline:
        trees["baseline"] = importable(args.baseline.resolve())
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    order = list(trees)
    for _ in range(args.rounds):
        for name in (order + order[::-1] if len(order) > 1 else order):  # one tree: one run a round
            r = run_tree(trees[name], args)
            runs[name].append(r)
            print(f"{name:9} steps {r['steps']:5d} tokens {r['tokens']:7d} loop {r['loop_s']:6.2f}s step "
                  f"{r['step_s']:6.2f}s admit {r['admit_s']:5.2f}s host {r['host_s']:5.2f}s = "
                  f"{r['host_us_per_step']:7.0f} us a step, {r['host_us_per_row_step']:5.2f} us a row-step", flush=True)
    summary = {k: {"host_us_per_step": statistics.median(r["host_us_per_step"] for r in v),
                   "host_us_per_row_step": statistics.median(r["host_us_per_row_step"] for r in v), "runs": v}
               for k, v in runs.items()}
    out = {"shape": {"rows": args.rows, "prompts": args.prompts, "samples": args.prompts * 8, "scale": args.scale},
           "trees": summary}
    line = ", ".join(f"{k} {v['host_us_per_step']:.0f} us a step" for k, v in summary.items())
    if "baseline" in summary:
        out["host_ratio"] = summary["this"]["host_us_per_step"] / summary["baseline"]["host_us_per_step"]
        line += f"; host_ratio={out['host_ratio']:.2f}"
    print(f"decode_host: {line}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
