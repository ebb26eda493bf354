"""Parameter objects of the DeepSpeed ranks: built once from the run config
(`reflow.infra.settings`) and passed down whole to every rank."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from reflow.engines.storage_access import StorageAccess


@dataclass(frozen=True)
class RankSettings:
    """How one DeepSpeed rank (policy or critic) is built and optimised."""

    zero_stage: Literal[0, 1, 2, 3] = 0
    precision: Literal["fp32", "bf16"] = "fp32"
    lr: float = 1e-4
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = 0
    total_steps: int = 1  # of a decaying schedule
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_size: int = 64
    threads: int = 1  # torch threads of the rank's process
    seed: int = 0
    backend: Literal["gloo", "nccl"] = "gloo"  # torch.distributed backend of the ranks' group
    zero3_param_persistence_threshold: int = 100_000  # ZeRO-3: parameters this small stay unpartitioned
    storage: StorageAccess | None = None  # how model folders in object storage are reached (None: defaults)
