"""Python's cyclic garbage collector and a run's long-lived processes.

Every process of a run (the engine, each trainer rank, the iteration's task workers, the driver) holds hundreds of
thousands of objects once set up (torch, transformers, the model's modules, Prefect) and then allocates and drops
many small ones per iteration (a rollout's 1024 request and record dicts). Now and then the young objects that
survive trigger a full collection, which walks every object the process holds: 0.26-0.32 s each, every ~7 rollouts,
in an engine process of ~467k objects on an H200 (bench/gc_pauses.py, bench/RESULTS.md 27), paid inside whichever
iteration it falls in. `freeze_long_lived` moves what the process holds at that moment out of the collector's sight
(`gc.freeze`): later full collections walk only what came after. Frozen objects are still freed by reference counting; only cycles among them stay until they are thawed. The
runtime freezes its actors once they are ready and the task workers after their imports (all live as long as the
run or the cluster), but not the actors of a colocated run with hand-overs: their release and offload free GPU memory
by dropping references, and a frozen cycle that became garbage would keep its memory for good. The driver freezes
for its training loop only and thaws after it. Only processes that used CUDA collect before they freeze.
"""
from __future__ import annotations

import gc
import sys


def freeze_long_lived(collect: bool = True) -> int:
    """Collect what is garbage now (unless `collect` is false: ~0.1-0.3 s in a large process), then freeze the rest;
    returns how many objects are frozen in all. Garbage that is not collected first stays until a `thaw`."""
    if collect:
        gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def freeze_actor(_actor) -> int:
    """`freeze_long_lived` inside a Ray actor, whatever its class: `handle.__ray_call__.remote(freeze_actor)`. It
    collects first where the process has used CUDA (set-up garbage there may hold device memory); elsewhere what
    garbage the set-up left is host memory, kept, and the collection's ~0.3-0.5 s on 2 cores is saved."""

    torch = sys.modules.get("torch")
    return freeze_long_lived(collect=torch is not None and torch.cuda.is_initialized())


def thaw() -> None:
    """Give the frozen objects back to the collector (a driver process whose run ended may run others: what the
    last one left in cycles must be collectable again)."""
    gc.unfreeze()
