"""Pluggable rollout functions (`rollout.generate_fn`, engines/rollout_fns.py) on a real embedded
engine on loopback: the default single-turn function samples what the batched path samples, a
multi-turn function's tool tokens are kept as generated and masked out of the training tensors,
and a function that fails is named with the sample. No Ray, no Prefect."""
from __future__ import annotations

import pytest
import torch

from reflow.engines import rollout_stages as ro
from reflow.engines.hf_io import load_tokenizer
from reflow.engines.rollout_fns import (
    DEFAULT,
    BatchRequest,
    RolloutFnError,
    RolloutSettings,
    TurnLimits,
    rollout_with_fn,
)
from reflow.rl.types import Prompt, to_train_tensors
from tests.rollout_fixtures import TOOL_TOKENS
from tests.test_engine import KEY
from tests.test_engine import engine as _engine_fixture

engine = _engine_fixture  # test_engine's embedded engine on loopback (module-scoped here too), reached with KEY


@pytest.fixture(scope="module")
def prompts(tiny_policy) -> list[Prompt]:
    tok = load_tokenizer(str(tiny_policy))
    return [Prompt(i, t, tok(t)["input_ids"], "x", {"row": i}) for i, t in enumerate(["12+34=", "5+6=", "7*8="])]


def _generate(engine, prompts, fn: str, n: int = 2, seed: int | None = 3):
    sp = ro.sampling_params(1.0, 1.0, -1, 4, None)
    return ro.generate(RolloutSettings([engine.url()], sp, n, 60.0, KEY, fn, seed=seed), BatchRequest(prompts, 5))


def test_single_turn_function_samples_what_the_batched_path_samples(engine, prompts):
    batched = _generate(engine, prompts, DEFAULT)
    seeds = ro.sample_seeds(3, 5, len(prompts) * 2)
    per_sample = rollout_with_fn(RolloutSettings([engine.url()], ro.sampling_params(1.0, 1.0, -1, 4, None), 2, 60.0, KEY,
                                                 DEFAULT), BatchRequest(prompts, 5), seeds)
    assert per_sample.response_ids == batched.response_ids and len(set(map(tuple, batched.response_ids))) > 1
    assert per_sample.response_text == batched.response_text
    assert per_sample.finish_reason == batched.finish_reason
    for a, b in zip(per_sample.rollout_logprobs, batched.rollout_logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b))
    assert per_sample.response_mask == [[1] * len(r) for r in batched.response_ids]
    assert batched.response_mask is None  # the default path is unchanged


def test_multi_turn_tokens_are_kept_and_tool_tokens_masked(engine, prompts):
    batch = _generate(engine, prompts, "tests.rollout_fixtures:two_turns")
    assert len(batch) == 6 and batch.group_index == [0, 0, 1, 1, 2, 2]
    for i in range(len(batch)):
        p, r, m = batch.prompt_ids[i], batch.response_ids[i], batch.response_mask[i]
        info = batch.reward_info[i]
        turn1 = len(info["context_ids"]) - len(p) - TOOL_TOKENS
        assert m == [1] * turn1 + [0] * TOOL_TOKENS + [1] * (len(r) - turn1 - TOOL_TOKENS)
        assert r[turn1:turn1 + TOOL_TOKENS] == p[:TOOL_TOKENS]  # the tool's tokens, as given
        assert info["context_ids"] == p + r[:turn1 + TOOL_TOKENS]  # turn 2 continued these exact ids
        assert [lp for lp, k in zip(batch.rollout_logprobs[i], m) if not k] == [0.0] * TOOL_TOKENS
        assert all(lp < 0 for lp, k in zip(batch.rollout_logprobs[i], m) if k)
    sample = batch.samples()[0]
    assert sample.reward_info["turns"] == 2 and sample.response_ids == tuple(batch.response_ids[0])
    t = to_train_tensors(batch.with_(advantages=[1.0] * len(batch)), pad_id=0)
    for i in range(len(batch)):  # position j scores token j+1: response token k sits at len(p) - 1 + k
        start = len(batch.prompt_ids[i]) - 1
        row = t["loss_mask"][i, start:start + len(batch.response_ids[i])]
        assert row.tolist() == [float(k) for k in batch.response_mask[i]]
        assert t["loss_mask"][i].sum() == sum(batch.response_mask[i])  # nothing outside the response
        assert t["response_positions"][i].sum() == len(batch.response_ids[i])
    table = ro.rollout_table(batch)
    assert table["policy_tokens"].tolist() == batch.policy_tokens() and '"tool_calls": 1' in table["rollout_info"][0]


def test_a_raising_rollout_function_is_named_with_the_sample(engine, prompts):
    with pytest.raises(RolloutFnError, match=r"rollout function tests\.rollout_fixtures:raising_rollout on sample 2 "
                                             r"\(prompt 1: '5\+6='\) raised ConnectionRefusedError: calculator "
                                             r"sandbox refused sample 2"):
        _generate(engine, prompts, "tests.rollout_fixtures:raising_rollout")
    with pytest.raises(RolloutFnError, match=r"short_logprobs on sample 0 .* returned 1 rollout_logprobs for 2 "
                                             r"generated tokens"):
        _generate(engine, prompts, "tests.rollout_fixtures:short_logprobs")
    with pytest.raises(ValueError, match=r"rollout\.generate_fn='tests\.rollout_fixtures:not_async' must be an "
                                         r"`async def`"):
        _generate(engine, prompts, "tests.rollout_fixtures:not_async")
    with pytest.raises(ValueError, match=r"rollout\.generate_fn='tests\.rollout_fixtures:nope': module "):
        _generate(engine, prompts, "tests.rollout_fixtures:nope")


def test_the_calculator_rollout_runs_on_a_real_engine(engine, prompts):
    """The tools demo's function against the embedded engine: its tokenizer comes from /model_info,
    ")" is a stop token next to eos, and whatever the random policy writes ends in a valid trajectory."""
    sp = ro.sampling_params(1.0, 1.0, -1, 6, [2])
    batch = ro.generate(RolloutSettings([engine.url()], sp, 4, 60.0, KEY, "reflow.engines.tool_rollout:calculator_rollout",
                                        limits=TurnLimits(3, 20, 5.0), seed=7), BatchRequest(prompts, 0))
    assert len(batch) == 12 and all(len(m) == len(r) <= 20 for m, r in zip(batch.response_mask, batch.response_ids))
    for ids, info in zip(batch.response_ids, batch.reward_info):
        assert 1 <= info["turns"] <= 3 and ("answer" in info or "tool_error" in info or len(ids) == 20
                                            or info["turns"] == 3), info
