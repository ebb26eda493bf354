"""Generalised advantage estimation for PPO (Schulman et al. 2016, eq. 16; PPO, Schulman et al.
2017, eq. 11-12).

delta_t = r_t + gamma V(s_{t+1}) - V(s_t);  A_t = sum_l (gamma lambda)^l delta_{t+l};
returns (value targets) R_t = A_t + V(s_t). Token-level: one step per response token; the value
after the last response token is 0 (episode end).

Masks: positions where mask == 0 (prompt, padding, or holes) are skipped — the recursion jumps
from one response token to the next response token — and get advantage and return 0. verl's loop
instead runs over every position of the right-padded response; the two agree when the response
tokens are contiguous and followed only by padding. Pure torch; the critic that produces `values`
and trains on `value_loss_tokens` is engines/train/critic.py (see docs/ALGORITHMS.md).
"""
from __future__ import annotations

import torch
from torch import Tensor


def gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float,
                   lam: float) -> tuple[Tensor, Tensor]:
    """rewards [B, T], values [B, T], mask [B, T] -> (advantages [B, T], returns [B, T]), fp32."""
    m = mask != 0  # [B, T]
    r = torch.where(m, rewards.double(), torch.zeros_like(rewards, dtype=torch.float64))  # [B, T]
    v = torch.where(m, values.double(), torch.zeros_like(values, dtype=torch.float64))  # [B, T]
    B, T = r.shape
    adv = torch.zeros_like(r)  # [B, T]
    next_value = torch.zeros(B, dtype=torch.float64)  # [B] V of the next response token (0 at the end)
    running = torch.zeros(B, dtype=torch.float64)  # [B] A of the next response token
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_value - v[:, t]  # [B]
        a = delta + gamma * lam * running  # [B]
        adv[:, t] = torch.where(m[:, t], a, torch.zeros_like(a))
        # Masked positions pass the carry through unchanged, so the recursion skips them.
        running = torch.where(m[:, t], a, running)
        next_value = torch.where(m[:, t], v[:, t], next_value)
    returns = torch.where(m, adv + v, torch.zeros_like(adv))  # [B, T]
    return adv.float(), returns.float()


def value_loss_tokens(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
                      clip_eps: float | None) -> Tensor:
    """Clipped value loss per token [B, T], 0 where mask is 0:
    0.5 * max((V - R)^2, (old + clip(V - old, -eps, eps) - R)^2).

    Value clipping is not in the PPO paper (eq. 9 uses a plain squared error); it is the variant of
    OpenAI baselines' PPO2 that verl and OpenRLHF also use. clip_eps None -> unclipped 0.5 (V - R)^2.
    """
    m = mask != 0  # [B, T]
    err = (values - returns).square()  # [B, T]
    if clip_eps is not None:
        clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)  # [B, T]
        err = torch.maximum(err, (clipped - returns).square())  # [B, T]
    return torch.where(m, 0.5 * err, torch.zeros_like(err))
