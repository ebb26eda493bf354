"""Issue 15 points 2 and 3 on CPU: compiled decoder layers with length buckets, and old log-probs
taken from the training forward itself. Both must leave the numbers of a step unchanged.

The compiled trainer here uses torch.compile's `aot_eager` backend: the same dynamo capture, graph
per shape and autograd split as `inductor` on the GPU, without C++ code generation (minutes on 2
cores). What inductor's kernels compute is measured on the H200 by bench/gpu.py.
"""
from __future__ import annotations

import math

import pytest
import ray
import torch

from reflow.engines.hf_io import load_tokenizer
from reflow.engines.train import packing
from reflow.engines.train.compiled import decoder_layers, length_bucket, packed_bucket, use_compile
from reflow.engines.train.trainer import _pad_length
from reflow.rl.types import to_train_tensors
from tests.test_trainer import _batch, _create, _train_kw


def test_length_buckets_are_four_per_octave():
    assert [length_bucket(n) for n in (1, 16, 17, 20, 21, 33, 100, 129, 2048, 2049)] == \
        [16, 16, 20, 20, 24, 40, 112, 160, 2048, 2560]
    buckets = {length_bucket(n) for n in range(1, 4097)}
    assert len(buckets) == 4 * 8 + 1  # 16 and four per octave from 16 to 4096
    assert all(b >= n and b <= 1.25 * n + 16 for n in range(1, 4097) for b in [length_bucket(n)])


def test_packed_rows_run_at_eighths_of_the_budget():
    assert [packed_bucket(n, 32768) for n in (1, 4096, 4097, 30000, 32768, 40000)] == \
        [4096, 4096, 8192, 32768, 32768, 40960]  # a sample over the budget: its length bucket
    assert {packed_bucket(n, 100) for n in range(1, 101)} == {16, 32, 48, 64, 80, 96, 100}  # steps of 16, capped


def test_packed_lengths_of_a_long_response_run_compile_a_bounded_set():
    """The packing of 40 iterations like the scratchpad GPU run's (512 samples of 16 + 83..913 tokens, 2
    mini-batches, budget 32,768): every row a length of at most 8 (4 buckets an octave gave one new graph every
    other iteration on the H100, RESULTS 45), at most budget/8 tokens of padding a row."""
    g = torch.Generator().manual_seed(0)
    seen, old = set(), set()
    for _ in range(40):
        lengths = (16 + torch.randint(83, 914, (512,), generator=g)).tolist()
        for mini in packing.plan(lengths, 2, 1, 32768).micros:
            for micro in mini[0]:
                n = sum(lengths[i] for i in micro)
                seen.add(packed_bucket(n, 32768))
                old.add(length_bucket(n))
                assert n <= packed_bucket(n, 32768) <= 32768 and packed_bucket(n, 32768) - n < 4096
    assert len(seen) <= 8 < len(old), (sorted(seen), sorted(old))


def test_compile_mode_and_layer_lookup(tiny_policy):
    assert use_compile("auto", torch.device("cuda")) and not use_compile("auto", torch.device("cpu"))
    assert use_compile("on", torch.device("cpu")) and not use_compile("off", torch.device("cuda"))
    assert not use_compile("auto", torch.device("cuda"), zero_stage=3)
    with pytest.raises(ValueError, match="zero_stage=3"):
        use_compile("on", torch.device("cuda"), zero_stage=3)
    with pytest.raises(ValueError, match="auto, on or off"):
        use_compile("yes", torch.device("cpu"))  # type: ignore[arg-type]
    from reflow.engines.hf_io import load_causal_lm

    assert len(decoder_layers(load_causal_lm(str(tiny_policy)))) == 2
    with pytest.raises(ValueError, match="trainer.compile=off"):
        decoder_layers(torch.nn.Linear(2, 2))


def test_padding_to_a_bucket_keeps_every_value(tiny_policy):
    pad = load_tokenizer(str(tiny_policy)).pad_token_id
    t = to_train_tensors(_batch(tiny_policy), pad)
    L = t["input_ids"].shape[1]
    p = _pad_length(t, L + 5, pad)
    for k, v in t.items():
        assert torch.equal(p[k][..., :v.shape[-1]], v) if v.dim() == 2 else torch.equal(p[k], v)
    assert p["input_ids"].shape[1] == L + 5 and p["loss_mask"].shape[1] == L + 4
    assert (p["input_ids"][:, L:] == pad).all() and not p["attention_mask"][:, L:].any()
    assert not p["loss_mask"][:, L - 1:].any()


def _weights(group) -> dict[str, torch.Tensor]:
    return dict(ray.get(group.named_weights()[0]))


def _close(a: dict, b: dict, **tol) -> None:
    for k in a:
        torch.testing.assert_close(a[k], b[k], **tol)


@pytest.mark.slow
def test_old_logprobs_from_the_training_forward_equal_a_separate_pass(ray_cluster, tiny_policy):
    """Same step with and without the separate no-grad pass: metrics and updated weights agree.
    TIS, an entropy bonus and a KL term to a reference model are on, so every use of the old
    log-probs is exercised; the rollout log-probs differ from the policy's (a real mismatch)."""
    pad = load_tokenizer(str(tiny_policy)).pad_token_id
    b = _batch(tiny_policy)
    batch = b.with_(rollout_logprobs=[[-0.3 - 0.1 * j for j in range(len(r))] for r in b.response_ids])
    loss = dict(tis_cap=2.0, entropy_coef=0.01, kl_coef=0.05)
    out = {}
    for mode in ("always", "auto"):
        g = _create(f"old-{mode}", 1, tiny_policy, ref_model_path=str(tiny_policy), old_logprob_pass=mode)
        try:
            m = ray.get(g.train_iteration(batch, **_train_kw(pad, **loss)))[0]
            m2 = ray.get(g.train_iteration(batch, **_train_kw(pad, minibatches=2, **loss)))[0]
            out[mode] = (m, m2, _weights(g))
        finally:
            g.kill()
    (sep, sep2, w_sep), (fused, fused2, w_fused) = out["always"], out["auto"]
    assert sep["old_logprobs_reused"] == 0.0 and fused["old_logprobs_reused"] == 1.0
    assert fused2["old_logprobs_reused"] == 0.0, "two mini-batches: the second runs on an updated policy"
    assert fused["logprob_mismatch"] > 0.1  # the rollout numbers really differ from the policy's
    for k in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "ratio_mean", "tis_weight_mean",
              "logprob_mismatch", "logprob_mismatch_max", "clip_frac"):
        assert fused[k] == pytest.approx(sep[k], rel=1e-6, abs=1e-7), k
        assert fused2[k] == pytest.approx(sep2[k], rel=1e-5, abs=1e-6), k
    _close(w_fused, w_sep, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_compiled_layers_train_like_eager_layers_and_bound_their_shapes(ray_cluster, tiny_policy):
    """compile=on (aot_eager) against eager on the same batch, padded, and packed (16-token rows padded to a length
    bucket, the bucket's tail a segment of its own) with activation checkpointing (the recompute replays the
    compiled layers): equal metrics and weights after two iterations; the second
    iteration, with lengths in buckets already seen, compiles nothing new."""
    pad = load_tokenizer(str(tiny_policy)).pad_token_id
    batch = _batch(tiny_policy)
    out = {}
    for name, mode, extra in (("off", "off", {}), ("on", "on", {}), ("packed", "on", {"max_tokens_per_micro_batch": 16, "activation_checkpointing": "on"})):
        g = _create(f"compile-{name}", 1, tiny_policy, compile=mode, compile_backend="aot_eager", **extra)
        try:
            ms = [ray.get(g.train_iteration(batch, **_train_kw(pad, entropy_coef=0.01)))[0] for _ in range(2)]
            out[name] = (ms, _weights(g))
        finally:
            g.kill()
    eager, w_eager = out["off"]
    for name in ("on", "packed"):
        compiled, w_compiled = out[name]
        for a, b in zip(eager, compiled):
            for k in ("loss", "pg_loss", "entropy", "grad_norm", "ratio_mean", "logprob_mismatch"):
                assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (name, k)
        # AdamW divides by sqrt(v): a gradient entry near 0 whose last bits differ (padded shapes take
        # other reduction orders) moves by up to a few % of lr = 1e-3 after two steps.
        _close(w_compiled, w_eager, rtol=1e-5, atol=5e-5)
        first, second = compiled[0]["compile_graphs"], compiled[1]["compile_graphs"]
        assert 1 <= first <= 4 and second == first, (name, first, second)  # <= (rows, bucket) pairs + masks
        assert all(math.isfinite(v) for v in compiled[1].values())
    assert eager[1]["compile_graphs"] == 0.0
    assert out["packed"][0][0]["pad_fraction"] < out["on"][0][0]["pad_fraction"]
    assert [out[n][0][0]["activation_checkpointing"] for n in ("off", "on", "packed")] == [0.0, 0.0, 1.0]  # auto: off on CPU


@pytest.mark.slow
def test_compiled_layers_under_bf16_mixed_autocast(ray_cluster, tiny_policy):
    """precision=bf16-mixed with compiled layers: the graphs are traced inside DeepSpeed's autocast region and
    score as the eager layers under it do (bf16 matmuls: a looser tolerance than the fp32 test above); the
    LM head in float32 (fp32_lm_head) under both."""
    pad = load_tokenizer(str(tiny_policy)).pad_token_id
    batch = _batch(tiny_policy)
    out = {}
    for mode in ("off", "on"):
        g = _create(f"mixed-{mode}", 1, tiny_policy, compile=mode, compile_backend="aot_eager",
                    precision="bf16-mixed", zero_stage=1, fp32_lm_head=True)
        try:  # two mini-batches: the separate old-logprob pass too (its hooks on the head, around the fp32 one)
            out[mode] = ray.get(g.train_iteration(batch, **_train_kw(pad, minibatches=2)))[0]
        finally:
            g.kill()
    assert out["on"]["compile_graphs"] >= 1 and out["off"]["compile_graphs"] == 0
    for k in ("loss", "grad_norm", "ratio_mean"):
        assert out["on"][k] == pytest.approx(out["off"][k], rel=1e-2), k


@pytest.mark.slow
def test_the_old_logprob_pass_replays_the_training_forwards_compiled_graph(ray_cluster, tiny_policy):
    """With compiled layers the separate old-logprob pass runs them in grad mode (the LM head after them
    without): it compiles nothing the training forward does not (a no-grad graph per shape took 2.9 s of
    the first iteration on the H200), and it scores with the training forward's function (the same step's
    metrics as when the training forward's own log-probs are reused)."""
    pad = load_tokenizer(str(tiny_policy)).pad_token_id
    batch = _batch(tiny_policy)
    out = {}
    for mode in ("always", "auto"):
        g = _create(f"oldpass-{mode}", 1, tiny_policy, compile="on", compile_backend="aot_eager", old_logprob_pass=mode)
        try:
            out[mode] = ray.get(g.train_iteration(batch, **_train_kw(pad)))[0]
        finally:
            g.kill()
    sep, reused = out["always"], out["auto"]
    assert sep["old_logprobs_reused"] == 0.0 and reused["old_logprobs_reused"] == 1.0
    assert sep["compile_graphs"] == reused["compile_graphs"] >= 1, (sep["compile_graphs"], reused["compile_graphs"])
    for k in ("loss", "pg_loss", "grad_norm", "ratio_mean", "logprob_mismatch"):
        assert sep[k] == pytest.approx(reused[k], rel=1e-6, abs=1e-7), k
    assert sep["ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # old log-probs = the update's own at this step
