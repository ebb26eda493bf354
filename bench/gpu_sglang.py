"""SGLang against the embedded engine on one GPU, the same model and the same requests over reflow's HTTP client
(issue 57 point 3): decode tokens/s at batch 64 and 256, short and long responses, and memory freed on release.

    PYTHONPATH=/tmp/site:src:bench python3 bench/gpu_sglang.py --out $OUT --sglang-python /tmp/sglang-python
    (bench/gpu_machine/sglang_next.sh runs it after bench/gpu_machine/sglang_start.sh got a server to generate)

Model: Qwen2.5-1.5B's dimensions as a Llama (28 layers, hidden 1536, 12 query / 2 KV heads of 128, MLP 8960,
vocabulary 151,936, tied embeddings, rope theta 1e6; Llama has no q/k/v bias, otherwise the same work), random
weights saved in bf16 with a word-level tokenizer of the same vocabulary (no hub). Each engine runs in a child
process of its own (SGLang's server is its own process group; the embedded engine serves from a thread), started
the way a run starts it: `SGLangEngine` (reflow's launcher, `--mem-fraction-static` as rollout.mem_fraction_static,
the memory saver on as when colocated) and `EmbeddedEngine` (KV pool from the same fraction, CUDA graphs). Requests:
random 256-token prompts, `ignore_eos` with per-request `max_new_tokens` (every row generates exactly that many),
temperature 1, one /generate call per batch through `EngineClient`, each call made twice and the second timed (the
first captures what its shape needs). tokens/s = generated tokens / wall seconds of the call (prefill included). Release: free GPU memory (cudaMemGetInfo) around
/release_memory_occupation. Writes $OUT/gpu-sglang-engines.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SHAPE = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
             num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True)
PROMPT = 256


TINY = dict(SHAPE, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def build(folder: Path, shape: dict, device: str) -> None:
    import torch
    from engine_throughput import build_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**shape, pad_token_id=0, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    build_tokenizer(shape["vocab_size"]).save_pretrained(folder)


def free_gib() -> float:
    import torch

    return torch.cuda.mem_get_info()[0] / 2**30 if torch.cuda.is_available() else 0.0


def child(args) -> dict:
    """One engine: start it, warm it, time each (batch, length), release; the result as a dict."""
    from engine_throughput import prompts_for, run_http

    from reflow.engines.rollout_client import EngineClient

    vocab = (TINY if args.tiny else SHAPE)["vocab_size"]
    before = free_gib()
    t0 = time.perf_counter()
    if args.engine == "sglang":
        from reflow.engines.sglang.launcher import SGLangEngine

        extra = json.loads(args.server_args or "{}")
        server = SGLangEngine(str(args.model), "bench-sglang", host="127.0.0.1", mem_fraction_static=args.mem_fraction,
                              enable_memory_saver=args.memory_saver, dtype="bfloat16", seed=0, python=args.sglang_python,
                              startup_timeout_s=600, server_args_extra=extra)
    else:
        from reflow.engines.embedded.engine import EmbeddedEngine

        server = EmbeddedEngine(model_path=str(args.model), engine_id="bench-embedded", threads=4, dtype="bf16",
                                device=args.device, kv_mem_fraction=args.mem_fraction if args.device == "cuda" else None,
                                max_batch_size=256)
    try:
        server.ready()
        start_s = time.perf_counter() - t0
        client = EngineClient(server.url(), timeout=3600, api_key=server.api_key())
        out = {"engine": args.engine, "start_s": round(start_s, 2), "free_gib_before": round(before, 2),
               "free_gib_loaded": round(free_gib(), 2), "rows": []}
        run_http(client, prompts_for(8, vocab, PROMPT, seed=9), [16] * 8)  # warm-up
        for batch in (64, 256):
            for length in args.lengths:
                prompts = prompts_for(batch, vocab, PROMPT, seed=batch)
                times = []
                for _ in range(2):  # the first also captures/compiles what this shape needs: the second counts
                    t = time.perf_counter()
                    tokens = run_http(client, prompts, [length] * batch)
                    times.append(time.perf_counter() - t)
                s = times[-1]
                row = {"batch": batch, "new_tokens": length, "tokens": tokens, "seconds": round(s, 3),
                       "first_seconds": round(times[0], 3), "tokens_per_s": round(tokens / s, 1)}
                print(f"{args.engine}: batch {batch} x {length} new tokens: {s:.2f} s, {tokens / s:,.0f} tokens/s",
                      flush=True)
                out["rows"].append(row)
        if args.engine == "sglang" and not args.memory_saver:
            return out
        loaded = free_gib()
        t = time.perf_counter()
        client.release_memory_occupation()
        out["release_s"] = round(time.perf_counter() - t, 3)
        released = free_gib()
        client.resume_memory_occupation()
        out["release"] = {"free_gib_loaded": round(loaded, 2), "free_gib_released": round(released, 2),
                          "engine_gib": round(before - loaded, 2), "freed_gib": round(released - loaded, 2),
                          "freed_fraction": round((released - loaded) / max(before - loaded, 1e-9), 3)}
        run_http(client, prompts_for(8, vocab, PROMPT, seed=9), [16] * 8)  # it still generates
        return out
    finally:
        server.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-out"), help="folder for gpu-sglang-engines.json")
    p.add_argument("--model", type=Path, default=Path("/tmp/gpu-sglang-model"), help="model folder (built if absent)")
    p.add_argument("--sglang-python", default=sys.executable, help="the interpreter that runs SGLang's server")
    p.add_argument("--server-args", default="", help="JSON of rollout.sglang_server_args for SGLang (e.g. a backend)")
    p.add_argument("--mem-fraction", type=float, default=0.85, help="both engines' weights + KV share of the GPU")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[256, 1024],
                   help="response lengths (tokens), comma-separated")
    p.add_argument("--engines", default="sglang,embedded", help="which engines, in this order")
    p.add_argument("--no-memory-saver", dest="memory_saver", action="store_false",
                   help="start SGLang without --enable-memory-saver (where torch_memory_saver does not work)")
    p.add_argument("--device", default="cuda", help="cuda; cpu only with --tiny (a smoke run of the embedded side)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model of a 512-token vocabulary (smoke runs)")
    p.add_argument("--engine", default="", help=argparse.SUPPRESS)  # a child's one engine
    args = p.parse_args()
    if args.engine:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not (args.model / "config.json").exists():
        t = time.perf_counter()
        build(args.model, TINY if args.tiny else SHAPE, args.device)
        print(f"model written to {args.model} in {time.perf_counter() - t:.1f} s", flush=True)
    res = {"what": "bench/gpu_sglang.py: SGLang and the embedded engine, same model and requests over reflow's HTTP "
                   "client, each engine in its own process",
           "card": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "torch": torch.__version__, "shape": "Qwen2.5-1.5B dimensions as a Llama, vocab 151,936, bf16, random",
           "prompt_tokens": PROMPT, "mem_fraction": args.mem_fraction, "server_args": args.server_args,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "engines": {}}
    for engine in args.engines.split(","):
        cmd = [sys.executable, __file__, "--engine", engine, "--model", str(args.model), "--sglang-python",
               args.sglang_python, "--server-args", args.server_args, "--mem-fraction", str(args.mem_fraction),
               "--lengths", ",".join(map(str, args.lengths)), "--device", args.device] + ["--tiny"] * args.tiny \
            + ["--no-memory-saver"] * (not args.memory_saver)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        (out / f"gpu-sglang-{engine}.log").write_text(proc.stdout + proc.stderr)
        got = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        res["engines"][engine] = json.loads(got[-1]) if got else {
            "error": f"exit {proc.returncode}", "tail": (proc.stdout + proc.stderr).splitlines()[-30:]}
        print(json.dumps(res["engines"][engine])[:2000], flush=True)
    for engine, r in res["engines"].items():
        for row in r.get("rows", []):
            res[f"{engine}_tokens_per_s_b{row['batch']}_l{row['new_tokens']}"] = row["tokens_per_s"]
    for engine in res["engines"]:  # the keys: the first (shortest) length
        for b in (64, 256):
            key = f"{engine}_tokens_per_s_b{b}_l{args.lengths[0]}"
            if key in res:
                res[f"{engine}_tokens_per_s_b{b}"] = res[key]
    (out / "gpu-sglang-engines.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if not isinstance(v, dict)}, indent=1))


if __name__ == "__main__":
    main()
