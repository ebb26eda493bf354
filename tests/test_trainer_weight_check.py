"""The trainer's side of the logprob weight check (issue 14 point 1).

TrainerRank.push_weights computes the logprobs of the fixed probe batch at the weights it pushes,
on every rank (under ZeRO-3 the forward is collective), and the engines' teacher-forced logprobs
are held to them. Real pieces: a two-rank ZeRO-3 DeepSpeed group on a local Ray cluster and an
embedded engine that starts from other weights than the trainer's.
"""
from __future__ import annotations

import pytest
import ray
import torch

from reflow.engines.hf_io import load_causal_lm
from reflow.engines.train.group import TrainerGroup
from reflow.engines.train.settings import RankSettings
from reflow.engines.weights.settings import PushSettings
from reflow.engines.weights.verify import engine_input_logprobs
from tests.sglang_backends import probe_of

pytestmark = pytest.mark.slow

RANK_KW = dict(precision="fp32", lr=1e-3, lr_schedule="constant", warmup_steps=0, total_steps=10, weight_decay=0.0,
               grad_clip=1.0, micro_batch_size=2, threads=1, seed=0, zero_stage=3,
               zero3_param_persistence_threshold=0)  # partition even this tiny model's tensors


@pytest.fixture(scope="module")
def other_policy(tmp_path_factory):
    """The tiny policy's shape with other weights: what an engine holds before the push."""
    from reflow.rl.demo_policy import build_model, build_tokenizer, save_policy

    tok = build_tokenizer()
    return save_policy(build_model(tok, hidden=32, layers=2, heads=2, mlp=64, seed=1), tok,
                       tmp_path_factory.mktemp("other_policy"))


def test_zero3_push_is_verified_by_the_trainers_logprobs(ray_cluster, tiny_policy, other_policy):
    from reflow.engines.embedded.engine import EmbeddedEngine
    from reflow.engines.rollout_client import EngineClient

    group = TrainerGroup.create(2, "test-weight-check", "wc", model_path=str(tiny_policy), init_timeout_s=300,
                                settings=RankSettings(**RANK_KW))
    engine = ray.remote(EmbeddedEngine).options(num_cpus=1).remote(str(other_policy), "weight-check-engine")
    try:
        url, key = ray.get([engine.url.remote(), engine.api_key.remote()])
        assert ray.get(engine.ready.remote())
        client = EngineClient(url, api_key=key)
        want = probe_of(load_causal_lm(str(tiny_policy)).eval())  # the trainer's weights, computed here
        before = torch.cat(engine_input_logprobs(client, want.prompts))  # [N]
        assert (before - torch.cat(want.reference)).abs().mean() > 0.1  # the check can tell the two apart
        reports = ray.get(group.push_weights([url], "1", PushSettings(verify="logprobs"), key))
        assert reports[1] == {} and reports[0]["verify_method"] == "logprobs", reports
        assert reports[0]["logprob_max_diff"] < 1e-4
        after = torch.cat(engine_input_logprobs(client, want.prompts))  # [N]
        torch.testing.assert_close(after, torch.cat(want.reference), rtol=0, atol=1e-4)
    finally:
        group.kill()
        ray.get(engine.shutdown.remote(), timeout=10)
        ray.kill(engine)


def test_below_zero3_the_probe_is_made_only_for_an_engine_checked_by_logprobs(ray_cluster, tiny_policy, other_policy):
    """Rank 0 makes the probe (a forward) only when an engine is to be checked by logprobs: a push verified by
    reading weights back makes none (on the GPU its first one compiled the layers for the probe's shape: 4.6 s
    of the run's start), one verified by logprobs makes it once and holds the engine to it."""
    from reflow.engines.embedded.engine import EmbeddedEngine

    kw = RANK_KW | dict(zero_stage=1)
    group = TrainerGroup.create(1, "test-weight-check-z1", "wc1", model_path=str(tiny_policy), init_timeout_s=300,
                                settings=RankSettings(**kw))
    engine = ray.remote(EmbeddedEngine).options(num_cpus=1).remote(str(other_policy), "weight-check-engine-z1")
    probes = lambda: ray.get(group.actors[0].__ray_call__.remote(lambda rank: rank.probes_made))  # noqa: E731
    try:
        url, key = ray.get([engine.url.remote(), engine.api_key.remote()])
        assert ray.get(engine.ready.remote())
        report = ray.get(group.push_weights([url], "1", PushSettings(verify="sample"), key))[0]
        assert report["verify_method"] == "weights" and probes() == 0, report
        report = ray.get(group.push_weights([url], "2", PushSettings(verify="logprobs"), key))[0]
        assert report["verify_method"] == "logprobs" and report["logprob_max_diff"] < 1e-4 and probes() == 1, report
    finally:
        group.kill()
        ray.get(engine.shutdown.remote(), timeout=10)
        ray.kill(engine)
