"""Parameter objects of the DeepSpeed ranks: built once from the run config
(`reflow.infra.config.settings`) and passed down whole to every rank."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from reflow.engines.storage_access import StorageAccess

Precision = Literal["fp32", "bf16", "bf16-mixed"]


def weights_precision(precision: str) -> str:
    """The dtype a trainer of `precision` holds its weights in, and so what its checkpoints, pushes and the
    engines it feeds hold: bf16-mixed keeps float32 weights (its matmuls run in bf16 under torch.autocast)."""
    return "fp32" if precision == "bf16-mixed" else precision


def attention_kernel(setting: str | None, packed: bool, cuda: bool) -> str | None:
    """transformers' attention kernel for the policy and reference (RankSettings.attn_implementation). None there:
    flex_attention for packed rows on CUDA (its block mask skips what a row's samples cannot see; SDPA computes the
    whole row under a dense mask: 1.49x the packed step on an H100, bench/RESULTS.md 30), else transformers' default.
    flex_attention off CUDA is refused: torch has no FlexAttention backward on CPU, and its CPU forward (torch 2.13 on
    an AVX2 host) returned NaN at some packed lengths (tests/test_packing.py)."""
    if setting == "flex_attention" and not cuda:
        raise ValueError("RankSettings.attn_implementation=flex_attention needs CUDA (torch has no FlexAttention "
                         "backward on CPU); on CPU leave it None (transformers' default) or set it to sdpa")
    return setting or ("flex_attention" if packed and cuda else None)


@dataclass(frozen=True)
class LoraSettings:
    """Low-rank adapters on the policy (peft); see reflow.engines.train.lora."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]


@dataclass(frozen=True)
class RankSettings:
    """How one DeepSpeed rank (policy or critic) is built and optimised."""

    zero_stage: Literal[0, 1, 2, 3] = 0
    precision: Precision = "fp32"  # bf16-mixed: fp32 weights, bf16 matmuls (torch.autocast)
    fp32_lm_head: bool = False  # the LM head computes in float32 (reflow.engines.hf_io.fp32_lm_head)
    tf32: bool = False  # float32 matrix products on TF32 tensor cores (reflow.engines.hf_io.set_tf32)
    lr: float = 1e-4
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = 0
    total_steps: int = 1  # of a decaying schedule
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_size: int = 64
    # policy only: micro-batches of at most this many tokens, samples packed end to end (engines/train/packing.py);
    # None: micro_batch_size samples a micro-batch, right-padded
    max_tokens_per_micro_batch: int | None = None
    # transformers' attention kernel for the policy and reference. None: flex_attention for packed rows on CUDA (its
    # block mask skips what a row's samples cannot see; SDPA computes the whole row under a dense mask), else SDPA
    attn_implementation: str | None = None
    # decoder layers recompute their forward in backward (compiled.checkpoint_layers); auto: when one micro-batch's
    # activations (compiled.activation_bytes at max_micro_batch_tokens) would take over half of the rank's GPU
    activation_checkpointing: Literal["auto", "on", "off"] = "auto"
    max_micro_batch_tokens: int = 0  # the most tokens one micro-batch can hold (0: unknown; auto then stays off)
    threads: int = 1  # torch threads of the rank's process
    seed: int = 0
    backend: Literal["gloo", "nccl"] = "gloo"  # torch.distributed backend of the ranks' group
    zero3_param_persistence_threshold: int = 100_000  # ZeRO-3: parameters this small stay unpartitioned
    compile: Literal["auto", "on", "off"] = "off"  # compiled decoder layers (engines/train/compiled.py); auto: on CUDA
    compile_backend: str = "inductor"  # torch.compile backend (tests use aot_eager: same wiring, no codegen)
    # "auto": when the policy cannot have changed since the rollout (one mini-batch, no advantage
    # finishing), old log-probs are the training forward's own, detached; "always": a separate pass.
    old_logprob_pass: Literal["auto", "always"] = "auto"
    grad_accum_dtype: Literal["fp32", "bf16"] = "fp32"  # bf16: micro-batch gradients summed in bf16
    immediate_grad_update: bool = False  # bf16, ZeRO-1: fold each gradient into fp32 as backward produces it
    storage: StorageAccess | None = None  # how model folders in object storage are reached (None: defaults)
    lora: LoraSettings | None = None  # policy only: train adapters instead of every weight
