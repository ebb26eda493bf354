"""The reward of the 7B throughput run (bench/gpu_machine/seven_b.sh, configs/gpu-7b.yaml): 0 or 1 by a hash of
the response text. A random-init policy never answers the addition task, so its exact-match reward would be 0 for
every sample and every GRPO advantage 0; this one spreads the rewards inside each group, so the update has the
loss and gradients a learning run would have. It measures speed and memory, not learning."""
from __future__ import annotations

import zlib


def reward(prompt: str, response: str, label) -> float:
    return float(zlib.crc32(response.encode()) % 2)
