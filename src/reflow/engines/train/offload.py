"""Optimizer state out of GPU memory and back, for colocated mode, where DeepSpeed has no way to do it.

DeepSpeed's `engine.offload_states` covers ZeRO-3 and its ZeRO-1/2 optimizer, but not `BF16_Optimizer`,
the one it picks for ZeRO-1 + bf16 with float32 gradient accumulation (our default): there it raises
AttributeError (seen on an H200, bench/gpu.py). This module moves that optimizer's float32 state
(master weights, gradient accumulators, Adam moments) to host memory and back.

How: every float32 storage the optimizer holds is copied to host memory and then resized to zero bytes,
which frees it on the device while every tensor and view over it (the optimizer keeps many: flat groups
and per-parameter views) stays the same Python object; on reload the storage is resized back and refilled,
so those views are valid again, with the same values. The bf16 model weights are not touched: the weight
push reads them while the engines run. As PyTorch FSDP frees parameters by resizing storages.
"""
from __future__ import annotations

import torch

_DEPTH = 3  # attributes hold tensors, lists of tensors, lists of lists (param groups) and dicts of state


def optimizer_storages(optimizer, device: torch.device, moments_only: bool = False) -> list[torch.UntypedStorage]:
    """The distinct float32 storages on `device` reachable from the optimizer's attributes and from its
    inner optimizer's state (Adam moments), largest first; `moments_only`: the inner state's alone."""
    found: dict[int, torch.UntypedStorage] = {}

    def visit(x, depth: int) -> None:
        if isinstance(x, torch.Tensor):
            if x.dtype == torch.float32 and x.device == device and x.untyped_storage().nbytes() > 0:
                s = x.untyped_storage()
                found.setdefault(s.data_ptr(), s)
        elif depth < _DEPTH and isinstance(x, (list, tuple)):
            for y in x:
                visit(y, depth + 1)
        elif depth < _DEPTH and isinstance(x, dict):
            for y in x.values():
                visit(y, depth + 1)

    for value in [] if moments_only else vars(optimizer).values():
        visit(value, 0)
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and inner is not optimizer:
        for state in getattr(inner, "state", {}).values():
            visit(state, 1)
    return sorted(found.values(), key=lambda s: -s.nbytes())


class HostCopies:
    """Storages moved to host memory (`offload`), and put back where they were (`reload`)."""

    def __init__(self) -> None:
        self.moved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    @property
    def nbytes(self) -> int:
        return sum(h.numel() for _, h in self.moved)

    def offload(self, storages: list[torch.UntypedStorage]) -> int:
        """Copy each storage to (pinned, on a GPU) host memory and free it on the device; returns bytes moved."""
        if self.moved:
            raise RuntimeError("optimizer states are already in host memory: reload them first")
        for s in storages:
            host = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=s.device.type == "cuda")
            host.untyped_storage().copy_(s)
            self.moved.append((s, host))
        for s, _ in self.moved:  # after every copy: one storage may back views of another's tensors
            s.resize_(0)
        if storages and storages[0].device.type == "cuda":
            torch.cuda.empty_cache()  # give the blocks back so the engines can take them
        return self.nbytes

    def reload(self) -> int:
        """Re-allocate each storage at its size and refill it; returns bytes moved."""
        moved = self.nbytes
        for s, host in self.moved:
            s.resize_(host.numel())
            s.copy_(host.untyped_storage())
        self.moved = []
        return moved


def own_storages(optimizer) -> int:
    """After a checkpoint load: give every state tensor the inner optimizer holds in a storage it cannot
    resize a copy in a storage of its own; returns how many. Torch's `Optimizer.load_state_dict` keeps the
    tensors `torch.load` made where device and dtype already match (CPU), and those storages belong to the
    loaded file's reader: `HostCopies.offload` could not free them ("Trying to resize storage that is not
    resizable"). On a GPU the load copies to the device and this finds nothing."""
    inner = getattr(optimizer, "optimizer", optimizer)
    copied = 0
    for state in getattr(inner, "state", {}).values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not value.untyped_storage().resizable():
                state[key] = value.clone()
                copied += 1
    return copied
