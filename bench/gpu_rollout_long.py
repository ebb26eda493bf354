"""Long generations on one GPU (issue 55 points 2 and 4): the embedded engine against the HBM roofline and
against transformers `generate`, and the train/inference log-prob mismatch by position.

    PYTHONPATH=src:bench python3 bench/gpu_rollout_long.py --out $OUT      # bench/gpu_machine/rollout_long.sh

Model: Qwen2.5-1.5B's shape (28 layers, hidden 1536, 12 query / 2 KV heads of 128, MLP 8960, vocabulary 151,936,
tied embeddings), random weights, bf16. Prompts: 256 random tokens. Responses forced to their lengths with
ignore_eos and per-request max_new_tokens, sampled at temperature 1. Workloads:
- uniform: 256 requests of 1,024 tokens at batch 256, also through HF `generate` (the same prompts and lengths;
  ratio_vs_generate_b256);
- longtail: 256 requests at batch 256 whose lengths are the quantiles of a log-normal (median 1,024, sigma 0.77:
  p99 ~6k, longest capped at 8,000): the whole batch waits for its longest (partial rollouts off);
- stream: 512 such requests through 256 rows (continuous batching refills rows as others finish).
Roofline: each decode step must read every weight once and each running row's K/V up to its position, so
bound(step) = (weight bytes + sum over rows of (position + 1) * KV bytes a token) / HBM bandwidth (H200 4.8 TB/s,
H100 SXM 3.35 TB/s: the vendors' figures); roofline fraction = sum of bounds / wall time of `generate` (prefill,
sampling and the host's work included). Idle fraction = 1 - (rows decoded over all steps) / (256 * steps).
Mismatch: 16 requests of 2,048 tokens from the engine, then the same tokens through a trainer-style HF forward
(whole sequence, SDPA) under the same precision; |engine logprob - trainer logprob| by response position.
Writes $OUT/gpu-rollout-long.json.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import statistics
import time
from pathlib import Path

import engine_throughput as ET
import torch
import torch.nn.functional as F

from reflow.engines.embedded.generator import Generator
from reflow.engines.embedded.kv_pool import bytes_per_position
from reflow.engines.embedded.static_decode import _bucket

SHAPE = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
             num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True)
PROMPT = 256
BATCH = 256


def build(dtype: torch.dtype, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(**SHAPE, pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    with torch.device("cuda"):
        return Qwen2ForCausalLM(cfg).to(dtype).eval()


def bandwidth() -> tuple[float, str]:
    name = torch.cuda.get_device_name()
    return (4.8e12 if "H200" in name else 3.35e12), name


def longtail(n: int, median: int = 1024, sigma: float = 0.77, cap: int = 8000, floor: int = 64) -> list[int]:
    """Quantiles of a log-normal, shuffled with a fixed seed (the long ones not all at the end)."""
    z = [statistics.NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)]
    out = [max(floor, min(cap, round(median * math.exp(sigma * x)))) for x in z]
    g = torch.Generator().manual_seed(3)
    return [out[i] for i in torch.randperm(n, generator=g).tolist()]


class Steps:
    """Counts what each decode step reads (rows, keys) by wrapping the decoder's `decode`."""

    def __init__(self, dec):
        self.dec, self.real = dec, dec.decode
        self.steps = self.rows = self.keys = 0
        dec.decode = self

    def __call__(self, tokens, positions, starts):
        self.steps += 1
        self.rows += len(positions)
        self.keys += sum(positions) + len(positions)
        return self.real(tokens, positions, starts)

    def reset(self):
        self.steps = self.rows = self.keys = 0


def run(gen, steps: Steps, prompts, lengths, wbytes: int, kvbytes: int, bw: float, tag: str,
        generate=ET.run_ours) -> dict:
    """One workload timed through `generate(gen, prompts, lengths)` -> tokens, with its roofline figures."""
    steps.reset()
    sec, tokens = ET.timed(lambda: generate(gen, prompts, lengths))
    bound = (steps.steps * wbytes + steps.keys * kvbytes) / bw
    row = {"workload": tag, "requests": len(prompts), "tokens": tokens, "seconds": sec, "tokens_per_s": tokens / sec,
           "steps": steps.steps, "mean_rows_per_step": steps.rows / max(steps.steps, 1),
           "idle_fraction": 1 - steps.rows / (BATCH * max(steps.steps, 1)), "weight_gb_read": steps.steps * wbytes / 1e9,
           "kv_gb_read": steps.keys * kvbytes / 1e9, "bound_s": bound, "roofline_fraction": bound / sec,
           "ms_per_step": 1e3 * sec / max(steps.steps, 1), "max_len": max(lengths),
           "p50_len": sorted(lengths)[len(lengths) // 2], "p99_len": sorted(lengths)[int(0.99 * len(lengths))]}
    print(f"  {tag}: {tokens} tokens in {sec:.2f} s = {row['tokens_per_s']:.0f} tok/s, {steps.steps} steps "
          f"({row['ms_per_step']:.2f} ms), roofline {row['roofline_fraction']:.3f}, idle {row['idle_fraction']:.3f}",
          flush=True)
    return row


def check_kernels(dtype: torch.dtype = torch.bfloat16) -> dict:
    """Each decode-attention kernel against float32 SDPA on random regions of `dtype` (rows of 1..8000 keys);
    float32 regions: the Triton kernel only (flash attention takes half types), under this process's float32
    matmul precision (IEEE at "highest", TF32 otherwise)."""
    from reflow.engines.embedded import decode_attention as TD

    g = torch.Generator(device="cuda").manual_seed(0)
    N, H, G, D, b = 40000, 2, 6, 128, 12
    k, v = (torch.randn(N + 1, H, D, device="cuda", generator=g).to(dtype) for _ in range(2))
    q = torch.randn(b, H, G, D, device="cuda", generator=g).to(dtype)
    used = torch.tensor([1, 7, 64, 65, 300, 1000, 1023, 2048, 3000, 5000, 7999, 8000], device="cuda")
    start = torch.cumsum(torch.cat([used.new_zeros(1), used[:-1] + 17]), 0)
    want = [F.scaled_dot_product_attention(q[r].float(), k[start[r]:start[r] + used[r]].transpose(0, 1).float(),
                                           v[start[r]:start[r] + used[r]].transpose(0, 1).float(), scale=0.088)
            for r in range(b)]
    out = {}
    for name in ("triton", "flash") if dtype != torch.float32 else ("triton",):
        try:
            if name == "triton":
                got = [TD.decode_attention(q, k, v, start, used.int(), 8192, 0.088, s) for s in (1, 4, 32)]
            else:
                first = torch.cat([start.int(), start.new_full((1,), N + 1).int()])
                qs = q.transpose(1, 2).reshape(b * G, H, D)
                o = torch.ops.aten._flash_attention_forward(qs, k, v, torch.arange(b + 1, device="cuda").int() * G, first,
                                                            G, 8192, 0.0, False, False, scale=0.088, seqused_k=used.int())[0]
                got = [o.view(b, G, H, D).transpose(1, 2)]
            err = max((x[r].float() - want[r]).abs().max().item() for x in got for r in range(b))
            out[name] = {"max_abs_err": err}
            if name == "triton":  # one graph-free call at 12 rows of up to 8k keys, for scale
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(20):
                    TD.decode_attention(q, k, v, start, used.int(), 8192, 0.088, 4)
                torch.cuda.synchronize()
                out[name]["ms_per_call"] = (time.perf_counter() - t0) / 20 * 1e3
        except Exception as e:  # deliberate: a kernel that fails here is reported and not used
            out[name] = {"error": repr(e)[:400]}
    print(f"  kernel check vs fp32 SDPA ({dtype}, matmul precision {torch.get_float32_matmul_precision()}): {out}",
          flush=True)
    return out


def check_sampler(B: int = 256) -> dict:
    """The sampling kernel (engines/embedded/sample_kernel.py) against sample_tokens's torch path at the 1.5B
    shape's vocabulary: tokens alike, tokens whose float64 interval holds the draw (within 1e-5), logprob error,
    and ms per call of each (graph-free)."""
    from reflow.engines.embedded import sample_kernel as SK
    from reflow.engines.embedded.sampling import SAMPLING_EPS, TOP_K_ALL, sample_tokens

    g = torch.Generator(device="cuda").manual_seed(0)
    V = SHAPE["vocab_size"]
    logits = torch.randn(B, V, device="cuda", generator=g) * 4
    temp = torch.rand(B, device="cuda", generator=g) + 0.5
    temp[:8] = 0.0
    u = torch.rand(B, device="cuda", generator=g, dtype=torch.float64)
    ones, alls, zeros = torch.ones(B, device="cuda"), torch.full((B,), TOP_K_ALL, device="cuda"), torch.zeros(B, device="cuda")
    out: dict = {"batch": B, "vocab": V}
    try:
        plain = sample_tokens(logits, temp, ones, alls, zeros, u, filtered=False)
        fused = sample_tokens(logits, temp, ones, alls, zeros, u, filtered=False, fused=True)
        t = torch.where(temp < SAMPLING_EPS, 1.0, temp).double()
        exact = torch.log_softmax(logits.double() / t[:, None], -1)
        cdf = exact.exp().cumsum(-1)
        tok = fused[0]
        hi = cdf.gather(1, tok[:, None])[:, 0]
        lo = torch.where(tok > 0, cdf.gather(1, (tok - 1).clamp_min(0)[:, None])[:, 0], torch.zeros_like(hi))
        inside = ((lo - 1e-5 <= u) & (u <= hi + 1e-5)) | (temp < SAMPLING_EPS)
        out.update(same_tokens=int((fused[0] == plain[0]).sum()), inside_interval=int(inside.sum()),
                   greedy_match=bool((fused[0][:8] == logits[:8].argmax(-1)).all()),
                   logprob_max_err=float((fused[1].double() - exact.gather(1, tok[:, None])[:, 0]).abs().max()))
        for name, fn in (("torch_ms", lambda: sample_tokens(logits, temp, ones, alls, zeros, u, filtered=False)),
                         ("kernel_ms", lambda: SK.sample(logits, temp, u, SAMPLING_EPS))):
            fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            out[name] = (time.perf_counter() - t0) / 20 * 1e3
    except Exception as e:  # deliberate: reported, not raised (the attention checks still run)
        out["error"] = repr(e)[:400]
    print(f"  sampler check: {out}", flush=True)
    return out


def tune_attention() -> dict:
    """The Triton decode-attention kernel's launch tiling (keys per load, warps, pipelining stages) and key splits
    swept over shapes a rollout meets (the 1.5B shape's 2 KV heads of 6 queries, bf16): each config's time a call
    (graph-free, 20 calls after one) and the HBM bandwidth its K/V reads reach (keys x 2 x 2 heads x 128 x 2 bytes
    over the time). Reports every config and the best per shape."""
    from reflow.engines.embedded import decode_attention as TD

    H, G, D, sms = 2, 6, 128, torch.cuda.get_device_properties(0).multi_processor_count
    shapes = {"b256_k768": (256, 768), "b256_k300": (256, 300), "b64_k2000": (64, 2000), "b8_k6000": (8, 6000)}
    res: dict = {"shapes": {}, "best": {}}
    for name, (b, keys) in shapes.items():
        N = b * keys + 1
        k, v = (torch.randn(N + 1, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        q = torch.randn(b, H, G, D, device="cuda", dtype=torch.bfloat16)
        start = torch.arange(b, device="cuda") * keys
        used = torch.full((b,), keys, device="cuda", dtype=torch.int32)
        t = _bucket(keys, 512)  # the key bound the decoder passes for rows of this length
        base = TD.splits_for(b, H, t, sms)
        gbytes = b * keys * H * D * 2 * 2 / 1e9
        rows = []
        ref = TD.decode_attention(q, k, v, start, used, t, 0.088, base)
        for block_n in (64, 128):  # (the sweep of RESULTS 43; decode_attention's defaults are one of its configs)
            for warps in (4, 8):
                for stages in (None, 2, 4):
                    for mult in (1, 2, 4):
                        splits = max(1, min(base * mult, t // block_n))
                        cfg = {"block_n": block_n, "num_warps": warps, "num_stages": stages, "splits": splits}
                        try:
                            out = TD.decode_attention(q, k, v, start, used, t, 0.088, splits, block_n, warps, stages)
                            err = float((out.float() - ref.float()).abs().max())
                            torch.cuda.synchronize()
                            t0 = time.perf_counter()
                            for _ in range(20):
                                TD.decode_attention(q, k, v, start, used, t, 0.088, splits, block_n, warps, stages)
                            torch.cuda.synchronize()
                            ms = (time.perf_counter() - t0) / 20 * 1e3
                            rows.append({**cfg, "ms": round(ms, 4), "gb_per_s": round(gbytes / ms * 1e3, 1),
                                         "max_abs_diff": err})
                        except Exception as e:  # deliberate: a config that does not compile is reported
                            rows.append({**cfg, "error": repr(e)[:160]})
        ok = [r for r in rows if "ms" in r and r["max_abs_diff"] < 0.05]
        best = min(ok, key=lambda r: r["ms"])
        now = next(r for r in ok if (r["block_n"], r["num_warps"], r["num_stages"]) == (TD.BLOCK_N, 4, None)
                   and r["splits"] == base)
        res["shapes"][name] = rows
        res["best"][name] = {"best": best, "current": now, "speedup": round(now["ms"] / best["ms"], 3)}
        print(f"  tune {name}: current {now['ms']:.4f} ms ({now['gb_per_s']} GB/s), best {best}", flush=True)
    return res


@torch.inference_mode()
def precapture(dec, longest: int) -> int:
    """Capture every (batch bucket, length bucket) graph a run up to `longest` positions can meet, before timing."""
    from reflow.engines.embedded.static_decode import batch_bucket

    buckets = sorted({batch_bucket(n) for n in range(1, BATCH + 1)})
    t, ts = 512 if dec.kernel != "gather" else 64, []
    while t < 2 * longest:
        ts.append(t)
        t *= 2
    dec._tok.zero_()
    dec._at[0].zero_()
    dec._at[1].fill_(dec.capacity)  # every row at the scratch position
    for b in buckets:
        for t in ts:
            if (b, t) not in dec._graphs:
                dec._capture(b, t)
    torch.cuda.synchronize()
    return dec.graph_count


def probe(model, tok, kernels: list[str]) -> dict:
    """ms a decode step per kernel: batch 256 with 1k-token prompts and batch 4 with 4k-token prompts, 128
    new tokens each (graphs captured by a first run)."""
    res: dict = {}
    for kernel in kernels:
        for b, plen in ((256, 1024), (4, 4096)):
            g = Generator(model, tok, max_batch_size=b, kv_tokens=b * (plen + 512), decoder="graphs")
            g.static_decoder().attention = kernel
            prompts = ET.prompts_for(b, SHAPE["vocab_size"], plen, seed=1)
            sp = {"temperature": 1.0, "max_new_tokens": 128, "ignore_eos": True}
            try:
                g.generate(prompts, sp)
                sec, _ = ET.timed(lambda g=g, p=prompts: g.generate(p, sp))
                res[f"{kernel}_b{b}_p{plen}_ms"] = 1e3 * sec / 128
            except Exception as e:  # deliberate: reported, and the kernel is not chosen
                res[f"{kernel}_b{b}_p{plen}_ms"] = None
                res[f"{kernel}_error"] = repr(e)[:400]
            g.static_decoder().release()
            del g
    print(f"  probe: {res}", flush=True)
    return res


def step_ms(model, tok, kernel: str, fuse: str | None = None) -> dict:
    """ms a decode step without the prefill: (time of 65 new tokens - time of 1) / 64, graphs captured first; then
    a profile of 8 graph-free steps at batch 4 (the kernels a step runs, by GPU time)."""
    from torch.profiler import ProfilerActivity, profile

    res: dict = {}
    for b, plen in ((256, 1024), (4, 4096), (4, 256)):
        g = Generator(model, tok, max_batch_size=b, kv_tokens=b * (plen + 512), decoder="graphs", decode_fusion=fuse)
        g.static_decoder().attention = kernel if kernel != "auto" else "triton"
        prompts = ET.prompts_for(b, SHAPE["vocab_size"], plen, seed=1)
        sp = [{"temperature": 1.0, "max_new_tokens": n, "ignore_eos": True} for n in (1, 65)]
        g.generate(prompts, sp[1])
        one, _ = ET.timed(lambda g=g, p=prompts: g.generate(p, sp[0]))
        many, _ = ET.timed(lambda g=g, p=prompts: g.generate(p, sp[1]))
        res[f"b{b}_p{plen}"] = 1e3 * (many - one) / 64
        g.static_decoder().release()
    print(f"  decode ms a step (no prefill): {res}", flush=True)
    g = Generator(model, tok, max_batch_size=4, kv_tokens=4 * 4608, decoder="static", decode_fusion=fuse)
    g.static_decoder().attention = "triton" if kernel == "auto" else kernel
    prompts = ET.prompts_for(4, SHAPE["vocab_size"], 4096, seed=1)
    g.generate(prompts, {"max_new_tokens": 4, "ignore_eos": True})
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        g.generate(prompts, {"max_new_tokens": 9, "ignore_eos": True})
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
    print(table, flush=True)
    res["profile_b4"] = table
    g.static_decoder().release()
    return res


@torch.inference_mode()
def anatomy(tok, kernel: str) -> dict:
    """One decode step's GPU work at batch 4 and 256 (t = 512 keys): kernels a step launches and their summed GPU
    time (a profile of the graph-free step), against the time of a replay of its CUDA graph."""
    from torch.profiler import ProfilerActivity, profile

    model = build(torch.bfloat16)
    res: dict = {}
    for b in (4, 256):
        g = Generator(model, tok, max_batch_size=b, kv_tokens=b * 768, decoder="graphs")
        dec = g.static_decoder()
        dec.attention = kernel
        g.generate(ET.prompts_for(b, SHAPE["vocab_size"], 256, seed=1), {"max_new_tokens": 2, "ignore_eos": True})
        dec._at[0].fill_(300)
        dec._at[1].copy_(torch.arange(b, device="cuda") * 768)
        graph = dec._graphs.get((b, 512)) or (dec._capture(b, 512), dec._graphs[(b, 512)])[1]
        for _ in range(3):
            graph[0].replay()
        sec, _ = ET.timed(lambda graph=graph: [graph[0].replay() for _ in range(50)] and 0)
        dec._step(b, 512)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                dec._step(b, 512)
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type.name == "CUDA"]
        gpu_us = sum(e.device_time for e in events) / 5
        top = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=50)
        res[f"b{b}"] = {"graph_replay_ms": 1e3 * sec / 50, "kernels_per_step": len(events) / 5,
                        "kernel_gpu_ms_per_step": gpu_us / 1e3}
        print(f"  anatomy b{b}: {res[f'b{b}']}\n{top}", flush=True)
        dec.release()
    return res


@torch.inference_mode()
def breakdown(tok, kernel: str, fuse: str | None, tokens: int = 1024) -> dict:
    """Where a whole decode step's wall time goes at batch 256 (the uniform workload, `tokens` each): one run as the
    engine runs it (steps/s), then one with a device sync around the decoder's call (the captured graph) and around
    the sampling, so each step splits into graph, sampling and the host's own work (the loop, the rows' checks,
    staging); then a profile (CPU and CUDA) of 24 steps past the middle, its top ops by CPU and by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    model = build(torch.bfloat16)
    gen = Generator(model, tok, max_batch_size=BATCH, kv_tokens=BATCH * (PROMPT + tokens + 256), decoder="graphs",
                    decode_fusion=fuse)
    gen.static_decoder().attention = kernel if kernel != "auto" else "triton"
    prompts = ET.prompts_for(BATCH, SHAPE["vocab_size"], PROMPT, seed=1)
    ET.run_ours(gen, prompts, [tokens] * BATCH)  # graphs for every length bucket captured, fusion compiled
    steps = Steps(gen.static_decoder())
    plain, _ = ET.timed(lambda: ET.run_ours(gen, prompts, [tokens] * BATCH))
    n_plain = steps.steps
    dec = gen.static_decoder()
    spent = {"graph": 0.0, "sample": 0.0}

    def timed(name, fn):
        def call(*a, **k):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = fn(*a, **k)
            torch.cuda.synchronize()
            spent[name] += time.perf_counter() - t0
            return r
        return call

    real_decode, real_sample = dec.decode, gen._sample
    dec.decode, gen._sample = timed("graph", real_decode), timed("sample", real_sample)
    steps.reset()
    synced, _ = ET.timed(lambda: ET.run_ours(gen, prompts, [tokens] * BATCH))
    n = steps.steps
    res = {"batch": BATCH, "tokens": tokens, "steps": n_plain, "ms_per_step": 1e3 * plain / n_plain,
           "synced_ms_per_step": 1e3 * synced / n, "graph_ms": 1e3 * spent["graph"] / n,
           "sample_ms": 1e3 * spent["sample"] / n,
           "host_ms": 1e3 * (synced - spent["graph"] - spent["sample"]) / n}
    print(f"  breakdown b{BATCH} x {tokens}: {json.dumps({k: round(v, 3) for k, v in res.items()})}", flush=True)
    dec.decode, gen._sample = real_decode, real_sample
    counter = {"n": 0}

    def window(*a, **k):  # profile steps 500-523 of one more run
        counter["n"] += 1
        if counter["n"] == 500:
            prof.start()
        r = real_decode(*a, **k)
        if counter["n"] == 524:
            torch.cuda.synchronize()
            prof.stop()
        return r

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    dec.decode = window
    ET.run_ours(gen, prompts, [tokens] * BATCH)
    dec.decode = real_decode
    for key in ("cpu_time_total", "cuda_time_total"):
        table = prof.key_averages().table(sort_by=key, row_limit=22, max_name_column_width=60)
        print(table, flush=True)
        res[f"profile_by_{key}"] = table
    dec.release()
    return res


def syncs(args, tok, bw: float) -> dict:
    """The rollout's own way of sampling (every row seeded, as rollout requests are) on the longtail and stream
    workloads, where rows finish and are admitted all along: seconds, tokens/s and roofline as `throughput`, plus
    the host waits PyTorch itself reports (torch.cuda.set_sync_debug_mode: blocking copies, .item(), nonzero) in
    a second, untimed and shorter run of each (its first 128 requests at an eighth of their lengths). Run it once on
    this tree and once on an older one (PYTHONPATH), each in its own process: the same work, so the seconds compare."""
    import warnings

    model = build(torch.bfloat16)
    wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kvbytes = bytes_per_position(SHAPE["num_hidden_layers"], SHAPE["num_key_value_heads"], 128, torch.bfloat16)
    gen = Generator(model, tok, max_batch_size=BATCH, decoder="graphs", kv_mem_fraction=args.mem_fraction,
                    decode_fusion=args.fuse or None)
    gen.static_decoder().attention = args.kernel if args.kernel != "auto" else "triton"
    steps = Steps(gen.static_decoder())
    tail, stream = longtail(BATCH), longtail(2 * BATCH)
    uni_p, stream_p = (ET.prompts_for(n, SHAPE["vocab_size"], PROMPT, seed=s) for n, s in ((BATCH, 1), (2 * BATCH, 2)))

    def seeded(gen, prompts, lengths) -> int:
        sps = [{"temperature": 1.0, "max_new_tokens": n, "ignore_eos": True, "sampling_seed": 1000 + i}
               for i, n in enumerate(lengths)]
        recs = gen.generate(prompts, sps, 1)
        return sum(len(r["output_ids"]) for r in recs)

    seeded(gen, uni_p[:8], [8] * 8)  # makes the pool
    precapture(gen.static_decoder(), PROMPT + max(stream + tail))
    rows = []
    for tag, prompts, lengths in (("longtail", uni_p, tail), ("stream", stream_p, stream)):
        row = run(gen, steps, prompts, lengths, wbytes, kvbytes, bw, tag, generate=seeded) | {"seeded": True}
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            seeded(gen, prompts[:128], [max(8, n // 8) for n in lengths[:128]])  # the same kinds of steps, shorter
        torch.cuda.set_sync_debug_mode("default")
        where: dict[str, int] = {}
        for w in caught:
            key = str(w.message).splitlines()[0][:80]
            where[key] = where.get(key, 0) + 1
        row.update(host_waits_short_run=len(caught), host_wait_kinds=where)
        print(f"  syncs {tag}: host waits {len(caught)} ({where})", flush=True)
        rows.append(row)
    gen.static_decoder().release()
    return {"rows": rows, "source": __import__("reflow").__file__}


def throughput(args, tok, bw: float) -> dict:
    model = build(torch.bfloat16)
    wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kvbytes = bytes_per_position(SHAPE["num_hidden_layers"], SHAPE["num_key_value_heads"], 128, torch.bfloat16)
    res: dict = {"weight_bytes": wbytes, "kv_bytes_per_token": kvbytes, "kernel_check": check_kernels()}
    res["step_ms"] = step_ms(model, tok, args.kernel, args.fuse or None)
    if args.kernel == "auto":
        ok = [k for k in ("triton", "flash") if res["kernel_check"][k].get("max_abs_err", 1.0) < 0.05]
        res["probe"] = probe(model, tok, ok + ["gather"])
        times = {k: res["probe"][f"{k}_b256_p1024_ms"] + res["probe"][f"{k}_b4_p4096_ms"] for k in ok + ["gather"]
                 if res["probe"][f"{k}_b256_p1024_ms"] and res["probe"][f"{k}_b4_p4096_ms"]}
        args.kernel = min(times, key=times.get)
    res["kernel"] = args.kernel
    print(f"  kernel used below: {args.kernel}", flush=True)
    uni_p = ET.prompts_for(BATCH, SHAPE["vocab_size"], PROMPT, seed=1)
    hf = None
    if args.hf:  # first, before the engine's pool takes its share of the memory
        ET.run_hf(model, uni_p[:8], [8] * len(uni_p[:8]), 0)  # warm-up
        sec, tokens = ET.timed(lambda m=model: ET.run_hf(m, uni_p, [1024] * BATCH, 0))
        hf = res["hf_uniform"] = {"seconds": sec, "tokens_per_s": tokens / sec, "tokens": tokens}
        print(f"  hf generate uniform: {tokens / sec:.0f} tok/s ({sec:.1f} s)", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    gen = Generator(model, tok, max_batch_size=BATCH, decoder="graphs", kv_mem_fraction=args.mem_fraction,
                    decode_fusion=args.fuse or None)
    gen.static_decoder().attention = args.kernel
    res["decode_fusion"] = args.fuse or None
    steps = Steps(gen.static_decoder())
    tail = longtail(BATCH)
    stream = longtail(2 * BATCH)
    stream_p = ET.prompts_for(2 * BATCH, SHAPE["vocab_size"], PROMPT, seed=2)
    t0 = time.perf_counter()
    ET.run_ours(gen, uni_p[:8], [8] * 8)  # makes the pool
    dec = gen.static_decoder()
    precapture(dec, PROMPT + max(stream + tail))
    res["warmup_s"] = time.perf_counter() - t0
    res.update(pool_tokens=dec.capacity, kv_cache_gib=dec.nbytes() / 2**30, graphs=dec.graph_count)
    rows = [run(gen, steps, uni_p, [1024] * BATCH, wbytes, kvbytes, bw, "uniform"),
            run(gen, steps, uni_p, tail, wbytes, kvbytes, bw, "longtail"),
            run(gen, steps, stream_p, stream, wbytes, kvbytes, bw, "stream")]
    res["rows"] = rows
    res["graphs_after"] = dec.graph_count
    if hf is not None:
        res["ratio_vs_generate_b256"] = hf["seconds"] / rows[0]["seconds"]
        print(f"  ours/generate (uniform): {res['ratio_vs_generate_b256']:.2f}", flush=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    gen.release_memory({"kv_cache", "cuda_graph", "weights"})
    after = torch.cuda.memory_allocated()
    res["release"] = {"allocated_before_gib": before / 2**30, "allocated_after_gib": after / 2**30,
                      "freed_fraction": (before - after) / before}
    print(f"  release: {before / 2**30:.1f} -> {after / 2**30:.2f} GiB allocated", flush=True)
    del gen, steps, dec
    gc.collect()
    torch.cuda.empty_cache()
    return res


def trainer_logprobs(model, prompt: list[int], out: list[int], autocast: bool) -> torch.Tensor:
    """Log-probs of `out` given the prompt from one HF forward of the whole sequence (as the trainer scores)."""
    ids = torch.tensor([prompt + out], device="cuda")
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids, logits_to_keep=len(out) + 1).logits[0, :-1].float()  # [R, V]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(out, device="cuda")[:, None])[:, 0]


BINS = ((0, 256), (256, 512), (512, 1024), (1024, 1536), (1536, 2048))


def mismatch(args, tok) -> dict:
    """Engine vs trainer log-probs of the same sampled tokens, per precision setting and response position."""
    settings = {"bf16": (torch.bfloat16, False, False), "bf16-mixed": (torch.float32, False, True),
                "fp32+tf32": (torch.float32, True, False), "fp32": (torch.float32, False, False)}
    prompts = ET.prompts_for(args.mm_rows, SHAPE["vocab_size"], PROMPT, seed=5)
    sp = {"temperature": 1.0, "max_new_tokens": args.mm_len, "ignore_eos": True, "sampling_seed": 9}
    res = {}
    for name, (dtype, tf32, autocast) in settings.items():
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        # the same random weights each time, rounded to bf16 (bf16-mixed's trainer holds fp32 weights)
        model = build(torch.bfloat16).to(dtype)
        gen = Generator(model, tok, max_batch_size=args.mm_rows, decoder="graphs")
        gen.static_decoder().attention = args.kernel if dtype != torch.float32 else "gather"
        t0 = time.perf_counter()
        recs = gen.generate(prompts, sp)
        gen_s = time.perf_counter() - t0
        gen.static_decoder().release()
        diffs = []
        for p, r in zip(prompts, recs):
            eng = torch.tensor([x[0] for x in r["output_token_logprobs"]], device="cuda")
            diffs.append(eng - trainer_logprobs(model, p, r["output_ids"], autocast))
        d = torch.stack(diffs)  # [rows, R]
        per_bin = {f"{a}-{b}": {"mean_abs": d[:, a:b].abs().mean().item(), "max_abs": d[:, a:b].abs().max().item(),
                                "mean": d[:, a:b].mean().item()} for a, b in BINS if a < d.shape[1]}
        res[name] = {"mean_abs": d.abs().mean().item(), "ratio_dev": (d.exp() - 1).abs().mean().item(),
                     "by_position": per_bin, "generate_s": gen_s, "engine_kernel": gen.static_decoder().kernel,
                     "mean_logprob": torch.tensor([x[0] for r in recs for x in r["output_token_logprobs"]]).mean().item()}
        print(f"  mismatch {name}: mean |d| {res[name]['mean_abs']:.3g}, by position "
              + ", ".join(f"{k} {v['mean_abs']:.3g}" for k, v in per_bin.items()), flush=True)
        del gen, model, recs
        gc.collect()
        torch.cuda.empty_cache()
    torch.backends.cuda.matmul.allow_tf32 = False
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu-out")
    ap.add_argument("--mem-fraction", type=float, default=0.85)
    ap.add_argument("--hf", type=int, default=1)
    ap.add_argument("--mm-rows", type=int, default=16)
    ap.add_argument("--kernel", default="auto", help="decode attention for the mismatch runs when throughput is skipped")
    ap.add_argument("--mm-len", type=int, default=2048)
    ap.add_argument("--skip", default="", help="comma list: throughput, mismatch")
    ap.add_argument("--check-kernels", action="store_true",
                    help="only the decode kernels against float32 SDPA: bf16, float32 (IEEE), float32 (TF32)")
    ap.add_argument("--anatomy", action="store_true", help="only anatomy(): one step's kernels and graph replay time")
    ap.add_argument("--tune-attention", action="store_true", help="only tune_attention(): the decode-attention kernel's "
                    "tiling and splits swept over rollout shapes")
    ap.add_argument("--breakdown", action="store_true", help="only breakdown(): a whole step's wall time split into "
                    "the graph, the sampling and the host's work, at batch 256 (with --fuse as given)")
    ap.add_argument("--syncs", default="", help="only syncs(): seeded longtail and stream rows, timed, and the host "
                    "waits PyTorch reports; the value names the result file (syncs-<value>.json)")
    ap.add_argument("--fuse", default="", help="throughput with the static decoder's elementwise work compiled by this "
                    "torch.compile backend (inductor; Generator's decode_fusion): run it beside one without, each in "
                    "a process of its own")
    args = ap.parse_args()
    bw, card = bandwidth()
    tok = ET.build_tokenizer(SHAPE["vocab_size"])
    out: dict = {"card": card, "hbm_bytes_per_s": bw, "torch": torch.__version__, "shape": "Qwen2.5-1.5B", **SHAPE,
                 "prompt_tokens": PROMPT, "batch": BATCH, "mem_fraction": args.mem_fraction,
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    path = Path(args.out, "gpu-rollout-long.json")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.check_kernels:
        res = {"sampler": check_sampler(), "bf16": check_kernels(torch.bfloat16), "fp32": check_kernels(torch.float32)}
        torch.set_float32_matmul_precision("high")
        res["fp32_tf32"] = check_kernels(torch.float32)
        torch.set_float32_matmul_precision("highest")
        Path(args.out, "kernel-check.json").write_text(json.dumps({**out, "kernel_check": res}, indent=1, default=str))
        return
    if args.anatomy:
        out["anatomy"] = anatomy(tok, "triton")
        Path(args.out, "anatomy.json").write_text(json.dumps(out, indent=1, default=str))
        return
    if args.tune_attention:
        out["tune_attention"] = tune_attention()
        Path(args.out, "tune-attention.json").write_text(json.dumps(out, indent=1, default=str))
        return
    if args.syncs:
        out["syncs"] = syncs(args, tok, bw)
        Path(args.out, f"syncs-{args.syncs}.json").write_text(json.dumps(out, indent=1, default=str))
        return
    if args.breakdown:
        out["breakdown"] = breakdown(tok, args.kernel, args.fuse or None)
        Path(args.out, "breakdown.json").write_text(json.dumps(out, indent=1, default=str))
        return
    if "throughput" not in args.skip:
        t = throughput(args, tok, bw)
        out["throughput"] = t
        by = {r["workload"]: r for r in t["rows"]}
        out["roofline_fraction_b256"] = by["longtail"]["roofline_fraction"]
        out["roofline_fraction_b256_uniform1k"] = by["uniform"]["roofline_fraction"]
        out["roofline_fraction_stream"] = by["stream"]["roofline_fraction"]
        out["idle_fraction_off"] = by["longtail"]["idle_fraction"]
        out["ratio_vs_generate_b256"] = t.get("ratio_vs_generate_b256")
        path.write_text(json.dumps(out, indent=1, default=str))
    if "mismatch" not in args.skip:
        out["logprob_mismatch"] = mismatch(args, copy.copy(tok))
        path.write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps({k: v for k, v in out.items() if k.endswith(("_b256", "_off", "_uniform1k", "_stream"))}))


if __name__ == "__main__":
    main()
