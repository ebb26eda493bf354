"""A decode step's sampling as one Triton kernel (GPU engines; sampling.sample_tokens's math, fewer passes).

Why: at batch 256 over a 151,936-token vocabulary the step's float32 logits are 155 MB, and sample_tokens reads and
writes them ~7 times in separate kernels (the division by the temperature, log_softmax, exp, cumsum, searchsorted,
the gathers, argmax): at the 1.5B shape that was most of what a decode step spent outside its CUDA graph (bench/
RESULTS.md 33: a 9.0 ms step, 5.1 ms of it the graph). Here one program per row reads its logits twice: a first
pass keeps the running maximum, the sum of exp(x / T - max) rescaled as the maximum moves (online softmax), and the
first index of the maximum; the second walks the row's cumulative probability block by block and takes the first
token where it passes the row's draw times the total (sample_tokens's inversion of the cumulative distribution at
one uniform draw a row, so seeded rows draw exactly as there). The logprob is x_t / T - max - log(sum), SGLang's
log_softmax(logits / T) of the chosen token; greedy rows (T < SAMPLING_EPS) take the first maximum and T = 1.
Rows filtered by top-p / top-k / min-p are not handled here: sample_tokens keeps its own path for a batch with any.
Where the draw lands past the last token by rounding, the row's mode is taken (as sample_tokens does).
"""
from __future__ import annotations

import os

import torch

try:  # Triton comes with torch's CUDA builds; the CPU build (tests, the demo) has none
    import triton
    import triton.language as tl
except ImportError:  # deliberate: no Triton, no kernel (sample_tokens's torch path serves)
    triton = None

BLOCK = 4096  # logits a program loads at a time
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton reads it once too (set before import, as the tests do)


def available() -> bool:
    return triton is not None


def serves(logits: torch.Tensor) -> bool:
    """Whether the kernel can sample these logits: float32 [B, V] with unit stride along V, on a GPU (or on
    CPU under Triton's interpreter, TRITON_INTERPRET=1: the tests)."""
    on = logits.is_cuda or _INTERPRETED
    return (triton is not None and on and logits.dim() == 2 and logits.dtype == torch.float32
            and logits.stride(1) == 1 and logits.shape[0] > 0)


if triton is not None:
    @triton.jit
    def _sample_kernel(x_ptr, stride, V, inv_t_ptr, greedy_ptr, u_ptr, tok_ptr, lp_ptr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        inv_t = tl.load(inv_t_ptr + row)
        offs = tl.arange(0, BLOCK)
        m = tl.full([], float("-inf"), tl.float32)  # running maximum of x / T
        s = tl.zeros([], tl.float32)  # sum of exp(x / T - m)
        best = tl.zeros([], tl.int64)  # first index of the maximum
        for start in range(0, V, BLOCK):
            idx = start + offs
            x = tl.load(base + idx, mask=idx < V, other=float("-inf")) * inv_t
            bm = tl.max(x, 0)
            new = tl.maximum(m, bm)
            first = tl.min(tl.where(x == bm, idx, V), 0).to(tl.int64)  # this block's first maximum
            best = tl.where(bm > m, first, best)
            keep = tl.where(m == new, 1.0, tl.exp(m - new))  # (both -inf: nothing to rescale)
            s = s * keep + tl.sum(tl.where(x == float("-inf"), 0.0, tl.exp(x - new)), 0)
            m = new
        target = (tl.load(u_ptr + row) * s.to(tl.float64)).to(tl.float32)  # the draw times the row's total
        acc = tl.zeros([], tl.float32)
        found = tl.full([], V, tl.int64)
        for start in range(0, V, BLOCK):
            idx = start + offs
            x = tl.load(base + idx, mask=idx < V, other=float("-inf")) * inv_t
            p = tl.where(x == float("-inf"), 0.0, tl.exp(x - m))
            c = tl.cumsum(p, 0) + acc
            found = tl.minimum(found, tl.min(tl.where((c > target) & (idx < V), idx, V), 0).to(tl.int64))
            acc += tl.sum(p, 0)
        tok = tl.where((found < V) & (tl.load(greedy_ptr + row) == 0), found, best)
        lp = tl.load(base + tok) * inv_t - m - tl.log(s)
        tl.store(tok_ptr + row, tok)
        tl.store(lp_ptr + row, lp)


def sample(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor | None,
           greedy_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B] long, logprobs [B] float32) for logits [B, V] float32 (`serves`), temperature [B] (below
    greedy_eps: greedy), uniform [B] float64 in (0, 1) or None (every row greedy)."""
    B, V = logits.shape
    greedy = temperature < greedy_eps  # [B]
    inv_t = torch.where(greedy, torch.ones_like(temperature), 1.0 / temperature).float()  # [B]
    u = uniform if uniform is not None else torch.zeros(B, dtype=torch.float64, device=logits.device)
    tokens = torch.empty(B, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    _sample_kernel[(B,)](logits, logits.stride(0), V, inv_t, greedy.to(torch.int8), u.double(), tokens, logprobs,
                         BLOCK=BLOCK, num_warps=8)
    return tokens, logprobs.clamp_min(torch.finfo(torch.float32).min)  # as SGLang: never -inf in JSON
