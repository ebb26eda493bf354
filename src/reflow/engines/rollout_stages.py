"""Rollout-side work that runs inside Ray (remote functions), so batches stay in the object store.

generate -> score (reward) -> advantages, each taking and returning a `RolloutBatch`, plus small
stat dicts for the driver; an eval set's generation, scoring and records; a batch's records.

The engines are reached only through `EngineClient` over SGLang's HTTP API, so the same code drives the embedded
engine and a real SGLang server.

Every function a Ray task runs lives here (or in another module without Prefect and the runtime): a task worker
imports the module of the function it runs, and those of the tasks/ side (Prefect, the runtime, the engine classes)
cost a worker ~3.5 s of CPU against ~1.5 s for this one, in every task worker of every run.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from reflow.engines import partial_rollout
from reflow.engines.gc_freeze import freeze_long_lived
from reflow.engines.partial_rollout import lengths_stats
from reflow.engines.rollout_client import EngineClient, generate_batch, result_logprobs
from reflow.engines.rollout_fns import DEFAULT as DEFAULT_ROLLOUT_FN
from reflow.engines.rollout_fns import BatchRequest, RolloutSettings, rollout_with_fn
from reflow.engines.weights.lora import adapter_name
from reflow.rl.dapo import fill_groups, groups_with_spread, overlong_penalty
from reflow.rl.metrics import eval_summary
from reflow.rl.rewards import DEFAULT_FN_TIMEOUT_S
from reflow.rl.scorers import Scorer, as_scorer, score_samples
from reflow.rl.types import RolloutBatch

if TYPE_CHECKING:  # at run time only where used: pandas for the tables, reflow.rl.algorithms (torch) for advantages
    import pandas as pd

    from reflow.rl.algorithms.base import AlgorithmBase


class RecordStore(Protocol):
    """Where the records of a batch or an eval set go: infra/store/storage.ExperimentStore (engines sit below infra)."""

    def write_parquet(self, rel: str, df: pd.DataFrame) -> str: ...

    def write_json(self, rel: str, obj: Any) -> str: ...


def sampling_params(temperature: float, top_p: float, top_k: int, max_new_tokens: int,
                    stop_token_ids: list[int] | None = None, skip_special_tokens: bool = True,
                    no_stop_trim: bool = False) -> dict[str, Any]:
    """SGLang `sampling_params` (only keys SGLang accepts). skip_special_tokens / no_stop_trim decide
    the response text only (special tokens dropped when decoding; the stop token cut from the end)."""
    sp: dict[str, Any] = {"temperature": temperature, "top_p": top_p, "top_k": top_k,
                          "max_new_tokens": max_new_tokens, "skip_special_tokens": skip_special_tokens,
                          "no_stop_trim": no_stop_trim}
    if stop_token_ids:
        sp["stop_token_ids"] = list(stop_token_ids)
    return sp


def sample_seeds(seed: int, version: int, count: int) -> list[int]:
    """One sampling_seed per sample, a pure function of (seed, version, sample index), so a resumed
    run samples exactly what the uninterrupted one did, whatever the engine's batching."""
    def one(j: int) -> int:
        digest = hashlib.sha256(f"reflow-sample:{seed}:{version}:{j}".encode()).digest()
        return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF
    return [one(j) for j in range(count)]


def generate(settings: RolloutSettings, batch: BatchRequest, carry: list[dict] | None = None) -> RolloutBatch:
    """n samples per prompt, prompt-major, by the engines' policy `batch.version`. With `settings.seed`,
    every sample gets its own sampling_seed (see `sample_seeds`; keyed by `batch.seed_key`, default the
    version); without, the engines' own random state decides. `settings.generate_fn` (rollout.generate_fn):
    the default single-turn rollout goes as one batched request per engine; any other function runs once
    per sample (engines/rollout_fns.py). `settings.adapter`: the engines hold the version as a LoRA
    adapter (trainer.lora.rank > 0), which every request names. `settings.partial` (rollout.partial carry|drop):
    rounds over the pool of the `carry` groups and new ones from `batch.prompts` (engines/partial_rollout.py);
    the carry for the next batch is `extra["carry"]`, the rounds' statistics `extra["partial_stats"]`."""
    s, version = settings, batch.version
    key = version if batch.seed_key is None else batch.seed_key
    seeds = sample_seeds(s.seed, key, len(batch.prompts) * s.n) if s.seed is not None else None
    lora_path = adapter_name(version) if s.adapter else None
    t0 = time.perf_counter()
    if s.partial is not None:
        out = _partial(s, batch, seeds, lora_path, carry or [])
    elif s.generate_fn != DEFAULT_ROLLOUT_FN:
        out = rollout_with_fn(s, batch, seeds, lora_path)
    else:
        out = _one_turn(s, batch, seeds, lora_path)
    # how long the engines took, wherever it ran: a generation launched ahead or in the background is
    # waited for by its `generate` task for less (time_generate), and throughput is counted over this
    out.extra["generate_s"] = time.perf_counter() - t0
    return out


def generate_timed(settings: RolloutSettings, batch: BatchRequest,
                   carry: list[dict] | None = None) -> tuple[RolloutBatch, dict[str, float]]:
    """The batch, and how long the engines took to generate it: as the rollout task saw it (requests,
    answers, the batch built) and inside the engine servers (their longest answer's e2e_latency, 0 when
    an engine reports none); its response-length percentiles and the engines' idle share of row-steps
    (engines/partial_rollout.py), with partial rollouts the rounds' statistics. Two returns, so the caller
    waits for the small one without fetching the batch into another task (one Ray task and a batch
    transfer less per rollout)."""
    before = decode_clock(settings)
    out = generate(settings, batch, carry)
    lengths = lengths_stats([len(r) for r in out.response_ids])
    idle = {"engine_idle_fraction": lengths.get("wait_all_idle_fraction", 0.0)}
    return out, {"generate_engine_s": float(out.extra.get("generate_s", 0.0)),
                 "generate_server_s": float(out.extra.get("server_s", 0.0)), **lengths, **idle,
                 **out.extra.get("partial_stats", {}), **decode_stats(before, decode_clock(settings))}


def decode_clock(settings: RolloutSettings) -> dict[str, float] | None:
    """The engines' decode-loop clocks summed (the embedded engine's /server_info `decode_time`: steps, the loop's
    seconds, the seconds its host sat waiting for the device); None where an engine keeps none (SGLang) or does
    not answer (the batch's own requests then say what is wrong)."""
    total = {"steps": 0.0, "loop_s": 0.0, "device_wait_s": 0.0}
    for url in settings.urls:
        client = EngineClient(url, timeout=2.0, api_key=settings.api_key)  # a figure: never worth a long wait
        try:
            clock = client.server_info().get("decode_time")
        except Exception:  # noqa: BLE001 - a statistic, never a reason to fail the batch
            return None
        finally:
            client.close()
        if not isinstance(clock, dict):
            return None
        for key in total:
            total[key] += float(clock.get(key, 0.0))
    return total


def decode_stats(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    """What the engines' decode loops did between two clocks (`decode_clock`): steps, ms a step, and the share of
    the loop's wall the host waited for the device (near 0: the loop is host-bound; near 1: device-bound). Other
    requests served meanwhile (an evaluation beside the rollout) are counted too. {} without both clocks."""
    if before is None or after is None:
        return {}
    steps, wall, wait = (after[k] - before[k] for k in ("steps", "loop_s", "device_wait_s"))
    if steps <= 0 or wall <= 0:
        return {}
    return {"decode_steps": steps, "decode_ms_per_step": 1000.0 * wall / steps,
            "decode_device_wait_share": wait / wall}


def carry_of(batch: RolloutBatch) -> list[dict]:
    """The groups a partial rollout's batch leaves for the next one (rollout.partial=carry), [] without."""
    return list(batch.extra.get("carry", []))


def _partial(s: RolloutSettings, batch: BatchRequest, seeds: list[int] | None, lora_path: str | None,
             carry: list[dict]) -> RolloutBatch:
    """Partial rollouts: rounds over the carried groups and as many new ones from `batch.prompts` as the pool lacks."""
    assert s.partial is not None
    clients = [EngineClient(u, timeout=s.timeout_s, api_key=s.api_key) for u in s.urls]
    carry = partial_rollout.check_carry(carry, s.n, "the carry of the previous batch")
    m = partial_rollout.new_groups(s.partial.pool_groups, carry)
    if m > len(batch.prompts):
        raise ValueError(f"partial rollout: {len(batch.prompts)} new prompts for {m} groups to start")
    out, rest, stats = partial_rollout.roll(clients, s.partial, s.sampling, s.n, batch.version, carry,
                                            batch.prompts[:m], None if seeds is None else seeds[:m * s.n], lora_path)
    out.extra.update(carry=rest, partial_stats=stats)
    return out


def _one_turn(s: RolloutSettings, batch: BatchRequest, seeds: list[int] | None, lora_path: str | None) -> RolloutBatch:
    """The default rollout: one batched request per engine."""
    prompts, n = batch.prompts, s.n
    clients = [EngineClient(u, timeout=s.timeout_s, api_key=s.api_key) for u in s.urls]
    outs = generate_batch(clients, [p.input_ids for p in prompts], s.sampling, n, seeds=seeds, lora_path=lora_path)
    if len(outs) != len(prompts) * n:
        raise RuntimeError(f"engines returned {len(outs)} samples for {len(prompts)} prompts x n={n}")
    gi = [i // n for i in range(len(outs))]
    out = RolloutBatch(
        group_index=gi,
        prompt_text=[prompts[g].text for g in gi],
        prompt_ids=[prompts[g].input_ids for g in gi],
        response_text=[o["text"] for o in outs],
        response_ids=[list(o["output_ids"]) for o in outs],
        rollout_logprobs=[result_logprobs(o) for o in outs],
        finish_reason=[o["meta_info"]["finish_reason"]["type"] for o in outs],
        label=[prompts[g].label for g in gi],
        policy_version=batch.version,
    )
    out.extra["server_s"] = max((float(o["meta_info"].get("e2e_latency") or 0.0) for o in outs), default=0.0)
    return out


def score(batch: RolloutBatch, reward_fn: Scorer | str, max_new_tokens: int = 0, overlong_buffer: int = 0,
          overlong_factor: float = 0.0,
          fn_timeout_s: float = DEFAULT_FN_TIMEOUT_S) -> tuple[RolloutBatch, dict[str, float]]:
    """Rewards from the scorer plus DAPO's soft overlong penalty (0 when the buffer is 0).

    `reward_fn` is a `reflow.rl.scorers.Scorer` (`reward_source` of the config), or a `module:function`
    string; a function's calls each get `fn_timeout_s` (reward.fn_timeout_s).
    `reward_mean` reports the reward function alone (task accuracy); the batch carries the sum, and
    the stats the means of the extra metrics a scorer returned (`reward/<key>`).
    """
    rewards, metrics = score_samples(as_scorer(reward_fn), batch.samples(), fn_timeout_s)
    lengths = [len(r) for r in batch.response_ids]
    penalty = [overlong_penalty(n, max_new_tokens, overlong_buffer, overlong_factor) for n in lengths]
    stats = {
        "reward_mean": sum(rewards) / max(len(rewards), 1),
        "overlong_penalty_mean": sum(penalty) / max(len(penalty), 1),
        "response_len_mean": sum(lengths) / max(len(lengths), 1),
        "response_len_max": float(max(lengths, default=0)),
        "truncated_frac": sum(f == "length" for f in batch.finish_reason) / max(len(batch), 1),
        **metrics,
    }
    return batch.with_(rewards=[r + p for r, p in zip(rewards, penalty)]), stats


def dynamic_fill(first: RolloutBatch, settings: RolloutSettings, rounds: list[BatchRequest], reward_fn: Scorer | str,
                 score_kw: dict[str, Any], target_groups: int) -> tuple[RolloutBatch, dict[str, float]]:
    """DAPO dynamic sampling: generate and score the extra `rounds` one by one until the scored `first`
    batch plus the extra rounds hold `target_groups` groups with reward spread (or the rounds run out),
    then keep exactly `target_groups` groups (`reflow.rl.dapo.fill_groups`). With
    `settings.seed`, round r samples with seed + 7919 * r, so a resumed run redraws the same rounds."""
    extra = rounds
    rounds = [first]
    informative = len(groups_with_spread(first)[0])
    for r, request in enumerate(extra, start=1):
        if informative >= target_groups:
            break
        round_settings = settings if settings.seed is None else replace(settings, seed=settings.seed + 7919 * r)
        scored, _ = score(generate(round_settings, request), reward_fn, **score_kw)
        rounds.append(scored)
        informative += len(groups_with_spread(scored)[0])
    batch, filler = fill_groups(rounds, target_groups)
    return batch, {"sampling_rounds": float(len(rounds)), "dynamic_filler_groups": float(filler),
                   "first_round_signal_frac": len(groups_with_spread(first)[0]) / max(first.n_groups, 1)}


def advantages(batch: RolloutBatch, algorithm: AlgorithmBase) -> tuple[RolloutBatch, dict[str, float]]:
    """The advantages of `algorithm` (its spec's function, reflow.rl.algorithms) on the whole batch."""
    return algorithm.spec.advantages(batch, algorithm)


def rollout_table(batch: RolloutBatch) -> pd.DataFrame:
    """The per-sample record written as rollouts.parquet."""
    import pandas as pd  # here: a worker that writes no table does without it

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
        **_trajectory_columns(batch),
        **_version_columns(batch),
    })


def _version_columns(batch: RolloutBatch) -> dict[str, list]:
    """Partial rollouts only: the version of each response token and the oldest of them (a carried sample's
    tokens began under an older policy than the batch's `policy_version`)."""
    if batch.token_versions is None:
        return {}
    return {"token_versions": [list(v) for v in batch.token_versions],
            "first_version": [min(v, default=batch.policy_version) for v in batch.token_versions]}


def write_rollout_table(batch: RolloutBatch, store: RecordStore, rel: str) -> str:
    """Write a batch's per-sample table (rollouts.parquet) from inside Ray: the batch never reaches the driver."""
    return store.write_parquet(rel, rollout_table(batch))


def pick_samples(batch: RolloutBatch, k: int) -> list[dict]:
    """A few samples for the UI: the best and the worst rewarded of the batch, then the first ones."""
    rewards = batch.rewards or [0.0] * len(batch)
    order = sorted(range(len(batch)), key=lambda i: -rewards[i])
    picked = list(dict.fromkeys(order[: k // 2] + order[-(k - k // 2):]))[:k] if order else []
    return [{"prompt": batch.prompt_text[i], "response": batch.response_text[i],
             "reward": None if batch.rewards is None else batch.rewards[i],
             "advantage": None if batch.advantages is None else batch.advantages[i],
             "finish": batch.finish_reason[i]} for i in picked]


def eval_sample_table(batch: RolloutBatch, prompt_index: list[int], n: int, threshold: float) -> pd.DataFrame:
    """One row per sample: the per-sample record of an eval set (samples.parquet)."""
    import pandas as pd  # here: a worker that writes no table does without it

    return pd.DataFrame({
        "prompt_index": [prompt_index[g] for g in batch.group_index],
        "sample": [j % n for j in range(len(batch))],
        "prompt": batch.prompt_text,
        "response": batch.response_text,
        "label": [str(x) for x in batch.label],
        "reward": batch.rewards,
        "correct": [r >= threshold for r in batch.rewards],
        "finish_reason": batch.finish_reason,
        "response_len": [len(r) for r in batch.response_ids],
        "logprob": [float(sum(lp)) for lp in batch.rollout_logprobs],  # sum over the response, under the policy
        "policy_version": [batch.policy_version] * len(batch),
    })


def eval_set(settings: RolloutSettings, batch: BatchRequest, name: str, reward_fn: Scorer, threshold: float, ks: list[int],
             n: int, prompt_index: list[int], store: RecordStore, out_dir: str, fn_timeout_s: float) -> dict:
    """One eval set in one Ray task: generate, then score and record (tasks/evaluate.py launches it). Scoring in a
    task of its own, chained on the generation's ref, waited 1.4-2.2 s for a worker in 3 of 4 evals of a 25M run
    (Ray's timeline: the generation done, every worker idle or generating the next rollout); here it follows the
    generation in the same worker."""
    return score_and_record_eval(generate(settings, batch), name, reward_fn, threshold, ks, n, prompt_index, store,
                                 out_dir, fn_timeout_s)


def score_and_record_eval(batch: RolloutBatch, name: str, reward_fn: Scorer, threshold: float, ks: list[int], n: int,
                          prompt_index: list[int], store: RecordStore, out_dir: str, fn_timeout_s: float) -> dict:
    """Score one eval set's samples (a reward function's calls within `fn_timeout_s` each, reward.fn_timeout_s),
    compute its metrics and write its records (inside Ray: the batch never reaches the driver). Returns the summary."""
    scored, _ = score(batch, reward_fn, fn_timeout_s=fn_timeout_s)
    df = eval_sample_table(scored, prompt_index, n, threshold)
    metrics = eval_summary(scored.group_index, scored.rewards, df["correct"].tolist(), df["response_len"].tolist(),
                           scored.finish_reason, ks)
    summary = {"set": name, "policy_version": batch.policy_version, **metrics}
    store.write_parquet(f"{out_dir}/{name}/samples.parquet", df)
    store.write_json(f"{out_dir}/{name}/summary.json", summary)
    return summary


def _trajectory_columns(batch: RolloutBatch) -> dict[str, list]:
    """Multi-turn rollouts only: each response's loss mask, its policy-token count and the rollout
    function's reward info (JSON), so turns and tool calls show in rollouts.parquet."""
    if batch.response_mask is None:
        return {}
    info = batch.reward_info or [{}] * len(batch)
    return {"response_mask": [list(m) for m in batch.response_mask], "policy_tokens": batch.policy_tokens(),
            "rollout_info": [json.dumps(i, default=str, sort_keys=True) for i in info]}


def warm_worker(modules: tuple[str, ...], freeze: bool) -> None:
    """A task worker's imports ahead of its first task (infra/cluster/runtime.warm_task_workers): this module's (it
    runs here) and `modules`, those of the other functions Ray tasks run."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a warm-up only: the task that needs the module reports it
            pass
    if freeze:  # a task worker lives as long as the driver's job: its imports out of later collections
        freeze_long_lived(collect=False)  # a worker of CPU tasks: what its imports left is host memory
