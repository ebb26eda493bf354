"""Partial rollouts against waiting for every sample (issue 55 point 3): rollout seconds per iteration at the same
number of trained samples, on the embedded engine over HTTP, as a run asks it.

    python bench/partial_rollout.py                                  # CPU, the tiny demo shape
    python bench/partial_rollout.py --device cuda --size gpu --prompts 64 --max-new 2048 --median 256 --chunk 128

Policy: the demo's shape with random weights whose responses end at a steady rate (reflow.rl.long_tail: geometric
lengths, median --median tokens, p99 ~6.6x that, capped at --max-new). Each iteration trains on --prompts groups
of --n samples, seeded per iteration. Modes (--modes, in that order; off again last, to see drift):
- off: one batched request per iteration, every sample to its end (rollout.partial=off);
- carry: a pool of prompts * (1 + --over) groups in one closing call (the embedded engine's: it stops at the step
  the --prompts-th group completes, engines/partial_rollout.py); the rest continue next iteration
  (rollout.partial=carry), the policy version incremented each iteration as a run's would be (the weights stay:
  this measures the engine, not learning);
- drop: the same, the rest discarded;
- carry_rounds, drop_rounds: the same in rounds of --chunk tokens (how a run on SGLang closes).
Reported: seconds per iteration (mean over iterations), partial_speedup = off / carry (<mode>_speedup for the others);
the same after the first --warmup-iterations of each mode as `steady` (`partial_speedup_steady`...): a carrying run's
first iteration has nothing carried yet and is an iteration of `off` with more rows, its pool filling over the next
ones (the GPU runs of RESULTS 40-42 took 3 iterations, carry falling each: 9.68, 8.06, 5.63 s, where off stayed at
8.7-10.5), so the all-iteration mean of a short run mixes that start into the rate a long run settles at; the engines' idle share of
row-steps (engines/partial_rollout.py), and the trained responses' mean length: closing on the first complete
groups prefers short ones (carried long ones train later; dropped ones never), which this shows rather than hides;
and, where the static decoder runs (a GPU), its loop's milliseconds a step and the share of that loop the host sat
waiting for the device's tokens (`dev wait`, Generator.decode_time): near 0 the device waited on the host's
bookkeeping (host-bound: bench/decode_host.py measures that side), near 1 the device's steps set the pace.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402,F401  (puts src/ on the path where reflow is not installed)


def build_policy(out: Path, size: str, median: int, max_new: int, device: str) -> tuple[Path, dict]:
    """The demo-shaped random policy whose responses end at about ln2/median a token (reflow.rl.long_tail's
    calibration on the model's own samples of up to 2 x median tokens); returns (its folder, the rates)."""
    from reflow.rl.demo_policy import SIZES, build_model, build_tokenizer, save_policy
    from reflow.rl.long_tail import calibrate_end_rate

    tok = build_tokenizer()
    model = build_model(tok, **SIZES[size], max_positions=max_new + 64, seed=0).to(device)
    rates = calibrate_end_rate(model, tok, median, ["12+34=", "5+6=", "70+8=", "40+2="],
                               sample_tokens=min(max_new, 2 * median, 1024))
    return save_policy(model.cpu(), tok, out), rates


def prompts_for(tok, iteration: int, count: int, offset: int = 0):
    from reflow.rl.types import Prompt

    rnd = random.Random(1000 * iteration + offset)
    texts = [f"{rnd.randint(10, 999)}+{rnd.randint(10, 999)}=" for _ in range(count)]
    return [Prompt(offset + i, t, tok(t)["input_ids"], None) for i, t in enumerate(texts)]


def run_off(clients, tok, args, sp) -> dict:
    from reflow.engines import rollout_stages as ro
    from reflow.engines.partial_rollout import lengths_stats
    from reflow.engines.rollout_client import generate_batch

    secs, lengths, idle = [], [], []
    for it in range(args.iterations):
        prompts = prompts_for(tok, it, args.prompts)
        t0 = time.perf_counter()
        outs = generate_batch(clients, [p.input_ids for p in prompts], sp, args.n,
                              seeds=ro.sample_seeds(7, it, len(prompts) * args.n))
        secs.append(time.perf_counter() - t0)
        ls = [len(o["output_ids"]) for o in outs]
        lengths += ls
        idle.append(lengths_stats(ls)["wait_all_idle_fraction"])
    return {"seconds": secs, "idle_fraction": statistics.mean(idle), "trained_len_mean": statistics.mean(lengths),
            **lengths_stats(lengths)}


def run_partial(clients, tok, args, sp, mode: str) -> dict:
    from reflow.engines import partial_rollout as pr
    from reflow.engines import rollout_stages as ro

    rounds = mode.endswith("_rounds")  # SGLang's way (rounds of --chunk tokens); else the embedded engine's closing
    settings = pr.PartialSettings.of(mode.removesuffix("_rounds"), args.chunk, args.prompts, args.over, not rounds)
    carry: list[dict] = []
    secs, lengths, idle, rounds, carried = [], [], [], [], []
    for it in range(args.iterations):
        m = pr.new_groups(settings.pool_groups, carry)
        prompts = prompts_for(tok, it, m)
        t0 = time.perf_counter()
        batch, carry, stats = pr.roll(clients, settings, sp, args.n, it, carry, prompts,
                                      ro.sample_seeds(7, it, m * args.n))
        secs.append(time.perf_counter() - t0)
        lengths += [len(r) for r in batch.response_ids]
        idle.append(stats["engine_idle_fraction"])
        rounds.append(stats["partial_rounds"])
        carried.append(stats["carried_samples"])
    return {"seconds": secs, "idle_fraction": statistics.mean(idle), "trained_len_mean": statistics.mean(lengths),
            "rounds_mean": statistics.mean(rounds), "carried_samples_mean": statistics.mean(carried)}


def anatomy(gen, ctx: int, replays: int = 30) -> dict:
    """One decode step of the whole batch (gen.max_batch_size rows, each `ctx` tokens into its own region), on the
    device alone: its CUDA graph replayed `replays` times (a GPU engine), or the graph-free step run so (CPU); then
    the graph-free step profiled, its kernels' summed device time (CUDA) and the top ops. Against the loop's ms a
    step (`decode` of each mode), the rest of a step is the host's or the wait between launches."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    dec = gen.static_decoder()
    if dec is None or dec.regions is None:
        return {"skipped": "no static decoder with a KV pool (the eager CPU engine)"}
    b, t = dec.step_shape(gen.max_batch_size, ctx)  # the shape decode() gives this batch: its graph's
    room = dec.capacity // b
    if room <= ctx:
        return {"skipped": f"{b} rows of {ctx} tokens do not fit the pool's {dec.capacity} positions"}
    cuda = dec._at.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.inference_mode(), gen.lock:
        dec._tok[:b].fill_(5)
        dec._at[0, :b].fill_(ctx)
        dec._at[1, :b].copy_(torch.arange(b, device=dec._at.device) * room)
        if dec.graphs:
            graph = dec._graphs.get((b, t)) or (dec._capture(b, t), dec._graphs[(b, t)])[1]
            run = graph[0].replay
        else:
            def run():
                dec._step(b, t)
        for _ in range(3):
            run()
        sync()
        began = time.perf_counter()
        for _ in range(replays):
            run()
        sync()
        step_ms = 1e3 * (time.perf_counter() - began) / replays
        dec._step(b, t)
        sync()
        with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                dec._step(b, t)
            sync()
    out = {"rows": b, "ctx": ctx, "keys_bucket": t, "device_step_ms": step_ms, "graphs": bool(dec.graphs)}
    if cuda:
        events = [e for e in prof.events() if e.device_type.name == "CUDA"]
        out.update(kernels_per_step=len(events) / 3, kernel_ms_per_step=sum(e.device_time for e in events) / 3e3)
    table = prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=12,
                                      max_name_column_width=50)
    out["top"] = table
    print(f"anatomy: {json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items() if k != 'top'})}"
          f"\n{table}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--size", default="tiny", choices=["tiny", "gpu"], help="the demo policy's shape (SIZES)")
    ap.add_argument("--prompts", type=int, default=16, help="groups trained per iteration (prompts_per_iteration)")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-new", type=int, default=256, help="rollout.max_new_tokens")
    ap.add_argument("--median", type=int, default=24, help="median response length the policy is set to")
    ap.add_argument("--chunk", type=int, default=16, help="rollout.partial_chunk_tokens")
    ap.add_argument("--over", type=float, default=0.5, help="rollout.over_sample")
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--warmup-iterations", type=int, default=1,
                    help="iterations of each mode left out of the `steady` figures (carry's pool fills over them)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of the engine")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                    help="the engine's dtype (on a GPU both decode with the Triton per-row-length attention kernel)")
    ap.add_argument("--kv-mem-fraction", type=float, default=None,
                    help="rollout.kv_mem_fraction (GPU: one KV pool, rows admitted by their own length; without it "
                         "the engine reserves max_new_tokens for every row of the batch at once)")
    ap.add_argument("--kv-reserve", type=float, default=1.0,
                    help="rollout.kv_reserve with --kv-mem-fraction: the share of max_new_tokens a row's KV region holds "
                         "when admitted (it grows as the row goes; 1.0: the whole cap, as before)")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "bf16"],
                    help="rollout.kv_cache_dtype: the static decoder's keys and values (bf16 under an fp32 engine halves "
                         "the bytes each decode step reads; on CPU the eager decoder keeps the model's dtype)")
    ap.add_argument("--max-batch-size", type=int, default=None,
                    help="rollout.max_batch_size: rows decoding at once (default: every row of a carrying pool, "
                         "ceil(prompts x (1 + over)) x n); fewer rows are admitted as others finish")
    ap.add_argument("--tf32", action="store_true", help="trainer.tf32's effect on the engine: fp32 products on TF32 cores")
    ap.add_argument("--modes", default="off,carry,drop,carry_rounds,off_again",
                    help="in this order; carry/drop close in one call per engine (the embedded engine's way), "
                         "carry_rounds/drop_rounds in rounds of --chunk tokens (SGLang's)")
    ap.add_argument("--anatomy", type=int, default=0, metavar="CTX",
                    help="after the modes: one decode step of the full batch (max_batch_size rows, each CTX tokens "
                         "into its region) timed on the device alone (its CUDA graph replayed, or the graph-free step "
                         "on CPU) and profiled by kernel, beside the loop's ms a step: how much of a step is the "
                         "device's")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    if not 0 <= args.warmup_iterations < args.iterations:
        ap.error(f"--warmup-iterations must be below --iterations ({args.iterations}), got {args.warmup_iterations}")
    _common.set_bench_env()

    from reflow.engines import rollout_stages as ro
    from reflow.engines.embedded.engine import EmbeddedEngine
    from reflow.engines.hf_io import load_tokenizer
    from reflow.engines.rollout_client import EngineClient

    with tempfile.TemporaryDirectory() as tmp:
        path, rates = build_policy(Path(tmp) / "policy", args.size, args.median, args.max_new, args.device)
        tok = load_tokenizer(str(path))
        rows = math.ceil(args.prompts * (1 + args.over)) * args.n
        engine = EmbeddedEngine(str(path), "partial-bench", threads=args.threads, device=args.device, dtype=args.dtype,
                                max_batch_size=args.max_batch_size or max(rows, args.prompts * args.n),
                                kv_mem_fraction=args.kv_mem_fraction, kv_reserve=args.kv_reserve,
                                kv_cache_dtype=args.kv_dtype, tf32=args.tf32)
        engine.ready()
        try:
            clients = [EngineClient(engine.url(), timeout=600, api_key=engine.api_key())]
            sp = ro.sampling_params(1.0, 1.0, -1, args.max_new, [tok.eos_token_id])
            run_off(clients, tok, argparse.Namespace(**{**vars(args), "iterations": 1}), sp)  # warm-up
            res = {}
            for m in args.modes.split(","):
                before = dict(engine.generator.decode_time)
                res[m] = run_off(clients, tok, args, sp) if m.startswith("off") else run_partial(clients, tok, args, sp, m)
                res[m]["decode_time"] = {k: v - before[k] for k, v in engine.generator.decode_time.items()}
                # ms a step, and the share of the decode loop's wall the host sat waiting for the device: near 0,
                # the device waited for the host (host-bound); near 1, the host's bookkeeping hid behind the steps
                res[m]["decode"] = ro.decode_stats(before, engine.generator.decode_time)  # {} on the eager decoder
                res[m]["device_wait_share"] = res[m]["decode"].get("decode_device_wait_share")
            if args.anatomy:
                res_anatomy = anatomy(engine.generator, args.anatomy)
            kv_moves = dict(engine.generator.kv_moves)
            kv_held = engine.generator.kv_cache_dtype()
        finally:
            engine.shutdown()
    per = {k: statistics.mean(v["seconds"]) for k, v in res.items()}
    off = statistics.mean([v for k, v in per.items() if k.startswith("off")])
    steady = {k: statistics.mean(v["seconds"][args.warmup_iterations:]) for k, v in res.items()}
    off_steady = statistics.mean([v for k, v in steady.items() if k.startswith("off")])
    out = {"shape": {"size": args.size, "device": args.device, "prompts": args.prompts, "n": args.n,
                     "max_new_tokens": args.max_new, "median": args.median, "chunk": args.chunk, "over": args.over,
                     "iterations": args.iterations, "warmup_iterations": args.warmup_iterations,
                     "kv_mem_fraction": args.kv_mem_fraction, "kv_reserve": args.kv_reserve, "kv_moves": kv_moves,
                     "dtype": args.dtype, "kv_cache_dtype": args.kv_dtype, "kv_cache_held": kv_held,
                     "max_batch_size": args.max_batch_size, "tf32": args.tf32, "end_rate": rates},
           "seconds_per_iteration": per, "modes": res,
           **{"partial_speedup" if k == "carry" else f"{k}_speedup": off / per[k] for k in per
              if not k.startswith("off")},
           "seconds_per_iteration_steady": steady,
           **{"partial_speedup_steady" if k == "carry" else f"{k}_speedup_steady": off_steady / steady[k] for k in steady
              if not k.startswith("off")},
           **{f"idle_fraction_{k}": v["idle_fraction"] for k, v in res.items() if k != "off_again"},
           **({"anatomy": res_anatomy} if args.anatomy else {})}
    print(f"{'mode':10} {'s/iter':>8} {'steady':>8} {'idle':>6} {'trained len':>11} {'ms/step':>8} {'dev wait':>8}")
    for k in res:
        dt = res[k]["decode"]
        static = f"{dt['decode_ms_per_step']:8.2f} {dt['decode_device_wait_share']:8.3f}" if dt else \
            f"{'n/a':>8} {'n/a':>8}"  # the eager decoder (CPU): no static loop
        print(f"{k:10} {per[k]:8.3f} {steady[k]:8.3f} {res[k]['idle_fraction']:6.3f} {res[k]['trained_len_mean']:11.1f} "
              f"{static}")
    off_lens = res["off"]
    speedups = " ".join(f"{k}={v:.2f}" for k, v in out.items() if k.endswith(("_speedup", "_speedup_steady")))
    print(f"partial_rollout: {speedups} "
          f"(off's lengths p50 {off_lens['response_len_p50']:.0f}, p99 {off_lens['response_len_p99']:.0f}; "
          f"{args.prompts}x{args.n} trained samples an iteration; steady: after {args.warmup_iterations} of "
          f"{args.iterations} iterations; KV cache {kv_held})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
