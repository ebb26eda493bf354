"""Hand-computed checks of the estimators (rl/algorithms/) and the policy-loss options (rl/losses.py).

Every expected number is written out so it can be re-derived on paper.
"""
from __future__ import annotations

import math
import random

import pytest
import torch
import yaml
from torch.testing import assert_close

from reflow.infra.config.schema import ConfigError, load_config
from reflow.rl.algorithms import SPECS, algorithm_config
from reflow.rl.algorithms.gae import gae_advantages, value_loss_tokens
from reflow.rl.algorithms.grpo import grpo_advantages
from reflow.rl.algorithms.gspo import gspo_log_ratio
from reflow.rl.algorithms.reinforce_pp import (
    kl_shaped_returns,
    moments,
    reinforce_pp_advantages,
    reinforce_pp_scores,
    whiten_from_moments,
)
from reflow.rl.algorithms.rloo import rloo_advantages
from reflow.rl.dapo import fill_groups, groups_with_spread, overlong_penalty
from reflow.rl.losses import aggregate, policy_loss, policy_loss_tokens, tis_weights
from reflow.rl.types import RolloutBatch

T = torch.tensor
SQ3 = math.sqrt(3.0)


# ---------------------------------------------------------------- RLOO
def test_rloo_hand_values_single_and_equal_groups():
    rewards = T([1.0, 0.0, 0.0, 3.0, 1.0, 5.0, 2.0, 2.0])
    groups = T([0, 0, 0, 1, 1, 2, 3, 3])
    # group 0: 1 - (0+0)/2 = 1; 0 - (1+0)/2 = -0.5 (twice); group 1: 3 - 1 = 2, 1 - 3 = -2
    # group 2 has one sample (no baseline) -> 0; group 3 all equal -> 0
    assert_close(rloo_advantages(rewards, groups), T([1.0, -0.5, -0.5, 2.0, -2.0, 0.0, 0.0, 0.0]))
    assert rloo_advantages(T([]), T([], dtype=torch.long)).numel() == 0


# ---------------------------------------------------------------- REINFORCE++
def test_reinforce_pp_whitens_over_tokens():
    # scores [1, 0, 0, 1], token weights [2, 1, 1, 0]: n = 4, mean = 2/4 = 0.5,
    # biased var = 2/4 - 0.25 = 0.25, unbiased = 0.25 * 4/3 = 1/3 -> (s - 0.5) * sqrt(3)
    adv = reinforce_pp_advantages(T([1.0, 0.0, 0.0, 1.0]), T([0, 0, 1, 1]), T([2.0, 1.0, 1.0, 0.0]), baseline=False)
    assert_close(adv, T([0.5 * SQ3, -0.5 * SQ3, -0.5 * SQ3, 0.0]))  # zero-length sample -> 0


def test_reinforce_pp_baseline_subtracts_group_mean_then_whitens():
    # scores r - group mean = [0.5, -0.5, 1, -1]; mean 0, biased var (.25+.25+1+1)/4 = 0.625,
    # unbiased 0.625 * 4/3 = 0.8333 -> std 0.912871
    adv = reinforce_pp_advantages(T([1.0, 0.0, 3.0, 1.0]), T([0, 0, 1, 1]), T([1.0, 1.0, 1.0, 1.0]), baseline=True)
    s = math.sqrt(0.625 * 4 / 3)
    assert_close(adv, T([0.5 / s, -0.5 / s, 1.0 / s, -1.0 / s]))


def test_reinforce_pp_all_equal_and_empty_are_zero():
    for baseline in (False, True):
        adv = reinforce_pp_advantages(T([0.3, 0.3, 0.3]), T([0, 0, 1]), T([2.0, 0.0, 1.0]), baseline)
        assert_close(adv, torch.zeros(3), atol=1e-6, rtol=0)
        assert_close(reinforce_pp_advantages(T([1.0, 0.0]), T([0, 0]), T([0.0, 0.0]), baseline), torch.zeros(2))


def test_kl_shaped_returns_and_whitening():
    kl = T([[0.1, 0.2, 0.3, 9.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    # future KL sums [0.6, 0.5, 0.3]; returns 1 - 0.5 * that = [0.7, 0.75, 0.85]; padding -> 0
    g = kl_shaped_returns(T([1.0]), kl, mask, 0.5)
    assert_close(g.float(), T([[0.7, 0.75, 0.85, 0.0]]))
    # whitening: mean 0.7667, unbiased var = ((-.0667)^2 + (-.0167)^2 + .0833^2) / 2 = 0.005833
    w = whiten_from_moments(g, mask, moments(g, mask))
    mean, sd = 2.3 / 3, math.sqrt(0.0058333333 + 1e-8)
    assert_close(w, T([[(0.7 - mean) / sd, (0.75 - mean) / sd, (0.85 - mean) / sd, 0.0]]), atol=1e-4, rtol=1e-4)
    assert_close(whiten_from_moments(g, torch.zeros_like(mask), moments(g, torch.zeros_like(mask))), torch.zeros(1, 4))


# ---------------------------------------------------------------- GAE
def test_gae_hand_values():
    r, v, m = T([[0.0, 0.0, 1.0]]), T([[0.5, 0.6, 0.7]]), torch.ones(1, 3)
    # gamma = lambda = 1: deltas [0.1, 0.1, 0.3] -> A = [0.5, 0.4, 0.3], returns = A + V = 1
    adv, ret = gae_advantages(r, v, m, 1.0, 1.0)
    assert_close(adv, T([[0.5, 0.4, 0.3]]))
    assert_close(ret, T([[1.0, 1.0, 1.0]]))
    # gamma 0.9, lambda 0.5: deltas [.9*.6-.5, .9*.7-.6, .3] = [.04, .03, .3];
    # A2 = .3, A1 = .03 + .45 * .3 = .165, A0 = .04 + .45 * .165 = .11425
    adv, _ = gae_advantages(r, v, m, 0.9, 0.5)
    assert_close(adv, T([[0.11425, 0.165, 0.3]]))


def _gae_loop(rewards, values, mask, gamma, lam):
    """Plain reverse loop over each row's response tokens (masked positions skipped)."""
    B, Tn = len(rewards), len(rewards[0])
    adv = [[0.0] * Tn for _ in range(B)]
    for b in range(B):
        pos = [t for t in range(Tn) if mask[b][t]]
        last, next_v = 0.0, 0.0
        for t in reversed(pos):
            delta = rewards[b][t] + gamma * next_v - values[b][t]
            last = delta + gamma * lam * last
            adv[b][t], next_v = last, values[b][t]
    return adv


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_reverse_loop_on_random_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    B, Tn = 5, 9
    rewards, values = torch.randn(B, Tn, generator=g), torch.randn(B, Tn, generator=g)
    mask = torch.zeros(B, Tn)
    for b in range(B):  # prompt prefix, response, right padding; row 4 holds no response token
        start, end = b, b + (Tn - 2 * b if b < 4 else 0)
        mask[b, start:max(start, end)] = 1.0
    mask[1, 3] = 0.0  # a hole inside a response is skipped, too
    rewards[mask == 0] = float("nan")  # padding can hold anything
    gamma, lam = 0.5 + 0.5 * random.Random(seed).random(), 0.95
    adv, ret = gae_advantages(rewards, values, mask, gamma, lam)
    expect = T(_gae_loop(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam))
    assert_close(adv, expect, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert_close(ret, torch.where(mask != 0, expect + values, torch.zeros_like(expect)), atol=1e-5, rtol=1e-5)


def test_value_loss_clipping_hand_values():
    v, old, ret = T([[1.0, 0.0, 0.5, float("nan")]]), T([[0.5, 0.5, 0.5, 0.0]]), T([[2.0, -1.0, 0.0, 0.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    # token 0: V moved +0.5 from old, clipped to 0.7: max((1-2)^2, (0.7-2)^2) = 1.69 -> 0.845
    # token 1: clipped V 0.3: max((0+1)^2, (0.3+1)^2) = 1.69 -> 0.845; token 2: unmoved: 0.5 * 0.25
    assert_close(value_loss_tokens(v, old, ret, mask, 0.2), T([[0.845, 0.845, 0.125, 0.0]]))
    assert_close(value_loss_tokens(v, old, ret, mask, None), T([[0.5, 0.5, 0.125, 0.0]]))


# ---------------------------------------------------------------- loss options
def test_aggregate_token_sum_modes():
    v = T([[1.0, 1.0, 1.0, 1.0], [3.0, 9.0, 9.0, 9.0], [5.0, 5.0, 5.0, 5.0]])
    m = T([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    # seq sums 4 and 3 over the 2 sequences with tokens -> 3.5
    assert_close(aggregate(v, m, "seq-mean-token-sum"), T(3.5))
    # Dr.GRPO constant normaliser: total 7 / (3 rows * norm_len 4)
    assert_close(aggregate(v, m, "seq-mean-token-sum-norm", norm_len=4), T(7.0 / 12.0))
    for mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        assert_close(aggregate(v, torch.zeros_like(m), mode, norm_len=4), T(0.0))
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(v, m, "seq-mean-token-sum-norm")


def test_dual_clip_caps_negative_advantage_loss():
    logp = T([[3.0, 3.0, math.log(0.5)]], requires_grad=True)
    old, mask = torch.zeros(1, 3), torch.ones(1, 3)
    adv = T([[-1.0, 1.0, -1.0]])
    # token 0: A=-1, r=e^3=20.09 -> PPO loss 20.09, dual clip min(20.09, 3 * 1) = 3 (no gradient)
    # token 1: A=+1 untouched: max(-20.09, -1.2) = -1.2; token 2: A=-1, r=.5 -> max(.5, .8) = .8 < 3
    out = policy_loss_tokens(logp, old, adv, mask, 0.2, 0.2, dual_clip_c=3.0)
    assert_close(out, T([[3.0, -1.2, 0.8]]))
    out.sum().backward()
    assert_close(logp.grad, T([[0.0, 0.0, 0.0]]))
    assert_close(policy_loss_tokens(logp, old, adv, mask, 0.2, 0.2)[0, 0], T(math.exp(3.0)))


def test_tis_weights_truncate_and_scale_the_loss():
    old = T([[-1.0, -1.0, 0.0, 0.0]])
    rollout = T([[-1.5, -0.5, 0.0, 7.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    # exp(old - rollout) = [e^.5 = 1.6487 -> capped 1.5, e^-.5 = 0.6065, 1]; masked -> 1
    w = tis_weights(old, rollout, mask, cap=1.5)
    assert_close(w, T([[1.5, math.exp(-0.5), 1.0, 1.0]]))
    logp = torch.zeros(1, 4, requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(1, 4), T([2.0]), mask, 0.2, 0.2, "token-mean", is_weights=w)
    # ratio 1 everywhere: per-token -2 * w -> mean over 3 tokens
    assert_close(loss, T(-2.0 * (1.5 + math.exp(-0.5) + 1.0) / 3))


def test_gspo_sequence_ratio_value_and_gradient():
    logp = T([[0.2, 0.4, float("nan")], [0.0, 0.0, 0.0]], requires_grad=True)
    old, mask = torch.zeros(2, 3), T([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    lr = gspo_log_ratio(logp, old, mask)
    # row 0: mean log ratio (0.2 + 0.4) / 2 = 0.3 on every token; row 1 (no tokens): 0
    assert_close(lr[0, :2], T([0.3, 0.3]))
    assert_close(lr[1], T([0.0, 0.0, 0.0]))
    # A = -1: s = e^.3 = 1.3499 > 1.2, unclipped branch wins -> loss e^.3 per token;
    # seq-mean-token-mean gradient d/dlogp_t (e^{mean logp}) = e^.3 / 2 = GSPO's eq. 5 gradient
    loss, met = policy_loss(logp, old, T([-1.0, 1.0]), mask, 0.2, 0.2, "seq-mean-token-mean",
                            ratio_level="sequence")
    assert_close(loss, T(math.exp(0.3)))
    loss.backward()
    assert_close(logp.grad[0, :2], T([math.exp(0.3) / 2] * 2))
    assert torch.isfinite(logp.grad).all() and all(torch.isfinite(v) for v in met.values())


# ---------------------------------------------------------------- no NaN anywhere
KINDS = ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo"]


def _scored(rewards: list[float], groups: list[int], lengths: list[int]) -> RolloutBatch:
    n = len(rewards)
    return RolloutBatch(group_index=groups, prompt_text=["p"] * n, prompt_ids=[[1]] * n, response_text=["r"] * n,
                        response_ids=[[2] * k for k in lengths], rollout_logprobs=[[0.0] * k for k in lengths],
                        finish_reason=["stop"] * n, label=[None] * n, rewards=rewards)


def _spec_advantages(kind: str, batch: RolloutBatch, **fields) -> list[float]:
    """Advantages the way the rollout stage computes them: through the type's spec."""
    cfg = algorithm_config(type=kind, **fields)
    out, stats = cfg.spec.advantages(batch, cfg)
    assert set(stats) == {"adv_abs_mean", "groups_with_signal_frac"}
    assert out.extra["advantages_are_scores"] == (cfg.kl_reward_coef > 0)
    return out.advantages


@pytest.mark.parametrize("kind", KINDS)
def test_every_estimator_is_finite_on_degenerate_batches(kind):
    # an all-equal group, single-sample groups, zero-length responses
    degenerate = _scored([1.0, 1.0, 0.0, 2.0, 0.5], [0, 0, 1, 2, 3], [0, 3, 0, 1, 2])
    for kl in ((0.0, 0.1) if SPECS[kind].kl_in_reward else (None,)):
        adv = _spec_advantages(kind, degenerate, **({} if kl is None else {"kl_in_reward": kl}))
        assert len(adv) == 5 and all(math.isfinite(a) for a in adv)
    eq = _spec_advantages(kind, _scored([0.7] * 4, [0, 0, 1, 1], [1, 2, 0, 3]))
    assert_close(T(eq), torch.zeros(4), atol=1e-6, rtol=0)
    assert _spec_advantages(kind, _scored([], [], [])) == []


def test_specs_route_to_each_papers_estimator():
    """What each spec computes equals the module's estimator called directly (the dispatch adds nothing)."""
    rewards, groups, lengths = [1.0, 0.0, 0.5, 0.5, 1.0, 0.2], [0, 0, 1, 1, 2, 2], [3, 1, 2, 2, 4, 1]
    batch = _scored(rewards, groups, lengths)
    r, g, n = T(rewards), T(groups, dtype=torch.long), T([float(k) for k in lengths])
    expect = {"grpo": grpo_advantages(r, g), "gspo": grpo_advantages(r, g), "rloo": rloo_advantages(r, g),
              "reinforce_pp": reinforce_pp_advantages(r, g, n, False),
              "reinforce_pp_baseline": reinforce_pp_advantages(r, g, n, True)}
    for kind, want in expect.items():
        assert_close(T(_spec_advantages(kind, batch)), want)
    assert_close(T(_spec_advantages("grpo", batch, normalize_std=False)), grpo_advantages(r, g, normalize_std=False))
    scores = _spec_advantages("reinforce_pp_baseline", batch, kl_in_reward=0.1)  # finished by the trainer
    assert_close(T(scores), reinforce_pp_scores(r, g, True).float())


def test_spec_table():
    """Only PPO needs a critic, only GSPO has a sequence-level ratio, only REINFORCE++ folds KL into
    the reward (and has a trainer-side finish for it)."""
    assert {k for k, s in SPECS.items() if s.needs_critic} == {"ppo"}
    assert {k for k, s in SPECS.items() if s.ratio_level == "sequence"} == {"gspo"}
    assert {k for k, s in SPECS.items() if s.kl_in_reward} == {"reinforce_pp", "reinforce_pp_baseline"}
    assert all((s.finish_advantages is not None) == s.kl_in_reward for s in SPECS.values())
    assert all(s.config.model_fields["type"].default == k for k, s in SPECS.items())


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_every_loss_option_is_finite_on_zero_length_responses(mode, ratio_level):
    logp = T([[0.3, float("nan")], [float("inf"), -0.2]], requires_grad=True)
    mask = T([[0.0, 0.0], [0.0, 1.0]])
    old, rollout = torch.zeros(2, 2), T([[float("nan"), 0.0], [0.0, -0.1]])
    w = tis_weights(old, rollout, mask, 2.0)
    loss, met = policy_loss(logp, old, T([[1.0, 1.0], [-1.0, -1.0]]), mask, 0.2, 0.28, mode, norm_len=4,
                            dual_clip_c=3.0, is_weights=w, ratio_level=ratio_level)
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in met.values())
    loss.backward()
    assert torch.isfinite(logp.grad).all()


def test_grpo_hand_values_and_ppo_needs_critic_values():
    assert_close(grpo_advantages(T([1.0, 0.0]), T([0, 0]), eps=0.0), T([1 / math.sqrt(2), -1 / math.sqrt(2)]))
    cfg = algorithm_config(type="ppo")
    with pytest.raises(ValueError, match="critic values"):
        cfg.spec.advantages(_scored([1.0], [0], [1]), cfg)


# ---------------------------------------------------------------- DAPO
def test_overlong_penalty_hand_values():
    # max 10 tokens, buffer 4: free up to 6, then (6 - len) / 4, -1 at 10 and beyond
    assert [overlong_penalty(n, 10, 4, 1.0) for n in (0, 6, 8, 10, 11)] == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert overlong_penalty(9, 10, 4, 0.5) == pytest.approx(-0.375)
    assert overlong_penalty(50, 10, 0, 1.0) == 0.0


def _batch(rewards: list[float], group_index: list[int], tag: str) -> RolloutBatch:
    n = len(rewards)
    return RolloutBatch(group_index=group_index, prompt_text=[f"{tag}{g}" for g in group_index],
                        prompt_ids=[[1]] * n, response_text=[f"{tag}{i}" for i in range(n)],
                        response_ids=[[2]] * n, rollout_logprobs=[[0.0]] * n, finish_reason=["stop"] * n,
                        label=[None] * n, rewards=rewards)


def test_dynamic_sampling_keeps_informative_groups_then_fills():
    r1 = _batch([1.0, 1.0, 0.0, 1.0, 0.0, 0.0], [0, 0, 1, 1, 2, 2], "a")  # only group 1 has spread
    r2 = _batch([1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1], "b")  # only group 0 has spread
    assert groups_with_spread(r1) == ([1], [0, 2])
    out, filler = fill_groups([r1, r2], target=3)
    # informative a1, b0 first, then the first zero-spread group a0 tops the batch up
    assert filler == 1 and out.group_index == [0, 0, 1, 1, 2, 2]
    assert out.prompt_text == ["a1", "a1", "b0", "b0", "a0", "a0"] and out.rewards == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    out, filler = fill_groups([r1, r2], target=1)
    assert filler == 0 and out.prompt_text == ["a1", "a1"]
    with pytest.raises(ValueError, match="only 5 groups"):
        fill_groups([r1, r2], target=6)


# ---------------------------------------------------------------- config
def test_algorithm_config_fields_and_checks():
    cfg = load_config(None, ["algorithm.type=reinforce_pp", "algorithm.kl_in_reward=0.01", "algorithm.tis_cap=2",
                             "algorithm.dual_clip_c=3", "algorithm.loss_agg=seq-mean-token-sum-norm"])
    assert cfg.algorithm.needs_ref and cfg.algorithm.tis_cap == 2.0
    ppo = load_config(None, ["algorithm.type=ppo", "critic.warmup_iterations=2", "algorithm.value_clip=null"])
    assert (ppo.algorithm.gamma, ppo.algorithm.lam, ppo.algorithm.value_clip) == (1.0, 0.95, None)
    assert ppo.critic.warmup_iterations == 2 and ppo.critic.path is None
    for bad, field in (("algorithm.lam=1.5", "algorithm.lam"), ("algorithm.gamma=-1", "algorithm.gamma"),
                       ("algorithm.value_clip=0", "algorithm.value_clip"), ("critic.lr=0", "critic.lr"),
                       ("critic.warmup_iterations=-1", "critic.warmup_iterations")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(None, ["algorithm.type=ppo", bad])
    with pytest.raises(ConfigError, match="kl_in_reward is an option of algorithm.type=reinforce_pp/reinforce_pp_baseline, "
                                          "not of type=grpo"):
        load_config(None, ["algorithm.type=grpo", "algorithm.kl_in_reward=0.1"])
    with pytest.raises(ConfigError, match=r"algorithm: .*gamma is an option of algorithm.type=ppo, not of type=gspo"):
        load_config(None, ["algorithm.type=gspo", "algorithm.gamma=0.9"])
    with pytest.raises(ConfigError, match="normalize_std is an option of algorithm.type=grpo/gspo, not of type=ppo"):
        load_config(None, ["algorithm.type=ppo", "algorithm.normalize_std=false"])
    with pytest.raises(ConfigError, match="algorithm: Input tag 'ppo2'.*expected tags: 'grpo'"):
        load_config(None, ["algorithm.type=ppo2"])
    with pytest.raises(ConfigError, match=r"algorithm\.typo"):
        load_config(None, ["algorithm.typo=1"])
    assert type(load_config(None, []).algorithm).__name__ == "GRPOConfig"  # the default type


def test_another_types_fields_are_refused_even_at_their_defaults(tmp_path):
    """A file carrying every type's fields (as the single-class AlgorithmConfig of 0.1 dumped them) is refused,
    naming the type a field belongs to: no field is dropped silently, whatever its value."""
    old = {"type": "grpo", "normalize_std": False, "clip_eps_low": 0.2, "gamma": 1.0, "loss_agg": "token-mean"}
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"algorithm": old}))
    with pytest.raises(ConfigError, match="gamma is an option of algorithm.type=ppo"):
        load_config(path)
    with pytest.raises(ConfigError, match="dual_clip_c"):
        load_config(None, ["algorithm.dual_clip_c=0.5"])
