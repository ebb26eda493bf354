"""Whether a one-layer model compiled in another process fills inductor's on-disk caches for the whole model's
compiled decoder layers (the idea behind compiling the trainer's graphs ahead while a run starts: iteration 0
spends 8.8-14 s compiling on the H200, bench/RESULTS.md 26, ~2 s with a warm cache, section 16).

    python bench/compile_cache_probe.py --model PATH [--device cpu|cuda] [--rows 8 --length 16]

Three child processes, each timing one forward+backward of its model through `compile_layers` (inductor):
  cold   - the whole model, a fresh cache folder;
  warmup - a one-layer model of the same config (random weights), another fresh folder;
  warm   - the whole model again, in the warm-up's folder.
Prints each child's seconds and inductor's/AOTAutograd's cache counters, and cold / warm.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def child(a) -> None:
    import torch
    from torch._dynamo.utils import counters
    from transformers import AutoConfig, AutoModelForCausalLM

    from reflow.engines.train.compiled import compile_layers

    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(a.model)
    if a.layers:
        cfg.num_hidden_layers = a.layers
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_config(cfg).to(a.device, dtype).eval()
    compile_layers(model, "inductor")
    ids = torch.randint(3, cfg.vocab_size, (a.rows, a.length), device=a.device)
    t0 = time.perf_counter()
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    out.float().logsumexp(-1).mean().backward()
    if a.device == "cuda":
        torch.cuda.synchronize()
    print(json.dumps({"seconds": time.perf_counter() - t0, "inductor": dict(counters["inductor"]),
                      "aot_autograd": dict(counters["aot_autograd"])}))


def run(a, layers: int, cache: str) -> dict:
    cmd = [sys.executable, __file__, "--part", "child", "--model", a.model, "--device", a.device, "--rows", str(a.rows),
           "--length", str(a.length), "--layers", str(layers)]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=tempfile.gettempdir()).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="an HF model folder (its config is what counts)")
    p.add_argument("--device", default="cuda" if os.path.exists("/dev/nvidiactl") else "cpu")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--length", type=int, default=16)
    p.add_argument("--layers", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--part", default="main", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.part == "child":
        return child(a)
    cold = run(a, 0, tempfile.mkdtemp(prefix="inductor-cold-"))
    shared = tempfile.mkdtemp(prefix="inductor-warm-")
    warmup = run(a, 1, shared)
    warm = run(a, 0, shared)
    for name, r in (("cold", cold), ("warmup", warmup), ("warm", warm)):
        print(f"  {name:6s} {r['seconds']:6.1f} s  inductor {r['inductor']}  aot_autograd {r['aot_autograd']}")
    print(f"compile_cache_probe: cold_s={cold['seconds']:.1f} warm_s={warm['seconds']:.1f} "
          f"cold_over_warm={cold['seconds'] / warm['seconds']:.2f}")


if __name__ == "__main__":
    main()
