"""Does reflow's trainer take the same step on the GPU whichever way it lays out a batch of long, ragged samples?

    python3 bench/gpu_packed_check.py                        # one GPU: the GPU demo's ~113M shape, fp32
    python3 bench/gpu_packed_check.py --folder /path/to/policy   # a policy of yours (an HF folder)
    .venv/bin/python bench/gpu_packed_check.py --device cpu --tiny   # the same code on CPU (no flex_attention there)

Why: the scratchpad task's first GPU run (configs/gpu-scratchpad.yaml: packed rows, flex_attention, compiled
layers, activation checkpointing auto, TF32) lost its held-out accuracy within ten iterations, while the same
task on CPU (SDPA, eager) learned. The CPU suite checks packed against padded only where CPU runs (SDPA and eager
attention, no flex_attention backward, no inductor), so this script checks the GPU-only paths against the plain one.

Each variant (VARIANTS) runs one `TrainerRank.train_iteration` (ZeRO-1, one PPO-clip step, one mini-batch) from the
same weights on the same batch, in a child process of its own. With Adam's first step every weight moves by about
lr x sign(its gradient), so the step's direction is compared weight by weight against the reference (`padded`:
right-padded micro-batches, SDPA, no compile, no checkpointing, float32 products): `sign_agreement` is the share
of weights that moved the same way among those the reference moved by more than lr/2, `cosine` the cosine of
the two updates; loss, entropy and gradient norm are compared as relative differences. A layout that computes
the same step agrees to ~1.0 in IEEE float32 (TF32 products round at ~1e-3: expect less there, still near 1);
a wrong mask, position or recomputation shows as far lower agreement. Writes $OUT/gpu-packed-check.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import child_row  # bench/ is this script's folder, first on sys.path

# name -> (packed, RankSettings overrides); "budget" is replaced by --budget
VARIANTS: dict[str, tuple[bool, dict]] = {
    "padded": (False, {"compile": "off", "attn_implementation": "sdpa", "activation_checkpointing": "off"}),
    "packed-sdpa": (True, {"compile": "off", "attn_implementation": "sdpa", "activation_checkpointing": "off"}),
    "packed-flex": (True, {"compile": "off", "attn_implementation": "flex_attention",
                           "activation_checkpointing": "off"}),
    "packed-flex-compiled": (True, {"compile": "on", "attn_implementation": "flex_attention",
                                    "activation_checkpointing": "off"}),
    "packed-flex-compiled-ckpt": (True, {"compile": "on", "attn_implementation": "flex_attention",
                                         "activation_checkpointing": "on"}),
    # configs/gpu-scratchpad.yaml's trainer: packing, attention and compile by default, checkpointing auto, TF32
    "scratchpad-config": (True, {"compile": "auto", "activation_checkpointing": "auto", "tf32": True}),
    # configs/gpu-demo.yaml's trainer (the addition demo that learns): padded, compiled, TF32
    "demo-config": (False, {"compile": "auto", "activation_checkpointing": "auto", "tf32": True}),
}
CUDA_ONLY = ("flex", "compiled", "config")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_folder(args, out: Path) -> Path:
    from reflow.rl.demo_policy import SIZES, build_model, build_tokenizer, save_policy

    tok = build_tokenizer()
    model = build_model(tok, **SIZES["tiny" if args.tiny else "gpu"], max_positions=1024, seed=0)
    return save_policy(model, tok, out)


def lengths(args) -> list[tuple[int, int]]:
    rng = random.Random(0)
    return [(rng.randint(6, 14), rng.randint(args.min_response, args.max_response)) for _ in range(args.samples)]


def batch(args, vocab: int):
    from reflow.rl.types import RolloutBatch

    g = torch.Generator().manual_seed(0)
    rows = [(torch.randint(4, vocab, (p,), generator=g).tolist(), torch.randint(4, vocab, (r,), generator=g).tolist())
            for p, r in lengths(args)]
    n = len(rows)
    adv = torch.randn(n, generator=g).tolist()
    return RolloutBatch(group_index=[i // 4 for i in range(n)], prompt_text=[""] * n, prompt_ids=[p for p, _ in rows],
                        response_text=[""] * n, response_ids=[r for _, r in rows],
                        rollout_logprobs=[[-1.0] * len(r) for _, r in rows], finish_reason=["stop"] * n,
                        label=[None] * n, advantages=adv)


def one(args) -> None:
    """One variant in this process: its metrics as JSON on stdout's last line, its update in args.update_file."""
    import dataclasses
    import logging

    from transformers import AutoConfig

    from reflow.engines.train.settings import RankSettings
    from reflow.engines.train.trainer import TrainerRank
    from reflow.rl.losses import LossSettings

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    packed, over = VARIANTS[args.variant]
    cuda = args.device == "cuda"
    longest = max(p + r for p, r in lengths(args))
    s = RankSettings(zero_stage=1, precision="fp32", lr=args.lr, total_steps=10, micro_batch_size=args.micro,
                     threads=2, backend="nccl" if cuda else "gloo",
                     max_micro_batch_tokens=args.budget if packed else args.micro * longest)
    s = dataclasses.replace(s, **over, **({"max_tokens_per_micro_batch": args.budget} if packed else {}))
    trainer = TrainerRank(0, 1, "127.0.0.1", _free_port(), str(args.folder), s)
    before = {k: v.float().clone() for k, v in trainer.named_weights()}
    b = batch(args, AutoConfig.from_pretrained(args.folder).vocab_size)
    t0 = time.perf_counter()
    m = trainer.train_iteration(b, minibatches=1, pad_id=0, loss=LossSettings(temperature=1.0))
    seconds = time.perf_counter() - t0
    update = {k: (v.float() - before[k]) for k, v in trainer.named_weights()}
    torch.save(update, args.update_file)
    keys = ("loss", "pg_loss", "entropy", "grad_norm", "pad_fraction", "activation_checkpointing", "compile_graphs")
    row = {"variant": args.variant, "packed": packed, **over, "seconds": seconds, **{k: m.get(k) for k in keys}}
    print("ROW " + json.dumps(row), flush=True)


def compare(ref: dict, other: dict, lr: float) -> dict:
    agree = moved = 0
    dot = na = nb = 0.0
    for k, a in ref.items():
        o = other[k]
        big = a.abs() > lr / 2
        moved += int(big.sum())
        agree += int((torch.sign(a) == torch.sign(o))[big].sum())
        dot += float((a.double() * o.double()).sum())
        na += float(a.double().square().sum())
        nb += float(o.double().square().sum())
    return {"sign_agreement": agree / max(moved, 1), "cosine": dot / max((na * nb) ** 0.5, 1e-30),
            "weights_moved": moved}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="the CPU demo's ~1M shape and short samples")
    p.add_argument("--folder", help="an HF policy folder (default: a random-init GPU demo shape)")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--min-response", type=int, default=80)
    p.add_argument("--max-response", type=int, default=900)
    p.add_argument("--budget", type=int, default=32768, help="packed: tokens a micro-batch (one row)")
    p.add_argument("--micro", type=int, default=8, help="padded: samples a micro-batch")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--update-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.tiny:
        args.samples, args.min_response, args.max_response, args.budget, args.micro = 16, 8, 90, 512, 4
    if args.variant:
        one(args)
        return
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu-packed-check-"))
    work = Path(tempfile.mkdtemp(prefix="gpu-packed-check-work-"))
    if not args.folder:
        args.folder = str(build_folder(args, work / "policy"))
    names = [n for n in args.variants.split(",") if args.device == "cuda" or not any(c in n for c in CUDA_ONLY)]
    print(f"# {args.samples} samples of 6-14 + {args.min_response}..{args.max_response} tokens; packed budget "
          f"{args.budget}, padded micro {args.micro}; lr {args.lr}; policy {args.folder}; variants {names}",
          flush=True)
    rows, updates = [], {}
    for name in names:
        upd = work / f"{name}.pt"
        row = child_row([sys.executable, __file__, *sys.argv[1:], "--variant", name, "--update-file", str(upd),
                         "--folder", args.folder], name)
        if "error" in row:
            rows.append(row)
            continue
        updates[name] = torch.load(upd)
        if name != names[0] and names[0] in updates:
            ref_row = rows[0]
            row.update(compare(updates[names[0]], updates[name], args.lr))
            for k in ("loss", "entropy", "grad_norm"):
                if row.get(k) is not None and ref_row.get(k):
                    row[f"{k}_rel_diff"] = abs(row[k] - ref_row[k]) / abs(ref_row[k])
        rows.append(row)
        print(f"  {name:26s} loss {row['loss']:.6f} entropy {row['entropy']:.5f} grad_norm {row['grad_norm']:.5f}"
              + (f"  sign agreement {row['sign_agreement']:.4f} cosine {row['cosine']:.4f}" if "cosine" in row else
                 "  (reference)"), flush=True)
    summary = {"device": args.device, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
               "torch": torch.__version__, "reference": names[0], "samples": args.samples,
               "response_tokens": [args.min_response, args.max_response], "budget": args.budget, "lr": args.lr,
               "rows": rows}
    (out / "gpu-packed-check.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
