"""The push and colocated parts of bench/gpu.py: trainer -> engine on one GPU, the engine in its own process.

CUDA IPC only works between processes (a process cannot open its own handles), so the engine runs as
in a real run: an `EmbeddedEngine` (HTTP server, model on the GPU) in a spawned child process; the
trainer (DeepSpeed `TrainerRank`, ZeRO-1, bf16) is this process.

- push: `push_weights` in mode=tensor with the trainer's parameters on the GPU (verify off): mapped (the
  default, weight_sync.map_once: the engine maps the parameters once by CUDA IPC and lays its own weights
  out as them, a push is one call through the engine's local socket: also timed through HTTP), mapped
  and packed (one buffer packed per push), and SGLang's calls (a CUDA IPC handle per bucket inside pause,
  flush, begin, end, continue), against plain copies of the same bytes in this process: one
  device-to-device copy of a flat buffer, one multi-tensor copy of every parameter, and one `copy_` per
  parameter. Reported also: the same push staged through host memory (the path before CUDA IPC).
- colocated hand-over: free GPU memory (`cudaMemGetInfo`, the whole device) at each step of
  tasks/colocate.py's sequence: both resident -> engine releases everything -> trainer reloads and trains
  one step -> trainer offloads -> engine resumes weights -> push -> engine resumes the rest and generates.
Results: $OUT/gpu-push.json (-> bench/results/gpu-push.json).
"""
from __future__ import annotations

import json
import math
import multiprocessing as mp
import time
from pathlib import Path

import torch

GIB = 2**30


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _engine_main(folder: str, device: str, q, stop) -> None:
    from reflow.engines.embedded.engine import EmbeddedEngine

    e = EmbeddedEngine(folder, "push-engine", threads=4, dtype="bf16", device=device)
    e.ready()
    q.put((e.url(), e.api_key()))
    stop.wait()
    e.shutdown()


def start_engine_process(folder: Path, device: str = "cuda"):
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_engine_main, args=(str(folder), device, q, stop), daemon=True)
    proc.start()
    url, key = q.get(timeout=900)
    from reflow.engines.rollout_client import EngineClient

    return proc, stop, EngineClient(url, timeout=900, api_key=key)


def _free_gib() -> float:
    _sync()
    return torch.cuda.mem_get_info()[0] / GIB if torch.cuda.is_available() else 0.0


def _best(fn, repeat: int) -> float:
    best = math.inf
    for _ in range(repeat + 1):  # the first is a warm-up
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _engine_mem(client) -> dict:
    """The engine process's own figures (torch's allocator there), from /server_info."""
    info = client.server_info()
    return {k: info[k] for k in ("gpu_allocated_gib", "gpu_reserved_gib", "kv_cache_gib", "cuda_graphs") if k in info}


def bench_push(trainer, client, args) -> dict:
    from reflow.engines.weights.push import push_weights
    from reflow.engines.weights.settings import PushSettings

    src = [p for _, p in trainer.engine.module.named_parameters()]
    nbytes = sum(p.numel() * p.element_size() for p in src)
    flat_a = torch.empty(nbytes, dtype=torch.uint8, device=src[0].device)
    flat_b = torch.empty_like(flat_a)
    twins = [torch.empty_like(p) for p in src]
    version = iter(range(1, 10**6))
    off = PushSettings(verify="off")

    sglang_calls = PushSettings(verify="off", map_once=False)

    def mapped():  # the default: the engine maps the trainer's parameters once; a push is one call
        push_weights([client], trainer._gathered(keep=True, on_device=True), str(next(version)), off, stable=True)

    from reflow.engines.weights.mapped import MAPPED

    engine_s: list[float] = []

    def mapped_local():  # the default, keeping what the engine says it spent inside the call
        out = push_weights([client], trainer._gathered(keep=True, on_device=True), str(next(version)), off, stable=True)
        engine_s.append(out["engine_seconds"])
        res_extra["copies"] = out["copies"]

    def mapped_http():  # the same, its one call through HTTP instead of the engine's local socket
        local = MAPPED.local.pop(client.url, None)
        try:
            mapped()
        finally:
            if local is not None:
                MAPPED.local[client.url] = local

    res_extra: dict = {}

    def mapped_packed():  # mapped once, but packed into one buffer at each push (what ZeRO-3 gathers take)
        push_weights([client], trainer._gathered(keep=True, on_device=True), str(next(version)), off)

    def ipc():  # SGLang's calls: pause, flush, begin, a CUDA IPC handle per bucket, end, continue
        push_weights([client], trainer._gathered(keep=True, on_device=True), str(next(version)), sglang_calls)

    def staged():
        push_weights([client], trainer._gathered(keep=True), str(next(version)), sglang_calls)

    def per_tensor():
        with torch.no_grad():
            for d, s in zip(twins, src):
                d.copy_(s)

    def foreach():  # the same copies as one multi-tensor launch group (what the engine's load does)
        with torch.no_grad():
            torch._foreach_copy_(twins, src)

    from reflow.engines.weights.buckets import SharedBucket
    from reflow.engines.weights.push import update_window

    named = trainer._gathered(keep=True, on_device=True)

    def window():  # the pause/flush/begin ... end/continue calls around every push, nothing sent
        with update_window([client], "abort", session=True):
            pass

    def pack():  # flat buffer on the GPU + one pickled IPC handle
        b = SharedBucket(named)
        b.payloads(1)
        b.release()

    def send():  # one prepared payload: HTTP, the engine maps the handle and copies every tensor
        b = SharedBucket(named)
        with update_window([client], "abort", session=True):
            client.update_weights_from_tensor(b.payloads(1), "flattened_bucket", True, "send")
        b.release()

    from reflow.engines.weights.buckets import flatten

    res = {"window_s": _best(window, args.repeat), "pack_s": _best(pack, args.repeat),
           "flatten_s": _best(lambda: flatten(named), args.repeat),
           "window_and_send_s": _best(send, args.repeat)}
    storages = len({p.untyped_storage().data_ptr() for p in src})
    res |= {"gb": nbytes / 1e9, "parameters": len(src), "parameter_storages": storages,
            "mapped_s": _best(mapped_local, args.repeat), "mapped_http_s": _best(mapped_http, args.repeat),
            "mapped_packed_s": _best(mapped_packed, args.repeat),
            "ipc_s": _best(ipc, args.repeat), "staged_s": _best(staged, args.repeat),
            "gather_device_s": _best(lambda: trainer._gathered(keep=True, on_device=True), args.repeat),
            "d2d_flat_s": _best(lambda: flat_b.copy_(flat_a), args.repeat),
            "d2d_per_tensor_s": _best(per_tensor, args.repeat), "d2d_foreach_s": _best(foreach, args.repeat)}
    res |= {"engine_call_s": min(engine_s), "engine_copies": res_extra.get("copies"),
            "local_socket_calls": MAPPED.local_calls}
    for k in ("mapped", "mapped_http", "mapped_packed", "ipc", "staged", "d2d_flat", "d2d_per_tensor", "d2d_foreach"):
        res[f"{k}_gbs"] = res["gb"] / res[f"{k}_s"]
    # ipc_ratio: the default colocated push (mapped) against one plain device copy of the same bytes
    res["ipc_ratio"] = res["mapped_gbs"] / res["d2d_flat_gbs"]
    res["ipc_ratio_foreach"] = res["mapped_gbs"] / res["d2d_foreach_gbs"]
    res["ipc_ratio_per_tensor"] = res["mapped_gbs"] / res["d2d_per_tensor_gbs"]
    res["ipc_ratio_http"] = res["mapped_http_gbs"] / res["d2d_flat_gbs"]  # the same push, its call through HTTP
    res["sglang_calls_ratio"] = res["ipc_gbs"] / res["d2d_flat_gbs"]  # the push before map_once
    checks = {}
    for name, kw in (("mapped", {"stable": True}), ("sglang_calls", {})):
        t0 = time.perf_counter()
        settings = PushSettings(verify="sample", verify_rows=64, map_once=name == "mapped")
        checked = push_weights([client], trainer._gathered(keep=True, on_device=True), str(next(version)), settings, **kw)
        checks[name] = {"seconds": time.perf_counter() - t0,  # sampled tensors' first 64 rows read back bit-exact
                        **{k: v for k, v in checked.items() if k.startswith("verif")}}
    # The same check with every weight changed first (negated in place: exact in bf16, undone after), so a push
    # whose copies did not run (or left the decoder's fused copies stale) reads back stale values and fails it
    with torch.no_grad():
        torch._foreach_neg_(src)
    try:
        settings = PushSettings(verify="sample", verify_rows=64)
        checked = push_weights([client], trainer._gathered(keep=True, on_device=True), str(next(version)), settings,
                               stable=True)
        checks["mapped_negated"] = {k: v for k, v in checked.items() if k.startswith("verif")}
    finally:
        with torch.no_grad():
            torch._foreach_neg_(src)
    res["verify"] = checks
    print(f"  push parts (SGLang's calls): update window {res['window_s'] * 1e3:.1f} ms, pack {res['pack_s'] * 1e3:.1f} ms "
          f"(flatten {res['flatten_s'] * 1e3:.1f}), window + send {res['window_and_send_s'] * 1e3:.1f} ms, gather on "
          f"the GPU {res['gather_device_s'] * 1e3:.1f} ms; {len(src)} parameters in {storages} storages")
    print(f"  mapped push: {res['engine_copies']} copies on the engine's side, {res['engine_call_s'] * 1e3:.2f} ms inside "
          f"its call; the call through HTTP {res['mapped_http_s'] * 1e3:.2f} ms (ratio {res['ipc_ratio_http']:.2f}); "
          f"{res['local_socket_calls']} calls through the local socket")
    print(f"  push {res['gb']:.2f} GB: mapped {res['mapped_s'] * 1e3:.2f} ms ({res['mapped_gbs']:.0f} GB/s), mapped and "
          f"packed {res['mapped_packed_s'] * 1e3:.2f} ms, SGLang's calls (CUDA IPC) {res['ipc_s'] * 1e3:.1f} ms, staged "
          f"{res['staged_s'] * 1e3:.0f} ms; plain d2d: flat {res['d2d_flat_s'] * 1e3:.2f} ms, foreach "
          f"{res['d2d_foreach_s'] * 1e3:.2f} ms, per-tensor {res['d2d_per_tensor_s'] * 1e3:.2f} ms; mapped/plain "
          f"{res['ipc_ratio']:.2f} (flat), {res['ipc_ratio_foreach']:.2f} (foreach), {res['ipc_ratio_per_tensor']:.2f} "
          f"(per tensor); verified {checks}", flush=True)
    return res


def handover(trainer, client, step, args) -> dict:
    """Free GPU memory along tasks/colocate.py's sequence; the engine has generated (cache and graphs made)."""
    from reflow.engines.weights.push import push_weights
    from reflow.engines.weights.settings import PushSettings

    prompts = [[5 + i, 6, 7] for i in range(64)]
    sp = {"max_new_tokens": 32, "ignore_eos": True}
    client.generate(input_ids=prompts, sampling_params=sp)
    step()  # optimizer state exists
    points = {"both_resident": _free_gib()}
    engine = {"serving": _engine_mem(client)}
    trainer_gib = {"trained": torch.cuda.memory_allocated() / GIB if torch.cuda.is_available() else 0.0}
    client.pause_generation()
    client.release_memory_occupation(None)
    points["engine_released"] = _free_gib()
    engine["released"] = _engine_mem(client)
    step()
    points["trainer_trained"] = _free_gib()
    try:
        trainer.offload_states()
    except Exception as e:  # deliberate: recorded (DeepSpeed offloads only some optimizers), the rest goes on
        points["trainer_offload_error"] = f"{type(e).__name__}: {e}"  # type: ignore[assignment]
    points["trainer_offloaded"] = _free_gib()
    trainer_gib["offloaded"] = torch.cuda.memory_allocated() / GIB if torch.cuda.is_available() else 0.0
    client.resume_memory_occupation(["weights"])
    points["engine_weights_back"] = _free_gib()
    push_weights([client], trainer._gathered(keep=True, on_device=True), "handover", PushSettings(verify="off"),
                 stable=True)  # as the trainer pushes its parameters
    client.resume_memory_occupation(["kv_cache", "cuda_graph"])
    client.continue_generation()
    client.generate(input_ids=prompts, sampling_params=sp)
    points["engine_generated_again"] = _free_gib()
    engine["serving_again"] = _engine_mem(client)
    if "trainer_offload_error" not in points:
        trainer.reload_states()
    error = points.pop("trainer_offload_error", None)
    held, left = engine["serving"].get("gpu_reserved_gib", 0.0), engine["released"].get("gpu_reserved_gib", 0.0)
    out = {"free_gib": points, "engine": engine, "engine_held_gib": held, "engine_left_gib": left,
           "engine_device_freed_gib": points["engine_released"] - points["both_resident"],
           "engine_release_fraction": (held - left) / held if held > 0 else None, "trainer_gib": trainer_gib,
           "trainer_offload_freed_gib": trainer_gib["trained"] - trainer_gib["offloaded"],
           "trainer_offload_error": error}
    print("  hand-over, free GiB: " + ", ".join(f"{k} {v:.1f}" for k, v in points.items())
          + f"; engine allocator {held:.2f} GiB -> {left:.2f} on release ({engine}), trainer offload frees "
            f"{out['trainer_offload_freed_gib']:.2f} GiB ({error or 'ok'})", flush=True)
    return out


def write(res: dict, args, out_dir: str | None) -> dict:
    summary = {"commit": args.commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "ipc_ratio": res.get("push", {}).get("ipc_ratio"),
               "ipc_ratio_per_tensor": res.get("push", {}).get("ipc_ratio_per_tensor"),
               "ipc_ratio_foreach": res.get("push", {}).get("ipc_ratio_foreach"), "nccl_ratio": None,
               "nccl_note": "needs two GPUs (nvidia-h200-x2), not lent in this session",
               "engine_release_fraction": res.get("handover", {}).get("engine_release_fraction"), **res}
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        Path(out_dir, "gpu-push.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def _engine_on_gpu1(folder: str, q, stop) -> None:
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = "1"  # as Ray gives an actor its GPU: the engine sees one, as cuda:0
    _engine_main(folder, "cuda", q, stop)


def _plain_rank(rank: int, nbytes: int, port: int, repeat: int, q) -> None:
    """One side of the baseline: torch.distributed broadcasts of one flat buffer, GPU 0 -> GPU 1."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(repeat + 1):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.broadcast(buf, src=0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        q.put(min(times[1:]))
    dist.destroy_process_group()


def bench_nccl(trainer, folder: Path, args) -> dict:
    """mode=distributed, backend=nccl: the trainer on GPU 0, the engine (own process) on GPU 1, against a
    plain NCCL broadcast of the same bytes between two fresh processes on the same two GPUs."""
    import socket

    from reflow.engines.rollout_client import EngineClient
    from reflow.engines.weights.push import push_weights
    from reflow.engines.weights.settings import PushSettings

    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_engine_on_gpu1, args=(str(folder), q, stop), daemon=True)
    proc.start()
    url, key = q.get(timeout=900)
    client = EngineClient(url, timeout=900, api_key=key)
    named = trainer._gathered(keep=True, on_device=True)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    version = iter(range(1, 10**6))
    s = PushSettings(mode="distributed", backend="nccl", verify="off", bucket_bytes=2 << 30)
    try:
        push_s = _best(lambda: push_weights([client], named, str(next(version)), s), args.repeat)
        checked = push_weights([client], named, "nccl-verified", PushSettings(mode="distributed", backend="nccl",
                                                                           verify="sample", bucket_bytes=2 << 30))
    finally:
        stop.set()
        proc.join(120)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    bq = ctx.Queue()
    ranks = [ctx.Process(target=_plain_rank, args=(r, nbytes, port, args.repeat, bq)) for r in range(2)]
    for r in ranks:
        r.start()
    plain_s = bq.get(timeout=600)
    for r in ranks:
        r.join(120)
    out = {"gb": nbytes / 1e9, "nccl_push_s": push_s, "nccl_plain_broadcast_s": plain_s,
           "nccl_push_gbs": nbytes / 1e9 / push_s, "nccl_plain_gbs": nbytes / 1e9 / plain_s,
           "nccl_ratio": plain_s / push_s, "verified_tensors": checked.get("verified_tensors")}
    print(f"  nccl push {nbytes / 1e9:.2f} GB GPU0 -> GPU1: {push_s * 1e3:.1f} ms ({out['nccl_push_gbs']:.0f} GB/s) vs a "
          f"plain broadcast {plain_s * 1e3:.1f} ms ({out['nccl_plain_gbs']:.0f} GB/s): ratio {out['nccl_ratio']:.2f}; "
          f"verified {out['verified_tensors']} tensors", flush=True)
    return out
