"""Sampling parameters and the pure sampling math of the embedded engine (SGLang 0.5.23 semantics).

logprob of a token = log_softmax(logits / temperature) taken BEFORE top-p/top-k/min-p filtering;
greedy (temperature < 1e-6) reports plain log_softmax(logits). See reflow.engines.embedded.generator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from reflow.engines.embedded import sample_kernel
from reflow.engines.embedded.staging import on_device

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
        return cls(tuple(cfgs), on_device(temp, device, torch.float32), on_device(top_p, device, torch.float32),
                   on_device(top_k, device), on_device(min_p, device, torch.float32))

    def select(self, keep: list[int], idx: torch.Tensor | None = None) -> SamplingTensors:
        """The rows `keep` (`idx`: the same indices, already on the device)."""
        idx = on_device(keep, self.temperature.device) if idx is None else idx
        return SamplingTensors(tuple(self.cfgs[k] for k in keep), self.temperature[idx], self.top_p[idx],
                               self.top_k[idx], self.min_p[idx])

    @cached_property  # once per batch composition, not once per decode step (the rows' configs are frozen)
    def all_greedy(self) -> bool:
        return all(c.greedy for c in self.cfgs)

    @cached_property
    def seeded(self) -> list[int]:
        """The batch rows that draw from their own sampling_seed (the rollout seeds every sample)."""
        return [b for b, c in enumerate(self.cfgs) if c.sampling_seed is not None and not c.greedy]

    @cached_property
    def seeds(self) -> torch.Tensor:
        """The `seeded` rows' seeds as int64 [S] on the device (a seed past int64 hashes as its low 64 bits)."""
        return on_device([as_int64(self.cfgs[b].sampling_seed) for b in self.seeded], self.temperature.device)

    @cached_property
    def any_min_new(self) -> bool:
        """Whether any row masks its stop tokens until it has min_new_tokens."""
        return any(c.min_new_tokens > 0 for c in self.cfgs)

    @cached_property
    def filtered(self) -> bool:
        return any(c.top_p < 1.0 or c.top_k != -1 or c.min_p > 0 for c in self.cfgs)


def as_int64(x: int) -> int:
    """A Python int as the int64 with the same low 64 bits (seeds past int64 hash as their low bits)."""
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                  top_k: torch.Tensor, min_p: torch.Tensor, uniform: torch.Tensor | None,
                  filtered: bool | None = None, fused: bool = False):
    """One sampling step. Returns (tokens [B] long, logprobs [B] float).

    logits [B, V] float32; temperature [B] (< SAMPLING_EPS = greedy); uniform [B] float64 draws in (0, 1)
    (None when every row is greedy); `filtered`: whether any row uses top-p/top-k/min-p (None: found out
    from the tensors, a device sync on a GPU). Sampling inverts each row's cumulative distribution at its
    uniform draw (one draw per row, so a seeded row needs one hashed number, not one per token; the filtered
    probs need no renormalisation: the draw is scaled by the row's total). The logprob is SGLang's:
    log_softmax(logits / T) of the chosen token, before filtering. `fused`: on a GPU, a batch without filtered
    rows is sampled by one Triton kernel that reads the logits twice (sample_kernel.py; the same draws).
    """
    if fused and filtered is False and sample_kernel.serves(logits):
        return sample_kernel.sample(logits, temperature, uniform, SAMPLING_EPS)
    greedy = temperature < SAMPLING_EPS  # [B]
    t = torch.where(greedy, torch.ones_like(temperature), temperature)  # [B]
    logprobs = torch.log_softmax(logits / t[:, None], dim=-1)  # [B, V]
    tokens = logits.argmax(-1)  # [B]
    if uniform is not None:
        probs = logprobs.exp()  # [B, V]
        if filtered is None:
            filtered = bool((top_p < 1.0).any() | (top_k < probs.shape[-1]).any() | (min_p > 0).any())
        if filtered:
            probs = filter_probs(probs, top_p, top_k, min_p)
        cdf = probs.cumsum(-1)  # [B, V]
        target = (uniform * cdf[:, -1].double()).float()  # [B], below the row's total
        sampled = torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp_max(cdf.shape[-1] - 1)  # [B]
        # rounding can land the draw on a token of probability 0 (past the last kept one): its row's mode then
        kept = probs.gather(-1, sampled[:, None])[:, 0] > 0  # [B]
        sampled = torch.where(kept, sampled, probs.argmax(-1))
        tokens = torch.where(greedy, tokens, sampled)
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)  # [B]
    return tokens, chosen.clamp_min(torch.finfo(chosen.dtype).min)  # as SGLang: never -inf in JSON


# A counter-based draw: a seeded row's uniform is a hash of (seed, position), computed for every seeded row of
# the batch at once. (A torch.Generator per row and step cost a host call, a draw over the vocabulary and, on a
# GPU, a host-to-device copy that also waited for the queued steps, per row.)
_MIX1, _MIX2 = -0x40A7B892E31B1A47, -0x6B2FB644ECCEEE15  # 0xbf58476d1ce4e5b9, 0x94d049bb133111eb as int64
_SEED, _POS = 0x9E3779B97F4A7C15 - (1 << 64), 0x632BE59BD9B4E019


def _mix(h: torch.Tensor) -> torch.Tensor:
    """A 64-bit finaliser (xor-shift-multiply rounds) on int64, wrapping; logical shifts via masks."""
    h = h ^ ((h >> 30) & ((1 << 34) - 1))
    h = h * _MIX1
    h = h ^ ((h >> 27) & ((1 << 37) - 1))
    h = h * _MIX2
    return h ^ ((h >> 31) & ((1 << 33) - 1))


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Uniform draws float64 in (0, 1), one per row, from `seeds` [B] and `positions` [B] (int64): a function
    of (seed, position) only, so a seeded sample is the same in any batch."""
    h = _mix(seeds.long() * _SEED ^ _mix(positions.long() * _POS + 1))  # [B]
    return (((h >> 11) & ((1 << 53) - 1)).double() + 0.5) * 2.0**-53  # 53 bits
