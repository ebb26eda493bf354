"""Rollout-side work that runs inside Ray (remote functions), so batches stay in the object store.

generate -> score (reward) -> advantages, each taking and returning a `RolloutBatch`, plus small
stat dicts for the driver. The engines are reached only through `EngineClient` over SGLang's
HTTP API, so the same code drives the embedded engine and a real SGLang server.
"""
from __future__ import annotations

import math
from typing import Any

import pandas as pd
import torch

from engines.rollout_client import EngineClient, generate_batch
from rl.advantages import grpo_advantages
from rl.rewards import compute_rewards, load_reward_fn
from rl.types import Prompt, RolloutBatch


def sampling_params(temperature: float, top_p: float, top_k: int, max_new_tokens: int,
                    stop_token_ids: list[int] | None = None) -> dict[str, Any]:
    """SGLang `sampling_params` (only keys SGLang accepts)."""
    sp: dict[str, Any] = {"temperature": temperature, "top_p": top_p, "top_k": top_k,
                          "max_new_tokens": max_new_tokens}
    if stop_token_ids:
        sp["stop_token_ids"] = list(stop_token_ids)
    return sp


def generate(urls: list[str], prompts: list[Prompt], sp: dict[str, Any], n: int, version: int,
             timeout: float) -> RolloutBatch:
    clients = [EngineClient(u, timeout=timeout) for u in urls]
    outs = generate_batch(clients, [p.input_ids for p in prompts], sp, n)
    if len(outs) != len(prompts) * n:
        raise RuntimeError(f"engines returned {len(outs)} samples for {len(prompts)} prompts x n={n}")
    gi = [i // n for i in range(len(outs))]
    return RolloutBatch(
        group_index=gi,
        prompt_text=[prompts[g].text for g in gi],
        prompt_ids=[prompts[g].input_ids for g in gi],
        response_text=[o["text"] for o in outs],
        response_ids=[list(o["output_ids"]) for o in outs],
        rollout_logprobs=[[lp[0] for lp in o["meta_info"].get("output_token_logprobs", [])] for o in outs],
        finish_reason=[o["meta_info"]["finish_reason"]["type"] for o in outs],
        label=[prompts[g].label for g in gi],
        policy_version=version,
    )


def score(batch: RolloutBatch, reward_fn: str) -> tuple[RolloutBatch, dict[str, float]]:
    fn = load_reward_fn(reward_fn)
    rewards = compute_rewards(fn, batch.prompt_text, batch.response_text, batch.label)
    lengths = [len(r) for r in batch.response_ids]
    stats = {
        "reward_mean": sum(rewards) / max(len(rewards), 1),
        "response_len_mean": sum(lengths) / max(len(lengths), 1),
        "response_len_max": float(max(lengths, default=0)),
        "truncated_frac": sum(f == "length" for f in batch.finish_reason) / max(len(batch), 1),
    }
    return batch.with_(rewards=rewards), stats


def advantages(batch: RolloutBatch, normalize_std: bool) -> tuple[RolloutBatch, dict[str, float]]:
    r = torch.tensor(batch.rewards, dtype=torch.float32)  # [N]
    g = torch.tensor(batch.group_index, dtype=torch.long)  # [N]
    adv = grpo_advantages(r, g, normalize_std=normalize_std)  # [N]
    n_groups = batch.n_groups
    spread = sum(1 for k in range(n_groups) if r[g == k].unique().numel() > 1)
    stats = {"adv_abs_mean": adv.abs().mean().item() if len(adv) else 0.0,
             "groups_with_signal_frac": spread / max(n_groups, 1)}
    if not all(math.isfinite(a) for a in adv.tolist()):
        raise FloatingPointError("advantages contain NaN/inf; rewards were " + repr(batch.rewards[:16]))
    return batch.with_(advantages=adv.tolist()), stats


def rollout_table(batch: RolloutBatch) -> pd.DataFrame:
    """The per-sample record written as rollouts.parquet."""
    return pd.DataFrame({
        "group": batch.group_index,
        "prompt": batch.prompt_text,
        "response": batch.response_text,
        "prompt_tokens": [len(p) for p in batch.prompt_ids],
        "response_tokens": [len(r) for r in batch.response_ids],
        "reward": batch.rewards if batch.rewards is not None else [float("nan")] * len(batch),
        "advantage": batch.advantages if batch.advantages is not None else [float("nan")] * len(batch),
        "finish_reason": batch.finish_reason,
        "label": [str(x) for x in batch.label],
        "policy_version": [batch.policy_version] * len(batch),
    })
