"""The engine part of bench/gpu.py: rollout tokens/s of the embedded engine against transformers `generate`.

Engines, on the same model and the same prompts/lengths (sampling at temperature 1, no eos stop):
- ours: `Generator` with its default decoder (on a GPU: static KV cache + CUDA graphs per batch bucket);
- ours/eager: the same generator class on HF's forward with a growing cache (the CPU path), batch 64 only;
- ours/http: ours behind the SGLang HTTP API (JSON over loopback), batch 64 only;
- hf: `model.generate` (dynamic cache, eager), the baseline of every ratio.
Batches 1, 64 and 256; equal lengths (all `gen_len`) and varying (log-uniform 4..gen_len, one at gen_len).
A greedy check compares graphs with the eager path (bf16: identical prefixes are expected to part after
a near-tie, so it reports the share of identical sequences and the logprob gap while they agree).
Results: $OUT/gpu-engine.json (-> bench/results/gpu-engine.json).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import engine_throughput as ET
import torch

BATCHES = (1, 64, 256)


def _peak_gib(base: float) -> float:
    if not torch.cuda.is_available():
        return 0.0
    return torch.cuda.max_memory_allocated() / 2**30 - base


def _engines(gen, client, batch: int) -> dict:
    from reflow.engines.embedded.generator import Generator

    eager = Generator(gen.model, gen.tokenizer, max_batch_size=gen.max_batch_size, decoder="eager")
    out = {"ours": lambda pr, ln: ET.run_ours(gen, pr, ln)}
    if batch == 64:
        out["ours/eager"] = lambda pr, ln: ET.run_ours(eager, pr, ln)
        if client is not None:
            out["ours/http"] = lambda pr, ln: ET.run_http(client, pr, ln)
    out["hf"] = lambda pr, ln: ET.run_hf(gen.model, pr, ln, 0)
    return out


def bench_engine(gen, client, args, batches=BATCHES) -> list[dict]:
    """Best of args.repeat per engine (engines take turns), after one warm-up run of each at this shape
    (graph capture and allocator growth stay out of the figures)."""
    class A:  # lengths_for's arguments
        length, min_len, max_len = args.gen_len, 4, args.gen_len
    rows = []
    for batch in batches:
        engines = _engines(gen, client, batch)
        for mode in ("equal", "varying") if batch > 1 else ("equal",):
            prompts, lengths = ET.prompts_for(batch, gen.vocab_size, 32), ET.lengths_for(batch, mode, A)
            best: dict[str, float] = {}
            for name, fn in engines.items():
                fn(prompts, lengths)
            for r in range(args.repeat):
                for name in engines:
                    if torch.cuda.is_available():
                        torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
                    sec, _ = ET.timed(lambda: engines[name](prompts, lengths))
                    best[name] = min(best.get(name, math.inf), sec)
                    best[f"{name}_gib"] = _peak_gib(base)
            row = {"mode": mode, "batch": batch, "tokens": sum(lengths), "steps": max(lengths),
                   **{f"{k}_tps": sum(lengths) / best[k] for k in engines},
                   **{f"{k}_gib": best[f"{k}_gib"] for k in engines},
                   **{f"{k}_ratio": best["hf"] / best[k] for k in engines if k != "hf"},
                   "ours_ms_per_step": 1e3 * best["ours"] / max(lengths), "hf_ms_per_step": 1e3 * best["hf"] / max(lengths)}
            rows.append(row)
            print(f"  engine b{batch} {mode}: " + ", ".join(f"{k} {row[f'{k}_tps']:.0f} tok/s" for k in engines)
                  + f"; ours/generate {row['ours_ratio']:.2f}", flush=True)
    return rows


def greedy_check(gen, args, batch: int = 16, length: int = 64) -> dict:
    """The default decoder against the eager path, greedy, same prompts, in the model's dtype and on a
    float32 copy (where rounding cannot part them): identical sequences, the mean length of the
    agreeing prefix, and the largest logprob gap within it."""
    import copy

    from reflow.engines.embedded.generator import Generator

    out = _greedy_pair(gen, batch, length)
    if gen.dtype != torch.float32:
        f32 = Generator(copy.deepcopy(gen.model).float(), gen.tokenizer, max_batch_size=batch)
        f32.device = gen.device
        out["fp32"] = _greedy_pair(f32, batch, length)
        del f32
        torch.cuda.empty_cache()
    return out


def _greedy_pair(gen, batch: int, length: int) -> dict:
    from reflow.engines.embedded.generator import Generator

    eager = Generator(gen.model, gen.tokenizer, max_batch_size=gen.max_batch_size, decoder="eager")
    prompts = ET.prompts_for(batch, gen.vocab_size, 32, seed=7)
    sp = {"temperature": 0.0, "max_new_tokens": length, "ignore_eos": True}
    a, b = eager.generate(prompts, sp), gen.generate(prompts, sp)
    same, prefix, gap = 0, [], 0.0
    for x, y in zip(a, b):
        k = next((i for i, (s, t) in enumerate(zip(x["output_ids"], y["output_ids"])) if s != t), length)
        same += k == length
        prefix.append(k)
        for (lp1, _, _), (lp2, _, _) in zip(x["output_token_logprobs"][:k], y["output_token_logprobs"][:k]):
            gap = max(gap, abs(lp1 - lp2))
    out = {"sequences": batch, "identical": same, "mean_agreeing_prefix": sum(prefix) / batch, "length": length,
           "max_logprob_gap": gap, "dtype": str(gen.dtype)}
    print(f"  greedy check ({gen.dtype}): {same}/{batch} identical to eager, agreeing prefix {out['mean_agreeing_prefix']:.1f}"
          f"/{length}, logprob gap <= {gap:.3g}", flush=True)
    return out


def summary(rows: list[dict], check: dict | None, gen, args) -> dict:
    """bench/results/gpu-engine.json's content (issue 16 point 5 names the first keys)."""
    def ratio(b: int, mode: str):
        return next((r["ours_ratio"] for r in rows if r["batch"] == b and r["mode"] == mode), None)
    static = gen.static_decoder()
    return {"commit": args.commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "ratio_b64_varying": ratio(64, "varying"), "ratio_b256_varying": ratio(256, "varying"),
            "ratio_b64_equal": ratio(64, "equal"), "ratio_b256_equal": ratio(256, "equal"),
            "ratio_b1": ratio(1, "equal"), "decoder": gen.decoder,
            "graphs": static.graph_count if static else 0, "kv_cache_gib": (static.nbytes() if static else 0) / 2**30,
            "gen_len": args.gen_len, "greedy_check": check, "rows": rows}


def write(summary_: dict, out_dir: str | None) -> None:
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        Path(out_dir, "gpu-engine.json").write_text(json.dumps(summary_, indent=1, default=str))
