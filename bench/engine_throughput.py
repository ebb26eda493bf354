"""Rollout engine throughput: our engine against transformers `generate` on the same model and prompts.

    .venv/bin/python bench/engine_throughput.py            # 3-5 min on 2 cores
    .venv/bin/python bench/engine_throughput.py --batches 64 --repeat 3

Same model (a random Llama-shaped causal LM with a 16k vocabulary, fp32 on CPU), same prompts
(32 random tokens each), same sampling (temperature 1, top-p 1, no top-k), batch sizes 1, 16, 64:
- equal: every response is exactly `--length` (64) tokens;
- varying: response lengths spread log-uniformly over [--min-len, --max-len] (the long tail of
  RL responses). Both engines produce exactly those lengths: ours through per-request
  `max_new_tokens` with `ignore_eos`, `generate` through a per-row stopping criterion (rows that
  are done are padded while the batch runs on, which is how `generate` batches).
tokens/s = response tokens produced / wall seconds, best of `--repeat` runs (the engines take
turns, so both see the same background load). "ours" is the engine's `Generator` called in
process; "ours/http" is the whole embedded engine (FastAPI server, SGLang's /generate with
logprobs) driven by `EngineClient`. Our engine also returns per-token logprobs; `generate` does not.
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

SHAPE = dict(hidden=512, layers=4, heads=8, mlp=1408, vocab=16384)


def build_tokenizer(vocab: int):
    """A word-level tokenizer of `vocab` synthetic tokens (no hub access needed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    words = {t: i for i, t in enumerate(specials + [f"t{i}" for i in range(vocab - len(specials))])}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>")


def build_model(kind: str, shape: dict, dtype: torch.dtype, device: str, seed: int = 0):
    """kind 'llama' (shape keys hidden, layers, heads, mlp, vocab) or 'qwen2-0.5b' (Qwen2.5-0.5B's config)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if kind == "qwen2-0.5b":
        cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                          rope_theta=1e6, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                          attn_implementation="sdpa")
        cls = Qwen2ForCausalLM
    else:
        cfg = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["mlp"],
                          num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                          num_key_value_heads=shape["heads"], max_position_embeddings=4096, pad_token_id=0,
                          bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, attn_implementation="sdpa")
        cls = LlamaForCausalLM
    with torch.device(device):
        model = cls(cfg).to(dtype)
    return model.eval()


def lengths_for(batch: int, mode: str, args) -> list[int]:
    if mode == "equal":
        return [args.length] * batch
    lo, hi = math.log(args.min_len), math.log(args.max_len)  # quantiles of log-uniform(min, max)
    out = [round(math.exp(lo + (hi - lo) * (i + 0.5) / batch)) for i in range(batch)]
    if batch > 1:
        out[-1] = args.max_len  # the batch always holds one response of the longest length
    return out


def prompts_for(batch: int, vocab: int, prompt_len: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (batch, prompt_len), generator=g).tolist()


def run_ours(gen, prompts, lengths) -> int:
    sps = [{"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": n, "ignore_eos": True} for n in lengths]
    recs = gen.generate(prompts, sps, 1)
    got = [len(r["output_ids"]) for r in recs]
    assert got == lengths, f"ours produced lengths {got[:8]}..., asked {lengths[:8]}..."
    return sum(got)


def run_http(client, prompts, lengths) -> int:
    sps = [{"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": n, "ignore_eos": True} for n in lengths]
    out = client.generate(input_ids=prompts, sampling_params=sps, return_logprob=True)
    got = [len(o["output_ids"]) for o in out]
    assert got == lengths, f"ours/http produced lengths {got[:8]}..."
    return sum(got)


def run_hf(model, prompts, lengths, pad_id: int) -> int:
    from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

    dev = next(model.parameters()).device
    ids = torch.tensor(prompts, device=dev)  # [B, P]: equal prompt lengths, no padding
    want = torch.tensor(lengths, device=dev)  # [B]
    P = ids.shape[1]

    class PerRowLength(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            return (input_ids.shape[1] - P) >= want  # [B] bool: this row is done

    gc = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max(lengths),
                          eos_token_id=None, pad_token_id=pad_id)
    model.generation_config.eos_token_id = None  # no eos stop: lengths come from the criterion only
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc,
                         stopping_criteria=StoppingCriteriaList([PerRowLength()]))
    assert out.shape[1] - P == max(lengths), f"generate ran {out.shape[1] - P} steps, expected {max(lengths)}"
    return sum(lengths)


def timed(fn) -> tuple[float, int]:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    n = fn()
    sync()
    return time.perf_counter() - t0, n


def measure(engines: dict, batches: list[int], modes: list[str], args, vocab: int) -> list[dict]:
    """engines: name -> fn(prompts, lengths) -> tokens. Best of args.repeat, engines taking turns."""
    rows = []
    for mode in modes:
        for b in batches:
            prompts, lengths = prompts_for(b, vocab, args.prompt_len), lengths_for(b, mode, args)
            best: dict[str, float] = {}
            names = list(engines)
            for r in range(args.repeat):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    sec, n = timed(lambda: engines[name](prompts, lengths))
                    best[name] = min(best.get(name, math.inf), sec)
            row = {"mode": mode, "batch": b, "tokens": sum(lengths), "max_len": max(lengths)}
            row.update({f"{k}_tps": sum(lengths) / v for k, v in best.items()})
            for k in best:
                if k != "hf":
                    row[f"{k}_ratio"] = best["hf"] / best[k]
            rows.append(row)
            print(f"  {mode:7} batch {b:3}: " + ", ".join(f"{k} {row[f'{k}_tps']:.0f} tok/s" for k in best),
                  flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--modes", default="equal,varying")
    p.add_argument("--length", type=int, default=64, help="response length of the equal mode")
    p.add_argument("--min-len", type=int, default=4)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--no-http", action="store_true", help="skip the HTTP engine")
    args = p.parse_args()
    C.set_bench_env()
    if args.threads:
        torch.set_num_threads(args.threads)
    from reflow.engines.embedded.engine import EmbeddedEngine
    from reflow.engines.embedded.generator import Generator
    from reflow.engines.rollout_client import EngineClient
    from reflow.rl.demo_policy import save_policy

    C.header("rollout engine throughput: our engine vs transformers generate (CPU)")
    tok = build_tokenizer(SHAPE["vocab"])
    model = build_model("llama", SHAPE, torch.float32, "cpu")
    nparams = sum(p.numel() for p in model.parameters())
    print(f"# model: Llama {SHAPE}, {nparams / 1e6:.1f}M parameters, fp32, {torch.get_num_threads()} threads; "
          f"prompts {args.prompt_len} tokens; equal = {args.length} tokens, varying = log-uniform "
          f"[{args.min_len}, {args.max_len}]; best of {args.repeat}")
    gen = Generator(model, tok, max_batch_size=256)
    engines = {"ours": lambda pr, ln: run_ours(gen, pr, ln)}
    server = None
    if not args.no_http:
        folder = save_policy(model, tok, Path(tempfile.mkdtemp(prefix="reflow-bench-engine-")) / "model")
        server = EmbeddedEngine(model_path=str(folder), engine_id="bench", threads=torch.get_num_threads())
        server.ready()
        client = EngineClient(server.url(), timeout=3600, api_key=server.api_key())
        engines["ours/http"] = lambda pr, ln: run_http(client, pr, ln)
    engines["hf"] = lambda pr, ln: run_hf(model, pr, ln, tok.pad_token_id)
    for fn in engines.values():  # warm-up: first-call costs stay out of the numbers
        fn(prompts_for(2, SHAPE["vocab"], args.prompt_len), [4, 4])
    batches = [int(b) for b in args.batches.split(",")]
    rows = measure(engines, batches, args.modes.split(","), args, SHAPE["vocab"])
    if server is not None:
        server.shutdown()
    cols = [("mode", "lengths", ""), ("batch", "batch", "d"), ("tokens", "tokens", "d"), ("max_len", "longest", "d"),
            ("ours_tps", "ours tok/s", ".0f")]
    if not args.no_http:
        cols.append(("ours/http_tps", "ours/http tok/s", ".0f"))
    cols += [("hf_tps", "generate tok/s", ".0f"), ("ours_ratio", "ours/generate", ".2f")]
    if not args.no_http:
        cols.append(("ours/http_ratio", "http/generate", ".2f"))
    print()
    print(C.table(rows, cols))
    print(f"peak RSS: this process {C.self_peak_mib():.0f} MiB (model, both engines, the HTTP server thread)")
    key = next((r for r in rows if r["mode"] == "varying" and r["batch"] == max(batches)), rows[-1])
    eq = next((r for r in rows if r["mode"] == "equal" and r["batch"] == max(batches)), None)
    print(f"\nengine_throughput: ours/generate at batch {key['batch']} varying = {key['ours_ratio']:.2f}"
          + (f" (http {key['ours/http_ratio']:.2f})" if "ours/http_ratio" in key else "")
          + (f", equal = {eq['ours_ratio']:.2f}" if eq else "") + " (target >= 2 at batch 64 varying)")


if __name__ == "__main__":
    main()
