"""Token-level policy-gradient math: log-probs, entropy, KL estimators, PPO-clip loss.

Pure torch (no ray / deepspeed / prefect). Shapes: B sequences, T positions (already shifted so
position t scores token t+1), V vocabulary. `mask` is 1 on response tokens and 0 on prompt and
padding; every reduction here ignores masked positions, even when they hold inf or NaN.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from torch import Tensor

from reflow.rl.algorithms.gspo import gspo_log_ratio

if TYPE_CHECKING:
    from reflow.rl.objectives import PolicyObjective

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGG_MODES: tuple[str, ...] = get_args(AggMode)
KLKind = Literal["k1", "k2", "k3", "low_var_kl"]
RatioLevel = Literal["token", "sequence"]


def _ppo_clip() -> PolicyObjective:
    from reflow.rl.objectives import PPOClip

    return PPOClip()


@dataclass(frozen=True)
class LossSettings:
    """Everything the policy loss of one update needs besides the batch (built from the run config
    by `reflow.infra.config.settings.loss_settings`; the defaults are plain PPO-clip)."""

    temperature: float = 1.0  # the rollout's, so logprobs are those of the sampled distribution
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0
    kl_estimator: KLKind = "low_var_kl"
    entropy_coef: float = 0.0
    loss_agg: AggMode = "token-mean"
    loss_norm_len: int | None = None
    dual_clip_c: float | None = None
    tis_cap: float | None = None
    ratio_level: RatioLevel = "token"
    # What the trainer minimises with these (reflow.rl.objectives): the algorithm's, resolved on the driver.
    objective: PolicyObjective = field(default_factory=_ppo_clip)


# Log-ratios are clamped before exp() so one wild token cannot overflow to inf (verl does the same).
_LOG_RATIO_CLAMP = 20.0


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over positions where `mask` != 0 (weighted by `mask`); 0 where nothing is kept.

    Masked-out entries are replaced by 0 before multiplying, so inf/NaN in padding cannot leak.
    """
    mask = mask.to(x.dtype) if x.is_floating_point() else mask.float()
    weighted = x * mask
    kept = torch.where(mask != 0, weighted, torch.zeros_like(weighted))
    if dim is None:
        num, den = kept.sum(), mask.sum()
    else:
        num, den = kept.sum(dim), mask.sum(dim)
    return torch.where(den != 0, num / torch.where(den != 0, den, torch.ones_like(den)), torch.zeros_like(num))


def _effective_temperature(temperature: float) -> float:
    """Greedy decoding (temperature ~0) reports the untempered distribution, as engines do."""
    return 1.0 if temperature <= 1e-6 else float(temperature)


# Logits of this many elements are processed at a time (~512 MiB of fp32 temporaries when eager;
# a 152k vocabulary: ~880 positions per chunk): few enough chunks that kernel launches do not
# dominate, small enough that no [T, V] fp32 copy of a whole sequence is ever alive.
_CHUNK_ELEMENTS = 1 << 27


def _chunks(logits: Tensor) -> Iterator[tuple[int, int, int, int]]:
    """(b0, b1, s, e): blocks logits[b0:b1, s:e] covering logits [B, T, V], each at most _CHUNK_ELEMENTS.
    Whole rows are grouped when several fit (short sequences over a small vocabulary: one row per block
    made 256 compiled-kernel calls per micro-batch, a quarter of the train stage on an H200, py-spy);
    a row longer than a block is split by positions."""
    B, T, V = logits.shape
    rows = _CHUNK_ELEMENTS // max(T * V, 1)
    if rows >= 1:
        for b in range(0, B, rows):
            yield b, min(B, b + rows), 0, T
        return
    step = max(1, _CHUNK_ELEMENTS // max(V, 1))
    for b in range(B):
        for s in range(0, T, step):
            yield b, b + 1, s, min(T, s + step)


def _shifted(chunk: Tensor, t: float) -> Tensor:
    """fp32 chunk / t minus its row maximum: [c, V]."""
    x = chunk.float()
    if t != 1.0:
        x = x / t
    return x - x.max(dim=-1, keepdim=True).values


def _forward_chunk(chunk: Tensor, labels: Tensor, t: float, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """chunk [c, V], labels [c] -> (log p[label], z = logsumexp(x) - max(x), entropy or z), all [c]."""
    y = _shifted(chunk, t)  # [c, V]: x - max(x), as log_softmax computes it
    z = torch.log(torch.exp(y).sum(-1))  # [c]
    logp = y.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1) - z
    if not with_entropy:
        return logp, z, z
    p = torch.exp(y - z.unsqueeze(-1))  # [c, V]
    return logp, z, z - (p * y).sum(-1)  # sum p = 1, so the shift cancels


def _backward_chunk(chunk: Tensor, labels: Tensor, z: Tensor, ent: Tensor, g_logp: Tensor, g_ent: Tensor,
                    t: float, with_entropy: bool) -> Tensor:
    """d loss / d chunk [c, V] (the chunk's dtype) from the gradients of log p and entropy ([c])."""
    y = _shifted(chunk, t)  # [c, V]
    log_p = y - z.unsqueeze(-1)
    p = torch.exp(log_p)
    gl = g_logp.unsqueeze(-1)  # [c, 1]
    g = (-gl * p).scatter_add(-1, labels.long().unsqueeze(-1), gl)
    if with_entropy:  # dH/dx_j = -p_j (log p_j + H)
        g = g - g_ent.unsqueeze(-1) * p * (log_p + ent.unsqueeze(-1))
    if t != 1.0:
        g = g / t
    return g.to(chunk.dtype)


_COMPILED: dict[str, Any] = {}


def _kernels(device: torch.device) -> tuple[Any, Any]:
    """The chunk functions, compiled by torch.compile on CUDA (one fused kernel or two per pass
    instead of ~12 memory-bound ones; `REFLOW_COMPILE_LOSS=0` turns it off), eager elsewhere."""
    if device.type != "cuda" or os.environ.get("REFLOW_COMPILE_LOSS", "1") == "0":
        return _forward_chunk, _backward_chunk
    if not _COMPILED:
        _COMPILED["fwd"] = torch.compile(_forward_chunk, dynamic=True)
        _COMPILED["bwd"] = torch.compile(_backward_chunk, dynamic=True)
    return _COMPILED["fwd"], _COMPILED["bwd"]


class _LogprobEntropy(torch.autograd.Function):
    """log softmax(logits/t)[labels] and the entropy of softmax(logits/t) in one read of the logits.

    Forward, per chunk of positions: x = fp32(logits)/t, y = x - max(x), z = log sum exp(y),
    logp = y[label] - z, H = z - sum softmax(y) * y (log_softmax's own order of operations, so the
    values match it to the last bits). Saved for backward: the logits themselves (no copy, in their
    own dtype), z and H ([B, T] fp32). Backward recomputes log p = y - z per chunk and writes
      d logits = (g_logp * (onehot(label) - p) - g_H * p * (log p + H)) / t
    into one gradient tensor of the logits' dtype (dH/dx_j = -p_j (log p_j + H)). No [B, T, V]
    fp32 copy is kept, and no second tempered logits tensor is ever built.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, labels: Tensor, t: float,  # type: ignore[override]
                with_entropy: bool) -> tuple[Tensor, Tensor]:
        B, T, V = logits.shape
        fwd, _ = _kernels(logits.device)
        logp = torch.empty((B, T), dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp)
        for b0, b1, s, e in _chunks(logits):
            shape = (b1 - b0, e - s)  # a block's positions go to the chunk functions as one [c, V] matrix
            out = fwd(logits[b0:b1, s:e].reshape(-1, V), labels[b0:b1, s:e].reshape(-1), t, with_entropy)
            logp[b0:b1, s:e], lse[b0:b1, s:e], ent[b0:b1, s:e] = (x.view(shape) for x in out)
        ctx.t, ctx.with_entropy = t, with_entropy
        ctx.save_for_backward(logits, labels, lse, ent)
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor | None,  # type: ignore[override]
                 g_ent: Tensor | None) -> tuple[Tensor | None, None, None, None]:
        logits, labels, lse, ent = ctx.saved_tensors
        with_entropy = ctx.with_entropy and g_ent is not None
        if g_logp is None and not with_entropy:
            return None, None, None, None
        _, bwd = _kernels(logits.device)
        gl = g_logp if g_logp is not None else torch.zeros_like(lse)
        ge = g_ent if g_ent is not None and with_entropy else gl  # unused when with_entropy is False
        grad = torch.empty_like(logits)  # [B, T, V], the logits' dtype
        V = logits.shape[-1]
        for b0, b1, s, e in _chunks(logits):
            flat = [x[b0:b1, s:e].reshape(-1) for x in (labels, lse, ent, gl, ge)]
            grad[b0:b1, s:e] = bwd(logits[b0:b1, s:e].reshape(-1, V), *flat, ctx.t,
                                   with_entropy).view(b1 - b0, e - s, V)
        return grad, None, None, None


def logprobs_and_entropy(logits: Tensor, labels: Tensor, temperature: float = 1.0,
                         entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """(log softmax(logits / T)[labels], entropy of softmax(logits / T) or None), per position, in
    one chunked pass over the logits with its own backward (`_LogprobEntropy`).

    logits [B, T, V] (any float dtype; read, never copied whole), labels [B, T] -> two [B, T]
    float32 tensors. Temperature ~0 means untempered (`_effective_temperature`), as engines report.
    """
    if logits.shape[0] == 0 or logits.shape[1] == 0:
        empty = logits.new_zeros(labels.shape, dtype=torch.float32)
        return empty, (empty.clone() if entropy else None)
    logp, ent = _LogprobEntropy.apply(logits, labels, _effective_temperature(temperature),  # type: ignore[no-untyped-call]
                                      entropy)
    return logp, (ent if entropy else None)  # without `entropy` the second output is a placeholder


def token_logprobs(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature)[labels], per position: logits [B, T, V], labels [B, T] ->
    [B, T] float32 (`logprobs_and_entropy` without the entropy)."""
    return logprobs_and_entropy(logits, labels, temperature)[0]


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / temperature) per position, H = logsumexp(x) - sum_v p_v x_v:
    logits [B, T, V] -> [B, T] float32."""
    labels = torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device)
    ent = logprobs_and_entropy(logits, labels, temperature, entropy=True)[1]
    assert ent is not None
    return ent


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: KLKind) -> Tensor:
    """Per-token estimator of KL(pi || ref) from samples of pi (Schulman, "Approximating KL
    divergence", 2020). With log r = logr - logp:

    k1 = -log r (unbiased, high variance, can be negative); k2 = 0.5 (log r)^2 (biased, low
    variance); k3 = r - 1 - log r (unbiased, always >= 0). "low_var_kl" is verl's k3 variant:
    log r clamped to [-20, 20] and the result clamped to [-10, 10].
    """
    log_r = ref_logprobs - logprobs  # [B, T]
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r.square()
    if kind == "k3":
        return torch.exp(log_r) - 1.0 - log_r
    if kind == "low_var_kl":
        log_r = log_r.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return (torch.exp(log_r) - 1.0 - log_r).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of k1, k2, k3, low_var_kl")


def aggregate(values: Tensor, mask: Tensor, mode: AggMode, norm_len: int | None = None) -> Tensor:
    """Reduce per-token values [B, T] to a scalar. Empty mask -> 0 in every mode.

    "token-mean": sum(v * m) / sum(m) — every token weighs the same (DAPO, Yu et al. 2025 §3.3).
    "seq-mean-token-mean": mean over sequences with >= 1 token of each sequence's token mean —
    the original GRPO objective (Shao et al. 2024, eq. 3), where long responses weigh less per
    token. Sequences without tokens are skipped (not counted as 0).
    "seq-mean-token-sum": mean over sequences with >= 1 token of each sequence's token *sum*.
    "seq-mean-token-sum-norm": sum(v * m) / (B * norm_len), B counting every row — Dr.GRPO's
    constant normaliser (Liu et al. 2025 §3.1: the 1/|o_i| of eq. 2 replaced by a constant, the
    generation budget). `norm_len` is required here: the padded width T varies with the batch.
    """
    if mode == "token-mean":
        return masked_mean(values, mask)
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        per_seq = masked_mean(values, mask, dim=-1)  # [B]
        if mode == "seq-mean-token-sum":
            per_seq = per_seq * mask.sum(dim=-1).to(per_seq.dtype)  # [B] token sum
        has_tokens = (mask != 0).any(dim=-1).float()  # [B]
        return masked_mean(per_seq, has_tokens)
    if mode == "seq-mean-token-sum-norm":
        if not norm_len or norm_len < 1:
            raise ValueError("loss aggregation seq-mean-token-sum-norm needs norm_len >= 1 (a constant length)")
        return masked_mean(values, mask) * mask.sum() / (values.shape[0] * norm_len)
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGG_MODES}")


def tis_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, cap: float) -> Tensor:
    """Truncated importance-sampling weights [B, T] = min(exp(old - rollout), cap), detached; 1 where
    mask is 0. Corrects for the rollout engine sampling from a slightly different distribution
    than the trainer's old policy (Yao et al. 2025, "Your efficient RL framework secretly brings
    you off-policy RL training"; verl's tis_imp_ratio_cap). The log-ratio is clamped to [-20, 20].
    """
    log_w = (old_logprobs - rollout_logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [B, T]
    w = torch.exp(log_w).clamp(max=cap)  # [B, T]
    return torch.where(mask != 0, w, torch.ones_like(w)).detach()


def _ppo_terms(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip_eps_low: float,
               clip_eps_high: float, ratio_level: RatioLevel = "token") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """advantages [B, T], ratio [B, T], unclipped and clipped per-token losses [B, T] (PPO eq. 7, negated)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logprobs)  # [B, T] broadcast over tokens
    if ratio_level == "sequence":
        log_ratio = gspo_log_ratio(logprobs, old_logprobs, mask)  # [B, T], GSPO-token (eq. 13)
    elif ratio_level == "token":
        log_ratio = logprobs - old_logprobs  # [B, T]
    else:
        raise ValueError(f"unknown ratio_level {ratio_level!r}; expected token or sequence")
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))  # [B, T]
    loss_unclipped = -advantages * ratio  # [B, T]
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)  # [B, T]
    return advantages, ratio, loss_unclipped, loss_clipped


def _dual_clip(loss: Tensor, advantages: Tensor, c: float | None) -> Tensor:
    """Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games", eq. 5): for A < 0
    the objective is max(min(rA, clip(r)A), cA), i.e. the negated loss is capped at -c A, so a
    huge ratio on a bad action cannot blow up the update. c > 1; None disables it."""
    if c is None:
        return loss
    return torch.where(advantages < 0, torch.minimum(loss, -c * advantages), loss)


def policy_loss_tokens(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                       clip_eps_low: float, clip_eps_high: float, *, dual_clip_c: float | None = None,
                       is_weights: Tensor | None = None, ratio_level: RatioLevel = "token") -> Tensor:
    """Unreduced PPO-clip loss per token [B, T], 0 where `mask` is 0.

    loss_t = max(-A ratio_t, -A clip(ratio_t, 1 - eps_low, 1 + eps_high)), ratio_t =
    exp(logp_t - old_t): the negated clipped surrogate of Schulman et al. 2017, eq. 7, with the
    decoupled bounds of DAPO's clip-higher (Yu et al. 2025 §3.1). Departure: the log-ratio is
    clamped to [-20, 20] before exp. A trainer doing gradient accumulation sums these itself.
    advantages: [B] (sequence-level, broadcast) or [B, T] (token-level). Options: `dual_clip_c`
    (see `_dual_clip`), `is_weights` [B, T] multiplying each token's loss (TIS, `tis_weights`),
    `ratio_level="sequence"` for GSPO's sequence ratio (rl/algorithms/gspo.py).
    """
    adv, _, loss_unclipped, loss_clipped = _ppo_terms(logprobs, old_logprobs, advantages, mask, clip_eps_low,
                                                      clip_eps_high, ratio_level)
    loss = _dual_clip(torch.maximum(loss_unclipped, loss_clipped), adv, dual_clip_c)  # [B, T]
    if is_weights is not None:
        loss = loss * is_weights  # [B, T]
    return torch.where(mask != 0, loss * mask.to(loss.dtype), torch.zeros_like(loss))


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                clip_eps_low: float, clip_eps_high: float, agg_mode: AggMode, *, norm_len: int | None = None,
                dual_clip_c: float | None = None, is_weights: Tensor | None = None,
                ratio_level: RatioLevel = "token") -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip loss reduced with `aggregate(…, agg_mode)`, plus detached scalar metrics over the
    masked tokens: clip_frac (share of tokens whose clipped branch is strictly larger, i.e. the
    gradient is cut), ratio_mean / ratio_min / ratio_max (1.0 with no tokens), approx_kl
    (mean of old - logp, the k1 estimate of KL(old || new)).
    """
    loss_tok = policy_loss_tokens(logprobs, old_logprobs, advantages, mask, clip_eps_low, clip_eps_high,
                                  dual_clip_c=dual_clip_c, is_weights=is_weights, ratio_level=ratio_level)
    loss = aggregate(loss_tok, mask, agg_mode, norm_len)
    with torch.no_grad():
        _, ratio, loss_unclipped, loss_clipped = _ppo_terms(
            logprobs, old_logprobs, advantages, mask, clip_eps_low, clip_eps_high, ratio_level)
        # Masked reductions only: no boolean indexing or host round trip, so on a GPU the metrics
        # cost no synchronisation (the trainer reads them once per iteration).
        keep = mask != 0  # [B, T]
        any_tok = keep.any()
        one = torch.ones((), dtype=ratio.dtype, device=ratio.device)
        inf = torch.full((), math.inf, dtype=ratio.dtype, device=ratio.device)
        metrics = {
            "clip_frac": masked_mean((loss_clipped > loss_unclipped).float(), mask),
            "ratio_mean": torch.where(any_tok, masked_mean(ratio, mask), one),
            "ratio_min": torch.where(any_tok, torch.where(keep, ratio, inf).min(), one),
            "ratio_max": torch.where(any_tok, torch.where(keep, ratio, -inf).max(), one),
            "approx_kl": masked_mean(old_logprobs - logprobs, mask),
        }
    return loss, {k: v.detach() for k, v in metrics.items()}
