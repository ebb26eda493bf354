"""Sampling parameters and the pure sampling math of the embedded engine (SGLang 0.5.23 semantics).

logprob of a token = log_softmax(logits / temperature) taken BEFORE top-p/top-k/min-p filtering;
greedy (temperature < 1e-6) reports plain log_softmax(logits). See reflow.engines.embedded.generator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SAMPLING_EPS = 1e-6  # temperature below this means greedy (SGLang's _SAMPLING_EPS)
TOP_K_ALL = 1 << 30


@dataclass(frozen=True)
class SamplingConfig:
    """The sampling parameters the embedded engine implements (SGLang names and defaults)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    sampling_seed: int | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> SamplingConfig:
        """Build from an SGLang sampling_params dict (`n` and None values are skipped)."""
        kw = {k: v for k, v in (d or {}).items() if v is not None and k != "n"}
        if isinstance(kw.get("stop"), str):
            kw["stop"] = (kw["stop"],)
        if "stop" in kw:
            kw["stop"] = tuple(kw["stop"])
        if "stop_token_ids" in kw:
            kw["stop_token_ids"] = frozenset(int(t) for t in kw["stop_token_ids"])
        unknown = set(kw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"sampling params not supported by the embedded engine: {sorted(unknown)}")
        cfg = cls(**kw)
        cfg.verify()
        return cfg

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def verify(self) -> None:
        """Range checks with SGLang's messages (SamplingParams.verify)."""
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise ValueError(f"temperature must be a non-negative finite number, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.top_k < 1 and self.top_k != -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], "
                             f"got {self.min_new_tokens}.")


# ---------------------------------------------------------------- pure sampling math


def filter_probs(probs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                 min_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens top-p / top-k / min-p exclude (unnormalised; the top token always stays).

    probs [B, V]; top_p, min_p [B] float; top_k [B] long (TOP_K_ALL = keep all).
    """
    sorted_p, idx = probs.sort(dim=-1, descending=True)  # [B, V]
    ranks = torch.arange(probs.shape[-1], device=probs.device)  # [V]
    mass_before = sorted_p.cumsum(-1) - sorted_p  # [B, V] probability mass ranked above each token
    drop = mass_before > top_p[:, None]  # [B, V]
    drop |= ranks[None, :] >= top_k[:, None]
    drop |= sorted_p < sorted_p[:, :1] * min_p[:, None]
    return torch.zeros_like(probs).scatter_(-1, idx, sorted_p.masked_fill(drop, 0.0))


@dataclass(frozen=True)
class SamplingTensors:
    """The per-row sampling parameters of a running batch as device tensors [B], plus host-side facts that
    spare each step a device sync (whether every row is greedy, whether any row filters). Built when rows
    join; `select` follows the batch when rows leave."""

    cfgs: tuple[SamplingConfig, ...]
    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    min_p: torch.Tensor

    @classmethod
    def of(cls, cfgs: list[SamplingConfig], device) -> SamplingTensors:
        vals = [(c.temperature, c.top_p, TOP_K_ALL if c.top_k == -1 else c.top_k, c.min_p) for c in cfgs]
        temp, top_p, top_k, min_p = zip(*vals) if vals else ((), (), (), ())
        return cls(tuple(cfgs), torch.tensor(temp, device=device), torch.tensor(top_p, device=device),
                   torch.tensor(top_k, device=device), torch.tensor(min_p, device=device))

    def select(self, keep: list[int]) -> SamplingTensors:
        idx = torch.tensor(keep, device=self.temperature.device)
        return SamplingTensors(tuple(self.cfgs[k] for k in keep), self.temperature[idx], self.top_p[idx],
                               self.top_k[idx], self.min_p[idx])

    @property
    def all_greedy(self) -> bool:
        return all(c.greedy for c in self.cfgs)

    @property
    def filtered(self) -> bool:
        return any(c.top_p < 1.0 or c.top_k != -1 or c.min_p > 0 for c in self.cfgs)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                  top_k: torch.Tensor, min_p: torch.Tensor, noise: torch.Tensor | None,
                  filtered: bool | None = None):
    """One sampling step. Returns (tokens [B] long, logprobs [B] float).

    logits [B, V] float32; temperature [B] (< SAMPLING_EPS = greedy); noise [B, V] Exp(1) draws
    (None when every row is greedy); `filtered`: whether any row uses top-p/top-k/min-p (None: found out
    from the tensors, a device sync on a GPU). Sampling is the exponential race argmax(p / E), which draws
    from p normalised, so the filtered probs need no renormalisation. The logprob is SGLang's:
    log_softmax(logits / T) of the chosen token, before filtering.
    """
    greedy = temperature < SAMPLING_EPS  # [B]
    t = torch.where(greedy, torch.ones_like(temperature), temperature)  # [B]
    logprobs = torch.log_softmax(logits / t[:, None], dim=-1)  # [B, V]
    tokens = logits.argmax(-1)  # [B]
    if noise is not None:
        probs = logprobs.exp()  # [B, V]
        if filtered is None:
            filtered = bool((top_p < 1.0).any() | (top_k < probs.shape[-1]).any() | (min_p > 0).any())
        if filtered:
            probs = filter_probs(probs, top_p, top_k, min_p)
        sampled = (probs / noise.clamp_min(1e-20)).argmax(-1)  # [B]
        tokens = torch.where(greedy, tokens, sampled)
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)  # [B]
    return tokens, chosen.clamp_min(torch.finfo(chosen.dtype).min)  # as SGLang: never -inf in JSON


def _seeded_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """Exp(1) noise [V] that depends only on (seed, position): batch-independent determinism."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + position) % (2**63))
    return torch.empty(vocab).exponential_(generator=g)  # [V]
