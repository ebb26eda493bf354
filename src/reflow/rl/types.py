"""Typed records handed between stages (generate -> reward -> advantages -> train).

Plain Python lists, no tensors: a `RolloutBatch` is what lives in the Ray object store between
stages and what is written as `rollouts.parquet`. `to_train_tensors` turns it into the padded
tensors the trainer consumes.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


@dataclass
class Prompt:
    """One prompt of the dataset: its text, token ids and whatever the verifier needs."""

    index: int  # position in the dataset (the data-loader cursor counts these)
    text: str
    input_ids: list[int]
    label: Any = None  # ground truth handed to the reward function
    metadata: dict[str, Any] = field(default_factory=dict)  # the row's other columns, for a rollout function


@dataclass(frozen=True)
class Sample:
    """One scored sample as a reward function that declares a `sample` parameter receives it
    (reflow.rl.rewards), besides the plain (prompt, response, label)."""

    prompt: str
    response: str  # as decoded by the engine (rollout.skip_special_tokens, rollout.no_stop_trim)
    label: Any
    finish_reason: str  # "stop": a stop token (eos) ended it; "length": it hit max_new_tokens; "abort"
    prompt_tokens: int
    response_tokens: int  # of `response_ids`
    response_ids: tuple[int, ...] = ()  # as the engine returned them (the embedded engine keeps the stop token)
    # What a rollout function (rollout.generate_fn) reported about the trajectory, e.g. tool calls.
    reward_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutBatch:
    """`n` sampled responses for each of P prompts, prompt-major (p0s0..p0s(n-1), p1s0, ...)."""

    group_index: list[int]  # [P*n] which prompt of this batch (0..P-1) the sample belongs to
    prompt_text: list[str]
    prompt_ids: list[list[int]]
    response_text: list[str]
    response_ids: list[list[int]]
    rollout_logprobs: list[list[float]]  # engine logprobs of each response token
    finish_reason: list[str]  # "stop" | "length" | "abort"
    label: list[Any]
    policy_version: int = 0
    rewards: list[float] | None = None
    advantages: list[float] | None = None  # one per sample (GRPO: sequence-level; PPO: first response token's)
    extra: dict[str, Any] = field(default_factory=dict)
    # Token-level (PPO), one float per response token: the critic's V(s_t) before its update,
    # GAE advantages and returns (value targets). See engines/train/critic.py for the alignment.
    values: list[list[float]] | None = None
    token_advantages: list[list[float]] | None = None
    returns: list[list[float]] | None = None
    # Multi-turn rollouts (engines/rollout_fns.py): one 0/1 per response token, 1 where the policy
    # generated it, 0 on tool/environment tokens (no loss, no advantage). None: every token is the policy's.
    response_mask: list[list[int]] | None = None
    reward_info: list[dict[str, Any]] | None = None  # per sample, from the rollout function
    # Partial rollouts (rollout.partial=carry, engines/partial_rollout.py): the policy version that generated each
    # response token; a carried sample's tokens span several. None: every token is `policy_version`'s.
    token_versions: list[list[int]] | None = None

    def __len__(self) -> int:
        return len(self.response_ids)

    def samples(self) -> list[Sample]:
        """One `Sample` per response, in order (what reward functions may look at)."""
        info = self.reward_info or [{}] * len(self)
        return [Sample(p, r, lab, f, len(pi), len(ri), tuple(ri), inf) for p, r, lab, f, pi, ri, inf in zip(
            self.prompt_text, self.response_text, self.label, self.finish_reason, self.prompt_ids, self.response_ids,
            info)]

    def policy_tokens(self) -> list[int]:
        """Per sample, how many response tokens the policy generated (all of them without a mask)."""
        if self.response_mask is None:
            return [len(r) for r in self.response_ids]
        return [sum(1 for m in row if m) for row in self.response_mask]

    @property
    def n_groups(self) -> int:
        return (max(self.group_index) + 1) if self.group_index else 0

    def with_(self, **kw: Any) -> RolloutBatch:
        return replace(self, **kw)

    def select(self, idx: list[int]) -> RolloutBatch:
        """Sub-batch of the given sample positions (used to shard over data-parallel ranks)."""
        def pick(xs: list[T] | None) -> list[T]:  # only the optional fields may be None
            return None if xs is None else [xs[i] for i in idx]  # type: ignore[return-value]

        return RolloutBatch(
            group_index=pick(self.group_index), prompt_text=pick(self.prompt_text),
            prompt_ids=pick(self.prompt_ids), response_text=pick(self.response_text),
            response_ids=pick(self.response_ids), rollout_logprobs=pick(self.rollout_logprobs),
            finish_reason=pick(self.finish_reason), label=pick(self.label),
            policy_version=self.policy_version, rewards=pick(self.rewards),
            advantages=pick(self.advantages), extra=dict(self.extra), values=pick(self.values),
            token_advantages=pick(self.token_advantages), returns=pick(self.returns),
            response_mask=pick(self.response_mask), reward_info=pick(self.reward_info),
            token_versions=pick(self.token_versions),
        )


def to_train_tensors(batch: RolloutBatch, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors for a causal LM forward pass over prompt+response.

    Position t of the `[B, T-1]` tensors scores token t+1 of `input_ids` (the usual shift):
    `loss_mask` is 1 exactly where that token is a response token the policy generated (a
    `response_mask` 0 — a tool/environment token of a multi-turn rollout — leaves it 0, so that token
    gets no loss, no gradient and no weight in any aggregation). Token-level fields (PPO) land on
    every response position: `old_values`, `returns`, and `advantages` as [B, T-1] instead of [B].
    """
    import torch  # here, not at the top: Ray task workers import this module for the batch alone (~1.7 s of CPU less)

    seqs = [p + r for p, r in zip(batch.prompt_ids, batch.response_ids)]
    B, T = len(seqs), max(len(s) for s in seqs)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((B, T), dtype=torch.long)  # [B, T]
    loss_mask = torch.zeros((B, T - 1), dtype=torch.float32)  # [B, T-1]
    rollout_lp = torch.zeros((B, T - 1), dtype=torch.float32)  # [B, T-1]
    for i, (p, r) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
        n = len(p) + len(r)
        input_ids[i, :n] = torch.tensor(p + r, dtype=torch.long)
        attention_mask[i, :n] = 1
        if r:
            loss_mask[i, len(p) - 1 : n - 1] = _response_mask(batch, i)
            rollout_lp[i, len(p) - 1 : n - 1] = torch.tensor(batch.rollout_logprobs[i], dtype=torch.float32)
    out = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
           "rollout_logprobs": rollout_lp}
    if batch.response_mask is not None:  # every response position, tool tokens included (the critic's values)
        out["response_positions"] = _on_response_tokens([[1.0] * len(r) for r in batch.response_ids], batch, T)
    if batch.advantages is not None:
        out["advantages"] = torch.tensor(batch.advantages, dtype=torch.float32)  # [B]
    for key, rows in (("old_values", batch.values), ("returns", batch.returns),
                      ("advantages", batch.token_advantages)):
        if rows is not None:
            out[key] = _on_response_tokens(rows, batch, T)  # [B, T-1]
    return out


def _response_mask(batch: RolloutBatch, i: int) -> torch.Tensor | float:
    """Sample i's loss mask over its response tokens: 1.0, or its `response_mask` row as floats."""
    import torch

    if batch.response_mask is None:
        return 1.0
    row = batch.response_mask[i]
    if len(row) != len(batch.response_ids[i]):
        raise ValueError(f"sample {i}: response_mask has {len(row)} entries for {len(batch.response_ids[i])} "
                         f"response tokens")
    return torch.tensor([1.0 if m else 0.0 for m in row], dtype=torch.float32)


def _on_response_tokens(rows: list[list[float]], batch: RolloutBatch, T: int) -> torch.Tensor:
    """Per-response-token values [B][len(response)] placed where `loss_mask` is 1 -> [B, T-1]."""
    import torch

    out = torch.zeros((len(rows), T - 1), dtype=torch.float32)  # [B, T-1]
    for i, (p, r, row) in enumerate(zip(batch.prompt_ids, batch.response_ids, rows)):
        if len(row) != len(r):
            raise ValueError(f"sample {i}: {len(row)} token values for {len(r)} response tokens")
        if r:
            out[i, len(p) - 1 : len(p) + len(r) - 1] = torch.tensor(row, dtype=torch.float32)
    return out
