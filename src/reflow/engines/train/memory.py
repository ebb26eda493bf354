"""What a trainer rank needs on its GPU: a rough estimate for the preflight and trainer.activation_checkpointing=auto.

Rough on purpose: it counts the big terms (weights, gradients, optimizer state by ZeRO stage, the activations one
micro-batch keeps for backward) and not the allocator's fragmentation, NCCL buffers or compiled graphs' workspace;
the preflight refuses only what cannot fit by that count.
"""
from __future__ import annotations

from dataclasses import dataclass


def activation_bytes(config, tokens: int, bytes_per_value: int) -> int:
    """A rough size of what one forward over `tokens` tokens keeps for backward without checkpointing, for a
    Llama-shaped HF config: per token and layer about 8 hidden-size vectors (norm inputs and outputs, attention
    input, output and projection input, residuals) + 2 key/value projections + 4 MLP-width vectors (gate, up, the
    activation and its product), plus the LM head's logits of every position (an upper bound: only scored ones
    run). Used to decide trainer.activation_checkpointing=auto, not to promise a peak."""
    h = int(config.hidden_size)
    inter = int(getattr(config, "intermediate_size", 4 * h))
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", heads) or heads) * (h // heads)
    per_layer = 8 * h + 2 * kv + 4 * inter
    return tokens * (int(config.num_hidden_layers) * per_layer + int(config.vocab_size)) * bytes_per_value


@dataclass(frozen=True)
class RankMemory:
    """Bytes on one trainer rank's GPU, by what holds them."""

    weights: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations


def rank_memory(config, params: int, *, precision: str, zero_stage: int, world: int, tokens: int,
                checkpointing: bool) -> RankMemory:
    """One rank's estimate: bf16 keeps bf16 weights and gradients and an fp32 master copy with Adam's two moments
    (16 bytes a parameter); fp32 and bf16-mixed keep fp32 weights and gradients and the two moments. ZeRO-1 shards the
    optimizer state over the ranks, ZeRO-2 the gradients too, ZeRO-3 the weights too. Activations of a `tokens`-token
    micro-batch; checkpointed, each layer keeps only its input and one layer's intermediates exist at a time."""
    low = precision == "bf16"
    w, g = params * (2 if low else 4), params * (2 if low else 4)
    opt = params * (12 if low else 8)
    if zero_stage >= 1:
        opt //= world
    if zero_stage >= 2:
        g //= world
    if zero_stage >= 3:
        w //= world
    per_value = 2 if low else 4
    if checkpointing:
        layers = int(config.num_hidden_layers)
        one_layer = (activation_bytes(config, tokens, per_value) - tokens * int(config.vocab_size) * per_value) // layers
        act = tokens * layers * int(config.hidden_size) * per_value + one_layer + tokens * int(config.vocab_size) * per_value
    else:
        act = activation_bytes(config, tokens, per_value)
    return RankMemory(weights=w, gradients=g, optimizer=opt, activations=act)
