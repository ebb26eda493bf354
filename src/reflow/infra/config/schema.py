"""Typed, nested run configuration.

One pydantic model per concern; every field has a default, a bound where one exists and a
docstring (Prefect renders the UI form from these). Experiment files under `configs/` are YAML;
`key.sub=value` overrides from the command line are applied on top and validated the same way,
so a bad value fails before anything starts and names the field.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from reflow.infra.config.guards import (
    CREDENTIAL_CHAIN,
    SEGMENT_PATTERN,
    TOKEN_ENV,
    check_segment,
    credential_problem,
    credentials_message,
    secret_name,
)
from reflow.rl.algorithms import SPECS, AlgorithmConfig, GRPOConfig
from reflow.rl.algorithms.base import StrictModel as _Strict
from reflow.rl.registry import spec_problem
from reflow.rl.rewards import DEFAULT_FN_TIMEOUT_S

CREDENTIALS = "credentials_in_url"  # the pydantic error type of a value that embeds credentials
# Upper bounds of counts that size a loop or an allocation: far past any real run, so that a typo such as
# rollout.max_new_tokens=1e13 fails here instead of in an engine.
MAX_TOKENS = 1 << 20  # a response, a prompt: longer than any model's context
MAX_STEPS = 10_000_000  # iterations, optimizer steps, rows of the synthetic task
MAX_BATCH = 1_000_000  # prompts or samples in one batch or one micro-batch


def _segment(name: str) -> str:
    return check_segment(name, "name")


def _credential_free(location: str) -> str:
    problem = credential_problem(location)
    if problem is not None:
        raise ValueError(credentials_message("this location", problem))
    return location


# A name that becomes one folder of a storage path (infra/config/guards.py says why `..` and `a/b` are refused).
# The pattern is for the JSON schema (Prefect's form); the validator gives the error that names the rule.
PathSegment = Annotated[str, AfterValidator(_segment), Field(json_schema_extra={"pattern": SEGMENT_PATTERN})]
# A path or URL given outside a RunConfig (a flow parameter); inside one, RunConfig checks every string.
Location = Annotated[str, AfterValidator(_credential_free)]


def _custom_resources(value: dict[str, float]) -> dict[str, float]:
    builtin = sorted(k for k in value if k in ("CPU", "GPU", "memory", "object_store_memory") or k.startswith("node:"))
    if builtin:
        raise ValueError(f"{builtin} are Ray's own resources, which reflow sets itself (CPUs and GPUs per actor); "
                         f"name custom resources a node was started with (`ray start --resources='{{\"reflow_engine_node\": 1}}'`)")
    return value


def _on_off(v: Any) -> Any:
    """YAML (and a `key=on` override) reads a bare on/off as true/false: take those as the words meant."""
    return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v


# auto/on/off, where a bare YAML on/off (read as a boolean) means the word
AutoOnOff = Annotated[Literal["auto", "on", "off"], BeforeValidator(_on_off)]

# Ray custom resources an actor asks for: it is placed only on nodes started with them (docs/scale-out.md).
NodeResources = Annotated[dict[str, Annotated[float, Field(gt=0.0)]], AfterValidator(_custom_resources)]


class ModelConfig(_Strict):
    path: str = Field(".reflow/models/demo-policy", description="HF checkpoint folder or URL (file://, s3://) of the initial policy.")
    ref_path: str | None = Field(None, description="Frozen reference model for the KL term; defaults to `path`.")


class DataConfig(_Strict):
    task: Literal["addition", "file"] = Field("addition", description="`addition`: the built-in synthetic task; `file`: prompts from `path`.")
    path: str | None = Field(None, description="jsonl/parquet of prompts (local or URL) when task=file.")
    eval_path: str | None = Field(None, description="task=file: jsonl/parquet of held-out prompts (the `heldout` eval set); default: the last num_eval rows of `path` are carved out of training (a warning says so).")
    prompt_key: str = Field("prompt", description="Column holding the prompt text.")
    label_key: str = Field("label", description="Column holding the ground truth passed to the reward function.")
    reward_fn: str = Field("reflow.rl.demo_task:reward", description="`module:function` scoring (prompt, response, label) -> float, sync or async; a function that also declares a `sample` parameter gets the sample's finish reason and token counts (reflow.rl.types.Sample).")
    seed: int = Field(0, ge=0, description="Seed of the synthetic task and of the prompt shuffle.")
    num_train: int = Field(5000, ge=1, le=MAX_STEPS, description="Synthetic task: number of training prompts.")
    num_eval: int = Field(200, ge=1, le=MAX_STEPS, description="Synthetic task: number of held-out prompts.")
    digits: int = Field(2, ge=1, le=6, description="Synthetic task: digits per operand.")
    max_prompt_len: int = Field(64, ge=1, le=MAX_TOKENS, description="Prompts longer than this many tokens are rejected with an error.")
    chat_template: bool = Field(False, description="Prompts are chat messages (a list of {role, content}, or a string = one user message) rendered by the tokenizer's chat template with the generation prompt; the same token ids go to rollout, training and eval.")
    system_prompt: str | None = Field(None, description="chat_template: a system message put first in every prompt that does not start with its own.")
    metadata_keys: list[str] = Field(default_factory=list, description="task=file: columns of data.path, data.eval_path and file eval sets copied into each prompt's metadata, which a rollout function gets (rollout.generate_fn, `RolloutRequest.metadata`); a file without one of them is an error.")


class RewardConfig(_Strict):
    """How samples are scored: `function` (data.reward_fn), `builtin` (reflow.rl.verifiers) or `http`
    (a reward-model server, reflow.rl.reward_http: its wire contract, retries and errors)."""

    type: Literal["function", "http", "builtin", "custom"] = Field("function", description="`function`: data.reward_fn; `builtin`: the verifier named by `builtin`; `http`: POST batches of samples to `url`; `custom`: the scorer named by `scorer`.")
    scorer: str | None = Field(None, description="type=custom: a scorer registered with reflow.rl.scorers.register_scorer, or `package.module:Class` (a reflow.rl.scorers.Scorer subclass built as Class(reward, data.reward_fn)).")
    builtin: Literal["exact_match", "math"] = Field("exact_match", description="type=builtin: `exact_match` (stripped response == label) or `math` (final answer equal to the label by math-verify; pip install 'reflow[math]').")
    url: str | None = Field(None, description="type=http: the reward server's endpoint (http:// or https://).")
    token_env: str | None = Field(None, min_length=1, description="type=http: environment variable (on the driver) holding a bearer token sent to the server; the token itself never goes into the config.")
    timeout_s: float = Field(30.0, gt=0.0, le=3600.0, description="type=http: deadline of one batch request, from its start to the answer's last byte (a server that trickles bytes does not stretch it).")
    retries: int = Field(3, ge=0, le=20, description="type=http: retries of a batch after a timeout, connection error, 429 or 5xx (exponential backoff).")
    backoff_s: float = Field(0.5, ge=0.0, le=60.0, description="type=http: wait before the first retry; doubled for each further one.")
    max_concurrency: int = Field(4, ge=1, le=256, description="type=http: most batch requests in flight at once.")
    batch_size: int = Field(64, ge=1, le=100000, description="type=http: samples per request.")
    fn_timeout_s: float = Field(DEFAULT_FN_TIMEOUT_S, gt=0.0, le=86400.0, description="type=function or builtin (and eval sets' reward_fn): deadline of one call of the reward function; past it the run (or `reflow config --check`) fails naming the function and the sample. An async function's calls of one batch start together, so the batch gets this long. A late call is abandoned in its worker thread (stopped if it loops in Python; one blocked in C ends on its own) and its answer never used.")

    @model_validator(mode="after")
    def _http_needs_url(self) -> RewardConfig:
        if self.type == "http" and not (self.url or "").startswith(("http://", "https://")):
            raise ValueError(f"reward.type=http needs reward.url, an http:// or https:// URL "
                             f"(got {_shown(repr(self.url))})")
        if (self.type == "custom") != (self.scorer is not None):
            raise ValueError("reward.type=custom needs reward.scorer (a registered scorer name or "
                             "'package.module:Class')" if self.type == "custom" else
                             f"reward.scorer={self.scorer!r} is read only with reward.type=custom: set "
                             f"reward.type=custom, or remove reward.scorer")
        if self.scorer is not None and (why := spec_problem(self.scorer, "reward.scorer", "scorer")):
            raise ValueError(why)
        return self


class RolloutConfig(_Strict):
    backend: Literal["embedded", "sglang"] = Field("embedded", description="Rollout engine: the embedded torch server or SGLang.")
    num_engines: int = Field(1, ge=1, description="Number of rollout engine actors.")
    prompts_per_iteration: int = Field(32, ge=1, le=MAX_BATCH, description="Prompts sampled per rollout iteration.")
    n_samples_per_prompt: int = Field(8, ge=1, le=MAX_BATCH, description="Responses per prompt (the GRPO group size).")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature; 0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="Top-k sampling; -1 keeps every token.")
    max_new_tokens: int = Field(8, ge=1, le=MAX_TOKENS, description="Maximum response length in tokens.")
    skip_special_tokens: bool = Field(True, description="Drop special tokens (eos, pad, ...) when decoding the response text the reward function sees (SGLang's sampling param of this name; eval sets too).")
    no_stop_trim: bool = Field(False, description="Keep the stop token that ended a response at the end of its text (SGLang's sampling param; shows in the text only with skip_special_tokens=false when the stop token is special, like eos). Either way a reward function with a `sample` parameter gets the finish reason.")
    seeded_sampling: bool = Field(True, description="Give every sample its own sampling_seed derived from (seed, iteration, sample), so rollouts are reproducible and a resumed run samples what the uninterrupted one would.")
    max_batch_size: int = Field(256, ge=1, le=MAX_BATCH, description="Largest batch an engine decodes at once.")
    engine_threads: int = Field(1, ge=1, description="torch threads of each engine process.")
    request_timeout_s: float = Field(600.0, gt=0, description="HTTP timeout of one generate request.")
    node_resources: NodeResources = Field(default_factory=dict, description="Ray custom resources each engine asks for, e.g. {reflow_engine_node: 0.01}: engines then run only on nodes started with them (`ray start --resources`); empty: any node. docs/scale-out.md.")
    generate_fn: str = Field("reflow.engines.rollout_fns:single_turn", min_length=3, description="`module:function`, an `async def (request, engine) -> Trajectory` rolling out one sample (multi-turn, tools: reflow.engines.rollout_fns); the default single-turn one is served as batched requests.")
    max_concurrent_requests: int = Field(256, ge=1, description="A custom generate_fn: most /generate requests in flight at once over all engines.")
    max_turns: int = Field(4, ge=1, le=100, description="A multi-turn generate_fn: most policy turns per trajectory (each turn's own limit is max_new_tokens).")
    max_response_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description="A multi-turn generate_fn: most tokens after the prompt (policy and tool tokens together); default max_turns * max_new_tokens.")
    tool_timeout_s: float = Field(10.0, gt=0.0, le=3600.0, description="A multi-turn generate_fn: a tool call running longer ends the trajectory (reward info `tool_error`), not the run.")

    def turn_limits(self) -> Any:
        """The multi-turn bounds as the rollout functions take them (reflow.engines.rollout_fns.TurnLimits)."""
        from reflow.engines.rollout_fns import TurnLimits

        return TurnLimits(self.max_turns, self.max_response_tokens or self.max_turns * self.max_new_tokens,
                          self.tool_timeout_s)
    router: bool = Field(False, description="Serve /generate through one router over all engines (backend=sglang: sglang-router when installed; otherwise reflow's least-loaded proxy) that retries a request on another engine when one dies.")
    tp_size: int = Field(1, ge=1, description="sglang: tensor-parallel GPUs per engine.")
    mem_fraction_static: float = Field(0.8, gt=0.0, lt=1.0, description="sglang: GPU memory fraction for weights + KV cache (lower it when colocated, e.g. 0.7).")
    decode_fusion: Annotated[Literal["auto", "off"], BeforeValidator(_on_off)] = Field("auto", description="Embedded engine on a GPU: its CUDA-graph decode step's elementwise work between the matrix products (norms, rotary, residuals, SiLU, the last norm) compiled by torch.compile (inductor) into fewer kernels, each graph then replaying those; off: eager kernels. No effect on CPU (the eager decoder) or with backend=sglang.")
    kv_mem_fraction: float | None = Field(None, gt=0.0, lt=1.0, description="Fraction of the GPU's memory an engine holds for weights + KV cache, as SGLang's mem_fraction_static: the embedded engine sizes one KV pool from it and admits a row when a region for its prompt + max_new_tokens is free (rows that do not fit wait; docs/engine.md). backend=sglang: passed as mem_fraction_static (setting both differently is refused). Null: the embedded engine gives each of max_batch_size slots room for the longest row of a call (rows never wait).")
    kv_cache_dtype: Literal["auto", "bf16"] = Field("auto", description="dtype of the engines' KV cache. auto: the model's (an fp32 engine keeps fp32 keys and values). bf16: keys and values stored in bfloat16 while the weights and products stay in the engine's dtype, as SGLang's --kv-cache-dtype bfloat16 (passed to it with backend=sglang): half the bytes each decode step reads and twice the positions a KV pool holds, for an fp32 engine whose decode is bound by reading its cache (the scratchpad task's ~400-token responses); the rounding moves the engine's log-probs a little further from the trainer's (logprob_mismatch; TIS corrects). The embedded engine applies it in its static-cache decoder (the one it runs on a GPU); where it decodes eagerly through transformers' cache (CPU) the cache keeps the model's dtype, and /get_server_info says which one holds.")
    kv_reserve: float = Field(1.0, gt=0.0, le=1.0, description="Embedded engine with a KV pool (kv_mem_fraction): the share of a row's max_new_tokens its KV region holds when admitted. 1.0: all of it (a row never outgrows its region). Below 1 more rows decode at once where most responses end well before max_new_tokens: a row reaching its region's end grows it by the same share of what it has left, in place or moved (its K/V copied), or, when the pool is full, leaves the batch and is prefilled again with what it generated once room frees (as SGLang retracts requests). backend=sglang admits on its own estimate: set schedule_conservativeness in sglang_server_args instead.")

    @field_validator("partial", mode="before")
    @classmethod
    def _partial_off(cls, v: Any) -> Any:
        """YAML reads a bare `off` as false: `partial: off` means what it says."""
        return "off" if v is False else v

    @field_validator("sglang_server_args")
    @classmethod
    def _sglang_flags(cls, v: dict[str, Any]) -> dict[str, Any]:
        """A field reflow owns, or a name that is no field, is refused when the config loads, not at launch; so is
        a credential (admin_api_key, ...): on SGLang's command line every local user could read it."""
        from reflow.engines.sglang.launcher import extra_flags

        for name in v:
            if secret_name(name):
                raise ValueError(f"rollout.sglang_server_args.{name} would put a credential on SGLang's command line, "
                                 f"which every user of the node can read (/proc/<pid>/cmdline); reflow hands SGLang "
                                 f"its own key in a private file (the runtime's --api-key), not this way")
        extra_flags(v)
        return v

    @model_validator(mode="after")
    def _kv_mem_fraction_for_sglang(self) -> RolloutConfig:
        """SGLang reads the one memory fraction it has (mem_fraction_static); both set differently is refused."""
        if self.backend == "sglang" and self.kv_mem_fraction is not None:
            if "mem_fraction_static" in self.model_fields_set and self.mem_fraction_static != self.kv_mem_fraction:
                raise ValueError(f"rollout.kv_mem_fraction={self.kv_mem_fraction} and rollout.mem_fraction_static="
                                 f"{self.mem_fraction_static} disagree; with backend=sglang set one of them")
            if self.mem_fraction_static != self.kv_mem_fraction:  # (an assignment validates the model again)
                self.mem_fraction_static = self.kv_mem_fraction
        if self.backend == "sglang" and self.kv_reserve != 1.0:
            raise ValueError(f"rollout.kv_reserve={self.kv_reserve} is the embedded engine's; SGLang admits rows on its "
                             f"own estimate of their new tokens and retracts them when its pool runs out: tune that with "
                             f"rollout.sglang_server_args.schedule_conservativeness and leave kv_reserve at 1.0")
        return self
    startup_timeout_s: float = Field(900.0, gt=0, description="How long an engine may take to answer /health_generate after launch.")
    sglang_server_args: dict[str, str | int | float | bool | list[str] | None] = Field(default_factory=dict, description="backend=sglang: more flags for SGLang's launch_server, by ServerArgs field name, e.g. {attention_backend: triton, disable_cuda_graph: true} (true: a bare flag; false/null: left out). Fields reflow sets from its own settings (model, host, ports, key, tp_size, mem_fraction_static, dtype, seed, LoRA, the memory saver) are refused, naming the setting to use.")
    sglang_python: str | None = Field(None, min_length=1, description="backend=sglang: the Python interpreter (path, or a command on PATH) that runs SGLang's server, e.g. a virtualenv's bin/python where SGLang's pins (torch, transformers) clash with the trainer's; it must import sglang.srt.entrypoints.http_server (checked before launch). Null: the engine actor's own interpreter. The trainer side still needs the `sglang` package importable (not imported whole) for CUDA IPC pushes in SGLang's own bucket format.")
    generate_ahead: bool = Field(True, description="Synchronous loop (max_staleness 0): the rollout source launches each iteration's batch right after the push of its policy and scores it in the background, so Prefect's bookkeeping between iterations (and a checkpoint due then) overlaps the engines' work. Same prompts, seeds and policy, hence the same batch. False: each iteration generates and scores in its own flow run's tasks (visible as task runs in the UI).")
    update_ahead: bool | None = Field(None, description="Synchronous loop with generate_ahead: the rollout source also computes the next batch's advantages and submits its update before its flow run starts, so the bookkeeping between flow runs overlaps the trainer's work too; the same batch and update. Null (auto): on where the run uses GPUs, where it measured faster; off on CPU, where it did not. Never with cluster.hand_over (the update waits for the hand-over in its flow run) or a critic (it must score the batch first).")
    max_staleness: int = Field(0, ge=0, le=8, description="Asynchronous rollout: 0 is the synchronous loop (generate, then train); k >= 1 lets the engines generate the next batches while the trainer trains, each batch by a policy at most k versions behind the one it trains (a push waits for the batch being generated, so every batch has one version, recorded per sample). Stale batches are corrected by truncated importance sampling at algorithm.tis_cap (2.0 when unset). Needs engines that stay resident (not colocated with hand-overs).")

    partial: Literal["off", "carry", "drop"] = Field("off", description="Long tails (engines/partial_rollout.py): off waits for every sample of the iteration's prompts. carry and drop keep prompts_per_iteration * (1 + over_sample) groups in flight and close the batch once prompts_per_iteration groups are complete (the embedded engine in one call per engine that stops at that step; SGLang in rounds of partial_chunk_tokens); carry continues the others in the next iteration under the new policy (each token keeps the version that generated it; truncated importance sampling at algorithm.tis_cap, 2.0 when unset, corrects them, and checkpoints hold the carried samples), drop discards them. Closing counts tokens, never seconds, so a resumed run is exact. Synchronous loop only (max_staleness 0), the default single-turn rollout, no dynamic sampling. On the embedded engine pair it with a KV pool (rollout.kv_mem_fraction) and rollout.kv_reserve below 1 (docs/engine.md): with whole regions the extra groups wait for room.")
    partial_chunk_tokens: int = Field(256, ge=1, le=MAX_TOKENS, description="rollout.partial carry|drop on backend=sglang (the embedded engine closes in one call and ignores it): new tokens a sample generates per round at most; after each round the complete groups are counted. Smaller: the batch closes nearer the moment enough groups finish, at more requests per iteration.")
    over_sample: float = Field(0.25, ge=0.0, le=4.0, description="rollout.partial carry|drop: extra groups in flight as a fraction of prompts_per_iteration (carried ones count): the batch closes on the first prompts_per_iteration complete groups among them.")

class CriticConfig(_Strict):
    """PPO's value model (algorithms whose spec needs a critic: algorithm.type=ppo): the policy's backbone plus a scalar head, trained by
    its own DeepSpeed ranks (trainer.num_ranks of them, with trainer's zero_stage, precision, grad_clip)."""

    path: str | None = Field(None, description="HF checkpoint folder or URL the critic's backbone starts from; default model.path.")
    lr: float = Field(1e-3, gt=0.0, description="Critic learning rate (constant).")
    warmup_iterations: int = Field(0, ge=0, le=MAX_STEPS, description="The critic trains alone for this many first iterations; the policy is not updated.")
    micro_batch_size: int | None = Field(None, ge=1, le=MAX_BATCH, description="Samples per critic forward/backward on one rank; default trainer.micro_batch_size.")


class LoraConfig(_Strict):
    rank: int = Field(0, ge=0, description="LoRA rank r; 0 = off (full fine-tuning). On: only the adapters are trained and held in the optimizer, checkpoints store the adapter (adapter/), pushes send only adapter tensors (weight_sync.mode=tensor), and `reflow export-merged` writes a merged HF folder.")
    alpha: float = Field(16.0, gt=0.0, description="LoRA alpha: the update B @ A is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0.0, le=0.0, description="LoRA dropout. Only 0: the trainer scores the batch with dropout off (old and new log-probs must score the same function), so a dropout would never act.")
    target_modules: list[str] = Field(["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1, description="Names of the linear modules that get adapters (peft's target_modules, matched against module name suffixes).")


class TrainerConfig(_Strict):
    num_ranks: int = Field(1, ge=1, description="Data-parallel trainer ranks (Ray actors).")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="DeepSpeed ZeRO stage.")
    precision: Literal["auto", "fp32", "bf16", "bf16-mixed"] = Field("auto", description="Training precision. auto (the default): fp32 where the ranks hold no GPU; on GPUs by the policy's size, counted from its safetensors headers when the run starts and logged: from 500M parameters bf16 (bf16-mixed where zero_stage=0), where it steps several times faster than fp32; below that fp32 with TF32 products (tf32 taken as true), which learned more per update on the small GPU demo at about bf16's speed. fp32; bf16: DeepSpeed's bf16 (the model's weights, activations and gradients in bf16, fp32 master weights in the optimizer; needs zero_stage >= 1); bf16-mixed: the weights stay fp32 and torch.autocast runs the matmuls in bf16 (norms, softmax and the residual stream in fp32), as HF Trainer's and TRL's bf16=True do; the engines then hold the fp32 weights too. fp32 weights learn more per update than bf16 ones; on NVIDIA GPUs, fp32 with tf32=true trains at about bf16's speed. See also fp32_lm_head and tf32.")
    fp32_lm_head: bool = Field(False, description="Compute the LM head (hidden state -> vocabulary logits) in float32 in the trainer and the embedded engines, whatever trainer.precision: bf16 logits carry ~3 significant digits into every log-prob, importance ratio and sampled token. Costs a float32 copy of the head's weight per forward. Not with rollout.backend=sglang (SGLang 0.5.23 has no such option).")
    tf32: bool = Field(False, description="On NVIDIA GPUs, float32 matrix products in the trainer ranks and the embedded engines run on TF32 tensor cores (inputs rounded to a 10-bit mantissa, float32 sums, range and everything between the products: torch.set_float32_matmul_precision('high')), for precision=fp32 (every product) and bf16-mixed (the products autocast leaves in float32, and fp32_lm_head's). No effect on CPU or with precision=bf16. torch's default is off.")
    lr: float = Field(1e-4, gt=0.0, description="Peak learning rate.")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="Learning-rate decay after warm-up.")
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="Linear warm-up optimizer steps.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0.0, description="Global gradient-norm clip.")
    micro_batch_size: int = Field(64, ge=1, le=MAX_BATCH, description="Samples per forward/backward on one rank (right-padded to the longest among them), unless max_tokens_per_micro_batch is set.")
    max_tokens_per_micro_batch: int | None = Field(None, ge=2, le=MAX_TOKENS, description="Sequence packing: each forward/backward of the policy is one row of at most this many tokens holding whole samples end to end (attention never crosses a sample; position ids restart per sample), samples spread over the ranks by tokens; micro_batch_size is then unused. Must hold the longest sample: data.max_prompt_len + rollout.max_new_tokens. None (default): micro_batch_size samples, padded. The pad_fraction metric says how much of the forward was padding either way.")
    activation_checkpointing: AutoOnOff = Field("auto", description="Each decoder layer of the policy keeps only its input for backward and recomputes its forward there: activation memory falls from every layer's intermediates to one layer's, for about one more forward of compute. auto: on when a rough estimate of one micro-batch's activations (at max_tokens_per_micro_batch, or micro_batch_size samples of data.max_prompt_len + rollout.max_new_tokens tokens) exceeds half of the rank's GPU memory; never on CPU.")
    minibatches_per_iteration: int = Field(1, ge=1, le=MAX_BATCH, description="Optimizer steps per iteration (the batch is split into this many mini-batches).")
    threads_per_rank: int = Field(1, ge=1, description="torch threads per trainer rank.")
    node_resources: NodeResources = Field(default_factory=dict, description="Ray custom resources each trainer (and critic) rank asks for, e.g. {reflow_trainer_node: 0.01}: ranks then run only on nodes started with them; empty: any node. Rank 0's node hosts the process group's rendezvous. docs/scale-out.md.")
    total_steps_hint: int | None = Field(None, ge=1, le=MAX_STEPS, description="Steps for decaying schedules; defaults to num_iterations * minibatches_per_iteration.")
    compile: AutoOnOff = Field("auto", description="torch.compile each decoder layer (static shapes; padded micro-batch lengths rounded up to 4 buckets per octave, packed rows to eighths of max_tokens_per_micro_batch). auto: on when the trainer runs on CUDA, off on CPU. The compile_graphs metric counts what was compiled.")
    old_logprob_pass: Literal["auto", "always"] = Field("auto", description="auto: with one mini-batch per iteration (and no advantages finished in the trainer), old log-probs come from the training forward itself, saving a full forward; always: a separate no-grad pass first.")
    grad_accum_dtype: Literal["fp32", "bf16"] = Field("fp32", description="precision=bf16: dtype micro-batch gradients are summed in (bf16 is cheaper but rounds away small gradients over many micro-batches).")
    immediate_grad_update: bool = Field(False, description="precision=bf16, ZeRO-1, grad_accum_dtype=fp32: fold each gradient into fp32 as backward produces it (DeepSpeed's BF16_Optimizer option).")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="Low-rank adapters (peft) instead of full fine-tuning.")


class WeightSyncConfig(_Strict):
    verify: Literal["full", "sample", "logprobs", "off"] = Field("sample", description="Check engines after each push (each also checks weight_version). full/sample: read every tensor, or a sample, back through /get_weights_by_name and compare (bit-exact at verify_atol=0: proves the values read); engines that cannot answer it whole (SGLang's Qwen2/Qwen3 classes, TP > 1) are checked by logprobs instead, reported in the push stats (verify_method, verify_fallback; metrics push_logprob_engines, push_logprob_max_diff). logprobs: every engine scores a fixed probe batch and its logprobs must match the trainer's at the pushed weights within the coarser dtype's noise (proves the engine computes with the pushed model, for any model and TP size; cannot see differences below that noise). off: no check.")
    verify_every: int = Field(1, ge=1, description="Run the `verify` check on policy versions divisible by this (version 0, the initial push, always); the other pushes check weight_version only. Raise it when the check is a large share of a short iteration (a read-back through /get_weights_by_name is JSON).")
    verify_sample: int = Field(4, ge=1, description="Tensors compared when verify=sample.")
    verify_rows: int | None = Field(8, ge=1, description="verify=sample: compare the first this many rows of each sampled tensor, bit for bit (SGLang's truncate_size). The answer is JSON, so its cost grows with the rows compared (whole embedding matrices take seconds); null compares them whole.")
    bucket_mb: int = Field(512, ge=1, description="Flattened bucket size of a tensor or distributed push.")
    mode: Literal["tensor", "distributed", "disk"] = Field("tensor", description="tensor: update_weights_from_tensor with buckets in shared memory (/dev/shm) of trainer rank 0's host, or on its GPU as CUDA IPC handles when it trains on one (colocated engines, which must see that GPU), so engines must run on that host (a push to another host is refused); distributed: a broadcast group + update_weights_from_distributed (engines on other GPUs); disk: the trainer writes HF safetensors, engines reload them.")
    transport: str | None = Field(None, description="A weight transport of one's own instead of the mode's (and of LoRA's adapter push): one registered with reflow.engines.weights.transport.register_transport, or `package.module:Class` (a WeightTransport subclass). null: the mode's (tensor: CUDA IPC, else shared memory, falling back to disk; distributed; disk).")
    map_once: bool = Field(True, description="mode=tensor to reflow's embedded engines: each engine maps the trainer's weights once (on a GPU the parameters themselves, by CUDA IPC; on CPU one shared-memory buffer the trainer packs at each push) and a push is then one call per engine (pause, copy, set the version, resume) instead of SGLang's pause, flush, begin, a handle per bucket, end and continue. false: SGLang's calls, as SGLang engines always get. reflow.engines.weights.mapped.")
    backend: Literal["gloo", "nccl"] = Field("gloo", description="Process-group backend of mode=distributed: gloo on CPU, nccl between GPUs (buckets are then packed on the trainer's CUDA device; a trainer without one is refused).")
    disk_dir: str | None = Field(None, description="mode=disk: folder or storage URL (file://, s3://) the engines can read. reflow writes only into its own subfolder `reflow-weight-push/` (one `v<version>` folder per push) and deletes only versions it wrote there. Default: a local temp folder (one node only).")
    verify_atol: float = Field(0.0, ge=0.0, description="Absolute tolerance of the weight check; 0 = bit-exact. Raise it for quantised engines (fp8/int4).")

    @model_validator(mode="after")
    def _transport_named(self) -> WeightSyncConfig:
        if self.transport is not None and (why := spec_problem(self.transport, "weight_sync.transport",
                                                               "weight transport")):
            raise ValueError(why)
        return self


class ClusterConfig(_Strict):
    address: str | None = Field(None, description="Ray address; default: $RAY_ADDRESS, else start a local cluster.")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of a locally started cluster (default: all).")
    namespace_prefix: str = Field("reflow", description="Actors live in namespace `<prefix>-<experiment>`.")
    bind_host: str = Field("127.0.0.1", description="Address engines and the router listen on: loopback for one machine; 0.0.0.0 on a multi-node cluster (they then advertise the node's IP).")
    placement_timeout_s: float = Field(120.0, gt=0.0, le=86400.0, description="How long an engine or trainer rank may wait for a node that can host it (its node_resources, CPUs, GPUs) before the run fails naming the actor and the nodes that offer them; a lost node then ends the run instead of leaving it pending.")
    gpu_memory_gib: float | None = Field(None, gt=0.0, le=1e5, description="Memory of one GPU of the cluster, for the preflight's check that a trainer rank fits (weights, gradients and optimizer state by ZeRO stage, one micro-batch's activations, a colocated engine that keeps its memory). None: what the preflight's own process sees on its first GPU, or no check where it sees none (a driver without GPUs).")
    gpus: AutoOnOff = Field("auto", description="Whether trainer ranks and embedded engines run on GPUs. auto: when the Ray cluster has GPUs (each trainer rank, critic rank and engine takes one; colocated: one per placement-group bundle, shared); on: the same, refused when the cluster has too few; off: CPU only (SGLang engines always take GPUs).")
    start_early: bool | None = Field(None, description="`reflow train` / `reflow demo` with a local cluster of their own: start Ray while the preflight runs (stopped again if it fails) and the run's actors as soon as it passed, while Prefect's server and the flow run start (the flow takes them): Ray's start-up and the flow's first steps overlap the preflight and the actors' loading. Null (auto): on where this machine has an NVIDIA GPU and cluster.gpus is not off. Never on a long-lived cluster (RAY_ADDRESS) or while the experiment's lease file exists.")
    fork_workers: AutoOnOff = Field("auto", description="Start the run's Ray workers by forking a process that has already imported torch, transformers, DeepSpeed and reflow's trainer and engine (infra/cluster/forkserver.py), so each actor skips those imports. Attached to a head `reflow cluster up` started with such a server (its --fork-workers; auto: where that machine has no NVIDIA GPU): auto and on use it, off starts workers as Ray does. A local cluster this run starts: only on starts a server (it exits with the run); its imports cost more than a short run's few actors save. A worker that finds no server, or whose code changed since the server imported it, starts as Ray starts it.")
    gc_freeze: bool = Field(True, description="Freeze what each long-lived process holds once set up out of Python's full garbage collections (engines/gc_freeze.py): the engines and trainer ranks once ready (not in colocated mode with hand_over), the task workers after their imports, the driver during its loop, so a full collection no longer walks every object of torch, transformers and the model inside a rollout or a step. false: Python's default.")
    colocate: bool = Field(False, description="Engines and trainers share GPUs: engines release memory during training (release_memory_occupation) and the trainer offloads its state during rollout.")
    hand_over: bool = Field(True, description="colocate: engines release their memory and trainers offload their optimizer state at each hand-over (needed when the GPU cannot hold both at once); false keeps both resident and saves each iteration's release and resume, where the GPU holds both.")
    release_tags: list[Literal["weights", "kv_cache", "cuda_graph"]] = Field(["weights", "kv_cache", "cuda_graph"], min_length=1, description="colocate: what engines release between rollout and train (SGLang's memory tags); resumed weights first, then the rest.")


class StorageConfig(_Strict):
    root: str = Field("file://./.reflow/runs", description="Where checkpoints, rollouts and metrics go (file:// or s3://bucket/prefix).")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint override (e.g. http://127.0.0.1:9000). Credentials come from the standard AWS chain (env, ~/.aws, instance role), never from this file.")
    retries: int = Field(10, ge=0, le=20, description="At most this many retries of one storage operation after a transient error (connection refused, timeout, 5xx); with the defaults, outage_budget_s ends the retrying first. Permanent errors (missing object, access denied, disk full, read-only filesystem) are never retried.")
    retry_backoff_s: float = Field(0.5, gt=0.0, le=60.0, description="Wait before the first retry; doubles on each further retry (capped at 30 s, and cut short so that the last retry falls at the end of outage_budget_s).")
    outage_budget_s: float = Field(60.0, gt=0.0, le=3600.0, description="How long one storage operation keeps retrying transient errors, counted from its first attempt: storage that is back within it costs time, not the run; past it the operation fails with a StorageError naming this setting. An attempt in flight is not cut short: a hung endpoint holds it as long as the S3 client waits (slow_call_warn_s makes that visible).")
    slow_call_warn_s: float = Field(10.0, gt=0.0, description="Log a warning when one storage call has run this long (while it still runs, so a hung endpoint shows) and its duration when it ends.")


class CheckpointConfig(_Strict):
    save_interval: int | None = Field(None, ge=1, le=MAX_STEPS, description="Save every this many completed iterations; a checkpoint is also saved after the last iteration unless save_last is false.")
    save_every_minutes: float | None = Field(10.0, gt=0.0, description="Also save when this many minutes have passed since the run's start or its last save (checked after each iteration), so a crash loses at most about this much work; null: only save_interval, the sentinel and the last iteration.")
    save_last: bool = Field(True, description="Save after the run's last iteration. false: only save_interval, save_every_minutes, the sentinel and the control API save (null both for a run that saves nothing, e.g. a throughput measurement whose checkpoint would not fit the disk; the preflight's disk check then has nothing to check).")
    keep_last: int = Field(3, ge=1, description="Committed checkpoints kept; older ones are deleted (never the one `latest` points to).")
    sentinel: str | None = Field(None, description="Path or URL of a file whose appearance requests a checkpoint after the current iteration; it is removed after the save.")
    background_commit: bool = Field(True, description="Interval and timed saves: every rank's write is queued at once and the driver goes on (eval, the next iteration's flow run) while the ranks write, hash and upload their files and a background task run commits them (the ranks' next training call runs after their write; the next save, a recovery and the run's end wait for it; a crash before COMMITTED leaves it uncommitted, so a resume takes the one before). The last save, a sentinel's and one asked for over the control API are committed before the run goes on. false: every save is.")
    signing_key_secret: str | None = Field(None, min_length=1, description="Name of a Prefect Secret block holding the key that signs checkpoint manifests (HMAC-SHA256, at least 32 characters); unset: $REFLOW_CHECKPOINT_KEY, else a key this machine generates on the first save (<Prefect home>/reflow-keys/<experiment>.key). The key itself is never written to the config or the bucket.")
    trust_unsigned: bool = Field(False, description="Also resume from checkpoints without a SIGNATURE (saved before signing existed) or signed before signatures named their experiment. Their optimizer states are pickles anyone who can write the bucket could have replaced: only for checkpoints you wrote yourself; later saves are signed.")


class TrackingConfig(_Strict):
    """Experiment trackers (infra/store/tracking.py), fed what the Prefect artifacts show: every iteration's
    metrics (`train/<metric>`, step = iteration) and every eval's summary (`eval/<set>/<key>`, step =
    policy version), plus the resolved config. Each needs its package (`pip install 'reflow[tracking]'`);
    the preflight says when one is missing. All off by default: nothing leaves the machine unless asked."""

    tensorboard: bool = Field(False, description="Write TensorBoard event files to the run's storage, <experiment>/tracking/tensorboard/ (package `tensorboard`; remote storage: staged locally, uploaded when the curves are redrawn and at the end).")
    wandb: bool = Field(False, description="Log to Weights & Biases (package `wandb`), one W&B run per flow run, named after the experiment.")
    wandb_mode: Literal["offline", "online"] = Field("offline", description="offline: files under local_dir only (upload later with `wandb sync`); online: to the W&B server (WANDB_API_KEY from the environment, never from this file).")
    wandb_project: str = Field("reflow", min_length=1, description="W&B project name.")
    mlflow: bool = Field(False, description="Log to MLflow (package `mlflow-skinny` or `mlflow`), one MLflow run per flow run in the MLflow experiment named after this one.")
    mlflow_uri: str | None = Field(None, description="MLflow tracking URI (e.g. http://mlflow:5000); default $MLFLOW_TRACKING_URI, else a SQLite file in local_dir (sqlite:///<local_dir>/mlflow.db, artifacts in <local_dir>/mlartifacts).")
    local_dir: str | None = Field(None, description="Folder for wandb's offline runs and MLflow's default SQLite store; default: <storage.root>/<experiment>/tracking with file:// storage, else .reflow/tracking/<experiment>.")


class EvalSetConfig(_Strict):
    """One named eval set: where its prompts come from, how responses are sampled and scored."""

    name: PathSegment = Field("heldout", description="Name of the set: its storage folder, artifact rows and plot curve.")
    source: str = Field("heldout", min_length=1, description="`heldout`: the task's held-out split (data.*); else a jsonl/parquet file path or URL (file://, s3://).")
    prompt_key: str | None = Field(None, description="Column holding the prompt text; default data.prompt_key.")
    label_key: str | None = Field(None, description="Column holding the ground truth; default data.label_key.")
    reward_fn: str | None = Field(None, description="`module:function` scoring (prompt, response, label[, *, sample]) like data.reward_fn; default data.reward_fn.")
    correct_threshold: float = Field(1.0, description="A sample counts as correct (for pass@k) when its reward is >= this.")
    n_samples: int | None = Field(None, ge=1, le=MAX_BATCH, description="Samples per prompt; default rollout.n_samples_per_prompt, or 1 when greedy.")
    temperature: float | None = Field(None, ge=0.0, description="Sampling temperature; default rollout.temperature; 0 = greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus sampling mass; default rollout.top_p (1 when greedy).")
    max_new_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description="Maximum response length; default rollout.max_new_tokens.")
    k: list[int] = Field([1], min_length=1, description="Report pass@k for each k (unbiased estimator; each k <= samples per prompt).")
    max_prompts: int | None = Field(None, ge=1, description="Evaluate only the first this many prompts of the set.")

    def sampling(self, rollout: RolloutConfig) -> dict[str, Any]:
        """This set's sampling options with the rollout's filling the gaps: n, temperature, top_p, top_k, max_new_tokens."""
        temperature = self.temperature if self.temperature is not None else rollout.temperature
        greedy = temperature == 0.0
        n = self.n_samples or (1 if greedy else rollout.n_samples_per_prompt)
        return {"n": n, "temperature": temperature, "top_p": 1.0 if greedy else (self.top_p or rollout.top_p),
                "top_k": -1 if greedy else rollout.top_k, "max_new_tokens": self.max_new_tokens or rollout.max_new_tokens}


class EvalConfig(_Strict):
    """When and on what the policy is evaluated (tasks/evaluate.py, flows/evaluate.py)."""

    sets: list[EvalSetConfig] = Field(default_factory=lambda: [EvalSetConfig(temperature=0.0)], description="Named eval sets; default: greedy accuracy on the task's held-out split.")
    before_train: bool = Field(True, description="Evaluate the initial policy before training (fresh runs only).")
    interval: int | None = Field(None, ge=1, le=MAX_STEPS, description="Evaluate every this many iterations; the last iteration is always evaluated.")
    blocking: bool = Field(True, description="false: an eval's generation overlaps the next iteration (the next weight push waits for it) and its scoring and records finish in the background; the run waits for every eval before it ends.")

    @model_validator(mode="after")
    def _unique_names(self) -> EvalConfig:
        names = [s.name for s in self.sets]
        if len(set(names)) != len(names):
            raise ValueError(f"eval set names must be unique, got {names}")
        return self


class ControlConfig(_Strict):
    """The run's control API (infra/ops/control.py, `reflow ctl`): health, metrics, pause/resume/save/stop."""

    enabled: bool = Field(True, description="Serve the control API while the train flow runs.")
    host: str = Field("127.0.0.1", description="Address it listens on (loopback: this machine only). Every request needs the run's bearer token, kept in a file readable by the run's user only.")
    port: int = Field(0, ge=0, le=65535, description="TCP port; 0 lets the OS pick a free one. The port and the token's file are recorded next to the experiment's lease (infra/cluster/leases.py), where `reflow ctl` finds them.")


class DebugConfig(_Strict):
    """Diagnosing a run (infra/ops/stack_dumps.py)."""

    stack_dump_interval_s: float | None = Field(None, gt=0.0, description="Every this many seconds, dump the Python stacks of the driver, trainer ranks and engines (py-spy) into <experiment>/debug/stacks/ in the run's storage, for diagnosing hangs; null: off.")


class FaultToleranceConfig(_Strict):
    """What the train flow does when a trainer rank dies mid-iteration (infra/recovery.py)."""

    max_trainer_recoveries: int = Field(2, ge=0, le=100, description="Times per run a dead trainer rank is answered by rebuilding the trainer group from the latest committed checkpoint and re-running from there; past it the run fails with the reason. 0: a dead rank fails the run.")


class RunConfig(_Strict):
    """One experiment: what to train, on what, how, and where results go."""

    # A root-level error's input is the whole config: pydantic's own message must not print a key in it.
    model_config = ConfigDict(hide_input_in_errors=True)

    experiment: PathSegment = Field("demo", description="Experiment name: storage prefix and Ray namespace.")
    seed: int = Field(0, ge=0, description="Global seed.")
    num_iterations: int = Field(20, ge=0, le=MAX_STEPS, description="Total rollout iterations of the run (a target: a resumed run stops when this many iterations are done in total, not this many more).")
    resume: str = Field("auto", min_length=1, description="`auto`: continue from the latest committed checkpoint of the experiment (if any); `never`: start fresh (refused if the experiment already has checkpoints); or a checkpoint URL.")
    debug_exit_after: int | None = Field(None, ge=1, le=MAX_STEPS, description="Stop after this many iterations of this invocation (debugging).")
    max_train_minutes: float | None = Field(None, gt=0.0, le=1e7, description="Wall-clock budget of this invocation, counted from the train flow's start: the iteration that ends past it becomes the run's last (saved, evaluated, COMPLETED; the log says the budget ended it), as `reflow ctl stop` would. For scheduled retraining and side-by-side comparisons; a resumed run gets the whole budget again; null: none.")
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    reward: RewardConfig = RewardConfig()
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = Field(default_factory=GRPOConfig, description="Advantage estimator and policy-loss options, by `type` (grpo, rloo, reinforce_pp, reinforce_pp_baseline, gspo, ppo); each type has its own options (rl/algorithms/), docs/ALGORITHMS.md maps each to its paper.")
    critic: CriticConfig = CriticConfig()
    trainer: TrainerConfig = TrainerConfig()
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    cluster: ClusterConfig = ClusterConfig()
    storage: StorageConfig = StorageConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    tracking: TrackingConfig = TrackingConfig()
    control: ControlConfig = ControlConfig()
    debug: DebugConfig = DebugConfig()
    fault_tolerance: FaultToleranceConfig = FaultToleranceConfig()

    @model_validator(mode="after")
    def _check_eval_k(self) -> RunConfig:
        for i, s in enumerate(self.eval.sets):
            n = s.sampling(self.rollout)["n"]
            if max(s.k) > n:
                raise ValueError(f"eval.sets.{i} ({s.name}): pass@k with k={max(s.k)} needs at least k samples "
                                 f"per prompt, but the set draws n={n} (set n_samples, or a temperature > 0)")
        return self

    @model_validator(mode="after")
    def _no_credentials(self) -> RunConfig:
        """Every string of the config (paths, URLs, endpoints, in any section) is saved in config.yaml and
        in flow-run parameters: refuse one that embeds a key or a signature. The message names the field
        and the part of the URL, never the secret."""
        found = [credentials_message(field, problem) for field, value in _strings(self.model_dump())
                 if (problem := credential_problem(value)) is not None]
        if found:
            raise PydanticCustomError(CREDENTIALS, "{message}", {"message": "\n  ".join(found)})
        return self

    @model_validator(mode="after")
    def _check_colocate(self) -> RunConfig:
        if self.cluster.colocate and self.rollout.backend == "sglang" and self.trainer.zero_stage == 0:
            raise ValueError("cluster.colocate with SGLang engines (GPUs) needs trainer.zero_stage 1, 2 or 3: DeepSpeed "
                             "offloads only ZeRO optimizer states, so with stage 0 the trainer's memory would stay "
                             "on the GPUs the engines need")
        return self

    @model_validator(mode="after")
    def _check_fp32_lm_head(self) -> RunConfig:
        if self.trainer.fp32_lm_head and self.rollout.backend == "sglang":
            raise ValueError("trainer.fp32_lm_head=true computes the logits in float32 in the trainer and the embedded "
                             "engines; SGLang 0.5.23 has no such option, so its engines would sample from bf16 logits "
                             "the trainer no longer computes. Use rollout.backend=embedded, or trainer.fp32_lm_head=false")
        return self

    @model_validator(mode="after")
    def _check_sglang_disk_dir(self) -> RunConfig:
        """SGLang's update_weights_from_disk loads a local folder (or a hub id), never a storage URL; the
        embedded engine downloads one, so only the SGLang backend is refused."""
        w = self.weight_sync
        if (self.rollout.backend == "sglang" and w.mode == "disk" and w.disk_dir
                and "://" in w.disk_dir and not w.disk_dir.startswith("file://")):
            raise ValueError(
                f"weight_sync.disk_dir={w.disk_dir!r}: with rollout.backend=sglang, weight_sync.mode=disk reloads "
                f"through SGLang's update_weights_from_disk, which reads only local folders (or hub ids), not "
                f"storage URLs. Set weight_sync.disk_dir to a folder every engine node can read (a local path or a "
                f"shared filesystem mount, e.g. /mnt/shared/weights), or use weight_sync.mode=tensor or distributed")
        return self

    @model_validator(mode="after")
    def _check_async(self) -> RunConfig:
        if self.rollout.max_staleness and self.cluster.colocate and self.cluster.hand_over:
            raise ValueError(f"rollout.max_staleness={self.rollout.max_staleness} generates while the trainer trains, but "
                             f"cluster.colocate with cluster.hand_over=true releases the engines' memory during training: "
                             f"set cluster.hand_over=false (both stay resident), cluster.colocate=false, or max_staleness=0")
        return self

    @model_validator(mode="after")
    def _check_partial(self) -> RunConfig:
        r, why = self.rollout, None
        if r.partial == "off":
            return self
        if r.max_staleness:
            why = f"rollout.max_staleness={r.max_staleness} (an asynchronous run's batches each have one version): set 0"
        elif r.generate_fn != type(r).model_fields["generate_fn"].default:
            why = f"rollout.generate_fn={r.generate_fn!r}: partial rollouts continue the default single-turn rollout only"
        elif self.algorithm.dynamic_sampling:
            why = "algorithm.dynamic_sampling (it refills groups by generating more): turn one of them off"
        if why is not None:
            raise ValueError(f"rollout.partial={r.partial} cannot be combined with {why}, or set rollout.partial=off")
        return self

    @model_validator(mode="after")
    def _check_lora(self) -> RunConfig:
        if self.trainer.lora.rank and self.weight_sync.mode != "tensor":
            raise ValueError("trainer.lora.rank > 0 pushes adapter tensors (load_lora_adapter_from_tensors), which "
                             "reflow implements for weight_sync.mode=tensor only (either rollout.backend): set it, "
                             "or trainer.lora.rank=0")
        return self

    @model_validator(mode="after")
    def _check_token_budget(self) -> RunConfig:
        budget, longest = self.trainer.max_tokens_per_micro_batch, self.data.max_prompt_len + self.rollout.max_new_tokens
        if budget is not None and budget < longest:
            raise ValueError(f"trainer.max_tokens_per_micro_batch={budget} cannot hold the longest sample, "
                             f"data.max_prompt_len + rollout.max_new_tokens = {self.data.max_prompt_len} + "
                             f"{self.rollout.max_new_tokens} = {longest} tokens: raise it to at least {longest}")
        return self

    @model_validator(mode="after")
    def _check_batch(self) -> RunConfig:
        samples = self.rollout.prompts_per_iteration * self.rollout.n_samples_per_prompt
        per = self.trainer.num_ranks * self.trainer.minibatches_per_iteration
        if samples % per:
            raise ValueError(
                f"rollout.prompts_per_iteration * rollout.n_samples_per_prompt = {samples} samples "
                f"must divide evenly over trainer.num_ranks * trainer.minibatches_per_iteration = {per}")
        return self


def _strings(node: Any, where: str = "") -> list[tuple[str, str]]:
    """(dotted field, value) of every string in a dumped config; list items are numbered (`eval.sets.0.source`)."""
    if isinstance(node, str):
        return [(where, node)]
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    return [found for key, value in items for found in _strings(value, f"{where}.{key}" if where else str(key))]


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the field and the fix."""


def _parse_value(raw: str) -> Any:
    """`8` -> 8, `1e-4` -> 1e-4, `true` -> True, `null` -> None, `[1,2]` -> list, else the string."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    data = json.loads(json.dumps(data))  # deep copy
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {_shown(repr(item))} is not of the form key.sub=value (e.g. trainer.lr=1e-4)")
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {_shown(repr(item))}: {p!r} is not a section")
        node[parts[-1]] = _parse_value(raw)
    return data


def _echo(error: Any) -> str:
    """` (got <input>)` for an error's message; nothing for a section or an unknown key (a secret put under a
    key reflow does not have, `storage.aws_secret_access_key=...`, would be printed), `(got <redacted>)` under
    a key named like a credential (`reward.token_env`), and never a value with credentials in it."""
    if "input" not in error or isinstance(error["input"], dict) or error["type"] == "extra_forbidden":
        return ""
    if any(secret_name(str(part)) for part in error["loc"]):
        return " (got <redacted>)"
    return f" (got {_shown(repr(error['input']))})"


def _shown(text: str) -> str:
    """`text` for an error message, unless it holds credentials (a refused URL must not be echoed)."""
    return "a value with credentials, not shown" if credential_problem(text) is not None else text


def format_errors(err: ValidationError, source: str, strip: int = 0) -> str:
    """One line per error, `field.path: message (got value)`; `strip` drops leading loc parts (a union's tag)."""
    lines = [f"invalid configuration ({source}):"]
    for e in err.errors():
        parts = [str(x) for x in e["loc"]][strip:]
        if parts[:1] == ["algorithm"] and len(parts) > 1 and parts[1] in SPECS:
            del parts[1]  # the union's tag: `algorithm.lam`, not `algorithm.ppo.lam`
        if e["type"] == CREDENTIALS:  # the message names the field(s) itself
            lines.append(f"  {e['msg']}")
            continue
        loc = ".".join(parts) or "<root>"
        hint = (f"; credentials never go in the config (it is saved in storage and in flow-run parameters): "
                f"for storage, {CREDENTIAL_CHAIN}; for a reward server, {TOKEN_ENV}"
                if e["type"] == "extra_forbidden" and parts and secret_name(parts[-1]) else "")
        lines.append(f"  {loc}: {e['msg']}{_echo(e)}{hint}")
    return "\n".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML experiment file (or the defaults), apply overrides, validate."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist (see configs/ for examples)")
        try:
            data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not UTF-8 text ({e.reason} at byte {e.start}); "
                              f"save it as UTF-8") from None
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
        raise ConfigError(format_errors(e, source)) from None


def dump_config(cfg: RunConfig) -> str:
    return str(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
