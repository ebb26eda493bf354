"""Weight push throughput: trainer actor -> engine actor, next to a plain in-process copy of the same tensors.

    .venv/bin/python bench/weight_push.py                    # 4M, 34M, 94M parameters, 1-3 min on 2 cores
    .venv/bin/python bench/weight_push.py --sizes 256x4,1024x8 --bucket-mb 64

"push" is the production path: `TrainerGroup.push_weights` on a DeepSpeed trainer rank (a Ray
actor) gathers its parameters, then `reflow.engines.weights.push` packs them into the shared-memory
buffer the engine (another Ray actor, the embedded engine over HTTP) has mapped once, and one call has the
engine pause, copy, set the version and resume (weight_sync.map_once). "SGLang's calls" is the same push
as SGLang engines get it, measured in the same run: pause, session, shared-memory buckets through
`/update_weights_from_tensor`, end of session, resume. Timed from the driver around the
whole Ray call, verification off; the verified push (the default `verify=sample`) is shown too.
"plain" is `dst.copy_(src)` for every tensor between two models in this process: what loading
the same weights costs with no processes in between ("clone" copies into freshly allocated
memory instead, which pays the page faults that every new buffer of the push pays too).
GB/s = fp32 weight bytes / seconds, best of `--repeat` (plain copies: 3x as many).
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

DEFAULT_SIZES = "256x4,512x8,768x10"  # hidden x layers of the demo policy shape (MLP 4x hidden)


def _best(fn, repeat: int) -> float:
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _best_push(one, repeat: int) -> tuple[float, dict]:
    """Best wall time of `repeat` pushes and that push's own report."""
    best, report = math.inf, {}
    for _ in range(repeat):
        t0 = time.perf_counter()
        stats = one()
        if time.perf_counter() - t0 < best:
            best, report = time.perf_counter() - t0, stats
    return best, report


def plain_copy(policy: Path, threads: int, repeat: int) -> tuple[float, float]:
    """(copy_ into the existing tensors of a second model, clone into fresh memory), best of `repeat`."""
    import torch

    from reflow.engines.hf_io import load_causal_lm

    torch.set_num_threads(threads)
    src, dst = load_causal_lm(str(policy)), load_causal_lm(str(policy))
    pairs = list(zip(src.state_dict().values(), dst.state_dict().values()))

    def copy():
        with torch.no_grad():
            for s, d in pairs:
                d.copy_(s)
    copy()  # warm-up
    return _best(copy, 3 * repeat), _best(lambda: [s.clone() for s, _ in pairs], 3 * repeat)


def push(policy: Path, args, size: str) -> dict:
    import ray

    from reflow.engines.embedded.engine import EmbeddedEngine
    from reflow.engines.train.group import TrainerGroup
    from reflow.engines.train.settings import RankSettings
    from reflow.engines.weights.settings import PushSettings

    ns = f"bench-push-{size}"
    group = TrainerGroup.create(1, ns, "bench", model_path=str(policy),
                                settings=RankSettings(lr=1e-4, total_steps=10, micro_batch_size=4, threads=args.threads))
    engine = ray.remote(EmbeddedEngine).options(namespace=ns, num_cpus=1).remote(
        model_path=str(policy), engine_id=f"engine-{size}", threads=args.threads)
    url, api_key = ray.get([engine.url.remote(), engine.api_key.remote()])
    ray.get(engine.ready.remote())
    version = iter(range(1, 10**6))

    def one(verify: str, map_once: bool = True) -> dict:
        settings = PushSettings(bucket_bytes=args.bucket_mb << 20, verify=verify, map_once=map_once)
        return ray.get(group.push_weights([url], str(next(version)), settings, api_key))[0]

    one("off", map_once=False)  # warm-up: first HTTP connections, first shared-memory segment
    sglang_best, _ = _best_push(lambda: one("off", map_once=False), args.repeat)  # SGLang's calls, as before map_once
    one("off")  # warm-up: the engine maps the trainer's buffer
    best, stats = _best_push(lambda: one("off"), args.repeat)
    out = {"push_s": best, "inner_s": stats["seconds"], "buckets": stats["buckets"], "sglang_calls_s": sglang_best}
    out["verified_s"] = _best(lambda: one("sample"), 1)
    out["peaks"] = C.process_tree_peaks()
    ray.get(engine.shutdown.remote())
    ray.kill(engine)
    group.kill()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="comma list of HIDDENxLAYERS")
    p.add_argument("--bucket-mb", type=int, default=512, help="bucket size (weight_sync.bucket_mb; default as config)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the trainer, the engine and the plain copy")
    p.add_argument("--repeat", type=int, default=5, help="pushes per size (plain copies: 3x as many)")
    args = p.parse_args()
    C.set_bench_env()
    import ray

    C.header("weight push: trainer actor -> engine actor (HTTP + shared memory) vs a plain in-process copy")
    work = Path(tempfile.mkdtemp(prefix="reflow-bench-push-"))
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=str(work / "ray"), log_to_driver=False,
             runtime_env={"env_vars": {**C.BENCH_ENV, "OMP_NUM_THREADS": str(args.threads)}})
    rows = []
    try:
        for size in args.sizes.split(","):
            h, layers = (int(x) for x in size.split("x"))
            policy = C.demo_policy(work / f"policy-{size}", hidden=h, layers=layers)
            nbytes = C.n_params(policy) * 4
            res = push(policy, args, size)
            plain, clone = plain_copy(policy, args.threads, args.repeat)
            gb = nbytes / 1e9
            rows.append({"size": size, "params": nbytes / 4e6, "mb": nbytes / 2**20, "push_s": res["push_s"],
                         "push_gbs": gb / res["push_s"], "sglang_calls_gbs": gb / res["sglang_calls_s"],
                         "mapped_over_sglang_calls": res["sglang_calls_s"] / res["push_s"], "inner_s": res["inner_s"], "verified_s": res["verified_s"],
                         "buckets": res["buckets"], "plain_s": plain, "plain_gbs": gb / plain,
                         "clone_gbs": gb / clone, "ratio": plain / res["push_s"], "peaks": res["peaks"]})
            print(f"  {size}: push {res['push_s']:.3f}s plain {plain:.3f}s", flush=True)
            shutil.rmtree(policy, ignore_errors=True)
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n# bucket {args.bucket_mb} MiB, {args.threads} torch threads per process, best of {args.repeat} "
          f"pushes / {3 * args.repeat} plain copies")
    print(C.table(rows, [("size", "hidden x layers", ""), ("params", "params M", ".1f"), ("mb", "MiB", ".0f"),
                         ("buckets", "buckets", "d"), ("push_s", "push s", ".3f"), ("push_gbs", "push GB/s", ".2f"),
                         ("sglang_calls_gbs", "SGLang's calls GB/s", ".2f"), ("mapped_over_sglang_calls", "push/SGLang's", ".2f"),
                         ("inner_s", "of which send s", ".3f"), ("verified_s", "verified push s", ".3f"),
                         ("plain_s", "plain s", ".3f"), ("plain_gbs", "plain GB/s", ".2f"),
                         ("clone_gbs", "clone GB/s", ".2f"),
                         ("ratio", "push/plain GB/s", ".2f")]))
    for r in rows:
        print(f"peak RSS {r['size']}: {C.fmt_peaks(r['peaks'], top=3)}")
    print(f"peak RSS: this process (driver + plain copy) {C.self_peak_mib():.0f} MiB")
    print("\nweight_push: push/plain GB/s " + " ".join(f"{r['params']:.0f}M={r['ratio']:.2f}" for r in rows)
          + " (target >= 0.5); push GB/s " + " ".join(f"{r['params']:.0f}M={r['push_gbs']:.2f}" for r in rows)
          + "; push/SGLang's calls " + " ".join(f"{r['params']:.0f}M={r['mapped_over_sglang_calls']:.2f}" for r in rows))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
