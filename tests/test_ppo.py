"""PPO's critic (engines/train/critic.py) on a real local Ray cluster with real DeepSpeed ranks (CPU, gloo).

Numbers are checked against a plain single-process forward of the same value model with the
critic's own weights: values per response token (alignment), the clipped value loss and its
gradient norm against hand-computed formulas, GAE returns as the targets. Checkpoints go through
tasks/checkpoint.py (one manifest for policy + critic) and must restore the critic bit for bit,
optimizer state included. The 3-iteration PPO run of the demo flow is in test_algorithms_e2e.py.
"""
from __future__ import annotations

import json
import math

import pytest
import ray
import torch

from reflow.engines.hf_io import load_tokenizer
from reflow.engines.train.critic import CriticGroup, attach_values, load_value_model
from reflow.engines.train.settings import RankSettings
from reflow.rl.algorithms.ppo import gae_batch
from reflow.rl.types import to_train_tensors
from tests.test_trainer import RANK_KW, _batch

pytestmark = pytest.mark.slow

NAMESPACE = "test-ppo"
LAM = 0.95
# Sequence rewards of the 8 samples of tests.test_trainer._batch (responses of 1-4 tokens).
REWARDS = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
CRITIC_KW = dict(precision="fp32", lr=1e-3, weight_decay=0.0, grad_clip=1.0, micro_batch_size=3, threads=1, seed=0,
                 zero3_param_persistence_threshold=0)  # micro-batches of 3 over 4 samples/rank: uneven on purpose


def _create(prefix: str, num_ranks: int, policy, **kw) -> CriticGroup:
    return CriticGroup.create(num_ranks, NAMESPACE, prefix, model_path=str(policy), init_timeout_s=300,
                              settings=RankSettings(**(CRITIC_KW | kw)))


@pytest.fixture(scope="module")
def critic(ray_cluster, tiny_policy):
    group = _create("critic-z3", 2, tiny_policy, zero_stage=3)  # ZeRO-3: the forward passes gather collectively
    yield group
    group.kill()


@pytest.fixture(scope="module")
def pad(tiny_policy) -> int:
    return load_tokenizer(str(tiny_policy)).pad_token_id


def _plain(policy, group):
    """A single-process ValueModel holding the critic's current weights."""
    model = load_value_model(str(policy)).eval()
    model.load_state_dict(dict(ray.get(group.named_weights()[0])))
    return model


def _plain_values(model, batch, pad):
    """Values per response token, read by hand: token j of a response after a prompt of p tokens is
    scored from the hidden state at position p + j - 1 (the position that predicts it)."""
    t = to_train_tensors(batch, pad)
    v = model(t["input_ids"], t["attention_mask"])  # [B, T]
    return v, [[v[i, len(p) + j - 1] for j in range(len(r))] for i, (p, r) in enumerate(zip(batch.prompt_ids,
                                                                                           batch.response_ids))]


def _with_values(group, batch, pad):
    return attach_values(batch, *ray.get(group.compute_values(batch, pad_id=pad)))


def test_values_align_with_a_plain_forward(critic, tiny_policy, pad):
    batch = _batch(tiny_policy).with_(rewards=REWARDS)
    out = _with_values(critic, batch, pad)
    _, expect = _plain_values(_plain(tiny_policy, critic), batch, pad)
    assert [len(v) for v in out.values] == [len(r) for r in batch.response_ids]
    for got, want in zip(out.values, expect):
        torch.testing.assert_close(torch.tensor(got), torch.stack(want).detach(), rtol=1e-5, atol=1e-6)
    assert len({round(v, 6) for row in out.values for v in row}) > 4, "values do not depend on the position"


@pytest.fixture()
def fresh_critic(ray_cluster, tiny_policy):
    group = _create("critic-fresh", 2, tiny_policy, zero_stage=3)
    yield group
    group.kill()


def test_one_critic_step_decreases_the_value_loss(fresh_critic, tiny_policy, pad):
    """The critic's first update (fresh weights and Adam state, whatever ran before)."""
    critic = fresh_critic
    batch = _with_values(critic, _batch(tiny_policy).with_(rewards=REWARDS), pad)
    out, _ = gae_batch(batch, 1.0, LAM)
    before = ray.get(critic.weights_checksum())
    first = ray.get(critic.train_iteration(out, minibatches=1, pad_id=pad, clip_eps=None))[0]
    after = ray.get(critic.weights_checksum())
    assert len(set(after)) == 1 and after[0] != before[0]
    again = _with_values(critic, out, pad)  # same targets, values of the updated critic
    second = ray.get(critic.train_iteration(again, minibatches=1, pad_id=pad, clip_eps=None))[0]
    assert second["value_loss"] < first["value_loss"]


def test_gae_returns_are_the_targets(critic, tiny_policy, pad):
    """GAE with gamma 1 by hand on each sample; the returns are what the critic then regresses on
    (its reported loss without clipping is 0.5 * mean (V - R)^2 with these R)."""
    batch = _with_values(critic, _batch(tiny_policy).with_(rewards=REWARDS), pad)
    out, stats = gae_batch(batch, gamma=1.0, lam=LAM)
    raw = []
    for v, r, ret, adv in zip(batch.values, REWARDS, out.returns, out.token_advantages):
        n = len(v)
        deltas = [(v[t + 1] if t + 1 < n else 0.0) - v[t] + (r if t == n - 1 else 0.0) for t in range(n)]
        a = [sum(LAM ** (s - t) * deltas[s] for s in range(t, n)) for t in range(n)]
        raw += a
        torch.testing.assert_close(torch.tensor(ret), torch.tensor([x + y for x, y in zip(a, v)]), rtol=1e-5, atol=1e-6)
        assert ret[-1] == pytest.approx(r, abs=1e-6)  # the last token's target is the reward itself
        assert len(adv) == n
    white = torch.tensor([x for row in out.token_advantages for x in row])
    assert white.mean().item() == pytest.approx(0.0, abs=1e-5) and white.std().item() == pytest.approx(1.0, abs=1e-4)
    assert torch.corrcoef(torch.stack([white, torch.tensor(raw)]))[0, 1] > 0.9999  # whitening is affine
    assert out.advantages == [row[0] for row in out.token_advantages]
    assert stats["returns_mean"] == pytest.approx(sum(raw) / len(raw) + stats["values_mean"], abs=1e-5)
    t = to_train_tensors(out, pad)  # token fields land where loss_mask is 1, in order
    assert t["advantages"].shape == t["loss_mask"].shape
    assert t["returns"][t["loss_mask"] != 0].tolist() == pytest.approx([x for row in out.returns for x in row])

    model = _plain(tiny_policy, critic)
    m = ray.get(critic.train_iteration(out, minibatches=1, pad_id=pad, clip_eps=None))[0]
    _, vals = _plain_values(model, out, pad)
    err = [0.5 * (v.detach().item() - R) ** 2 for row, rets in zip(vals, out.returns) for v, R in zip(row, rets)]
    assert m["value_loss"] == pytest.approx(sum(err) / len(err), rel=1e-5)
    assert m["value_clip_frac"] == 0.0


def _hand_clipped(vals, returns, eps):
    """Per-token 0.5 max((V - R)^2, (old + clip(V - old, -eps, eps) - R)^2) with old = 0, written out;
    a token on the clipped side is a constant (its V is outside old +- eps: no gradient)."""
    terms, n_clip = [], 0
    for row, rets in zip(vals, returns):
        for val, R in zip(row, rets):
            x = val.detach().item()
            c = max(-eps, min(eps, x))
            unclipped, clip = 0.5 * (x - R) ** 2, 0.5 * (c - R) ** 2
            n_clip += clip > unclipped
            terms.append(0.5 * (val - R).square() if unclipped >= clip else torch.tensor(clip))
    return torch.stack(terms), n_clip


def test_clipped_value_loss_and_grad_norm_match_hand_values(critic, tiny_policy, pad):
    """Old values 0 and returns +-1 by hand, eps 0.01: loss, clip fraction and pre-clip gradient
    norm over 2 ranks with uneven micro-batches (3 + 1 samples) equal a single-process computation
    over the whole batch, so the loss is normalised by the global token count."""
    eps = 0.01
    batch = _batch(tiny_policy).with_(rewards=REWARDS)
    returns = [[(-1.0) ** (i + j) for j in range(len(r))] for i, r in enumerate(batch.response_ids)]
    batch = batch.with_(values=[[0.0] * len(r) for r in batch.response_ids], returns=returns)
    model = _plain(tiny_policy, critic)
    terms, n_clip = _hand_clipped(_plain_values(model, batch, pad)[1], returns, eps)
    assert 0 < n_clip < len(terms), "the test needs clipped and unclipped tokens"
    loss = terms.mean()
    loss.backward()
    norm = math.sqrt(sum(float(p.grad.square().sum()) for p in model.parameters() if p.grad is not None))
    metrics = ray.get(critic.train_iteration(batch, minibatches=1, pad_id=pad, clip_eps=eps))
    assert all(x == metrics[0] for x in metrics), "ranks must return the same all-reduced metrics"
    m = metrics[0]
    assert m["value_loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert m["value_clip_frac"] == pytest.approx(n_clip / len(terms))
    assert m["critic_grad_norm"] == pytest.approx(norm, rel=1e-4)
    m2 = ray.get(critic.train_iteration(batch, minibatches=2, pad_id=pad, clip_eps=eps))[0]  # two steps
    assert all(math.isfinite(v) for v in m2.values())


def test_checkpoint_restores_the_critic_bit_for_bit(ray_cluster, critic, tiny_policy, pad, tmp_path):
    """Policy + critic saved by reflow.tasks.checkpoint.save into one manifest; fresh groups load it: the
    critic's weights are identical, and so is its next update (Adam moments restored too)."""
    from reflow.engines.train.group import TrainerGroup
    from reflow.infra.store import checkpoint as ckpt
    from reflow.infra.store.storage import ExperimentStore
    from reflow.tasks.checkpoint import load_first_valid, save

    store = ExperimentStore.open(f"file://{tmp_path}/runs", "ppo")
    policy_kw = dict(model_path=str(tiny_policy), settings=RankSettings(**(RANK_KW | dict(zero_stage=0))))
    policy = TrainerGroup.create(1, NAMESPACE, "policy-a", init_timeout_s=300, **policy_kw)
    batch, _ = gae_batch(_with_values(critic, _batch(tiny_policy).with_(rewards=REWARDS), pad), 1.0, LAM)
    ray.get(critic.train_iteration(batch, minibatches=1, pad_id=pad, clip_eps=0.2))  # Adam state is non-trivial
    save(policy, store, 1, ckpt.state_for(1, 4, 0, 1), "x: 1\n", keep_last=3, critic=critic)
    files = json.loads(store.read_bytes(ckpt.at_step(store, 1).rel(ckpt.MANIFEST)))["files"]
    assert {"critic/rng/rank_00000.pt", "critic/rng/rank_00001.pt", "critic/model/value_head.safetensors",
            "critic/model/model.safetensors", "model/model.safetensors", "rng/rank_00000.pt"} <= set(files)
    assert any(k.startswith("critic/optim/") for k in files)
    saved = ray.get(critic.weights_checksum())[0]
    # The exported critic folder is a valid `critic.path`: it loads to the same function.
    exported = load_value_model(str(tmp_path / "runs/ppo/checkpoints/iter_000001/critic/model")).eval()
    live = _plain(tiny_policy, critic)
    t = to_train_tensors(batch, pad)
    torch.testing.assert_close(exported(t["input_ids"], t["attention_mask"]), live(t["input_ids"], t["attention_mask"]))

    fresh_policy = TrainerGroup.create(1, NAMESPACE, "policy-b", init_timeout_s=300, **policy_kw)
    fresh = _create("critic-b", 2, tiny_policy, zero_stage=3)
    try:
        assert ray.get(fresh.weights_checksum())[0] != saved
        found = [(ck, f) for ck, f, _ in ckpt.valid_candidates(store)]
        assert load_first_valid(fresh_policy, found, num_ranks=1, critic=fresh).step == 1
        assert ray.get(fresh.weights_checksum())[0] == saved
        again = _with_values(critic, batch, pad)
        ray.get(critic.train_iteration(again, minibatches=1, pad_id=pad, clip_eps=0.2))
        ray.get(fresh.train_iteration(again, minibatches=1, pad_id=pad, clip_eps=0.2))
        assert ray.get(fresh.weights_checksum()) == ray.get(critic.weights_checksum())
    finally:
        for g in (policy, fresh_policy, fresh):
            g.kill()


def test_resumed_ppo_run_equals_the_uninterrupted_one(ppo_run, tiny_policy, tmp_path, monkeypatch):
    """2 iterations (conftest's ppo_run, shared with the estimator test), then a resume to 3, gives the critic
    (and policy) of a straight 3-iteration run bit for bit: the train flow saves the critic with the policy and
    restores it exactly. A run of the finished experiment then says so and trains nothing, touching no cluster."""
    from reflow.flows import session
    from reflow.flows.train import train
    from tests.test_algorithms_e2e import CASES, _config

    first, summary = ppo_run
    assert summary["iterations"] == 2
    resumed = train(_config(tiny_policy, first, "ppo", CASES["ppo"] + ["num_iterations=3"]))
    assert (resumed["start"], resumed["iterations"]) == (2, 1)
    train(_config(tiny_policy, tmp_path, "ppo-straight", CASES["ppo"] + ["num_iterations=3"]))
    final = {n: root / "runs" / f"algo-{n}" / "checkpoints" / "iter_000003" for n, root in
             (("ppo", first), ("ppo-straight", tmp_path))}
    for rel in ("critic/model/model.safetensors", "critic/model/value_head.safetensors", "model/model.safetensors"):
        a, b = ((final[n] / rel).read_bytes() for n in final)
        assert a == b, f"{rel} differs after resume"

    def no_cluster(*a, **k):
        raise AssertionError("a finished experiment started its cluster")

    monkeypatch.setattr(session, "start_cluster", no_cluster)
    done = train(_config(tiny_policy, tmp_path, "ppo-straight", CASES["ppo"] + ["num_iterations=3"]))
    assert (done["iterations"], done["start"], done["already_complete"]) == (0, 3, True)
    assert "already completed 3 of num_iterations=3" in done["message"] and "raise it" in done["message"]


def test_colocated_ppo_hands_the_critic_over_too(ray_cluster, prefect_server, tiny_policy, tmp_path):
    """cluster.colocate: the critic offloads with the policy before rollout and reloads before its
    values pass, every iteration (state-checked no-ops on CPU, so a missed or doubled move raises)."""
    from reflow.flows.train import train
    from reflow.infra.cluster.runtime import get_runtime, shutdown_runtime
    from tests.test_algorithms_e2e import CASES, _config

    cfg = _config(tiny_policy, tmp_path, "ppo-colocate", CASES["ppo"] + ["num_iterations=2", "cluster.colocate=true"])
    try:
        assert train(cfg, release_cluster=False)["iterations"] == 2
        # initial offload + (reload, offload) per iteration; this reload is one more move
        assert ray.get(get_runtime(cfg).critic.reload_states())[0]["moves"] == 1 + 2 * 2 + 1
    finally:
        shutdown_runtime(cfg.experiment)
