"""A remote reward model (`reward.type: http`): samples are POSTed in batches to a reward server.

Wire contract (one request per batch of at most `batch_size` samples, JSON both ways):
  POST <url>  {"samples": [{"prompt", "response", "label", "finish_reason", "prompt_tokens",
                            "response_tokens", "response_ids", "reward_info"}, ...]}
  200         {"rewards": [r_0, r_1, ...]}   one per sample, in order; r_i a number or
                                             {"score": number, <metric>: number, ...}
With a token, requests carry `Authorization: Bearer <token>`. `timeout_s` is a deadline for the whole
request, from its start to the answer's last byte (httpx's own timeouts bound each read, so a server
sending a byte now and then would hold a request for ever). Timeouts, connection errors, 429 and
5xx answers are retried `retries` times with exponential backoff (backoff_s * 2^attempt); another
4xx, or a 200 whose body breaks the contract, fails at once with `RewardError` naming the server,
the batch and what was wrong (repeating a malformed answer would not fix it). At most
`max_concurrency` requests are in flight.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from reflow.rl.rewards import RewardError, _run_coroutine, metric_means, split_value
from reflow.rl.scorers import Scorer
from reflow.rl.types import Sample

_RETRY_STATUS = (429, 500, 502, 503, 504)


@dataclass(frozen=True)
class HttpReward(Scorer):
    """Where and how to reach the reward server (built from the `reward:` config section): the `http` scorer."""

    url: str
    timeout_s: float = 30.0
    retries: int = 3
    backoff_s: float = 0.5
    max_concurrency: int = 4
    batch_size: int = 64
    token: str | None = None

    def __repr__(self) -> str:  # never the token
        return f"HttpReward({self.url!r}, batch_size={self.batch_size})"

    def score(self, samples: Sequence[Sample], timeout_s: float | None = None) -> tuple[list[float], dict[str, float]]:
        """One reward per sample, in order, plus the means of the extra metrics the server sent. `timeout_s`
        (a function's deadline) is not this scorer's: each request has `self.timeout_s` (reward.timeout_s)."""
        values = _run_coroutine(self._score_all(list(samples)))
        who = f"reward server {self.url}"
        split = [split_value(who, i, s.prompt, s.response, v) for i, (s, v) in enumerate(zip(samples, values))]
        return [r for r, _ in split], metric_means([e for _, e in split])

    def describe(self) -> str:
        return f"reward.url: {self.url}"

    def check(self, sample: Sample, timeout_s: float) -> None:
        """Asked once, without retries."""
        dataclasses.replace(self, retries=0).score([sample])

    def check_failed(self, source: str, error: str) -> str:
        return (f"reward.url={self.url!r} did not score the first row of {source} with an empty response: {error}. "
                f"Start the server, or fix reward.url / its answer (the contract is in reflow.rl.reward_http)")

    async def _score_all(self, samples: list[Sample]) -> list[Any]:
        limit = asyncio.Semaphore(self.max_concurrency)
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        starts = range(0, len(samples), self.batch_size)
        # no timeouts of httpx's own (each bounds one read): `_batch` gives each request a deadline of timeout_s
        async with httpx.AsyncClient(timeout=httpx.Timeout(None), headers=headers) as client:
            parts = await asyncio.gather(*(self._batch(client, limit, samples[s:s + self.batch_size], s)
                                           for s in starts))
        return [v for part in parts for v in part]

    async def _batch(self, client: httpx.AsyncClient, limit: asyncio.Semaphore, batch: list[Sample],
                     first: int) -> list[Any]:
        where = f"reward server {self.url} (samples {first}..{first + len(batch) - 1})"
        body = json.dumps({"samples": [_wire(s) for s in batch]}, default=_plain).encode()
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            async with limit:
                try:
                    r = await asyncio.wait_for(
                        client.post(self.url, content=body, headers={"Content-Type": "application/json"}),
                        self.timeout_s)
                except TimeoutError:  # the deadline of the whole request: worth another try
                    last = f"no complete answer within {self.timeout_s:g} s (reward.timeout_s)"
                    continue
                except httpx.TransportError as e:  # connection errors: worth another try
                    last = f"{type(e).__name__}: {e}"
                    continue
            if r.status_code in _RETRY_STATUS:
                last = f"HTTP {r.status_code}: {r.text[:200]}"
                continue
            if r.status_code >= 300:
                raise RewardError(f"{where} answered HTTP {r.status_code}: {r.text[:300]} (not retried)")
            return _rewards(r, len(batch), where)
        raise RewardError(f"{where} failed {self.retries + 1} times; last: {last}")


def _wire(s: Sample) -> dict[str, Any]:
    return {"prompt": s.prompt, "response": s.response, "label": s.label, "finish_reason": s.finish_reason,
            "prompt_tokens": s.prompt_tokens, "response_tokens": s.response_tokens,
            "response_ids": list(s.response_ids), "reward_info": dict(s.reward_info)}


def _plain(x: Any) -> Any:
    """numpy values (labels read from parquet) as JSON; anything else as its string."""
    return x.tolist() if hasattr(x, "tolist") else str(x)


def _rewards(r: httpx.Response, n: int, where: str) -> list[Any]:
    """The `rewards` list of a 200 answer, or a RewardError saying how the answer breaks the contract."""
    try:
        body = r.json()
    except ValueError:
        raise RewardError(f"{where} answered with a body that is not JSON: {r.text[:200]!r}; "
                          f'expected {{"rewards": [one number or {{"score": ...}} per sample]}}') from None
    rewards = body.get("rewards") if isinstance(body, dict) else None
    if not isinstance(rewards, list):
        raise RewardError(f"{where} answered without a `rewards` list: {str(body)[:200]}; "
                          f'expected {{"rewards": [one number or {{"score": ...}} per sample]}}')
    if len(rewards) != n:
        raise RewardError(f"{where} answered {len(rewards)} rewards for {n} samples")
    return rewards


def http_scorer(reward: Any) -> HttpReward:
    """The reward server of a `reward:` config section (reward.type: http), its token read from the
    driver's environment (reward.token_env) and handed to the scoring task only."""
    token = None
    if reward.token_env is not None:
        token = os.environ.get(reward.token_env)
        if not token:
            raise ValueError(f"reward.token_env={reward.token_env!r}: that environment variable is not set (or "
                             f"empty) where the flow runs; export the reward server's token there")
    if not reward.url:
        raise ValueError("reward.type=http needs reward.url")
    return HttpReward(reward.url, reward.timeout_s, reward.retries, reward.backoff_s, reward.max_concurrency,
                      reward.batch_size, token)
