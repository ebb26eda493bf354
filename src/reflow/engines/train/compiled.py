"""Compiled decoder layers for the trainer (issue 15 point 2), and the length buckets that bound
how many shapes they compile.

Each decoder layer's `forward` is replaced by `torch.compile(forward, dynamic=False)`: "regional"
compilation. The layers of one model share one code object, so a shape compiles once for all of
them (dynamo inlines the module and treats its parameters as inputs), and the compile time is that
of one layer, not of the whole model. Only `forward` is compiled, not the module call: module hooks
(DeepSpeed ZeRO-3 gathers parameters in a pre-forward hook) keep running eagerly around it.

Static shapes compile to the fastest kernels but a new (rows, length) pair means a new graph. The
trainer therefore pads each micro-batch's length up to `length_bucket(n)`: four buckets per octave
(…, 1024, 1280, 1536, 1792, 2048, …), so padding adds at most 25 % (in practice ~1/8) and a run
whose lengths span a few octaves compiles a dozen shapes. `compiled_graphs()` reports how many
graphs dynamo built so far (the trainer's `compile_graphs` metric), so a recompile storm shows.

Packed rows (trainer.max_tokens_per_micro_batch) are padded on a coarser grid, `packed_bucket`: eighths of the
budget. First-fit packing fills every row of a mini-batch but its last to near the budget, and that last row's
length is anywhere from a few hundred tokens to the budget: under four buckets an octave it met a new bucket every
other iteration. Measured on an H100 (bench/RESULTS.md 45, the scratchpad task, budget 32,768): 8 -> 23 graphs in
18 iterations, each new one 5-11 s of a cold inductor compile, ~120 s of a 270 s run. Eight lengths bound that at 8
graphs a grad mode; the cost is at most budget/8 tokens of padding in a mini-batch's last row.
"""
from __future__ import annotations

import logging
from typing import Literal

import torch
from torch.utils.checkpoint import checkpoint

log = logging.getLogger("reflow.trainer")

CompileMode = Literal["auto", "on", "off"]
MIN_BUCKET = 16
RECOMPILE_LIMIT = 64  # dynamo's default (8) would fall back to eager after 8 lengths, silently slow


def length_bucket(n: int) -> int:
    """Smallest value >= n of the form k * 2**(e-2), k in 4..7: four buckets per octave, >= 16."""
    if n <= MIN_BUCKET:
        return MIN_BUCKET
    step = 1 << max((n - 1).bit_length() - 3, 0)  # a quarter of the octave n-1 lies in
    return -(-n // step) * step


def packed_bucket(n: int, budget: int, parts: int = 8) -> int:
    """The length a packed row of n tokens runs at under compiled layers: n rounded up to a multiple of
    budget/parts (at least MIN_BUCKET), never past the budget, so a run compiles at most `parts` packed lengths.
    A single sample longer than the budget (a row of its own) takes its length_bucket."""
    if n > budget:
        return length_bucket(n)
    step = max(-(-budget // parts), MIN_BUCKET)
    step = -(-step // MIN_BUCKET) * MIN_BUCKET  # a multiple of 16 tokens
    return min(-(-max(n, 1) // step) * step, max(budget, MIN_BUCKET))


def use_compile(mode: CompileMode, device: torch.device, zero_stage: int = 0) -> bool:
    """`auto`: on for CUDA (where launch overhead and unfused kernels cost most), off on CPU and
    under ZeRO-3, whose partitioned parameters and memory-efficient linear (called inside each
    layer) make dynamo recompile per layer: measured on the H200, 1.38 s per step instead of 0.40."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"trainer.compile must be auto, on or off, got {mode!r}")
    if mode == "on" and zero_stage == 3:
        raise ValueError("trainer.compile=on does not work with trainer.zero_stage=3 (DeepSpeed's partitioned "
                         "parameters recompile every layer); use compile=auto (off under ZeRO-3) or zero_stage 1-2")
    return mode == "on" or (mode == "auto" and device.type == "cuda" and zero_stage != 3)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of an HF causal LM (`model.model.layers` for Llama/Qwen/Mistral/...)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ValueError(f"{type(model).__name__}: no decoder layers found at model.get_decoder().layers; "
                         f"set trainer.compile=off for this model")
    return list(layers)


def compile_layers(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Replace every decoder layer's forward by its compiled version; returns how many."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    layers = decoder_layers(model)
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=backend, dynamic=False)
    log.info("compiled the forward of %d decoder layers (%s, static shapes, length buckets)", len(layers), backend)
    return len(layers)


def checkpoint_layers(model: torch.nn.Module) -> int:
    """Activation checkpointing: each decoder layer keeps only its input for backward and runs its forward again
    there (torch.utils.checkpoint, non-reentrant). Wraps whatever forward the layer has, a compiled one included
    (call after compile_layers: the recompute replays the compiled graph). Under no_grad the layer runs plainly.
    HF's own switch (gradient_checkpointing_enable) acts only in train mode, and the ranks keep their model in
    eval mode (no dropout: the old-logprob pass and the update must score the same function). Returns how many."""

    layers = decoder_layers(model)
    for layer in layers:
        def forward(*args, _inner=layer.forward, **kwargs):
            if torch.is_grad_enabled():
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
            return _inner(*args, **kwargs)

        layer.forward = forward
    return len(layers)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_cache_hits() -> int:
    """Graphs inductor took from its on-disk cache in this process so far (an earlier run's)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_hit"])
