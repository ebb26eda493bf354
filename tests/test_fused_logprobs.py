"""The fused log-prob / entropy pass (rl/losses.logprobs_and_entropy) against the per-row math it
replaced (tests/reference.py): values and gradients, every loss aggregation, entropy on and off,
temperatures, chunk boundaries inside a sequence, bf16 logits."""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from reflow.rl import losses
from reflow.rl.losses import AGG_MODES, aggregate, logprobs_and_entropy
from tests.reference import entropy_per_row, token_logprobs_per_row

B, T, V = 3, 7, 11


def _case(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T + 1, V, generator=g) * 3).to(dtype)[:, :-1]  # a slice, as the trainer's
    labels = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[0] = 0.0  # one sequence with no response token
    weights = torch.randn(B, T, generator=g)
    return logits, labels, mask, weights


def _loss(logp, ent, mask, weights, agg, entropy_coef):
    pg = aggregate(logp * weights, mask, agg, 9)
    return pg - entropy_coef * aggregate(ent, mask, agg, 9) if entropy_coef else pg


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_values_and_gradients_equal_the_per_row_math(agg, entropy_coef, temperature):
    logits, labels, mask, weights = _case(0)
    a = logits.detach().clone().requires_grad_(True)
    logp, ent = logprobs_and_entropy(a, labels, temperature, entropy=True)
    _loss(logp, ent if entropy_coef else ent.detach(), mask, weights, agg, entropy_coef).backward()

    r = logits.detach().clone().requires_grad_(True)
    t = 1.0 if temperature <= 1e-6 else temperature
    ref_lp = token_logprobs_per_row(r, labels, temperature)
    ref_ent = entropy_per_row(r / t)
    _loss(ref_lp, ref_ent if entropy_coef else ref_ent.detach(), mask, weights, agg, entropy_coef).backward()

    assert_close(logp, ref_lp, rtol=0, atol=1e-6)
    # The per-row entropy, logsumexp(x) - sum p*x on unshifted logits, loses up to ~3e-6 to
    # cancellation at |x| ~ 10; the fused pass works on x - max(x): within 1e-6 of float64.
    x = logits.double() / t
    truth = torch.logsumexp(x, -1) - (torch.softmax(x, -1) * x).sum(-1)  # float64 throughout
    assert (ent.double() - truth).abs().max() <= 1e-6
    assert (ent.double() - truth).abs().max() <= (ref_ent.double() - truth).abs().max() + 1e-7
    assert_close(ent, ref_ent, rtol=0, atol=5e-6)
    assert a.grad is not None and a.grad.abs().sum() > 0
    assert_close(a.grad, r.grad, rtol=0, atol=1e-6)


def test_entropy_off_gives_the_same_logprobs_and_gradients():
    logits, labels, mask, weights = _case(1)
    a = logits.detach().clone().requires_grad_(True)
    logp, ent = logprobs_and_entropy(a, labels, 1.0, entropy=False)
    assert ent is None
    (logp * weights * mask).sum().backward()
    r = logits.detach().clone().requires_grad_(True)
    (token_logprobs_per_row(r, labels) * weights * mask).sum().backward()
    assert_close(a.grad, r.grad, rtol=0, atol=1e-6)


def _assert_entropy_loss_matches_the_per_row_math(seed: int, temperature: float) -> None:
    """Values and gradients of a token-mean loss with an entropy bonus, fused against per-row math."""
    logits, labels, mask, weights = _case(seed)
    a = logits.detach().clone().requires_grad_(True)
    logp, ent = logprobs_and_entropy(a, labels, temperature, entropy=True)
    (aggregate(logp * weights, mask, "token-mean") - 0.1 * aggregate(ent, mask, "token-mean")).backward()
    r = logits.detach().clone().requires_grad_(True)
    (aggregate(token_logprobs_per_row(r, labels, temperature) * weights, mask, "token-mean")
     - 0.1 * aggregate(entropy_per_row(r / temperature), mask, "token-mean")).backward()
    assert_close(logp.detach(), token_logprobs_per_row(logits, labels, temperature), rtol=0, atol=1e-6)
    assert_close(a.grad, r.grad, rtol=0, atol=1e-6)


def test_chunks_that_split_a_sequence(monkeypatch):
    """Chunks of 3 positions (V=11 -> 33 elements): boundaries fall inside every sequence."""
    monkeypatch.setattr(losses, "_CHUNK_ELEMENTS", 3 * V)
    _assert_entropy_loss_matches_the_per_row_math(2, 0.9)


def test_blocks_of_whole_rows(monkeypatch):
    """Two rows a block (B=3: blocks of 2 and 1 rows); the logits are a non-contiguous slice, so each block
    is reshaped to [c, V] by copying at most one block."""
    monkeypatch.setattr(losses, "_CHUNK_ELEMENTS", 2 * T * V)
    assert list(losses._chunks(torch.empty(B, T, V))) == [(0, 2, 0, T), (2, 3, 0, T)]
    _assert_entropy_loss_matches_the_per_row_math(4, 0.8)


def test_bf16_logits_gradients_in_bf16_match_the_fp32_math():
    """bf16 logits are read as they are (upcast per chunk) and the gradient comes back in bf16."""
    logits, labels, mask, weights = _case(3, torch.bfloat16)
    a = logits.detach().clone().requires_grad_(True)
    logp, _ = logprobs_and_entropy(a, labels, 1.0)
    (logp * weights * mask).sum().backward()
    r = logits.detach().clone().requires_grad_(True)
    (token_logprobs_per_row(r, labels) * weights * mask).sum().backward()
    assert a.grad.dtype == torch.bfloat16
    assert_close(logp, token_logprobs_per_row(logits, labels), rtol=0, atol=1e-6)
    assert_close(a.grad, r.grad, rtol=0, atol=0)  # both round the same fp32 gradient to bf16
