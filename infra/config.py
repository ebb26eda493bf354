"""Typed, nested run configuration.

One pydantic model per concern; every field has a default, a bound where one exists and a
docstring (Prefect renders the UI form from these). Experiment files under `configs/` are YAML;
`key.sub=value` overrides from the command line are applied on top and validated the same way,
so a bad value fails before anything starts and names the field.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    path: str = Field(".reflow/models/demo-policy", description="HF checkpoint folder or URL (file://, s3://) of the initial policy.")
    ref_path: str | None = Field(None, description="Frozen reference model for the KL term; defaults to `path`.")


class DataConfig(_Strict):
    task: Literal["addition", "file"] = Field("addition", description="`addition`: the built-in synthetic task; `file`: prompts from `path`.")
    path: str | None = Field(None, description="jsonl/parquet of prompts (local or URL) when task=file.")
    prompt_key: str = Field("prompt", description="Column holding the prompt text.")
    label_key: str = Field("label", description="Column holding the ground truth passed to the reward function.")
    reward_fn: str = Field("rl.demo_task:reward", description="`module:function` computing a reward from (response_text, label).")
    seed: int = Field(0, ge=0, description="Seed of the synthetic task and of the prompt shuffle.")
    num_train: int = Field(5000, ge=1, description="Synthetic task: number of training prompts.")
    num_eval: int = Field(200, ge=1, description="Synthetic task: number of held-out prompts.")
    digits: int = Field(2, ge=1, le=6, description="Synthetic task: digits per operand.")
    max_prompt_len: int = Field(64, ge=1, description="Prompts longer than this many tokens are rejected with an error.")


class RolloutConfig(_Strict):
    backend: Literal["embedded", "sglang"] = Field("embedded", description="Rollout engine: the embedded torch server or SGLang.")
    num_engines: int = Field(1, ge=1, description="Number of rollout engine actors.")
    prompts_per_iteration: int = Field(32, ge=1, description="Prompts sampled per rollout iteration.")
    n_samples_per_prompt: int = Field(8, ge=1, description="Responses per prompt (the GRPO group size).")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature; 0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="Top-k sampling; -1 keeps every token.")
    max_new_tokens: int = Field(8, ge=1, description="Maximum response length in tokens.")
    max_batch_size: int = Field(256, ge=1, description="Largest batch an engine decodes at once.")
    engine_threads: int = Field(1, ge=1, description="torch threads of each engine process.")
    request_timeout_s: float = Field(600.0, gt=0, description="HTTP timeout of one generate request.")


class AlgorithmConfig(_Strict):
    type: Literal["grpo"] = Field("grpo", description="Advantage estimator.")
    normalize_std: bool = Field(True, description="GRPO: divide by the group's reward std (False = Dr.GRPO).")
    clip_eps_low: float = Field(0.2, ge=0.0, le=1.0, description="PPO clip: lower ratio bound is 1 - clip_eps_low.")
    clip_eps_high: float = Field(0.2, ge=0.0, le=10.0, description="PPO clip: upper ratio bound is 1 + clip_eps_high.")
    kl_coef: float = Field(0.0, ge=0.0, description="Weight of the KL(policy || reference) term in the loss; 0 disables the reference model.")
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = Field("low_var_kl", description="KL estimator (Schulman's k1/k2/k3; low_var_kl = k3 clamped to [-10, 10]).")
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus weight.")
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = Field("token-mean", description="How per-token losses are reduced.")


class TrainerConfig(_Strict):
    num_ranks: int = Field(1, ge=1, description="Data-parallel trainer ranks (Ray actors).")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="DeepSpeed ZeRO stage.")
    precision: Literal["fp32", "bf16"] = Field("fp32", description="Training precision.")
    lr: float = Field(1e-4, gt=0.0, description="Peak learning rate.")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="Learning-rate decay after warm-up.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up optimizer steps.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0.0, description="Global gradient-norm clip.")
    micro_batch_size: int = Field(64, ge=1, description="Samples per forward/backward on one rank.")
    minibatches_per_iteration: int = Field(1, ge=1, description="Optimizer steps per iteration (the batch is split into this many mini-batches).")
    threads_per_rank: int = Field(1, ge=1, description="torch threads per trainer rank.")
    total_steps_hint: int | None = Field(None, ge=1, description="Steps for decaying schedules; defaults to num_iterations * minibatches_per_iteration.")


class WeightSyncConfig(_Strict):
    verify: Literal["full", "sample", "off"] = Field("sample", description="Check engine weights after each push: every tensor, a sample, or not at all.")
    verify_sample: int = Field(4, ge=1, description="Tensors compared when verify=sample.")
    bucket_mb: int = Field(512, ge=1, description="Flattened bucket size for update_weights_from_tensor.")


class ClusterConfig(_Strict):
    address: str | None = Field(None, description="Ray address; default: $RAY_ADDRESS, else start a local cluster.")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of a locally started cluster (default: all).")
    namespace_prefix: str = Field("reflow", description="Actors live in namespace `<prefix>-<experiment>`.")


class StorageConfig(_Strict):
    root: str = Field("file://./.reflow/runs", description="Where checkpoints, rollouts and metrics go (file:// or s3://).")


class RunConfig(_Strict):
    """One experiment: what to train, on what, how, and where results go."""

    experiment: str = Field("demo", pattern=r"^[A-Za-z0-9_.-]+$", description="Experiment name: storage prefix and Ray namespace.")
    seed: int = Field(0, ge=0, description="Global seed.")
    num_iterations: int = Field(20, ge=0, description="Total rollout iterations of the run.")
    debug_exit_after: int | None = Field(None, ge=1, description="Stop after this many iterations of this invocation (debugging).")
    eval_before_train: bool = Field(True, description="Evaluate the initial policy before training.")
    eval_interval: int | None = Field(None, ge=1, description="Evaluate every this many iterations (and at the end).")
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    trainer: TrainerConfig = TrainerConfig()
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    cluster: ClusterConfig = ClusterConfig()
    storage: StorageConfig = StorageConfig()

    @model_validator(mode="after")
    def _check_batch(self) -> "RunConfig":
        samples = self.rollout.prompts_per_iteration * self.rollout.n_samples_per_prompt
        per = self.trainer.num_ranks * self.trainer.minibatches_per_iteration
        if samples % per:
            raise ValueError(
                f"rollout.prompts_per_iteration * rollout.n_samples_per_prompt = {samples} samples "
                f"must divide evenly over trainer.num_ranks * trainer.minibatches_per_iteration = {per}")
        return self


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the field and the fix."""


def _parse_value(raw: str) -> Any:
    """`8` -> 8, `1e-4` -> 1e-4, `true` -> True, `null` -> None, `[1,2]` -> list, else the string."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = json.loads(json.dumps(data))  # deep copy
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key.sub=value (e.g. trainer.lr=1e-4)")
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
        node[parts[-1]] = _parse_value(raw)
    return data


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "<root>"
        got = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
        lines.append(f"  {loc}: {e['msg']}{got}")
    return "\n".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML experiment file (or the defaults), apply overrides, validate."""
    data: dict = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist (see configs/ for examples)")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
        source = str(p)
    if overrides:
        data = apply_overrides(data, overrides)
        source += " + overrides"
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
