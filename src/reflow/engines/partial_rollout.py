"""Partial rollouts (`rollout.partial`): a long tail that does not stall the batch.

`off` (the default) waits for every sample of the iteration's prompts. `carry` and `drop` keep a pool of
`prompts_per_iteration * (1 + over_sample)` groups in flight and close the batch on the first
`prompts_per_iteration` groups whose every sample has finished (the first complete ones in pool order: the
oldest carried first, then the new ones by prompt). `carry` keeps the other groups, finished or not, for the
next iteration's pool with their tokens so far, their engine log-probs and the policy version that
generated each token; the next iteration continues them under the new policy and tops the pool up with new
prompts. `drop` discards them (over-sampling).

How the engines close a batch:
- reflow's embedded engine: one closing call per engine (POST /reflow/generate_closing; the engine's
  generator counts each group's finished samples at every step and, once its share of the groups is
  complete, cuts the rest where they are). The batch closes at the very step the last needed group
  completes: no sample waits for anything longer than the groups trained on.
- SGLang (no such call): rounds of at most `partial_chunk_tokens` new tokens a sample; after each round the
  complete groups are counted. Each round waits for its longest sample and sends every continued sample's
  prompt + tokens so far again (SGLang's radix cache keeps most of those prefixes).

A carried sample trains on tokens of several policy versions; the trainer's truncated importance
sampling (algorithm.tis_cap, 2.0 when unset) corrects each token by its own engine log-prob, as it
does an asynchronous run's stale batches (slime's partial rollout and AReaL's interruptible generation
do the same; the token-level versions are what those call the behaviour policy per token).

Closing depends only on token counts, never on wall-clock time: a continued sample is sent with
`max_new_tokens` = what it has left (a round: at most the chunk), and with seeded sampling a sample's token
at position t is a function of (its seed, t) on the embedded engine (SGLang's `sampling_seed` likewise), so a
continued sample draws what an uninterrupted one would under the same weights; where a closing call cuts
depends on the same counts. A resumed run (the carry is in the checkpoint, tasks/checkpoint.py) therefore
regenerates exactly.

`engine_idle_fraction` counts, in row-steps, the rows that had finished while their call (round, closing call,
or for `off` the whole batch) still decoded others, so the modes compare.
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from reflow.engines.rollout_client import (
    CLOSED,
    EngineClient,
    EngineError,
    generate_batch,
    lora_fields,
    result_logprobs,
    shard_bounds,
)
from reflow.rl.types import Prompt, RolloutBatch


@dataclass(frozen=True)
class PartialSettings:
    """rollout.partial, rollout.partial_chunk_tokens, rollout.over_sample and the batch's size."""

    mode: str  # "carry" | "drop"
    chunk_tokens: int  # new tokens a sample generates per round at most
    target_groups: int  # prompts_per_iteration: the groups a batch trains on
    pool_groups: int  # groups in flight: target_groups * (1 + over_sample), rounded up
    closing: bool = False  # one closing call per engine instead of rounds (reflow's embedded engine)

    @classmethod
    def of(cls, mode: str, chunk_tokens: int, prompts_per_iteration: int, over_sample: float,
           closing: bool = False) -> PartialSettings:
        return cls(mode, chunk_tokens, prompts_per_iteration, math.ceil(prompts_per_iteration * (1 + over_sample)),
                   closing)


def new_groups(pool: int, carried: list[dict]) -> int:
    """How many groups of new prompts join an iteration's pool beside the carried ones (never fewer than 0)."""
    return max(pool - len(carried), 0)


def _group(prompt: Prompt, n: int, seeds: list[int] | None) -> dict:
    """A new group: n empty samples of `prompt`. Plain JSON-able data (the carry is saved in checkpoints)."""
    return {"prompt_index": prompt.index, "prompt_text": prompt.text, "prompt_ids": list(prompt.input_ids),
            "label": prompt.label,
            "samples": [{"seed": None if seeds is None else int(seeds[j]), "ids": [], "logprobs": [], "versions": [],
                         "text": "", "finish": None} for j in range(n)]}


def check_carry(carry: Any, n: int, where: str) -> list[dict]:
    """A carry read back (from a checkpoint's state.json or a stage record): its shape, or a clear error."""
    if not isinstance(carry, list):
        raise ValueError(f"{where}: the rollout carry is {type(carry).__name__}, expected a list of groups")
    for i, g in enumerate(carry):
        ok = (isinstance(g, dict) and isinstance(g.get("prompt_ids"), list) and isinstance(g.get("samples"), list)
              and len(g["samples"]) == n
              and all(isinstance(s, dict) and len(s.get("ids", ())) == len(s.get("logprobs", ()))
                      == len(s.get("versions", ())) for s in g["samples"]))
        if not ok:
            raise ValueError(f"{where}: carried group {i} is malformed (expected {n} samples, each with as many "
                             f"ids as logprobs and versions); delete it or resume with rollout.partial=off")
    return carry


def _done(s: dict) -> bool:
    return s["finish"] is not None


def _apply(active: list[tuple[dict, dict]], outs: list[dict], version: int, max_new: int) -> list[int]:
    """Append each result to its sample (tokens, engine log-probs, this version per token); a sample is finished
    unless it stopped at its call's token limit short of max_new, or was cut by a closing call. Returns the tokens
    each got."""
    got = []
    for (_, s), o in zip(active, outs):
        new = list(o["output_ids"])
        s["ids"] += new
        s["logprobs"] += result_logprobs(o)
        s["versions"] += [version] * len(new)
        s["text"] += o["text"]
        reason = o["meta_info"]["finish_reason"]
        kind = reason["type"]
        cut = kind == "abort" and reason.get("message") == CLOSED
        if not cut and (kind != "length" or len(s["ids"]) >= max_new):
            s["finish"] = kind
        got.append(len(new))
    return got


def _entry(g: dict, s: dict, sampling: dict[str, Any], max_new_tokens: int) -> tuple[list[int], dict[str, Any]]:
    """The request entry that continues sample `s` of group `g`: its prompt + tokens so far, its own seed."""
    return g["prompt_ids"] + s["ids"], {**sampling, "n": 1, "max_new_tokens": max_new_tokens,
                                         **({} if s["seed"] is None else {"sampling_seed": s["seed"]})}


def _round(clients: list[EngineClient], active: list[tuple[dict, dict]], sampling: dict[str, Any], version: int,
           chunk: int, max_new: int, lora_path: str | None) -> list[list[int]]:
    """One round: every unfinished sample continues for at most `chunk` tokens. Returns the tokens each got."""
    entries = [_entry(g, s, sampling, min(chunk, max_new - len(s["ids"]))) for g, s in active]
    outs = generate_batch(clients, [e[0] for e in entries], [e[1] for e in entries], 1, lora_path=lora_path)
    return [_apply(active, outs, version, max_new)]


def _closing(clients: list[EngineClient], pool: list[dict], need: int, sampling: dict[str, Any], version: int,
             max_new: int, lora_path: str | None) -> list[list[int]]:
    """One closing call per engine (reflow's embedded engine: EngineClient.generate_closing) over the incomplete
    groups, split between the engines by group: each engine runs its unfinished samples to their ends and stops
    once its share of the `need` groups is complete (the share in proportion to its groups, rounded up), cutting
    the rest where they are. Returns the tokens each sample got, per engine."""
    groups = [g for g in pool if not all(_done(s) for s in g["samples"])]
    shards = shard_bounds(len(groups), len(clients))

    def run(client: EngineClient, lo: int, hi: int) -> list[int]:
        mine = groups[lo:hi]
        at = [(k, g, s) for k, g in enumerate(mine) for s in g["samples"] if not _done(s)]  # k: its group's id
        active = [(g, s) for _, g, s in at]
        entries = [_entry(g, s, sampling, max_new - len(s["ids"])) for g, s in active]
        complete = min(len(mine), math.ceil(need * len(mine) / len(groups)))
        outs = client.generate_closing([e[0] for e in entries], [e[1] for e in entries], [k for k, _, _ in at],
                                       complete, **lora_fields(lora_path))
        if not isinstance(outs, list) or len(outs) != len(active):
            raise EngineError(client.url, "/reflow/generate_closing", 200, f"expected {len(active)} results")
        return _apply(active, outs, version, max_new)

    with ThreadPoolExecutor(max_workers=len(shards)) as ex:
        futures = [ex.submit(run, clients[i], lo, hi) for i, (lo, hi) in enumerate(shards)]
        return [f.result() for f in futures]


def roll(clients: list[EngineClient], settings: PartialSettings, sampling: dict[str, Any], n: int, version: int,
         carried: list[dict], prompts: list[Prompt], seeds: list[int] | None,
         lora_path: str | None = None) -> tuple[RolloutBatch, list[dict], dict[str, float]]:
    """Generate over the pool (the `carried` groups, then one group per new prompt) until
    `settings.target_groups` groups are complete: in rounds of `settings.chunk_tokens`, or with
    `settings.closing` (reflow's embedded engine) in one closing call per engine; returns (the batch of those groups, the carry
    for the next iteration: [] with mode drop, the statistics)."""
    max_new = int(sampling["max_new_tokens"])
    pool = [dict(g, samples=[dict(s, ids=list(s["ids"]), logprobs=list(s["logprobs"]), versions=list(s["versions"]))
                             for s in g["samples"]]) for g in carried]
    pool += [_group(p, n, None if seeds is None else seeds[k * n:(k + 1) * n]) for k, p in enumerate(prompts)]
    if len(pool) < settings.target_groups:
        raise ValueError(f"partial rollout: {len(pool)} groups in the pool for {settings.target_groups} to train")
    rounds, row_steps, tokens = 0, 0, 0
    while (have := sum(all(_done(s) for s in g["samples"]) for g in pool)) < settings.target_groups:
        if settings.closing:
            per_engine = _closing(clients, pool, settings.target_groups - have, sampling, version, max_new, lora_path)
        else:
            active = [(g, s) for g in pool for s in g["samples"] if not _done(s)]
            per_engine = _round(clients, active, sampling, version, settings.chunk_tokens, max_new, lora_path)
        rounds += 1
        row_steps += sum(len(got) * max(got, default=0) for got in per_engine)  # an engine's rows run in lockstep
        tokens += sum(sum(got) for got in per_engine)
    complete = [g for g in pool if all(_done(s) for s in g["samples"])][:settings.target_groups]
    taken = {id(g) for g in complete}
    rest = [g for g in pool if id(g) not in taken]
    batch = _batch(complete, n, version)
    stats = {"partial_rounds": float(rounds), "engine_idle_fraction": idle_fraction(tokens, row_steps),
             "carried_samples": float(sum(min(s["versions"], default=version) < version
                                          for g in complete for s in g["samples"])),
             "carry_out_groups": float(len(rest) if settings.mode == "carry" else 0),
             "dropped_groups": float(len(rest) if settings.mode == "drop" else 0),
             "new_groups": float(len(prompts))}
    return batch, (rest if settings.mode == "carry" else []), stats


def _batch(groups: list[dict], n: int, version: int) -> RolloutBatch:
    """The trained groups as a RolloutBatch (group g's samples at g*n..g*n+n-1), with each token's version."""
    rows = [(gi, g, s) for gi, g in enumerate(groups) for s in g["samples"]]
    return RolloutBatch(
        group_index=[gi for gi, _, _ in rows], prompt_text=[g["prompt_text"] for _, g, _ in rows],
        prompt_ids=[list(g["prompt_ids"]) for _, g, _ in rows], response_text=[s["text"] for _, _, s in rows],
        response_ids=[list(s["ids"]) for _, _, s in rows], rollout_logprobs=[list(s["logprobs"]) for _, _, s in rows],
        finish_reason=[s["finish"] for _, _, s in rows], label=[g["label"] for _, g, _ in rows],
        policy_version=version, token_versions=[list(s["versions"]) for _, _, s in rows])


def idle_fraction(tokens: int, row_steps: int) -> float:
    """The share of row-steps in which a row had already finished while its round (or batch) decoded others."""
    return 0.0 if row_steps <= 0 else 1.0 - tokens / row_steps


def lengths_stats(lengths: list[int]) -> dict[str, float]:
    """Response-length percentiles (p50, p90, p99, nearest rank) and the one-round idle fraction of
    waiting for the longest: what `off` costs on this batch."""
    if not lengths:
        return {}
    xs = sorted(lengths)

    def pct(q: float) -> float:
        return float(xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))])

    return {"response_len_p50": pct(0.5), "response_len_p90": pct(0.9), "response_len_p99": pct(0.99),
            "wait_all_idle_fraction": idle_fraction(sum(xs), len(xs) * xs[-1])}
