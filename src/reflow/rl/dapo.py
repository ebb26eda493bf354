"""DAPO rollout-side tricks (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning
System at Scale", arXiv 2503.14476): soft overlong punishment (§3.4, R_length of eq. 13) and
dynamic sampling (§3.2, the constraint 0 < |{o_i correct}| < G of the DAPO objective).
Plain Python over `RolloutBatch`; no ray.

Departures: the dynamic-sampling filter keeps groups whose *final* reward (after the overlong
penalty) is not constant, rather than counting correct answers — identical for 0/1 rewards
without the penalty, and the same rule verl applies with metric=seq_final_reward. When the cap on
extra rounds is reached, the batch is topped up with the filtered (zero-signal) groups so its size
stays fixed; their advantages are 0, so they only dilute a token-mean normaliser.
"""
from __future__ import annotations

from typing import Any

from reflow.rl.types import RolloutBatch


def overlong_penalty(length: int, max_len: int, buffer: int, factor: float) -> float:
    """DAPO eq. 13 scaled by `factor`: 0 up to max_len - buffer tokens, then linear to -factor at
    max_len, and -factor beyond. buffer == 0 disables it (returns 0)."""
    if buffer <= 0:
        return 0.0
    start = max_len - buffer
    if length <= start:
        return 0.0
    if length <= max_len:
        return factor * (start - length) / buffer
    return -factor


def groups_with_spread(batch: RolloutBatch) -> tuple[list[int], list[int]]:
    """(group ids whose rewards are not all equal, group ids whose rewards are), in batch order."""
    if batch.rewards is None:
        raise ValueError("dynamic sampling needs batch.rewards: score the batch first")
    by_group: dict[int, list[float]] = {}
    for g, r in zip(batch.group_index, batch.rewards):
        by_group.setdefault(g, []).append(r)
    keep = [g for g, rs in by_group.items() if max(rs) != min(rs)]
    drop = [g for g, rs in by_group.items() if max(rs) == min(rs)]
    return keep, drop


def select_groups(batch: RolloutBatch, groups: list[int]) -> RolloutBatch:
    """The samples of `groups` (in that order), group ids renumbered 0..len(groups)-1."""
    rank = {g: i for i, g in enumerate(groups)}
    idx = [i for g in groups for i, gi in enumerate(batch.group_index) if gi == g]
    out = batch.select(idx)
    return out.with_(group_index=[rank[g] for g in out.group_index])


def concat(batches: list[RolloutBatch]) -> RolloutBatch:
    """Batches one after another, group ids shifted so they stay distinct."""
    first, offset, gi = batches[0], 0, []
    for b in batches:
        gi += [g + offset for g in b.group_index]
        offset += b.n_groups

    def cat(name: str) -> list[Any] | None:
        return None if getattr(first, name) is None else [x for b in batches for x in getattr(b, name)]

    fields = ("prompt_text", "prompt_ids", "response_text", "response_ids", "rollout_logprobs",
              "finish_reason", "label", "rewards", "advantages", "values", "token_advantages", "returns",
              "response_mask", "reward_info")
    return first.with_(group_index=gi, **{f: cat(f) for f in fields})


def fill_groups(rounds: list[RolloutBatch], target: int) -> tuple[RolloutBatch, int]:
    """Exactly `target` groups: informative groups of every round first (round order), then, if
    fewer than `target`, zero-spread ones. Returns (batch, number of zero-spread groups used)."""
    kept, dropped = [], []
    for b in rounds:
        keep, drop = groups_with_spread(b)
        kept += [select_groups(b, [g]) for g in keep]
        dropped += [select_groups(b, [g]) for g in drop]
    chosen = kept[:target]
    filler = dropped[: target - len(chosen)]
    if len(chosen) + len(filler) < target:
        raise ValueError(f"dynamic sampling: only {len(chosen) + len(filler)} groups for a batch of {target}")
    return concat(chosen + filler), len(filler)
