"""The trainer on long, ragged samples (issue 54 point 7): reflow's TrainerRank packed, and padded, against a plain
compiled torch loop doing the same packed work; each variant in a process of its own.

    python3 bench/gpu_long.py                      # one H200: a Qwen2.5-1.5B shape, 152k vocabulary, bf16
    python3 bench/gpu_long.py --variants packed,plain-packed --samples 32
    .venv/bin/python bench/gpu_long.py --device cpu --tiny   # a smoke test of the same code on CPU

The batch: `--samples` samples of a `--prompt`-token prompt and a response of `--min-response`..`--max-response`
tokens (uniform, seeded), one PPO-clip `train_iteration` a step (ZeRO-1, bf16 with fp32 master weights, compiled
layers on CUDA, old log-probs from the training forward). Variants:

- `packed`: trainer.max_tokens_per_micro_batch=`--budget` (engines/train/packing.py), activation checkpointing auto;
- `padded`: micro-batches of `--micro` samples right-padded to their longest, as before packing;
- `packed-flex`: `packed` with transformers' flex_attention (a block mask whose empty blocks are skipped; SDPA
  computes each whole row under a dense block-diagonal mask);
- `packed-mixed`, `packed-tf32`: `packed` under trainer.precision=bf16-mixed, and fp32 with tf32 matmuls (the
  GPU demo's setting; activation checkpointing auto may turn on: fp32 activations are twice bf16's);
- `plain-packed` (`plain-packed-flex`: with flex_attention): the plain way on the very rows `packed` builds (reflow's packing plan and layout, nothing else of
  reflow): HF model in bf16 with SDPA, compiled decoder layers, cross-entropy on the scored positions only, fused
  AdamW on the bf16 weights, one backward per row, one step.

Each variant runs in a child process (dynamo's recompile limit and the CUDA caching allocator are per process: a
variant run first could leave the next one uncompiled or short of memory), warm-up step (compiles) first, then
`--steps` timed steps. MFU on executed FLOPs: per sample of n tokens, k of them scored, a forward is
2*N_layers*n + 2*L*d*n^2 (causal attention) + 2*V*d*k (the LM head runs on scored positions only), padding included
for `padded` (its rows' padded length); 3 forwards a step (forward + backward), 4 with activation checkpointing;
peak 989 TFLOP/s (H200 dense bf16). Writes $OUT/gpu-long.json (-> bench/results/gpu-long.json).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import child_row  # bench/ is this script's folder, first on sys.path

HERE = Path(__file__).resolve().parent
PEAK_BF16 = {"cuda": 989e12, "cpu": float("nan")}
QWEN15B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
               num_attention_heads=12, num_key_value_heads=2)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
VARIANTS = ("packed", "padded", "plain-packed")
# Precision (issue 54 point 4), packed as `packed`: bf16-mixed (fp32 weights, bf16 autocast) and fp32 with TF32 matmuls
PRECISIONS = {"packed-mixed": {"precision": "bf16-mixed"}, "packed-tf32": {"precision": "fp32", "tf32": True},
              # attention over packed rows through FlexAttention's block mask (empty blocks skipped) instead of SDPA
              "packed-flex": {"attn_implementation": "flex_attention"},
              # packed-flex, DeepSpeed folding each bf16 gradient into fp32 as backward makes it (no bf16 sum per row)
              "packed-flex-igu": {"attn_implementation": "flex_attention", "immediate_grad_update": True},
              # packed-flex summing the rows' gradients in bf16 (trainer.grad_accum_dtype=bf16), as the plain loop's
              # autograd does; the optimizer still steps fp32 master weights
              "packed-flex-bf16acc": {"attn_implementation": "flex_attention", "grad_accum_dtype": "bf16"}}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def build_folder(shape: dict, out: Path) -> Path:
    """A random-init Qwen2 of `shape` (bf16) with a synthetic word-level tokenizer, saved as an HF folder."""
    sys.path.insert(0, str(HERE))
    import engine_throughput as ET
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from reflow.rl.demo_policy import save_policy

    torch.manual_seed(0)
    cfg = Qwen2Config(**shape, max_position_embeddings=32768, tie_word_embeddings=False, rope_theta=1e6)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    return save_policy(model, ET.build_tokenizer(cfg.vocab_size), out)


def lengths(args) -> list[tuple[int, int]]:
    """(prompt, response) token counts of each sample."""
    rng = random.Random(0)
    return [(args.prompt, rng.randint(args.min_response, args.max_response)) for _ in range(args.samples)]


def batch(args, vocab: int):
    from reflow.rl.types import RolloutBatch

    g = torch.Generator().manual_seed(0)
    rows = [(torch.randint(4, vocab, (p,), generator=g).tolist(), torch.randint(4, vocab, (r,), generator=g).tolist())
            for p, r in lengths(args)]
    n = len(rows)
    return RolloutBatch(group_index=[i // 2 for i in range(n)], prompt_text=[""] * n, prompt_ids=[p for p, _ in rows],
                        response_text=[""] * n, response_ids=[r for _, r in rows],
                        rollout_logprobs=[[-1.0] * len(r) for _, r in rows], finish_reason=["length"] * n,
                        label=[None] * n, advantages=[1.0 if i % 2 else -1.0 for i in range(n)])


def executed_flops(cfg, seqs: list[tuple[int, int]], forwards: int) -> float:
    """Model FLOPs of `forwards` forwards over samples (tokens run, tokens scored)."""
    h, L, V, mlp = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    layers = L * (h * h * 2 + 2 * h * kv + 3 * h * mlp)
    return forwards * sum(2 * layers * n + 2 * L * h * n * n + 2 * V * h * k for n, k in seqs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(step, steps: int) -> tuple[float, float, object]:
    t0 = time.perf_counter()
    step()
    _sync()
    warm = time.perf_counter() - t0
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        last = step()
    _sync()
    return warm, (time.perf_counter() - t0) / steps, last


def _profiled(step, args, name: str) -> None:
    """--profile: one more step under torch.profiler; its kernels and reflow's ranges by device time (and the
    call stacks' CPU time) into $OUT/profile-<variant>.txt, the top rows on stdout."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        _sync()
    avg = prof.key_averages()
    key = "device_time_total" if args.device == "cuda" else "cpu_time_total"
    try:
        by_device = avg.table(sort_by=key, row_limit=45, max_name_column_width=90)
    except (AttributeError, KeyError, ValueError):  # older torch names it cuda_time_total
        by_device = avg.table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=90)
    text = f"# {name}: one step under torch.profiler\n{by_device}\n\n# by CPU time\n" + avg.table(
        sort_by="cpu_time_total", row_limit=25, max_name_column_width=90)
    (Path(os.environ.get("OUT") or ".") / f"profile-{name}.txt").write_text(text)
    print(by_device[:6000], flush=True)


def run_trainer(folder: Path, args, packed: bool, name: str = "") -> dict:
    import dataclasses

    from transformers import AutoConfig

    from reflow.engines.train.settings import RankSettings
    from reflow.engines.train.trainer import TrainerRank
    from reflow.rl.losses import LossSettings

    cuda = args.device == "cuda"
    s = RankSettings(zero_stage=1, precision="bf16", lr=1e-6, total_steps=1000, micro_batch_size=args.micro, threads=4,
                     backend="nccl" if cuda else "gloo", compile="auto",
                     max_micro_batch_tokens=args.budget if packed else args.micro * (args.prompt + args.max_response))
    if packed:
        s = dataclasses.replace(s, max_tokens_per_micro_batch=args.budget, **PRECISIONS.get(name, {}))
    trainer = TrainerRank(0, 1, "127.0.0.1", _free_port(), str(folder), s)
    cfg = AutoConfig.from_pretrained(folder)
    b = batch(args, cfg.vocab_size)
    kw = dict(minibatches=1, pad_id=0, loss=LossSettings(temperature=1.0, kl_estimator="k1"))
    warm, sec, m = _timed(lambda: trainer.train_iteration(b, **kw), args.steps)
    if args.profile:
        _profiled(lambda: trainer.train_iteration(b, **kw), args, name or "packed")
    forwards = (3 if m["old_logprobs_reused"] else 4) + (1 if m["activation_checkpointing"] else 0)
    if packed:
        seqs = [(p + r, r) for p, r in lengths(args)]
    else:  # every row of a micro-batch runs at its longest's length; the LM head from the first scored position
        ls = lengths(args)
        seqs = []
        for i in range(0, len(ls), args.micro):
            chunk = ls[i:i + args.micro]
            longest = max(p + r for p, r in chunk)
            seqs += [(longest, longest - min(p for p, _ in chunk)) for _ in chunk]
    fl = executed_flops(cfg, seqs, forwards)
    return {"variant": name or ("packed" if packed else "padded"), "precision": s.precision, "tf32": s.tf32, "s": sec, "warmup_s": warm,
            "tok_s": sum(p + r for p, r in lengths(args)) / sec, "tflops": fl / sec / 1e12,
            "mfu_executed": fl / sec / PEAK_BF16[args.device], "peak_gib": _peak_gib(),
            "pad_fraction": m["pad_fraction"], "forwards": forwards,
            "activation_checkpointing": m["activation_checkpointing"], "compile_graphs": m["compile_graphs"],
            "loss": m["loss"]}


def run_plain(folder: Path, args, attn: str = "sdpa") -> dict:
    """The plain way on the rows `packed` builds: HF model (bf16, SDPA), compiled layers, CE on scored positions."""
    from transformers import AutoModelForCausalLM

    from reflow.engines.train import packing
    from reflow.engines.train.compiled import packed_bucket
    from reflow.rl.types import to_train_tensors

    dev = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation=attn).to(dev)
    model.eval()  # no dropout, as the trainer ranks run (the loss still back-propagates)
    if args.device == "cuda":
        for layer in model.model.layers:
            layer.forward = torch.compile(layer.forward, dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=args.device == "cuda")
    b = batch(args, model.config.vocab_size)
    ls = [p + r for p, r in lengths(args)]
    plan = packing.plan(ls, 1, 1, args.budget)
    t = to_train_tensors(b, 0)
    scored = t["loss_mask"] != 0
    first = torch.where(scored.any(dim=1), scored.int().argmax(dim=1), scored.shape[1])
    rows = []
    for micro in plan.micros[0][0]:
        idx = torch.tensor(micro)
        pk = packing.pack(t["input_ids"][idx], [ls[i] for i in micro], first[idx].tolist(), 0,
                          length=packed_bucket(sum(ls[i] for i in micro), args.budget) if args.device == "cuda" else None)
        rows.append((pk.input_ids.to(dev), pk.position_ids.to(dev), pk.keep.to(dev), pk.labels.to(dev)))
    total = sum(int(r[3].numel()) for r in rows)

    def step():
        for ids, pos, keep, labels in rows:
            logits = model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep).logits
            loss = torch.nn.functional.cross_entropy(logits[0].float(), labels[0], reduction="sum") / total
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    warm, sec, _ = _timed(step, args.steps)
    if args.profile:
        _profiled(step, args, "plain-packed" + ("-flex" if attn == "flex_attention" else ""))
    fl = executed_flops(model.config, [(p + r, r) for p, r in lengths(args)], 3)
    return {"variant": "plain-packed" + ("-flex" if attn == "flex_attention" else ""), "s": sec, "warmup_s": warm, "tok_s": sum(ls) / sec, "tflops": fl / sec / 1e12,
            "mfu_executed": fl / sec / PEAK_BF16[args.device], "peak_gib": _peak_gib(), "forwards": 3,
            "rows": len(rows)}


def one(args) -> None:
    """A single variant in this process; its row as JSON on the last line of stdout."""
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    folder = Path(args.folder)
    name = args.variant
    if name.startswith("plain-packed"):
        row = run_plain(folder, args, "flex_attention" if name.endswith("-flex") else "sdpa")
    else:
        row = run_trainer(folder, args, name != "padded", name)
    print("ROW " + json.dumps(row), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="a tiny model and short samples: a smoke test")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens of each sample")
    p.add_argument("--min-response", type=int, default=512)
    p.add_argument("--max-response", type=int, default=4096)
    p.add_argument("--budget", type=int, default=16384, help="packed: tokens a micro-batch (one row)")
    p.add_argument("--micro", type=int, default=2, help="padded: samples a micro-batch")
    p.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--profile", action="store_true", help="one more step of each variant under torch.profiler "
                   "(after the timed ones): $OUT/profile-<variant>.txt")
    p.add_argument("--variant", help=argparse.SUPPRESS)  # the child's one variant
    p.add_argument("--folder", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.tiny:
        args.samples, args.prompt, args.min_response, args.max_response, args.budget, args.steps = 8, 4, 4, 24, 64, 1
    if args.variant:
        one(args)
        return
    shape = TINY if args.tiny else QWEN15B
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu-long-"))
    folder = build_folder(shape, Path(tempfile.mkdtemp(prefix="gpu-long-model-")) / "m")
    ls = lengths(args)
    print(f"# {'tiny' if args.tiny else 'Qwen2.5-1.5B'} shape {shape}, bf16; {args.samples} samples of {args.prompt} + "
          f"{args.min_response}..{args.max_response} tokens ({sum(p + r for p, r in ls)} in all); packed budget "
          f"{args.budget}, padded micro {args.micro}; {args.steps} timed steps; device {args.device}", flush=True)
    rows = []
    for name in args.variants.split(","):
        row = child_row([sys.executable, __file__, *sys.argv[1:], "--variant", name, "--folder", str(folder)], name)
        rows.append(row)
        if "error" in row:
            continue
        print(f"  {name:13s} {row['s']:.3f} s/step  {row['tok_s']:.0f} tok/s  {row['tflops']:.1f} TFLOP/s  "
              f"MFU(executed) {row['mfu_executed']:.1%}  peak {row['peak_gib']:.1f} GiB"
              + (f"  pad {row['pad_fraction']:.3f}" if "pad_fraction" in row else ""), flush=True)
    by = {r["variant"]: r for r in rows if "error" not in r}
    summary = {"shape": "tiny" if args.tiny else "qwen2.5-1.5b", "device": args.device,
               "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
               "samples": args.samples, "tokens": sum(p + r for p, r in ls), "budget": args.budget,
               "rows": rows}
    # The headline keys describe the fastest packed variant run (flex_attention where it ran), against the plain loop
    # with the same attention kernel.
    for mine, plain in (("packed", "plain-packed"), ("packed-flex", "plain-packed-flex")):
        if mine not in by:
            continue
        summary.update(variant=mine, mfu_executed=by[mine]["mfu_executed"], pad_fraction=by[mine]["pad_fraction"],
                       peak_gib=by[mine]["peak_gib"], ratio_vs_plain=by[plain]["s"] / by[mine]["s"] if plain in by else None,
                       speedup_vs_padded=by["padded"]["s"] / by[mine]["s"] if "padded" in by else None)
    summary["seven_b_iterations"] = None  # the 7B run in the real flow is its own step (not run by this script)
    (out / "gpu-long.json").write_text(json.dumps(summary, indent=2, default=lambda v: None if v != v else v))
    print("summary: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()
                                  if isinstance(v, float) and not math.isnan(v)), flush=True)


if __name__ == "__main__":
    main()
