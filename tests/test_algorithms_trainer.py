"""Loss options through the real DeepSpeed trainer (2 ranks, 2 micro-batches each) against a
single-process torch computation of the same objective on the whole batch.

Equal gradient norms prove the cross-rank / micro-batch normalisation of every aggregation mode,
TIS weights, the sequence-level (GSPO) ratio and the trainer-side REINFORCE++ KL-in-reward.
"""
from __future__ import annotations

import math

import pytest
import ray
import torch

from reflow.engines.hf_io import load_causal_lm, load_tokenizer
from reflow.rl.algorithms.reinforce_pp import kl_shaped_returns, moments, whiten_from_moments
from reflow.rl.losses import aggregate, entropy_from_logits, kl_estimate, policy_loss, tis_weights, token_logprobs
from reflow.rl.types import to_train_tensors
from tests.test_trainer import TEMPERATURE, _batch, _create, _train_kw

pytestmark = pytest.mark.slow

NORM_LEN = 6


def _logprobs(model, t):
    logits = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).logits[:, :-1]  # [B, T-1, V]
    return logits, token_logprobs(logits, t["input_ids"][:, 1:], TEMPERATURE)  # [B, T-1]


def _reference(policy, named, batch, opt):
    """(batch with rollout logprobs, loss, pre-clip grad norm) of the objective on the whole batch."""
    model = load_causal_lm(str(policy)).eval()
    model.load_state_dict(dict(named))
    t = to_train_tensors(batch, load_tokenizer(str(policy)).pad_token_id)
    mask, agg = t["loss_mask"], opt["loss_agg"]
    logits, logp = _logprobs(model, t)
    old = logp.detach()
    # rollout logprobs shifted by +-0.3 per sample, so TIS weights are e^-+0.3 (one side capped)
    shift = torch.tensor([0.3 if i % 2 else -0.3 for i in range(len(batch))]).unsqueeze(-1)  # [B, 1]
    rollout = old - shift * mask  # [B, T-1]
    adv = t["advantages"]  # [B]
    if opt.get("kl_in_reward", 0.0) > 0:
        with torch.no_grad():
            _, ref_lp = _logprobs(load_causal_lm(str(policy)).eval(), t)
        g = kl_shaped_returns(adv, kl_estimate(old, ref_lp, opt["kl_estimator"]), mask, opt["kl_in_reward"])
        adv = whiten_from_moments(g, mask, moments(g, mask))  # [B, T-1]
    isw = tis_weights(old, rollout, mask, opt["tis_cap"]) if opt.get("tis_cap") else None
    pg, _ = policy_loss(logp, old, adv, mask, 0.2, 0.2, agg, norm_len=NORM_LEN, dual_clip_c=opt.get("dual_clip_c"),
                        is_weights=isw, ratio_level=opt.get("ratio_level", "token"))
    ent = aggregate(entropy_from_logits(logits / TEMPERATURE), mask, agg, NORM_LEN)
    loss = pg - opt.get("entropy_coef", 0.0) * ent
    loss.backward()
    norm = math.sqrt(sum(float(p.grad.square().sum()) for p in model.parameters() if p.grad is not None))
    rows = [rollout[i][mask[i] != 0].tolist() for i in range(len(batch))]
    return batch.with_(rollout_logprobs=rows), float(loss.detach()), norm


@pytest.fixture(scope="module")
def group(ray_cluster, tiny_policy):
    g = _create("algo", 2, tiny_policy, zero_stage=0, ref_model_path=str(tiny_policy))
    yield g
    g.kill()


CASES = {
    "token-sum": dict(loss_agg="seq-mean-token-sum", entropy_coef=0.01),
    "token-sum-norm": dict(loss_agg="seq-mean-token-sum-norm", entropy_coef=0.01),
    "tis+dual-clip": dict(loss_agg="token-mean", tis_cap=1.2, dual_clip_c=3.0),
    "gspo": dict(loss_agg="seq-mean-token-mean", ratio_level="sequence"),
    "kl-in-reward": dict(loss_agg="token-mean", kl_in_reward=0.5, kl_estimator="k1"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_option_matches_single_process_reference(group, tiny_policy, case):
    opt = CASES[case]
    pad = load_tokenizer(str(tiny_policy)).pad_token_id
    opt = {"kl_estimator": "low_var_kl"} | opt
    kw = _train_kw(pad, **opt, loss_norm_len=NORM_LEN)
    if opt.get("kl_in_reward"):  # move the policy off the reference first, so the KL is not 0
        ray.get(group.train_iteration(_batch(tiny_policy), **_train_kw(pad)))
    named = ray.get(group.named_weights()[0])
    batch, ref_loss, ref_norm = _reference(tiny_policy, named, _batch(tiny_policy), opt)
    if opt.get("kl_in_reward"):
        batch = batch.with_(extra={"advantages_are_scores": True})
    m = ray.get(group.train_iteration(batch, **kw))[0]
    assert all(math.isfinite(v) for v in m.values()), m
    assert m["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
    assert m["loss"] == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
    if opt.get("tis_cap"):
        assert m["tis_weight_mean"] == pytest.approx((1.2 + math.exp(-0.3)) / 2, rel=0.2)  # 1.2 or e^-.3
    if opt.get("kl_in_reward"):
        assert m["kl_in_reward_mean"] != 0.0


def test_kl_in_reward_refuses_finished_advantages(group, tiny_policy):
    pad = load_tokenizer(str(tiny_policy)).pad_token_id
    with pytest.raises(ray.exceptions.RayTaskError, match="needs per-sequence scores"):
        ray.get(group.train_iteration(_batch(tiny_policy), **_train_kw(pad, kl_in_reward=0.1)))
