"""Parameter object of a weight push: built once from the run config (`reflow.infra.config.settings`)
and passed down whole, from the push task through the trainer ranks to `push.push_weights`."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from reflow.engines.storage_access import StorageAccess


@dataclass(frozen=True)
class PushSettings:
    """How weights travel to the engines and how the result is checked (`WeightSyncConfig`)."""

    mode: Literal["tensor", "distributed", "disk"] = "tensor"
    bucket_bytes: int = 512 << 20
    verify: Literal["full", "sample", "logprobs", "off"] = "full"  # what each proves: reflow.engines.weights.verify
    verify_sample: int = 4  # tensors compared when verify=sample
    verify_rows: int | None = None  # first rows of each sampled tensor; None = whole tensors
    verify_atol: float = 0.0  # 0 = bit-exact
    verify_every: int = 1  # verify versions divisible by this (and non-numeric ones); others: weight_version only
    verify_logprob_tol: float | None = None  # mean |engine - trainer| logprob allowed; None: by dtype (verify.LOGPROB_TOLERANCE)
    backend: Literal["gloo", "nccl"] = "gloo"  # mode=distributed: the broadcast group's backend
    disk_dir: str | None = None  # mode=disk: where the versioned HF folders go (default: a local temp dir)
    pause_mode: str = "abort"  # what engines do with in-flight requests during the update
    map_once: bool = True  # mode=tensor to engines that offer it: map once, one call a push (weights/mapped.py)
    storage: StorageAccess | None = None  # mode=disk: how disk_dir in object storage is reached (None: defaults)
    # The trainer's transport, chosen once by the runtime (weight_sync.transport, else the mode's): a factory of
    # a reflow.engines.weights.transport.WeightTransport; None: `mode`'s (trainer.lora: the adapter's).
    transport: Callable[[], Any] | None = None


DEFAULT_PUSH = PushSettings()
