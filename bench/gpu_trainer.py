"""The trainer half of bench/gpu.py (issue 15 point 5): reflow's `TrainerRank` under several settings
next to a plain torch loop, uncompiled and compiled; a short profile of the default.

Each variant (each name in --variants, the plain loops included) runs in a child process of its own
(`bench_all` starts `bench/gpu.py ... --one NAME`; `one` is the child's side; issue 54 point 7): dynamo's
recompile limit (8) and the CUDA caching allocator are per process, so in one process a variant changed
the next one's figures: the compiled plain loop (then calling the model with its KV cache on) hit the
recompile limit and reflow's layers ran uncompiled after it (reflow's default on the H200: 40.9 % MFU run
first alone, 29.7 % after the plain loop), and ZeRO-3 left memory held. So every compiled variant pays
its own compile (in its warm-up), and `process_s` is each child's wall seconds, imports included. A child
that fails (an exception, a crash, the OOM killer) gives a failed row with its stderr tail; the others run.
The profile of one default step runs in the default variant's child, after its timed steps.

Variants (each a fresh TrainerRank): the default settings (ZeRO-1, compiled layers, old log-probs from the
training forward, fp32 gradient accumulation), then one change each: a separate old-logprob pass, no
compile, bf16 gradient accumulation, immediate gradient updates, ZeRO-2, ZeRO-3, a larger micro-batch. MFU
counts the model FLOPs each executes (bench/gpu.py `model_flops`): 3 forwards per step when old log-probs
come from the training forward, 4 with the separate pass.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

VARIANTS = {  # name: (RankSettings overrides, micro-batch multiplier), in the order they run by default
    "default": ({}, 1), "old-pass": ({"old_logprob_pass": "always"}, 1), "eager": ({"compile": "off"}, 1),
    "accum-bf16": ({"grad_accum_dtype": "bf16"}, 1), "immediate": ({"immediate_grad_update": True}, 1),
    "micro-x2": ({}, 2),
    "all-scored": ({}, 1),  # a 1-token prompt: every position scored, as in the plain loop's loss
    "zero2": ({"zero_stage": 2}, 1),
    # Last (from when the variants shared one process: ZeRO-3 left 63-131 GiB held, and rows measured
    # after it were off by up to 17 % in both directions on the H200).
    "zero3": ({"zero_stage": 3}, 1),
}


def _trainer(folder: Path, args, overrides: dict, micro: int, port: int):
    from reflow.engines.train.settings import RankSettings
    from reflow.engines.train.trainer import TrainerRank

    cuda = args.device == "cuda"
    s = RankSettings(zero_stage=1, precision="bf16", lr=1e-6, total_steps=1000, micro_batch_size=micro, threads=4,
                     backend="nccl" if cuda else "gloo", compile="auto")
    return TrainerRank(0, 1, "127.0.0.1", port, str(folder), dataclasses.replace(s, **overrides))


def _timed(G, step, steps: int):
    """(warm-up seconds, mean seconds of `steps` timed calls, last result); peak memory reset after
    the warm-up (which compiles)."""
    t0 = time.perf_counter()
    step()
    G.sync()
    warm = time.perf_counter() - t0
    G.gpu_peak_gib()
    t0 = time.perf_counter()
    for _ in range(steps):
        last = step()
    G.sync()
    return warm, (time.perf_counter() - t0) / steps, last


def _iteration(G, trainer, cfg, args, prompt: int):
    """One PPO-clip `train_iteration` on the synthetic batch (prompt tokens of each row unscored)."""
    from reflow.rl.losses import LossSettings

    batch = G.synthetic_batch(args.batch, args.seq, cfg.vocab_size, prompt)
    kw = dict(minibatches=getattr(args, "minibatches", 1), pad_id=0, loss=LossSettings(temperature=1.0, kl_estimator="k1"))
    return lambda: trainer.train_iteration(batch, **kw)


def run_variant(G, trainer, cfg, args, name: str) -> dict:
    """Warm-up step (compiles), then args.steps timed steps of `train_iteration`."""
    prompt = 1 if name == "all-scored" else args.seq // 2
    warm, sec, m = _timed(G, _iteration(G, trainer, cfg, args, prompt), args.steps)
    forwards = 3 if m.get("old_logprobs_reused") else 4
    fl = G.model_flops(cfg, args.batch, args.seq, forwards)
    # The LM head does not run on the prompt positions before the first scored one (prompt - 1 each).
    executed = fl - forwards * args.batch * (prompt - 1) * 2 * cfg.vocab_size * cfg.hidden_size
    row = {"what": f"reflow {name}", "variant": name, "s": sec, "tok_s": args.batch * args.seq / sec,
           "tflops": fl / sec / 1e12, "mfu": fl / sec / G.PEAK_BF16[args.device],
           "mfu_executed": executed / sec / G.PEAK_BF16[args.device], "gpu_gib": G.gpu_peak_gib(),
           "forwards": forwards, "warmup_s": warm, "compile_graphs": m.get("compile_graphs", 0.0),
           "micro": trainer.micro_batch_size}
    print(f"  {row['what']}: {sec:.3f} s/step, {row['tok_s']:.0f} tok/s, MFU {row['mfu']:.1%} "
          f"(executed FLOPs {row['mfu_executed']:.1%}), "
          f"{row['gpu_gib']:.1f} GiB, warm-up {warm:.1f} s", flush=True)
    return row


def profile(G, trainer, cfg, args) -> dict:
    """One profiled step: top kernels by GPU time and the share of the step the GPU had no kernel."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step = _iteration(G, trainer, cfg, args, args.seq // 2)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        t0 = time.perf_counter()
        step()
        G.sync()
        wall_us = (time.perf_counter() - t0) * 1e6
    from torch.autograd import DeviceType

    # Kernels only: an aten op's own entry repeats the device time of the kernels it launched.
    # Ranges (reflow's record_function phases, the optimizer's step) also appear on the GPU timeline.
    rows = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0
            and not getattr(e, "is_user_annotation", False) and not e.key.startswith(("reflow.", "Optimizer."))]
    busy = sum(e.self_device_time_total for e in rows)
    top = sorted(rows, key=lambda e: -e.self_device_time_total)[:10]
    # reflow's own phase ranges (record_function in the trainer): host time spent in each, and the
    # device time of the kernels launched inside it; host >> device marks where the GPU waits.
    phases = {e.key: {"cpu_ms": e.cpu_time_total / 1e3, "gpu_ms": e.device_time_total / 1e3, "calls": e.count}
              for e in prof.key_averages() if e.key.startswith("reflow.") and e.device_type != DeviceType.CUDA}
    return {"wall_ms": wall_us / 1e3, "gpu_busy_ms": busy / 1e3, "phases": phases,
            "gpu_idle_share": max(0.0, 1 - busy / wall_us) if busy else float("nan"),
            "top": [{"kernel": e.key[:90], "ms": e.self_device_time_total / 1e3, "calls": e.count} for e in top]}


PLAINS = ("plain", "plain-compiled", "plain-x2", "plain-compiled-x2")


def plain(G, folder: Path, cfg, args, compiled: bool, micro: int) -> dict:
    """The plain way: bf16 weights, SDPA, fused AdamW, HF cross-entropy; micro-batches accumulate to B.
    `compiled`: each decoder layer's forward under torch.compile, as reflow does it; `micro`: rows
    per forward/backward."""
    from transformers import AutoModelForCausalLM

    if args.device == "cpu":
        # The trainer ranks' threads=4 (`_trainer`), which the plain loop inherited when it ran after them in one
        # process; in a process of its own at torch's default (2 on a 2-core machine with a core busy elsewhere)
        # its steps took 0.5-0.8 s instead of 0.026 s.
        torch.set_num_threads(4)
    dev = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="sdpa").to(dev)
    model.train()
    if compiled:
        for layer in model.model.layers:
            layer.forward = torch.compile(layer.forward, dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=args.device == "cuda")
    ids = torch.randint(4, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(dev)

    def step():
        for s in range(0, args.batch, micro):
            mb = ids[s:s + micro]
            (model(input_ids=mb, labels=mb, use_cache=False).loss * mb.shape[0] / args.batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    warm, sec, _ = _timed(G, step, args.steps)
    fl = G.model_flops(cfg, args.batch, args.seq, forwards=3)
    row = {"what": "plain torch loop" + (" (compiled layers)" if compiled else "") + f" micro {micro}",
           "variant": "plain" + "-compiled" * compiled + "-x2" * (micro != args.micro), "s": sec, "micro": micro, "tok_s": args.batch * args.seq / sec, "tflops": fl / sec / 1e12,
           "mfu": fl / sec / G.PEAK_BF16[args.device], "mfu_executed": fl / sec / G.PEAK_BF16[args.device],
           "gpu_gib": G.gpu_peak_gib(), "forwards": 3, "warmup_s": warm}
    print(f"  {row['what']}: {sec:.3f} s/step, {row['tok_s']:.0f} tok/s, MFU {row['mfu']:.1%}", flush=True)
    return row


def one(G, folder: Path, args) -> None:
    """The child's side: the variant `args.one` in this process, then a line `ROW {"row": ..., "profile": ...}`
    (JSON; the profile of one step for the default variant) last on stdout. An exception ends the process."""
    from transformers import AutoConfig

    name, cfg = args.one, AutoConfig.from_pretrained(folder)
    if name in PLAINS:
        row, prof = plain(G, folder, cfg, args, compiled="compiled" in name,
                          micro=args.micro * (2 if name.endswith("-x2") else 1)), None
    else:
        overrides, mult = VARIANTS[name]
        trainer = _trainer(folder, args, overrides, args.micro * mult, G._free_port())
        row = run_variant(G, trainer, cfg, args, name)
        prof = profile(G, trainer, cfg, args) if name == "default" and args.profile else None
    print("ROW " + json.dumps({"row": row, "profile": prof}), flush=True)


def bench_all(G, folder: Path, args) -> tuple[list[dict], dict | None]:
    """Every variant in args.variants, each in a child process of its own (the module's docstring says why):
    `G`'s script with this process's arguments and `--one NAME --folder FOLDER`. The child's stdout and stderr
    pass through as they come; its row is the last `ROW ` line, with the child's wall seconds as `process_s`."""
    rows, prof = [], None
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for name in args.variants:
        cmd = [sys.executable, str(Path(G.__file__).resolve()), *sys.argv[1:], "--one", name, "--folder", str(folder)]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        tail: collections.deque[str] = collections.deque(maxlen=60)

        def drain(stream=proc.stderr, tail=tail):
            for line in stream:
                sys.stderr.write(line)
                tail.append(line)
        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        found = None
        for line in proc.stdout:
            if line.startswith("ROW "):
                found = line
            else:
                sys.stdout.write(line)
        sys.stdout.flush()
        rc = proc.wait()
        reader.join()
        if rc or found is None:
            err = "".join(tail)[-1500:] or f"exit {rc}, no stderr"
            last = err.strip().splitlines()[-1] if err.strip() else ""
            print(f"  {name}: FAILED (exit {rc}) {last}", flush=True)
            rows.append({"what": f"{name} (failed)", "variant": name, "error": err, "s": math.nan,
                         "tok_s": math.nan, "tflops": math.nan, "mfu": math.nan, "gpu_gib": math.nan,
                         "process_s": time.perf_counter() - t0})
            continue
        got = json.loads(found[4:])
        rows.append({**got["row"], "process_s": time.perf_counter() - t0})
        prof = got["profile"] or prof
    return rows, prof


def summary(rows: list[dict], prof: dict | None, args, shape: str) -> dict:
    """bench/results/gpu-trainer.json's content (issue 15 point 5 names the first keys)."""
    by = {r["variant"]: r for r in rows}
    get = lambda v, k: by[v][k] if v in by and not math.isnan(by[v][k]) else None  # noqa: E731
    out = {"commit": args.commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "shape": shape,
           "reflow_mfu": get("default", "mfu"), "reflow_mfu_executed": get("default", "mfu_executed"),
           "reflow_tokens_per_s": get("default", "tok_s"), "reflow_all_scored_mfu": get("all-scored", "mfu"),
           "reflow_all_scored_tokens_per_s": get("all-scored", "tok_s"),
           "plain_tokens_per_s": get("plain", "tok_s"), "plain_compiled_tokens_per_s": get("plain-compiled", "tok_s"),
           "plain_mfu": get("plain", "mfu"), "plain_compiled_mfu": get("plain-compiled", "mfu"),
           "micro": args.micro}
    for mine, key in (("reflow_tokens_per_s", "reflow_over_plain_compiled"),
                      ("reflow_all_scored_tokens_per_s", "reflow_all_scored_over_plain_compiled")):
        if out[mine] and out["plain_compiled_tokens_per_s"]:
            out[key] = out[mine] / out["plain_compiled_tokens_per_s"]
    out.update(rows=rows, profile=prof)
    return out


def write(summary_: dict, out_dir: str | None) -> None:
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        Path(out_dir, "gpu-trainer.json").write_text(json.dumps(summary_, indent=1, default=str))
