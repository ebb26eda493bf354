"""Where the static decoder's KV cache positions go: one pool of token positions, a region per row.

Why a pool: the first static cache gave every slot room for the batch's longest prompt + max_new_tokens,
so one 8k-token request made all 256 slots 8k long (and a budget could not say how many rows fit). Here a
row takes a contiguous region of its own size (its prompt + its own max_new_tokens, rounded up to
`granule` positions), carved from one pool per layer, `[L, pool + 1, H_kv, D]` (the last position is
scratch, where idle rows of a CUDA graph's batch bucket write). A row is admitted when a region fits
(first fit, lowest address); otherwise it waits, first come first served, until running rows finish and
free theirs. By default a region holds the row's prompt + max_new_tokens, so a row never outgrows it and nothing is
ever evicted or recomputed. With a reservation below that (Generator's `kv_reserve`, rollout.kv_reserve) a row is
admitted with room for part of its new tokens and grows as it goes: in place where the hole after its region is free
(`grow`), else moved to a larger region (its K/V copied), else it leaves the batch and waits to be prefilled again
with what it generated (SGLang admits on an estimate and retracts requests the same way when its pool runs out).
Contiguous regions keep attention simple: flash attention's varlen form reads row b's keys at
`start[b] .. start[b] + used[b]` (cu_seqlens_k as start offsets plus seqused_k), no block table.

Sizing (`pool_tokens`): an explicit token count; else a fraction of the GPU's memory for weights + KV
(SGLang's mem_fraction_static: what the process already holds counts against it, and room for one step's
logits and activations is kept back); else `slots x longest row` with every region a slot of that size,
which is exactly the first static cache (the default, so nothing changes unless a budget is set).
"""
from __future__ import annotations

import bisect

import torch

GRANULE = 256  # region sizes round up to this many positions (fewer distinct holes than exact sizes)


def round_up(n: int, granule: int) -> int:
    return -(-n // granule) * granule


class RegionPool:
    """First-fit allocator of contiguous position ranges in [0, size); `granule` rounds every request up."""

    def __init__(self, size: int, granule: int = GRANULE):
        self.size, self.granule = size, max(1, min(granule, size))  # a small pool: regions no larger than it
        self._free: list[tuple[int, int]] = [(0, size)] if size > 0 else []  # (start, length), sorted by start
        self._used: dict[int, int] = {}  # start -> length of each region handed out

    def need(self, positions: int) -> int:
        """Positions a row of `positions` occupies (rounded to the granule)."""
        return round_up(max(positions, 1), self.granule)

    def fits_ever(self, positions: int) -> bool:
        """Whether a row of `positions` fits the empty pool (else it would wait forever)."""
        return self.need(positions) <= self.size

    def alloc(self, positions: int) -> int | None:
        """Start of a free region for `positions`, or None when no hole is large enough now."""
        want = self.need(positions)
        for i, (start, length) in enumerate(self._free):
            if length >= want:
                if length == want:
                    del self._free[i]
                else:
                    self._free[i] = (start + want, length - want)
                self._used[start] = want
                return start
        return None

    def free(self, start: int) -> None:
        """Give a region back, merging it with free neighbours."""
        length = self._used.pop(start)
        i = bisect.bisect(self._free, (start, 0))
        if i < len(self._free) and start + length == self._free[i][0]:  # joins the hole after it
            length += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:  # and the hole before it
            start, length = self._free[i - 1][0], self._free[i - 1][1] + length
            self._free[i - 1] = (start, length)
            return
        self._free.insert(i, (start, length))

    def length(self, start: int) -> int:
        """Positions the region at `start` holds."""
        return self._used[start]

    def grow(self, start: int, positions: int) -> bool:
        """Extend the region at `start` in place to hold `positions` (rounded to the granule), taking from the
        hole right after it; False (nothing changed) when that hole is missing or too small."""
        want = self.need(positions) - self._used[start]
        if want <= 0:
            return True
        end = start + self._used[start]
        i = bisect.bisect(self._free, (end, -1))
        if i == len(self._free) or self._free[i][0] != end or self._free[i][1] < want:
            return False
        if self._free[i][1] == want:
            del self._free[i]
        else:
            self._free[i] = (end + want, self._free[i][1] - want)
        self._used[start] += want
        return True

    def reset(self) -> None:
        """Every region free again (a generate call that raised mid-way leaves its rows' regions taken)."""
        self._free, self._used = ([(0, self.size)] if self.size > 0 else []), {}

    @property
    def in_use(self) -> int:
        return sum(self._used.values())


def bytes_per_position(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token over all layers."""
    return 2 * layers * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


def budget_positions(fraction: float, per_position: int, device: torch.device, max_batch: int, vocab: int) -> int:
    """Positions a pool may hold when this process may hold `fraction` of the GPU's memory in all (weights and
    KV, as SGLang's mem_fraction_static): the total times the fraction, less what torch holds already (the
    weights), less one step's float32 logits at the largest batch six times over (sampling's temporaries)
    and 1 GiB for activations, prefill and CUDA graphs."""
    total = torch.cuda.get_device_properties(device).total_memory
    keep_back = 6 * 4 * max_batch * vocab + (1 << 30)
    spare = int(fraction * total) - torch.cuda.memory_allocated(device) - keep_back
    if spare < per_position:
        raise ValueError(f"kv_mem_fraction={fraction} leaves no room for a KV cache: {fraction} of "
                         f"{total / 2**30:.1f} GiB is taken by {torch.cuda.memory_allocated(device) / 2**30:.1f} GiB "
                         f"already allocated and {keep_back / 2**30:.1f} GiB kept for a step's logits; raise it")
    return spare // per_position
