"""The scratchpad task's GPU bootstrap (issue 56 point 2): how fast its warm-up steps run, and how long it takes to
reach its target, under float32 + TF32 (the setting's default) and under bf16 autocast. Needs torch and
transformers only (no Ray, no Prefect: no carried wheels):

    PYTHONPATH=src python3 bench/gpu_bootstrap.py --variant tf32 --steps 40 --out $OUT    # s/step, peak memory
    PYTHONPATH=src python3 bench/gpu_bootstrap.py --variant bf16 --full --out $OUT       # the whole bootstrap
    PYTHONPATH=src python3 bench/gpu_bootstrap.py --variant bf16 --micro-batches 1 --out $OUT  # one padded forward

Each variant in its own process. The steps: 64 worked traces drawn from the seed-0 train file (2-6 digit
operands, 83-913 tokens), in --micro-batches forwards cut by length (default: the gpu setting's), each padded to
its own longest, one AdamW step each; the first 5 are not timed. Writes $OUT/bootstrap-<variant>-mb<N>[-full].json.
"""
from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from pathlib import Path

import torch

from reflow.rl import scratchpad_task
from reflow.rl.demo_policy import SIZES, _sft_step, answer_batch, build_model, build_tokenizer
from reflow.rl.scratchpad_demo import SETTINGS, bootstrap_scratchpad, write_scratchpad_data


def steps(variant: str, n: int, data: dict, micro_batches: int = 1) -> dict:
    setting = SETTINGS["gpu"]
    rows = [json.loads(x) for x in Path(data["train"]).read_text().splitlines()]
    tok = build_tokenizer()
    model = build_model(tok, **SIZES["gpu"], max_positions=setting["max_positions"], seed=0).to("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=setting["warmup"]["lr"])
    batch_fn = functools.partial(answer_batch, target=scratchpad_task.row_trace)
    g = torch.Generator().manual_seed(0)
    times, losses, tokens = [], [], 0
    for i in range(n + 5):
        pick = [rows[j] for j in torch.randint(len(rows), (setting["warmup"]["batch"],), generator=g).tolist()]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(_sft_step(model, opt, tok, pick, batch_fn, autocast=variant == "bf16",
                                micro_batches=micro_batches))
        torch.cuda.synchronize()
        if i >= 5:
            times.append(time.perf_counter() - t0)
            tokens += sum(len(scratchpad_task.row_trace(r)) for r in pick)
    return {"variant": variant, "micro_batches": micro_batches, "steps_timed": n, "s_per_step": sum(times) / n, "steps_per_s": n / sum(times),
            "trace_tokens_per_s": tokens / sum(times), "loss_first": losses[0], "loss_last": losses[-1],
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=("tf32", "bf16"), default="tf32")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--micro-batches", type=int, default=None,
                    help="forwards a step, its rows cut by length (demo_policy._sft_step); default: the gpu setting's")
    ap.add_argument("--full", action="store_true", help="the whole bootstrap to its target (bootstrap_scratchpad)")
    ap.add_argument("--out", default="gpu-out")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    torch.set_float32_matmul_precision("high")  # both variants: TF32 where float32 products remain
    work = Path(tempfile.mkdtemp(prefix="bootstrap-"))
    data = write_scratchpad_data(work / "data", 0, "gpu")
    micro = args.micro_batches or SETTINGS["gpu"]["warmup"].get("micro_batches", 1)
    if args.full:
        t0 = time.perf_counter()
        res = bootstrap_scratchpad(work / "policy", data, seed=0, size="gpu", device="cuda", progress=True,
                                   autocast=args.variant == "bf16", micro_batches=micro)
        res["wall_s"] = time.perf_counter() - t0
        res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    else:
        res = steps(args.variant, args.steps, data, micro)
    res["card"] = torch.cuda.get_device_name()
    name = f"bootstrap-{args.variant}-mb{micro}{'-full' if args.full else ''}.json"
    Path(args.out, name).write_text(json.dumps(res, indent=1, default=str))
    keep = ("variant", "micro_batches", "s_per_step", "steps_per_s", "trace_tokens_per_s", "peak_gib", "eval_accuracy_after", "seconds",
            "wall_s", "loss_last")
    print(f"bootstrap {name}: " + json.dumps({k: res[k] for k in keep if k in res} |
                                            ({"warmup": res["warmup"]} if "warmup" in res else {})), flush=True)


if __name__ == "__main__":
    main()
