"""Hand-computed checks of the pure RL math (rl/losses.py, rl/algorithms/, rl/types.py).

Every expected number is written out so it can be re-derived on paper.
"""
from __future__ import annotations

import math

import torch
from torch.testing import assert_close

from reflow.rl.algorithms.grpo import grpo_advantages
from reflow.rl.losses import (
    aggregate,
    entropy_from_logits,
    kl_estimate,
    masked_mean,
    policy_loss,
    policy_loss_tokens,
    token_logprobs,
)
from reflow.rl.types import RolloutBatch, to_train_tensors

T = torch.tensor


# ---------------------------------------------------------------- masked_mean / aggregate
def test_masked_mean_ignores_padding_even_nan_and_inf():
    x = T([[1.0, 2.0, 3.0], [4.0, float("nan"), float("inf")]])
    m = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert_close(masked_mean(x, m), T(7.0 / 3.0))  # (1 + 2 + 4) / 3
    assert_close(masked_mean(x, m, dim=-1), T([1.5, 4.0]))


def test_masked_mean_all_zero_mask_is_zero():
    x = T([[float("nan"), 2.0]], requires_grad=True)
    out = masked_mean(x, torch.zeros(1, 2))
    assert_close(out, T(0.0))
    out.backward()
    assert torch.isfinite(x.grad).all()
    assert_close(masked_mean(x, torch.zeros(1, 2), dim=-1), T([0.0]))


def test_aggregate_modes_differ_on_unequal_lengths():
    v = T([[1.0, 1.0, 1.0, 1.0], [3.0, 9.0, 9.0, 9.0], [5.0, 5.0, 5.0, 5.0]])
    m = T([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    # token-mean: (1+1+1+1+3) / 5 tokens; seq-mean: (mean 1 + mean 3) / 2 seqs (row 3 has no tokens)
    assert_close(aggregate(v, m, "token-mean"), T(1.4))
    assert_close(aggregate(v, m, "seq-mean-token-mean"), T(2.0))
    assert_close(aggregate(v, torch.zeros_like(m), "seq-mean-token-mean"), T(0.0))


# ---------------------------------------------------------------- advantages
def test_grpo_advantages_hand_values():
    rewards = T([1.0, 0.0, 1.0, 0.0, 3.0, 1.0])
    groups = T([0, 0, 0, 0, 7, 7])
    # group 0: mean 0.5, unbiased std = sqrt(4 * 0.25 / 3) = 1/sqrt(3) -> +-0.5 * sqrt(3)
    # group 7: mean 2, unbiased std = sqrt((1 + 1) / 1) = sqrt(2) -> +-1/sqrt(2)
    a, b = 0.5 * math.sqrt(3.0), 1.0 / math.sqrt(2.0)
    assert_close(grpo_advantages(rewards, groups, eps=0.0), T([a, -a, a, -a, b, -b]))
    assert_close(grpo_advantages(rewards, groups), T([a, -a, a, -a, b, -b]), atol=1e-5, rtol=1e-5)
    # Dr.GRPO: no std normalisation
    assert_close(grpo_advantages(rewards, groups, normalize_std=False), T([0.5, -0.5, 0.5, -0.5, 1.0, -1.0]))


def test_grpo_all_equal_and_single_sample_groups_are_zero():
    rewards = T([0.1, 0.1, 0.1, 1.0, 0.0, 0.0, 1.0])
    groups = T([0, 0, 0, 1, 2, 2, 3])  # group 0 all equal; groups 1 and 3 have one sample
    for norm in (True, False):
        adv = grpo_advantages(rewards, groups, normalize_std=norm, eps=0.0)
        assert torch.isfinite(adv).all()
        assert_close(adv[[0, 1, 2, 3, 4, 5, 6]], T([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]))
    assert grpo_advantages(T([]), T([], dtype=torch.long)).numel() == 0


# ---------------------------------------------------------------- PPO-clip
def _clip_case():
    # eps_low 0.2 -> lower bound 0.8; eps_high 0.28 -> upper bound 1.28 (asymmetric, clip-higher)
    logp = T([[0.5, -0.5, 0.0], [0.5, 9.0, 9.0]], requires_grad=True)
    old = torch.zeros(2, 3)
    adv = T([[1.0, -1.0, 1.0], [-1.0, 1.0, 1.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    return logp, old, adv, mask


def test_policy_loss_clipping_both_sides_and_metrics():
    logp, old, adv, mask = _clip_case()
    e = math.exp(0.5)  # 1.6487
    # token (A=+1, r=e^.5 > 1.28): max(-1.6487, -1.28) = -1.28 (clipped)
    # token (A=-1, r=e^-.5=0.6065 < 0.8): max(0.6065, 0.8) = 0.8 (clipped)
    # token (A=+1, r=1): -1 (unclipped);  token (A=-1, r=e^.5): max(1.6487, 1.28) = 1.6487 (unclipped)
    expect_tok = T([[-1.28, 0.8, -1.0], [e, 0.0, 0.0]])
    assert_close(policy_loss_tokens(logp, old, adv, mask, 0.2, 0.28), expect_tok)
    loss, met = policy_loss(logp, old, adv, mask, 0.2, 0.28, "token-mean")
    assert_close(loss, T((-1.28 + 0.8 - 1.0 + e) / 4))
    assert_close(met["clip_frac"], T(0.5))
    assert_close(met["ratio_min"], T(1.0 / e))
    assert_close(met["ratio_max"], T(e))
    assert_close(met["ratio_mean"], T((e + 1.0 / e + 1.0 + e) / 4))
    assert_close(met["approx_kl"], T((-0.5 + 0.5 + 0.0 - 0.5) / 4))
    loss.backward()
    # clipped tokens get no gradient; d(-A r)/dlogp = -A r, divided by 4 tokens
    assert_close(logp.grad, T([[0.0, 0.0, -0.25], [e / 4, 0.0, 0.0]]))


def test_policy_loss_sequence_advantages_broadcast():
    logp, old, adv_bt, mask = _clip_case()
    adv_b = T([1.0, -1.0])
    full = adv_b.unsqueeze(-1).expand(2, 3)
    a, _ = policy_loss(logp, old, adv_b, mask, 0.2, 0.2, "seq-mean-token-mean")
    b, _ = policy_loss(logp, old, full, mask, 0.2, 0.2, "seq-mean-token-mean")
    assert_close(a, b)
    # row 0 (A=+1): r = [e^.5, e^-.5, 1] -> losses [-1.2, -0.6065, -1]; row 1 (A=-1, r=e^.5): 1.6487
    row0 = (-1.2 - math.exp(-0.5) - 1.0) / 3
    assert_close(a, T((row0 + math.exp(0.5)) / 2))


def test_policy_loss_zero_length_response_is_finite_zero():
    logp = T([[0.3, float("nan")]], requires_grad=True)
    mask = torch.zeros(1, 2)
    for mode in ("token-mean", "seq-mean-token-mean"):
        loss, met = policy_loss(logp, torch.zeros(1, 2), T([1.0]), mask, 0.2, 0.2, mode)
        assert_close(loss, T(0.0))
        assert all(torch.isfinite(v) for v in met.values())
        assert_close(met["clip_frac"], T(0.0))
        loss.backward()
        assert torch.isfinite(logp.grad).all()
        logp.grad = None


# ---------------------------------------------------------------- KL estimators
def test_kl_estimators_hand_values():
    ln2 = math.log(2.0)
    logp = torch.log(T([0.5, 0.25]))
    logr = torch.log(T([0.25, 0.5]))
    # token 0: log r = logr - logp = -ln2, r = 1/2; token 1: log r = +ln2, r = 2
    assert_close(kl_estimate(logp, logr, "k1"), T([ln2, -ln2]))
    assert_close(kl_estimate(logp, logr, "k2"), T([0.5 * ln2**2, 0.5 * ln2**2]))
    assert_close(kl_estimate(logp, logr, "k3"), T([0.5 - 1 + ln2, 2 - 1 - ln2]))  # 0.1931, 0.3069
    assert_close(kl_estimate(logp, logr, "low_var_kl"), T([0.5 - 1 + ln2, 2 - 1 - ln2]))


def test_low_var_kl_clamps():
    logp = T([0.0, 0.0, 0.0])
    logr = T([-5.0, 30.0, -30.0])
    # log r = -5: e^-5 - 1 + 5 = 4.00674 (inside); +30 and -30 exceed 10 -> 10
    assert_close(kl_estimate(logp, logr, "low_var_kl"), T([math.exp(-5) + 4.0, 10.0, 10.0]))
    assert kl_estimate(logp, logr, "k3")[1] > 1e12  # unclamped k3 explodes


# ---------------------------------------------------------------- log-probs and entropy
def test_token_logprobs_temperature_matches_manual():
    logits = T([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])  # [1, 2, 3]
    labels = T([[2, 0]])
    # temperature 2: logits/2 = [0.5, 1, 1.5]; log p[2] = 1.5 - log(e^.5 + e^1 + e^1.5)
    lp2 = 1.5 - math.log(math.exp(0.5) + math.exp(1.0) + math.exp(1.5))
    assert_close(token_logprobs(logits, labels, 2.0), T([[lp2, -math.log(3.0)]]))
    lp1 = 3.0 - math.log(math.exp(1.0) + math.exp(2.0) + math.exp(3.0))
    assert_close(token_logprobs(logits, labels), T([[lp1, -math.log(3.0)]]))
    assert_close(token_logprobs(logits, labels, 0.0), token_logprobs(logits, labels, 1.0))  # greedy
    assert token_logprobs(logits.bfloat16(), labels).dtype == torch.float32


def test_entropy_uniform_is_log_v_and_one_hot_is_zero():
    logits = torch.zeros(2, 3, 7)
    logits[1, 2] = T([100.0, 0, 0, 0, 0, 0, 0])  # almost one-hot
    ent = entropy_from_logits(logits)
    expect = torch.full((2, 3), math.log(7.0))
    expect[1, 2] = 0.0
    assert_close(ent, expect, atol=1e-4, rtol=1e-4)
    two = T([[[0.0, math.log(3.0)]]])  # p = [1/4, 3/4]
    assert_close(entropy_from_logits(two), T([[-(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]]))


# ---------------------------------------------------------------- rl/types.py alignment
def test_to_train_tensors_mask_lines_up_with_response_tokens():
    batch = RolloutBatch(
        group_index=[0, 0, 1], prompt_text=["a", "b", "c"],
        prompt_ids=[[5, 6, 7], [5, 6], [9]], response_ids=[[8, 9, 2], [8], []],
        response_text=["x", "y", ""], rollout_logprobs=[[-0.1, -0.2, -0.3], [-0.4], []],
        finish_reason=["stop", "length", "length"], label=[1, 1, 2], advantages=[1.0, -1.0, 0.0])
    t = to_train_tensors(batch, pad_id=0)
    assert t["input_ids"].tolist() == [[5, 6, 7, 8, 9, 2], [5, 6, 8, 0, 0, 0], [9, 0, 0, 0, 0, 0]]
    assert t["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]]
    # position t scores token t+1: row 0 positions 2,3,4 score tokens 8,9,2; row 1 position 1 scores 8
    assert t["loss_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0], [0, 0, 0, 0, 0]]
    targets = t["input_ids"][:, 1:]  # [B, T-1]
    assert targets[t["loss_mask"].bool()].tolist() == [8, 9, 2, 8]
    assert_close(t["rollout_logprobs"], T([[0, 0, -0.1, -0.2, -0.3], [0, -0.4, 0, 0, 0], [0, 0, 0, 0, 0.0]]))
    assert_close(t["advantages"], T([1.0, -1.0, 0.0]))
