"""Decode attention over the KV pool's regions, as one Triton kernel (flash decoding, split over the keys).

Why not flash attention's varlen kernel (static_decode's "flash"): a decode step has one query per row, and
that kernel tiles queries 128 at a time, so a KV head's 6 query heads (GQA, Qwen2.5-1.5B) fill 6 of 128
tile rows: it computed ~20x the useful products, and it runs one thread block per (row, KV head) over all of
that row's keys, so a batch's long tail of a few 8k-token rows left most of the GPU idle (measured on an H100:
~7.8 ms a step, batch 256 or 4). Here a program handles (row, KV head, split): the head's G queries padded
to 16 tile rows, the keys of its split in blocks of 64, online softmax (Dao et al. 2022); splits are chosen so
that about two programs run per SM, and their partial results are merged by log-sum-exp weights.
Layout: q [b, Hkv, G, D]; K/V pool [N + 1, Hkv, D] (static_decode.py); a row's keys at start .. start + used - 1.
bf16/fp16 regions, and float32 ones (an fp32 engine: the GPU demo's): their products in IEEE float32, or on TF32
tensor cores where the process allows TF32 for float32 products (reflow.engines.hf_io.set_tf32, trainer.tf32), as
every other product of that engine.
"""
from __future__ import annotations

import math

import torch

try:  # Triton comes with torch's CUDA builds; the CPU build (tests, the demo) has none
    import triton
    import triton.language as tl
except ImportError:  # deliberate: no Triton, no kernel (the decoder then uses flash attention or a gather)
    triton = None

BLOCK_N = 64  # keys a program loads at a time
GP = 16  # a KV head's query heads padded to this many tile rows (tl.dot's smallest)


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _decode_kernel(q_ptr, k_ptr, v_ptr, start_ptr, used_ptr, o_ptr, lse_ptr, scale,
                       s_qb, s_qh, s_qg, s_kn, s_kh, s_ob, s_oh, s_os, s_og, s_lb, s_lh, s_ls,
                       G: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr, GP: tl.constexpr,
                       BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        row, head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start = tl.load(start_ptr + row)
        used = tl.load(used_ptr + row)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + row * s_qb + head * s_qh + g[:, None] * s_qg + d[None, :], mask=g[:, None] < G, other=0.0)
        q = (q.to(tl.float32) * (scale * 1.4426950408889634)).to(k_ptr.dtype.element_ty)  # log2 domain, the keys' dtype
        m = tl.full([GP], float("-inf"), tl.float32)
        den = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        lo = split * CHUNK
        hi = tl.minimum(lo + CHUNK, used)
        for n in range(lo, hi, BLOCK_N):
            offs = n + tl.arange(0, BLOCK_N)
            keep = offs < hi
            where = (start + offs)[:, None] * s_kn + head * s_kh + d[None, :]
            k = tl.load(k_ptr + where, mask=keep[:, None], other=0.0)  # [BLOCK_N, D]
            if IEEE:  # float32 regions, TF32 not allowed: exact float32 products
                s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [GP, BLOCK_N]
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(keep[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            v = tl.load(v_ptr + where, mask=keep[:, None], other=0.0)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            den = den * alpha + tl.sum(p, 1)
            m = m_new
        full = den > 0
        out = acc / tl.where(full, den, 1.0)[:, None]
        lse = tl.where(full, m + tl.log2(tl.where(full, den, 1.0)), float("-inf"))
        tl.store(o_ptr + row * s_ob + head * s_oh + split * s_os + g[:, None] * s_og + d[None, :], out,
                 mask=g[:, None] < G)
        tl.store(lse_ptr + row * s_lb + head * s_lh + split * s_ls + g, lse, mask=g < G)


def ieee_products(dtype: torch.dtype) -> bool:
    """Whether the kernel's products run in IEEE float32: float32 regions where TF32 is not allowed (torch's
    float32 matmul precision "highest", its default)."""
    return dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"


def serves(p: torch.Tensor) -> bool:
    """Whether the kernel serves KV regions like `p`: on a CUDA device, in bf16, fp16 or float32."""
    return available() and p.device.type == "cuda" and p.dtype in (torch.bfloat16, torch.float16, torch.float32)


def splits_for(b: int, kv_heads: int, t: int, sms: int) -> int:
    """Key splits per (row, KV head): enough programs for ~2 per SM, each split at least 256 keys."""
    want = max(1, math.ceil(2 * sms / (b * kv_heads)))
    return max(1, min(want, t // 256))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, used: torch.Tensor,
                     t: int, scale: float, splits: int, block_n: int = BLOCK_N, num_warps: int = 4,
                     num_stages: int | None = None) -> torch.Tensor:
    """q [b, Hkv, G, D]; k/v [N + 1, Hkv, D]; start/used [b] (keys start .. start + used - 1, used <= t) ->
    [b, Hkv, G, D] in q's dtype. K/V may be held in a narrower dtype than q (rollout.kv_cache_dtype): q is then
    rounded to theirs for its products with the keys, the softmax and the sums staying float32. Shapes depend on
    (b, t, splits) only, so a CUDA graph can hold it. `block_n`,
    `num_warps`, `num_stages`: the launch's tiling (keys a program loads at a time, its warps, Triton's software
    pipelining depth, None: its default). The defaults were swept on an H100 over the 1.5B shape's rollouts
    (bench/gpu_rollout_long.py --tune-attention, RESULTS 43): alone, 64 keys / 8 warps / 4 stages came within
    1.04x of each shape's best where these took 1.11-1.70x its time; inside the fused decode step's CUDA graph the
    two measured the same (graph 5.30 ms these, 5.41 ms that, batch 256 x 1,024 tokens, one machine, one call), so
    these stay until a change shows in the step."""
    assert triton is not None
    b, H, G, D = q.shape
    chunk = -(-t // splits)
    chunk = -(-chunk // block_n) * block_n
    tiling = {"num_warps": num_warps, **({"num_stages": num_stages} if num_stages else {})}
    q = q.contiguous()
    out = torch.empty((b, H, splits, G, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, H, splits, G), dtype=torch.float32, device=q.device)
    _decode_kernel[(b, H, splits)](q, k, v, start, used, out, lse, scale,
                                   q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
                                   out.stride(0), out.stride(1), out.stride(2), out.stride(3),
                                   lse.stride(0), lse.stride(1), lse.stride(2),
                                   G=G, D=D, CHUNK=chunk, GP=GP, BLOCK_N=block_n, IEEE=ieee_products(k.dtype),
                                   **tiling)
    if splits == 1:
        return out[:, :, 0].to(q.dtype)
    w = torch.exp2(lse - lse.amax(2, keepdim=True))  # [b, H, S, G]; an empty split weighs 0
    return ((out * w[..., None]).sum(2) / w.sum(2)[..., None]).to(q.dtype)
