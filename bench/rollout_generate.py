"""The rollout's generate call as reflow sends it, through the embedded engine's `Generator`: this tree next
to another tree's code, in child processes of one script, taking turns.

    python bench/rollout_generate.py                               # this tree only
    python bench/rollout_generate.py --baseline /tmp/base          # + the code at /tmp/base (`git archive`)
    python bench/rollout_generate.py --profile                     # + where this tree's host time goes

Shape: the GPU demo's rollout (configs/gpu-demo.yaml with `rollout.prompts_per_iteration=256`): P distinct
3-digit-addition prompts x n samples, each sample its own request with its own `sampling_seed` (the
default `rollout.seeded_sampling`: engines/rollout_client.py sends n=1 requests), temperature 1,
max_new_tokens 6, max_batch_size 512. On a GPU the policy is a random one of the GPU demo's shape (113M,
bf16; decoding through CUDA graphs), on CPU the tiny demo shape (fp32). Random weights: eos comes at
random, equally for both trees. Each child builds the same model from the same seed, warms up (graph
capture), then times `--repeat` rollouts; the best and the median are reported, and
samples/s = samples / median seconds. Results: --json FILE (bench/results/rollout-generate-*.json).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _trees import importable  # noqa: E402


def demo_rollout(args, cpu_threads: int = 2):
    """The GPU demo's rollout call through the engine's `Generator`: (rollout(version) -> the outputs, whether on
    CUDA). args: prompts, n, batch (the engine's max_batch_size), cpu. Shared with bench/gc_pauses.py."""
    import torch

    from reflow.engines.embedded.generator import Generator
    from reflow.rl.demo_policy import SIZES, build_model, build_tokenizer

    cuda = torch.cuda.is_available() and not args.cpu
    torch.manual_seed(0)
    tok = build_tokenizer()
    model = build_model(tok, **SIZES["gpu" if cuda else "tiny"], seed=0)
    model = model.to("cuda", torch.bfloat16) if cuda else model
    gen = Generator(model, tok, max_batch_size=args.batch, threads=None if cuda else cpu_threads)
    prompts = [tok(f"{100 + 7 * i % 900}+{100 + 13 * i % 900}=", add_special_tokens=False)["input_ids"]
               for i in range(args.prompts)]
    ids = [list(p) for p in prompts for _ in range(args.n)]  # one request per sample, as the rollout sends them

    def rollout(version: int) -> list[dict]:
        sps = [{"temperature": 1.0, "max_new_tokens": 6, "sampling_seed": version * 1_000_003 + j}
               for j in range(len(ids))]
        out = gen.generate(ids, sps)
        if cuda:
            torch.cuda.synchronize()
        return out

    return rollout, cuda


def child(args) -> dict:
    import torch

    generate, cuda = demo_rollout(args)

    def rollout(version: int) -> int:
        return sum(len(r["output_ids"]) for r in generate(version))

    for v in range(2):  # warm-up: graph capture, allocator growth
        rollout(v)
    secs, tokens = [], 0
    for v in range(args.repeat):
        t0 = time.perf_counter()
        tokens = rollout(100 + v)
        secs.append(time.perf_counter() - t0)
    prof = None
    if args.trace:  # the GPU's view of one more rollout: kernel time against wall time, the largest ops
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda
        with profile(activities=acts) as tp:
            t0 = time.perf_counter()
            rollout(998)
            wall = time.perf_counter() - t0
        ev = [e for e in tp.events() if e.device_type.name == "CUDA"] if cuda else []
        busy = sum(e.device_time for e in ev) / 1e6  # kernel seconds (overlaps counted twice: one stream here)
        table = tp.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=30)
        print(f"  trace: wall {wall:.4f} s under the profiler, GPU kernels {busy:.4f} s, {len(ev)} kernels\n{table}",
              flush=True)
    if args.profile:
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        rollout(999)
        pr.disable()
        st = pstats.Stats(pr)
        rows = sorted(((v[3], v[2], f"{Path(k[0]).name}:{k[1]}:{k[2]}") for k, v in st.stats.items()), reverse=True)
        prof = [{"cum_s": round(c, 4), "self_s": round(s, 4), "where": w} for c, s, w in rows[:40]]
    return {"device": torch.cuda.get_device_name() if cuda else "cpu", "samples": args.prompts * args.n, "tokens": tokens,
            "seconds": secs, "median_s": statistics.median(secs), "best_s": min(secs), "profile": prof}


def _run(tree: Path, args, label: str, profile: bool) -> dict:
    out = Path(tempfile.mkdtemp(prefix="rollout-gen-")) / "r.json"
    cmd = [sys.executable, __file__, "--part", "child", "--json", str(out), "--prompts", str(args.prompts),
           "--n", str(args.n), "--batch", str(args.batch), "--repeat", str(args.repeat)]
    cmd += ["--profile"] * profile + ["--trace"] * (profile and args.trace) + ["--cpu"] * args.cpu
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(importable(tree)), os.environ.get("PYTHONPATH", "")]),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    subprocess.run(cmd, check=True, env=env, cwd=tempfile.gettempdir())  # not a checkout: its reflow/ would shadow
    r = json.loads(out.read_text())
    print(f"  {label}: {r['samples']} samples, {r['tokens']} tokens; median {r['median_s']:.3f} s, best "
          f"{r['best_s']:.3f} s -> {r['samples'] / r['median_s']:.0f} samples/s", flush=True)
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=256, help="distinct prompts per rollout")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (each its own seeded request)")
    p.add_argument("--batch", type=int, default=512, help="the engine's max_batch_size")
    p.add_argument("--repeat", type=int, default=5, help="timed rollouts per child")
    p.add_argument("--rounds", type=int, default=2, help="children per tree, taking turns (ABBA...)")
    p.add_argument("--baseline", default=None, help="a tree of another commit to run alongside (git archive)")
    p.add_argument("--profile", action="store_true", help="cProfile one more rollout of this tree")
    p.add_argument("--trace", action="store_true", help="with --profile: torch.profiler over one more rollout "
                   "(GPU kernel seconds against wall seconds, the largest ops)")
    p.add_argument("--cpu", action="store_true", help="stay on the CPU even where a GPU is")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--part", default="main", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.part == "child":
        Path(args.json).write_text(json.dumps(child(args)))
        return
    trees = {"this": ROOT} | ({"baseline": Path(args.baseline).resolve()} if args.baseline else {})
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(trees)[::-1]
        for k in order:
            runs[k].append(_run(trees[k], args, f"{k} (round {r + 1})", args.profile and k == "this" and r == 0))
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": runs["this"][0]["device"],
           "shape": {"prompts": args.prompts, "n": args.n, "batch": args.batch, "max_new_tokens": 6}}
    for k, rs in runs.items():
        med = statistics.median(s for r in rs for s in r["seconds"])
        res[k] = {"median_s": med, "samples_per_s": rs[0]["samples"] / med, "tokens": rs[0]["tokens"],
                  "seconds": [r["seconds"] for r in rs]}
    if runs["this"][0]["profile"]:
        res["profile_this"] = runs["this"][0]["profile"]
        print("  where this tree's rollout goes (cProfile, cumulative s):")
        for row in res["profile_this"][:25]:
            print(f"    {row['cum_s']:8.4f} {row['self_s']:8.4f} {row['where']}")
    line = f"rollout_generate: this_samples_per_s={res['this']['samples_per_s']:.0f}"
    if "baseline" in res:
        res["this_over_baseline"] = res["baseline"]["median_s"] / res["this"]["median_s"]
        line += f" baseline_samples_per_s={res['baseline']['samples_per_s']:.0f} speedup={res['this_over_baseline']:.2f}"
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    print(line)


if __name__ == "__main__":
    main()
