"""The trainer's fused log-prob / entropy pass (rl/losses.logprobs_and_entropy), forward + backward with
entropy, over blocks of whole rows (the current `_chunks`) against one row at a time (how it chunked
before 5a7eaf1), in one process on CPU or a GPU. Prints a table and ends with
`fused_logprobs: <shape>=<speedup>x ...`.

Shapes: the CPU demo's micro-batch (256 rows of ~17 tokens, its 24-token vocabulary), the GPU demo's
(256 x 17, its character vocabulary), and a long-sequence, large-vocabulary case where a row is split
by positions either way (the ratio there should stay ~1).

    python bench/fused_logprobs.py [--reps 10] [--device cuda]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator

import _common  # noqa: F401  (puts the repository on sys.path)
import torch

from reflow.rl import losses

SHAPES = {"cpu-demo": (256, 17, 24), "gpu-demo": (256, 17, 64), "long-vocab": (4, 512, 32768)}


def per_row_chunks(logits: torch.Tensor) -> Iterator[tuple[int, int, int, int]]:
    """The previous chunking: one row (or a slice of positions of one row) per block."""
    B, T, V = logits.shape
    step = max(1, losses._CHUNK_ELEMENTS // max(V, 1))
    for b in range(B):
        for s in range(0, T, step):
            yield b, b + 1, s, min(T, s + step)


def seconds(shape: tuple[int, int, int], device: str, reps: int) -> float:
    """Median seconds of one forward + backward (with entropy) over logits of `shape` (bf16 on a GPU)."""
    B, T, V = shape
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T + 1, V, generator=g).to(device=device, dtype=dtype)[:, :-1]  # a slice, as the trainer's
    labels = torch.randint(0, V, (B, T), generator=g).to(device)
    times = []
    for r in range(reps + 2):  # two warm-ups (compilation on a GPU)
        x = logits.detach().requires_grad_(True)
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        logp, ent = losses.logprobs_and_entropy(x, labels, 1.0, entropy=True)
        (logp.sum() + ent.sum()).backward()
        if device == "cuda":
            torch.cuda.synchronize()
        if r >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    blocks = losses._chunks
    rows, summary = [], []
    for name, shape in SHAPES.items():
        if a.device == "cpu" and name == "long-vocab":
            shape = (2, 256, 8192)  # the same kind of case at a size a CPU finishes in seconds
        res = {}
        for label, fn in (("per-row", per_row_chunks), ("blocks", blocks)) * 2:  # interleaved, best of two
            losses._chunks = fn
            res[label] = min(res.get(label, float("inf")), seconds(shape, a.device, a.reps))
        losses._chunks = blocks
        ratio = res["per-row"] / res["blocks"]
        rows.append((name, "x".join(map(str, shape)), res["per-row"] * 1e3, res["blocks"] * 1e3, ratio))
        summary.append(f"{name}={ratio:.1f}x")
    print(f"device {a.device}, forward + backward with entropy, median of {a.reps}")
    print(f"{'shape':12} {'B x T x V':>16} {'per-row ms':>11} {'blocks ms':>10} {'speedup':>8}")
    for name, shp, old, new, ratio in rows:
        print(f"{name:12} {shp:>16} {old:11.2f} {new:10.2f} {ratio:7.1f}x")
    print("fused_logprobs: " + " ".join(summary))


if __name__ == "__main__":
    main()
