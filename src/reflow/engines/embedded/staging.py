"""Host values onto the GPU without waiting for the queued work.

`torch.tensor(values, device="cuda")` builds the tensor in pageable host memory and copies it with
`non_blocking=False`, which makes the host wait until the stream has run everything queued before it. In
the decode loop that drains the pipeline the step was built to keep full: the next step is queued before the
host reads this one's tokens, so each such wait leaves the GPU idle for the host's bookkeeping of a step. Small
index and parameter tensors (rows that stay, seeds and positions of seeded draws, prompt ids at admission) go
through pinned memory instead: PyTorch's caching host allocator records the copy's event on the pinned block and
does not hand it out again before the copy has run, so one pinned tensor per call is safe to drop at once.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def on_device(values: Sequence | torch.Tensor, device: torch.device | str, dtype: torch.dtype = torch.long) \
        -> torch.Tensor:
    """`values` (a list, or a CPU tensor) as a tensor on `device`, queued behind the stream's work on a GPU
    (the host does not wait for it); a plain tensor on CPU."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
