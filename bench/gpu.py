"""GPU benchmark: trainer tokens/s and MFU (each variant in a process of its own), engine tokens/s, weight-push GB/s.

    python3 bench/gpu.py                          # on one H200 (a Qwen2.5-0.5B-shaped model, bf16)
    .venv/bin/python bench/gpu.py --device cpu --tiny    # a smoke test of the same code on CPU
    python3 bench/gpu.py --model demo --batch 1024 --seq 16 --micro 512 --skip engine,push --variants default,eager \
      --minibatches 2
                                                  # the GPU demo's policy shape (113M) at its batch

The GPU machine has torch and transformers but no Ray or Prefect, so the classes the Ray actors
host are driven directly: `reflow.engines.train.trainer.TrainerRank` (DeepSpeed, one rank, ZeRO-1, bf16; a
plain torch loop with the same loss if DeepSpeed cannot be imported), and
`reflow.engines.embedded.engine.EmbeddedEngine` (its HTTP server in a thread; the model moved to the
GPU). Wheels for DeepSpeed and the HTTP server are carried along (see bench/RESULTS.md).

Each trainer variant (each name in --variants, the plain loops included; the profile in the default's)
runs in a child process of its own, this script again with a hidden `--one NAME`: dynamo's recompile
limit and the CUDA caching allocator are per process, and in one process the compiled plain loop left
reflow's layers uncompiled for the variants after it (bench/gpu_trainer.py says more). The engine and
push parts run in this process, after the trainer's children have exited. Run it from anywhere, the
project root included: only bench/ joins sys.path (as the script's folder), and reflow is the installed
package, or src/reflow where none is installed (bench/_common.py).

- trainer (bench/gpu_trainer.py): `train_iteration` on a synthetic batch of B x T tokens (one
  PPO-clip step) under several settings (ZeRO-1/2/3, compiled layers or not, old log-probs from the
  training forward or a separate pass, gradient accumulation dtype, micro-batch), next to a plain
  torch loop (same model, SDPA, fused AdamW on bf16 weights, HF cross-entropy, use_cache=False as the
  trainer calls it) uncompiled and with compiled layers, plus a profile of one default step; each
  variant in a child process, its wall seconds as `process_s`. MFU = model FLOPs executed / seconds /
  peak (989 TFLOP/s dense bf16, the H200's datasheet figure). Model FLOPs per sequence: forward
  2*N*T + 2*L*d*T^2 (causal attention), N = parameters of the matrix products (the tied embedding
  counted once, as the LM head); a forward/backward counts 3 forwards, a separate old-logprob
  pass 1 more. Results also go to $OUT/gpu-trainer.json (-> bench/results/gpu-trainer.json).
- engine: response tokens/s of our engine (in process, and over HTTP) and of transformers
  `generate` on the same model, batch 64, equal and varying lengths (bench/engine_throughput.py).
- push: trainer -> engine through `reflow.engines.weights.push.push_weights` (what `TrainerRank.push_weights`
  calls; that method only adds Ray's node address) next to a plain device-to-device copy.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import engine_throughput as ET  # noqa: E402
import gpu_engine as GE  # noqa: E402
import gpu_push as GP  # noqa: E402
import gpu_trainer as GT  # noqa: E402

PEAK_BF16 = {"cuda": 989e12, "cpu": float("nan")}
TINY = dict(hidden=64, layers=2, heads=4, mlp=256, vocab=512)
DEMO = dict(hidden=768, layers=12, heads=12, mlp=3072, vocab=32)  # reflow.rl.demo_policy SIZES["gpu"] (21 tokens)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def gpu_peak_gib(reset: bool = True) -> float:
    if not torch.cuda.is_available():
        return float("nan")
    v = torch.cuda.max_memory_allocated() / 2**30
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return v


def model_flops(cfg, seqs: int, T: int, forwards: int) -> float:
    """Forward FLOPs (2*N*T + causal attention 2*L*d*T^2) per sequence, times sequences and forwards."""
    h, L, V, mlp = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    n = L * (h * h * 2 + 2 * h * kv + 3 * h * mlp) + V * h  # q, o, k, v, MLP per layer; LM head
    return forwards * seqs * (2 * n * T + 2 * L * h * T * T)


def synthetic_batch(B: int, T: int, vocab: int, prompt: int):
    from reflow.rl.types import RolloutBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (B, T), generator=g).tolist()
    return RolloutBatch(group_index=[i // 2 for i in range(B)], prompt_text=[""] * B,
                        prompt_ids=[r[:prompt] for r in ids], response_text=[""] * B,
                        response_ids=[r[prompt:] for r in ids], rollout_logprobs=[[-1.0] * (T - prompt)] * B,
                        finish_reason=["length"] * B, label=[None] * B,
                        advantages=[1.0 if i % 2 else -1.0 for i in range(B)])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_trainer(folder: Path, args):
    """TrainerRank (DeepSpeed) when it imports; None otherwise (the caller falls back)."""
    try:
        import deepspeed  # noqa: F401

        from reflow.engines.train.settings import RankSettings
        from reflow.engines.train.trainer import TrainerRank
    except ImportError as e:
        print(f"# DeepSpeed unavailable ({e}); the trainer row is the plain loop with the RL loss")
        return None
    cuda = args.device == "cuda"  # backend nccl: the trainer builds a cpu:gloo,cuda:nccl group itself
    settings = RankSettings(zero_stage=1, precision="bf16", lr=1e-6, total_steps=1000, micro_batch_size=args.micro,
                            threads=4, backend="nccl" if cuda else "gloo")
    return TrainerRank(0, 1, "127.0.0.1", _free_port(), str(folder), settings)


def start_engine(folder: Path, args):
    """The embedded engine (HTTP server thread) with its model on the device."""
    from reflow.engines.embedded.engine import EmbeddedEngine
    from reflow.engines.rollout_client import EngineClient

    server = EmbeddedEngine(model_path=str(folder), engine_id="gpu-bench", threads=4, dtype="bf16", device=args.device)
    gen = server.generator
    server.ready()
    return server, gen, EngineClient(server.url(), timeout=3600, api_key=server.api_key())


def push_on_gpu(trainer, folder: Path, cfg, res: dict, args) -> None:
    """CUDA IPC push and the colocated hand-over, the engine in a child process (bench/gpu_push.py)."""
    proc, stop, client = GP.start_engine_process(folder)
    parts = {"push": lambda: GP.bench_push(trainer, client, args),
             "handover": lambda: GP.handover(trainer, client, GT._iteration(sys.modules[__name__], trainer, cfg, args, 32),
                                             args)}
    try:
        for name, fn in parts.items():
            try:
                res[name] = fn()
            except Exception as e:  # deliberate: one part failing keeps the other's figures (printed, recorded)
                traceback.print_exc()
                res[name] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        stop.set()
        proc.join(120)
    res["push_summary"] = GP.write({"push": res["push"], "handover": res["handover"]}, args, os.environ.get("OUT"))


def bench_push(trainer, plain_named, gen, client, args) -> dict:
    """Gather + push (verify off) against a device-to-device copy and a device->host->device copy."""
    from reflow.engines.weights.push import push_weights
    from reflow.engines.weights.settings import PushSettings

    def gathered():
        if trainer is not None:
            return trainer.named_weights()  # every parameter as a CPU copy (TrainerRank.push_weights does this)
        return [(n, p.detach().to("cpu")) for n, p in plain_named]

    src = dict(trainer.engine.module.named_parameters()) if trainer is not None else dict(plain_named)
    dst = {n: gen._params[n] for n in src}
    nbytes = sum(t.numel() * t.element_size() for t in src.values())
    version = iter(range(1, 10**6))
    best = {"push": math.inf, "gather": math.inf, "d2d": math.inf, "staged": math.inf}
    for r in range(args.repeat + 1):  # the first round is a warm-up
        sync()
        t0 = time.perf_counter()
        named = gathered()
        t1 = time.perf_counter()
        push_weights([client], named, str(next(version)), PushSettings(verify="off"))
        sync()
        t2 = time.perf_counter()
        with torch.no_grad():
            for n, t in src.items():
                dst[n].copy_(t)
            sync()
            t3 = time.perf_counter()
            for n, t in src.items():
                dst[n].copy_(t.to("cpu"))
            sync()
            t4 = time.perf_counter()
        if r:
            for k, v in (("push", t2 - t0), ("gather", t1 - t0), ("d2d", t3 - t2), ("staged", t4 - t3)):
                best[k] = min(best[k], v)
    t0 = time.perf_counter()
    push_weights([client], gathered(), str(next(version)), PushSettings(verify="sample"))  # proves the weights landed
    verified = time.perf_counter() - t0
    gb = nbytes / 1e9
    return {"gb": gb, **{f"{k}_s": v for k, v in best.items()}, **{f"{k}_gbs": gb / v for k, v in best.items()},
            "verified_s": verified}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny Llama and batches: a smoke test")
    p.add_argument("--model", default="qwen2-0.5b", choices=["qwen2-0.5b", "demo"],
                   help="the model's shape: Qwen2.5-0.5B's, or the GPU demo policy's (113M Llama, 32 tokens)")
    p.add_argument("--batch", type=int, default=16, help="trainer sequences per step")
    p.add_argument("--seq", type=int, default=2048, help="trainer tokens per sequence")
    p.add_argument("--micro", type=int, default=8, help="trainer micro-batch (sequences)")
    p.add_argument("--minibatches", type=int, default=1, help="optimizer steps per iteration (the GPU demo: 2; "
                   "more than 1 runs the separate old-logprob pass)")
    p.add_argument("--steps", type=int, default=3, help="timed trainer steps")
    p.add_argument("--gen-batches", default="1,64,256", help="engine batch sizes")
    p.add_argument("--gen-len", type=int, default=256)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--skip", default="", help="comma list of parts to skip: trainer, engine, push")
    p.add_argument("--variants", default=None,
                   help=f"comma list of trainer variants: {', '.join([*GT.VARIANTS, *GT.PLAINS])} "
                        f"(default: all on cuda; default,old-pass,plain with --tiny)")
    p.add_argument("--no-profile", dest="profile", action="store_false", help="skip the profiled trainer step")
    p.add_argument("--nccl", action="store_true", help="only the two-GPU NCCL push (trainer GPU 0, engine GPU 1)")
    p.add_argument("--commit", default=None, help="the commit measured, for the JSON results (default: git's, "
                                                   "which a copy without .git does not have)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child's one trainer variant
    p.add_argument("--folder", default=None, help=argparse.SUPPRESS)  # the child's model folder
    args = p.parse_args()
    if args.tiny:
        args.batch, args.seq, args.micro, args.steps, args.gen_batches, args.gen_len = 4, 64, 2, 1, "1,8", 16
    if args.one:  # a child of bench_all: one trainer variant, its row on the last line of stdout
        C.set_bench_env()
        import logging

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        try:
            GT.one(sys.modules[__name__], Path(args.folder), args)
        except BaseException:  # deliberate: the parent reports the traceback (stderr's tail) as the failed row
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # not the interpreter's teardown: a process group or thread left behind must not hang the parent
    # The order of old, when all shared one process: the plain loops first, ZeRO-3 (which left memory held) last.
    default_variants = "default,old-pass,plain" if args.tiny else ",".join([*GT.PLAINS, *GT.VARIANTS])
    args.variants = (args.variants or default_variants).split(",")
    args.commit = args.commit or C.git_commit()
    unknown = set(args.variants) - set(GT.VARIANTS) - set(GT.PLAINS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}")
    C.set_bench_env()
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its per-stage memory printouts
    from reflow.rl.demo_policy import save_policy

    C.header(f"GPU benchmark, each trainer variant in a process of its own ({args.device})")
    import reflow

    print(f"# reflow from {Path(reflow.__file__).parent}")  # the installed package, or src/reflow: nothing shadows it
    kind = "llama" if args.tiny else args.model
    model = ET.build_model("llama" if kind == "demo" else kind, DEMO if kind == "demo" else TINY, torch.bfloat16,
                           args.device)
    cfg, n_total = model.config, sum(p.numel() for p in model.parameters())
    folder = save_policy(model, ET.build_tokenizer(cfg.vocab_size), Path(tempfile.mkdtemp(prefix="reflow-gpu-")) / "m")
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the children need the memory
    print(f"# model: {kind}, {n_total / 1e6:.0f}M parameters, bf16; trainer batch {args.batch} x {args.seq} "
          f"(micro {args.micro}); engine batches {args.gen_batches} x up to {args.gen_len} tokens", flush=True)
    skip, res = set(args.skip.split(",")), {"train": [], "engine": [], "push": None}
    if "trainer" not in skip:
        res["train"], prof = GT.bench_all(sys.modules[__name__], folder, args)
        res["trainer_summary"] = GT.summary(res["train"], prof, args, f"{kind} {args.batch}x{args.seq} bf16")
        GT.write(res["trainer_summary"], os.environ.get("OUT"))
    trainer = make_trainer(folder, args) if "push" not in skip else None
    if {"engine", "push"} <= skip:
        return report(res, args)
    if args.nccl:  # two GPUs: the distributed push over NCCL (bench/gpu_push.py)
        res["nccl"] = GP.bench_nccl(trainer, folder, args)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "gpu-nccl.json").write_text(json.dumps({"commit": args.commit, **res["nccl"]}))
        return
    if "push" not in skip and args.device == "cuda" and trainer is not None:
        push_on_gpu(trainer, folder, cfg, res, args)  # first: the engine in-process below would hold memory
        skip.add("push")
        if "engine" in skip:
            return report(res, args)
    server, gen, client = start_engine(folder, args)
    if "engine" not in skip:
        check = GE.greedy_check(gen, args)
        res["engine"] = GE.bench_engine(gen, client, args, [int(b) for b in args.gen_batches.split(",")])
        res["engine_summary"] = GE.summary(res["engine"], check, gen, args)
        GE.write(res["engine_summary"], os.environ.get("OUT"))
    if "push" not in skip:
        plain_named = None
        if trainer is None:
            from transformers import AutoModelForCausalLM

            plain_named = list(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
                               .to(args.device).named_parameters())
        res["push"] = bench_push(trainer, plain_named, gen, client, args)
    server.shutdown()
    report(res, args)


def report(res: dict, args) -> None:
    print()
    if res["train"]:
        print(C.table(res["train"], [("what", "trainer", ""), ("s", "s/step", ".3f"), ("tok_s", "tokens/s", ".0f"),
                                     ("tflops", "TFLOP/s", ".1f"), ("mfu", "MFU", ".1%"),
                                     ("mfu_executed", "MFU executed", ".1%"), ("gpu_gib", "GPU peak GiB", ".1f"),
                                     ("warmup_s", "warm-up s", ".1f")]))
        prof = res["trainer_summary"]["profile"]
        if prof:
            print(f"profile of one default step: {prof['wall_ms']:.0f} ms, GPU busy {prof['gpu_busy_ms']:.0f} ms, "
                  f"idle {prof['gpu_idle_share']:.1%}; top kernels:")
            print(C.table(prof["top"], [("kernel", "kernel", ""), ("ms", "ms", ".1f"), ("calls", "calls", "d")]))
            print(C.table([{"phase": k, **v} for k, v in prof["phases"].items()],
                          [("phase", "phase", ""), ("cpu_ms", "host ms", ".1f"), ("gpu_ms", "kernels ms", ".1f"),
                           ("calls", "calls", "d")]))
    if res["engine"]:
        print(C.table(res["engine"], [("mode", "lengths", ""), ("batch", "batch", "d"), ("tokens", "tokens", "d"),
                                      ("ours_tps", "ours tok/s", ".0f"), ("ours/eager_tps", "eager tok/s", ".0f"),
                                      ("ours/http_tps", "ours/http tok/s", ".0f"), ("hf_tps", "generate tok/s", ".0f"),
                                      ("ours_ratio", "ours/generate", ".2f"), ("ours/eager_ratio", "eager/generate", ".2f"),
                                      ("ours/http_ratio", "http/generate", ".2f"), ("ours_ms_per_step", "ours ms/step", ".2f"),
                                      ("hf_ms_per_step", "generate ms/step", ".2f"), ("ours_gib", "ours peak +GiB", ".2f"),
                                      ("hf_gib", "generate peak +GiB", ".2f")]))
    if res["push"] and "ipc_s" in res["push"] and "free_gib" in res.get("handover", {}):
        print(C.table([res["push"]], [("gb", "GB", ".2f"), ("mapped_s", "mapped push s", ".5f"),
                                      ("mapped_gbs", "mapped GB/s", ".0f"), ("mapped_packed_s", "mapped+packed s", ".5f"),
                                      ("ipc_s", "SGLang-calls IPC s", ".4f"), ("staged_s", "host-staged s", ".3f"),
                                      ("d2d_flat_gbs", "flat d2d GB/s", ".0f"), ("d2d_foreach_gbs", "foreach d2d GB/s", ".0f"),
                                      ("d2d_per_tensor_gbs", "per-tensor d2d GB/s", ".0f"),
                                      ("ipc_ratio", "mapped/flat", ".2f"), ("ipc_ratio_foreach", "mapped/foreach", ".2f"),
                                      ("ipc_ratio_per_tensor", "mapped/per-tensor", ".2f")]))
        ho = res["handover"]
        print(C.table([{"point": k, "free": v} for k, v in ho["free_gib"].items()],
                      [("point", "colocated hand-over", ""), ("free", "free GPU GiB", ".2f")]))
    elif res["push"]:
        pu = res["push"]
        print(C.table([pu], [("gb", "GB", ".2f"), ("push_s", "push s", ".3f"), ("push_gbs", "push GB/s", ".2f"),
                             ("gather_s", "of which gather s", ".3f"), ("verified_s", "verified push s", ".3f"),
                             ("d2d_gbs", "plain d2d GB/s", ".1f"), ("staged_gbs", "plain d->h->d GB/s", ".2f")]))
    print(f"peak RSS: this process {C.self_peak_mib():.0f} MiB")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu.json").write_text(json.dumps(res, indent=1, default=str))
    tr = next((r for r in res["train"] if r["variant"] == "default"), None)
    ratio = res.get("trainer_summary", {}).get("reflow_over_plain_compiled")
    varying = [r for r in res["engine"] if r["mode"] == "varying"]
    eng = next((r for r in varying if r["batch"] == 64), varying[0] if varying else None)
    parts = []
    if tr:
        parts.append(f"trainer MFU {tr['mfu']:.1%} (target 40%)"
                     + (f", {ratio:.2f}x the compiled plain loop's tokens/s (target 0.95)" if ratio else ""))
    if eng:
        big = res["engine_summary"]["ratio_b256_varying"]
        parts.append(f"engine/generate {eng['ours_ratio']:.2f} at batch {eng['batch']} varying (target 4 at 64)"
                     + (f", {big:.2f} at 256 (target 3)" if big else ""))
    if res["push"] and "ipc_s" in res["push"] and "free_gib" in res.get("handover", {}):
        parts.append(f"colocated (mapped) push {res['push']['ipc_ratio']:.2f}x a flat d2d copy (target 0.5), "
                     f"{res['push']['ipc_ratio_foreach']:.2f}x a multi-tensor copy of the parameters, "
                     f"engine frees {res['handover']['engine_release_fraction']:.0%} on release (target 90%)")
    elif res["push"]:
        parts.append(f"push {res['push']['push_gbs']:.2f} GB/s vs d2d {res['push']['d2d_gbs']:.0f} GB/s")
    print("\ngpu: " + "; ".join(parts))


if __name__ == "__main__":
    main()
