"""The engine's weights laid out as the trainer's, so that a mapped push is a few large copies.

A mapped push (reflow.engines.weights.mapped) copies every tensor of the trainer's storage into the
engine's parameters. Tensor by tensor that is ~290 copies for a Qwen2-0.5B (one multi-tensor launch
group on a GPU: 1.08 ms against 0.56 ms for one flat copy of the same 0.99 GB on an H200, bench/RESULTS.md
section 7). The trainer's parameters already live in one buffer (DeepSpeed flattens each parameter group), so the
engine does the same on the first mapped push it takes while idle: it moves its own parameters into one
buffer per trainer storage (an `Arena`), in the trainer's byte order exactly. A push then copies runs of
bytes that continue on both sides (`copy_runs`): one per trainer storage. The static decoder views the
tensors it fuses (q/k/v, gate/up) where they lie together in that order (Llama's), and keeps copies of the
others, brought up to date after each write (Qwen2's q/k/v, whose biases sit between the weights: one more
multi-tensor launch a push). Laying the fused tensors together instead (the first version) split a Qwen2
push into 1 + 5 copies per layer, 0.73 ms inside the engine's call against 0.48 ms for one flat copy on
the H200 (bench/RESULTS.md 24-25).

The arena is the parameters' memory from then on: colocated mode's release moves it to host memory
whole and back (`Arena.to`), so the layout survives the hand-over.
"""
from __future__ import annotations

import torch

from reflow.engines.weights.buckets import storage_bytes

Pair = tuple[torch.Tensor, torch.Tensor]  # (source, destination)


def byte_order(named: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Names in storage byte order: storages in first-seen order, tensors by offset inside each."""
    first: dict[int, int] = {}
    for _, t in named:
        first.setdefault(t.untyped_storage().data_ptr(), len(first))
    return [n for n, t in sorted(named, key=lambda nt: (first[nt[1].untyped_storage().data_ptr()],
                                                           nt[1].storage_offset() * nt[1].element_size()))]


class Arena:
    """One uint8 buffer holding parameters back to back (each aligned to its element size), in `order`."""

    def __init__(self, params: dict[str, torch.nn.Parameter], order: list[str], device: torch.device):
        self.params = {n: params[n] for n in order}
        self.slots: list[tuple[str, int]] = []  # (name, byte offset)
        offset = 0
        for n in order:
            p = params[n]
            offset = -(-offset // p.element_size()) * p.element_size()
            self.slots.append((n, offset))
            offset += p.numel() * p.element_size()
        self.buffer = torch.empty(offset, dtype=torch.uint8, device=device)
        self._point(copy=True)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def _view(self, name: str, offset: int) -> torch.Tensor:
        p = self.params[name]
        n = p.numel() * p.element_size()
        return self.buffer[offset:offset + n].view(p.dtype).view(p.shape)

    def _point(self, copy: bool) -> None:
        """Every parameter becomes its view of the buffer (`copy`: its current values copied in first)."""
        with torch.no_grad():
            for name, offset in self.slots:
                view, p = self._view(name, offset), self.params[name]
                if copy:
                    view.copy_(p.data)
                p.data = view

    def holds(self) -> bool:
        """Whether every parameter is still its view of the buffer (nothing re-pointed it since)."""
        return all(self.params[n].data_ptr() == self.buffer.data_ptr() + off for n, off in self.slots)

    def to(self, device: torch.device | str) -> None:
        """Move the whole buffer (colocated release / resume) and re-point the parameters into the moved one.
        A parameter something else re-pointed meanwhile has its values copied back in first."""
        if not self.holds():
            self._point(copy=True)
        self.buffer = self.buffer.to(device)
        self._point(copy=False)


def copy_runs(pairs: list[Pair]) -> list[Pair]:
    """The same copies as fewer, larger ones: consecutive (source, destination) pairs of one dtype whose
    bytes continue exactly on both sides (same storages, no gap) become one uint8 pair. Pairs that cannot
    join (a cast, a non-contiguous side) stay as they are."""
    out: list[Pair] = []
    run: list | None = None  # [src storage ptr, dst storage ptr, src start, dst start, bytes, src, dst]

    def close() -> None:
        if run is not None:
            out.append((storage_bytes(run[5], run[2], run[4]), storage_bytes(run[6], run[3], run[4])))

    for src, dst in pairs:
        joinable = src.dtype == dst.dtype and src.is_contiguous() and dst.is_contiguous()
        if not joinable:
            close()
            run = None
            out.append((src, dst))
            continue
        s0, d0 = src.storage_offset() * src.element_size(), dst.storage_offset() * dst.element_size()
        sp, dp, n = src.untyped_storage().data_ptr(), dst.untyped_storage().data_ptr(), src.numel() * src.element_size()
        if run is not None and (run[0], run[1]) == (sp, dp) and s0 == run[2] + run[4] and d0 == run[3] + run[4]:
            run[4] += n
            continue
        close()
        run = [sp, dp, s0, d0, n, src, dst]
    close()
    return out
