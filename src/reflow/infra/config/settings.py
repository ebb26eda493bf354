"""The parameter objects of the engines and the loss, built once from a run config and passed down
whole (the run config itself stays on the driver)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from reflow.engines.storage_access import StorageAccess
from reflow.engines.train.settings import LoraSettings, Precision, RankSettings
from reflow.engines.weights.settings import PushSettings
from reflow.engines.weights.transport import choose as choose_transport
from reflow.infra.config.schema import RunConfig, TrainerConfig
from reflow.rl.losses import LossSettings
from reflow.rl.objectives import build_objective


def storage_access(cfg: RunConfig) -> StorageAccess:
    """How every path outside the experiment store is reached (model folders, prompt files, eval
    sources, new data, disk pushes): storage.endpoint_url and the storage retry settings."""
    return StorageAccess.from_config(cfg.storage)


def loss_settings(cfg: RunConfig) -> LossSettings:
    """The policy loss of `cfg.algorithm`, at the rollout's temperature."""
    a = cfg.algorithm
    return LossSettings(
        temperature=cfg.rollout.temperature, clip_eps_low=a.clip_eps_low, clip_eps_high=a.clip_eps_high,
        kl_coef=a.kl_coef, kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef, loss_agg=a.loss_agg,
        loss_norm_len=a.loss_norm_len or cfg.rollout.max_new_tokens, dual_clip_c=a.dual_clip_c,
        tis_cap=tis_cap(cfg), ratio_level=a.spec.ratio_level,
        objective=build_objective(a.objective or a.spec.objective,
                                  "algorithm.objective" if a.objective else f"the {a.type} spec's objective"))


ASYNC_TIS_CAP = 2.0  # the off-policy correction of an asynchronous run whose algorithm.tis_cap is unset


def tis_cap(cfg: RunConfig) -> float | None:
    """algorithm.tis_cap; an asynchronous run (rollout.max_staleness >= 1) always corrects its stale
    batches, and a run that carries partial rollouts (rollout.partial=carry) its samples' older tokens,
    at ASYNC_TIS_CAP when the algorithm sets none."""
    cap, r = cfg.algorithm.tis_cap, cfg.rollout
    return ASYNC_TIS_CAP if cap is None and (r.max_staleness or r.partial == "carry") else cap


def total_steps(cfg: RunConfig) -> int:
    """Optimizer steps a decaying schedule spans: the hint, else the whole run's."""
    t = cfg.trainer
    return t.total_steps_hint or max(1, cfg.num_iterations * t.minibatches_per_iteration)


def rank_backend(gpus: bool) -> Literal["gloo", "nccl"]:
    """The ranks' torch.distributed backend: nccl when they hold GPUs (gloo then only carries the CPU tensors the
    step reduces, ds_rank._init_distributed), gloo on CPU. Before, GPU ranks were given gloo: two of them failed at
    DeepSpeed's init (each Ray actor sees its one GPU as cuda:0, gloo's LOCAL_RANK named cuda:1; found on the
    two-GPU machine, RESULTS.md 27)."""
    return "nccl" if gpus else "gloo"


# trainer.precision=auto on GPUs: bf16 from this many policy parameters, fp32 with TF32 products below. Measured at the
# two ends (bench/RESULTS.md 42, an H100: the Qwen2.5-1.5B shape, 1.78B parameters, 0.5k-4k-token samples: bf16 2.84 s a
# step, bf16-mixed 3.88, fp32+tf32 9.97; RESULTS 28-29, an H200: the 113M GPU demo learned more per update in fp32+tf32
# at about bf16's speed); the line between them is a judgement, not a measurement.
AUTO_BF16_PARAMS = 500_000_000


def resolve_precision(t: TrainerConfig, gpus: bool, params: Callable[[], int] | None = None) -> tuple[Precision, bool]:
    """(precision, tf32) the ranks and engines run with: trainer.precision and trainer.tf32 as set, or for `auto` fp32
    without GPUs and on GPUs by the policy's size (`params()`: its parameter count, asked for only then)."""
    if t.precision != "auto":
        return t.precision, t.tf32
    if not gpus:
        return "fp32", t.tf32
    if params is None:
        raise ValueError("trainer.precision=auto on GPUs is decided by the policy's size: pass its parameter count")
    if params() >= AUTO_BF16_PARAMS:
        return ("bf16" if t.zero_stage >= 1 else "bf16-mixed"), t.tf32  # DeepSpeed's bf16 needs fp32 master weights
    return "fp32", True


def policy_rank_settings(cfg: RunConfig, gpus: bool = False,
                         precision: tuple[Precision, bool] | None = None) -> RankSettings:
    """`gpus`: whether the ranks take GPUs (runtime.use_gpus); `precision`: (precision, tf32) as `resolve_precision`
    decided (required for trainer.precision=auto on GPUs)."""
    t = cfg.trainer
    p, tf32 = precision or resolve_precision(t, gpus)
    return RankSettings(backend=rank_backend(gpus),
        zero_stage=t.zero_stage, precision=p, fp32_lm_head=t.fp32_lm_head, tf32=tf32, lr=t.lr, lr_schedule=t.lr_schedule,
        warmup_steps=t.warmup_steps, total_steps=total_steps(cfg), weight_decay=t.weight_decay,
        grad_clip=t.grad_clip, micro_batch_size=t.micro_batch_size, threads=t.threads_per_rank, seed=cfg.seed,
        max_tokens_per_micro_batch=t.max_tokens_per_micro_batch, compile=t.compile,
        activation_checkpointing=t.activation_checkpointing, max_micro_batch_tokens=t.max_tokens_per_micro_batch or
        t.micro_batch_size * (cfg.data.max_prompt_len + cfg.rollout.max_new_tokens), old_logprob_pass=t.old_logprob_pass,
        grad_accum_dtype=t.grad_accum_dtype,
        immediate_grad_update=t.immediate_grad_update, storage=storage_access(cfg),
        lora=LoraSettings(t.lora.rank, t.lora.alpha, tuple(t.lora.target_modules)) if t.lora.rank else None)


def critic_rank_settings(cfg: RunConfig, gpus: bool = False,
                         precision: tuple[Precision, bool] | None = None) -> RankSettings:
    """The trainer's ZeRO stage, precision, clip, threads and backend; the critic's own constant lr and micro-batch."""
    t, c = cfg.trainer, cfg.critic
    p, tf32 = precision or resolve_precision(t, gpus)
    return RankSettings(backend=rank_backend(gpus),
        zero_stage=t.zero_stage, precision=p, lr=c.lr, weight_decay=t.weight_decay,
        grad_clip=t.grad_clip, micro_batch_size=c.micro_batch_size or t.micro_batch_size,
        threads=t.threads_per_rank, seed=cfg.seed, grad_accum_dtype=t.grad_accum_dtype,
        immediate_grad_update=t.immediate_grad_update, storage=storage_access(cfg), tf32=tf32)


def push_settings(cfg: RunConfig) -> PushSettings:
    """The push options, with the trainer's transport chosen here, once: weight_sync.transport, else the
    LoRA adapter's (trainer.lora.rank > 0), else weight_sync.mode's (reflow.engines.weights.transport)."""
    w = cfg.weight_sync
    name = w.transport or ("adapter" if cfg.trainer.lora.rank else w.mode)
    transport = choose_transport(name, "weight_sync.transport" if w.transport else "weight_sync.mode")
    return PushSettings(mode=w.mode, bucket_bytes=w.bucket_mb << 20, verify=w.verify, verify_sample=w.verify_sample,
                        verify_rows=w.verify_rows, verify_atol=w.verify_atol, verify_every=w.verify_every,
                        backend=w.backend, disk_dir=w.disk_dir, map_once=w.map_once,
                        storage=storage_access(cfg), transport=transport)
