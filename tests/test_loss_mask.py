"""Multi-turn loss masks (RolloutBatch.response_mask): tool/environment tokens get no gradient, no
weight in any loss aggregation mode, no advantage, and do not count as the policy's tokens."""
from __future__ import annotations

import pytest
import torch

from reflow.rl.algorithms.base import sequence_level
from reflow.rl.algorithms.ppo import gae_batch
from reflow.rl.losses import AGG_MODES, policy_loss, policy_loss_tokens, token_logprobs
from reflow.rl.types import RolloutBatch, to_train_tensors

MASKS = [[1, 1, 0, 0, 1], [1, 0, 1], [0, 0]]  # sample 2: nothing generated (all tool output)


def _batch(**kw) -> RolloutBatch:
    resp = [[3 + j for j in range(len(m))] for m in MASKS]
    return RolloutBatch(group_index=[0, 0, 1], prompt_text=["a", "b", "c"], prompt_ids=[[1, 2], [1], [2, 2, 2]],
                        response_text=["", "", ""], response_ids=resp,
                        rollout_logprobs=[[-0.5 if k else 0.0 for k in m] for m in MASKS],
                        finish_reason=["stop"] * 3, label=[None] * 3, response_mask=[list(m) for m in MASKS], **kw)


def _loss(logits: torch.Tensor, t: dict, adv: torch.Tensor, old_shift: torch.Tensor, mode: str) -> torch.Tensor:
    labels = t["input_ids"][:, 1:]  # [B, T-1]
    logp = token_logprobs(logits, labels)  # [B, T-1]
    old = logp.detach() + old_shift  # a ratio away from 1, so clipping and advantages matter
    return policy_loss(logp, old, adv, t["loss_mask"], 0.2, 0.2, mode, norm_len=6)[0]


@pytest.mark.parametrize("mode", AGG_MODES)
def test_masked_tokens_get_no_gradient_and_no_weight(mode):
    t = to_train_tensors(_batch(), pad_id=0)
    mask = t["loss_mask"]  # [B, T-1]
    assert mask.sum() == sum(map(sum, MASKS)) and mask[2].sum() == 0
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(*mask.shape, 11, generator=g).requires_grad_()  # [B, T-1, V]
    adv = torch.randn(*mask.shape, generator=g)  # [B, T-1] token-level, so masked ones could matter
    shift = 0.3 * torch.randn(*mask.shape, generator=g)
    loss = _loss(logits, t, adv, shift, mode)
    loss.backward()
    hole = (mask == 0)  # [B, T-1]: prompt, padding and tool tokens
    assert logits.grad[hole].abs().max() == 0 and logits.grad[~hole].abs().sum() > 0
    # Anything at masked positions may change without changing the loss ...
    noisy = logits.detach().clone()
    noisy[hole] = 50 * torch.randn(int(hole.sum()), 11, generator=g)
    other = _loss(noisy, t, torch.where(hole, 1e3, adv), torch.where(hole, -5.0, shift), mode)
    torch.testing.assert_close(other, loss.detach())
    # ... and the reduction counts only the generated tokens (hand-computed from the per-token losses).
    with torch.no_grad():
        logp = token_logprobs(logits, t["input_ids"][:, 1:])
        tok = policy_loss_tokens(logp, logp + shift, adv, mask, 0.2, 0.2)  # [B, T-1]
    kept = [[float(tok[b, j]) for j in range(mask.shape[1]) if mask[b, j]] for b in range(mask.shape[0])]
    rows = [k for k in kept if k]
    expected = {"token-mean": sum(map(sum, rows)) / sum(map(len, rows)),
                "seq-mean-token-mean": sum(sum(k) / len(k) for k in rows) / len(rows),
                "seq-mean-token-sum": sum(sum(k) for k in rows) / len(rows),
                "seq-mean-token-sum-norm": sum(map(sum, rows)) / (3 * 6)}[mode]
    torch.testing.assert_close(loss.detach().double(), torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)


def test_advantage_estimators_skip_tool_tokens():
    batch = _batch(rewards=[1.0, 0.0, 1.0])
    assert batch.policy_tokens() == [3, 2, 0]
    seen = {}

    def estimate(r, g, lengths, cfg):
        seen["lengths"] = lengths.tolist()
        return r

    class Cfg:
        kl_reward_coef = 0.0

    sequence_level(estimate)(batch, Cfg())
    assert seen["lengths"] == [3.0, 2.0, 0.0]  # token-weighted estimators weigh generated tokens only
    values = [[0.5] * len(m) for m in MASKS]
    out, _ = gae_batch(batch.with_(values=values), gamma=1.0, lam=1.0)
    for adv, ret, m in zip(out.token_advantages, out.returns, MASKS):
        assert [a for a, k in zip(adv, m) if not k] == [0.0] * m.count(0)
        assert [x for x, k in zip(ret, m) if not k] == [0.0] * m.count(0)
    # gamma = lam = 1: every generated token's return is the sequence reward, wherever the tool tokens sit
    assert [x for x, k in zip(out.returns[0], MASKS[0]) if k] == [1.0, 1.0, 1.0]
    assert [x for x, k in zip(out.returns[1], MASKS[1]) if k] == [0.0, 0.0]


def test_a_mask_of_the_wrong_length_is_refused():
    bad = _batch()
    bad.response_mask[1] = [1, 0]
    with pytest.raises(ValueError, match="sample 1: response_mask has 2 entries for 3 response tokens"):
        to_train_tensors(bad, pad_id=0)
