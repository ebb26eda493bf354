"""Partial rollouts (rollout.partial carry|drop, engines/partial_rollout.py) on a real embedded engine on
loopback: rounds of a few tokens continue a sample exactly as one uninterrupted request draws it, a batch
closes on its first complete groups, carried samples keep each token's policy version, drop discards the
rest, and the same inputs give the same batch. The run-level test trains through the flow and resumes
from a checkpoint that holds the carry."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from reflow.engines import partial_rollout as pr
from reflow.engines import rollout_stages as ro
from reflow.engines.hf_io import load_tokenizer
from reflow.engines.rollout_client import GENERATE_CLOSING, EngineClient, EngineError, generate_batch
from reflow.engines.rollout_fns import BatchRequest, RolloutSettings
from reflow.infra.config.schema import load_config
from reflow.infra.config.settings import ASYNC_TIS_CAP, loss_settings
from reflow.rl.types import Prompt
from tests.engine_fixtures import served
from tests.test_engine import KEY

N, MAX_NEW = 2, 8


def stopping_policy(tiny_policy: Path, out: Path, logit: float = 1.5) -> Path:
    """The tiny random policy ending its responses at a steady rate (reflow.rl.long_tail): 1..max_new_tokens
    tokens, a long tail (the random policy almost never stops, and every group would finish in the same round)."""
    from transformers import AutoModelForCausalLM

    from reflow.rl.long_tail import end_responses_early

    shutil.copytree(tiny_policy, out, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_policy)
    end_responses_early(model, load_tokenizer(str(tiny_policy)), logit)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def policy(tiny_policy, tmp_path_factory) -> Path:
    return stopping_policy(tiny_policy, tmp_path_factory.mktemp("stopping_policy"))


@pytest.fixture(scope="module")
def engine(policy):
    with served(policy, "partial-engine", KEY) as e:
        yield e


@pytest.fixture(scope="module")
def prompts(policy) -> list[Prompt]:
    tok = load_tokenizer(str(policy))
    texts = ["12+34=", "5+6=", "7+8=", "40+2=", "3+3=", "9+1="]
    return [Prompt(i, t, tok(t)["input_ids"], str(i)) for i, t in enumerate(texts)]


def _sampling(policy: Path, max_new: int = MAX_NEW) -> dict:
    return ro.sampling_params(1.0, 1.0, -1, max_new, [load_tokenizer(str(policy)).eos_token_id])


def _roll(engine, policy, prompts, mode, version, carried, chunk=1, target=2, over=1.0, closing=False):
    settings = pr.PartialSettings.of(mode, chunk, target, over, closing)
    m = pr.new_groups(settings.pool_groups, carried)
    seeds = ro.sample_seeds(11, version, m * N)
    return pr.roll([EngineClient(engine.url(), timeout=60, api_key=KEY)], settings, _sampling(policy),
                   N, version, carried, prompts[:m], seeds)


@pytest.mark.parametrize("chunk", [1, 3])
def test_rounds_continue_a_sample_as_one_request_draws_it(engine, policy, prompts, chunk):
    """With one policy throughout, generating in rounds of `chunk` tokens (each round the prompt plus what came
    before, the same sampling_seed) gives the tokens and log-probs of one uninterrupted request."""
    c = EngineClient(engine.url(), timeout=60, api_key=KEY)
    seeds = ro.sample_seeds(5, 0, len(prompts))
    whole = generate_batch([c], [p.input_ids for p in prompts], _sampling(policy), 1, seeds=seeds)
    settings = pr.PartialSettings.of("drop", chunk, len(prompts), 0.0)
    batch, rest, stats = pr.roll([c], settings, _sampling(policy), 1, 0, [], prompts, seeds)
    longest = max(len(o["output_ids"]) for o in whole)
    assert rest == [] and stats["partial_rounds"] == -(-longest // chunk)  # until the longest has finished
    assert batch.response_ids == [list(o["output_ids"]) for o in whole]
    assert batch.finish_reason == [o["meta_info"]["finish_reason"]["type"] for o in whole]
    assert {"stop", "length"} <= set(batch.finish_reason)  # some end on eos mid-way: rounds of unequal rows
    for got, o in zip(batch.rollout_logprobs, whole):
        assert got == pytest.approx([lp[0] for lp in o["meta_info"]["output_token_logprobs"]], abs=1e-5)
    assert batch.token_versions == [[0] * len(r) for r in batch.response_ids]


def test_a_closing_call_cuts_every_sample_at_the_step_the_last_needed_group_completes(engine, policy, prompts):
    """The embedded engine's closing call (rollout.partial on backend=embedded): one call runs the pool's samples
    together and stops at the step where the target-th group (by that step) has every sample finished; each sample
    then holds what one uninterrupted request draws, up to that step (the cut ones exactly that many tokens)."""
    c = EngineClient(engine.url(), timeout=60, api_key=KEY)
    m, target = 4, 2
    seeds = ro.sample_seeds(11, 0, m * N)
    whole = generate_batch([c], [p.input_ids for p in prompts[:m]], _sampling(policy), N, seeds=seeds)
    lengths = [len(o["output_ids"]) for o in whole]
    ends = [max(lengths[g * N:(g + 1) * N]) for g in range(m)]  # the step each group completes at
    close = sorted(ends)[target - 1]
    assert close < max(ends), "every group completes at once: the test would see no sample cut"
    batch, rest, stats = _roll(engine, policy, prompts, "carry", 0, [], target=target, over=1.0, closing=True)
    assert stats["partial_rounds"] == 1
    done = [g for g in range(m) if ends[g] <= close][:target]
    assert batch.response_ids == [whole[g * N + j]["output_ids"] for g in done for j in range(N)]
    for g in rest:
        k = next(i for i, p in enumerate(prompts[:m]) if p.input_ids == g["prompt_ids"])
        for j, s in enumerate(g["samples"]):
            want = whole[k * N + j]["output_ids"]
            assert s["ids"] == want[:close] and (s["finish"] is None) == (len(want) > close)
    assert any(s["finish"] is None for g in rest for s in g["samples"])
    assert c.server_info()[GENERATE_CLOSING] is True  # advertised, as every reflow extension (docs/ENGINE_CONTRACT.md)
    with pytest.raises(EngineError, match="close must be"):
        c.generate_closing([prompts[0].input_ids], [_sampling(policy)], [0], 0)
    with pytest.raises(EngineError, match="one id per prompt") as bad:
        c.generate_closing([prompts[0].input_ids], [_sampling(policy)], [0, 1], 1)
    assert bad.value.status == 400


@pytest.mark.parametrize("closing", [False, True], ids=["rounds", "closing"])
def test_carry_closes_on_complete_groups_and_continues_the_rest_under_the_next_version(engine, policy, prompts, closing):
    """Pool of 4 groups for 2 to train: the batch holds the first 2 complete groups in pool order; the other two
    are carried with their tokens so far and continued by the next version, which tops the pool up with new
    prompts; a carried sample's tokens record the version that generated each."""
    first, carry, s0 = _roll(engine, policy, prompts, "carry", 0, [], closing=closing)
    assert first.n_groups == 2 and len(first) == 2 * N and len(carry) == 2 and s0["carry_out_groups"] == 2
    assert all(f in ("stop", "length") for f in first.finish_reason)
    assert all(len(r) == MAX_NEW or f == "stop" for r, f in zip(first.response_ids, first.finish_reason))
    unfinished = [s for g in carry for s in g["samples"] if s["finish"] is None]
    assert unfinished, "nothing was left mid-response: the test would not see a sample continued by version 1"
    assert all(set(s["versions"]) <= {0} and len(s["ids"]) == len(s["logprobs"]) for g in carry for s in g["samples"])
    json.dumps(carry)  # plain data: what a checkpoint's state.json holds

    second, carry2, s1 = _roll(engine, policy, prompts, "carry", 1, carry, closing=closing)
    assert s1["new_groups"] == 2 and second.policy_version == 1  # the pool is topped up to 4 with new prompts
    continued = 0
    for g in carry:  # each carried sample, wherever it finished: its old tokens first, as they were generated
        for s in g["samples"]:
            rows = [i for i, (p, r) in enumerate(zip(second.prompt_ids, second.response_ids))
                    if p == g["prompt_ids"] and r[:len(s["ids"])] == s["ids"] and second.token_versions[i][:1] == [0]]
            if rows:
                v = second.token_versions[rows[0]]
                assert v == [0] * len(s["ids"]) + [1] * (len(v) - len(s["ids"]))
                assert second.rollout_logprobs[rows[0]][:len(s["ids"])] == s["logprobs"]
                continued += s["finish"] is None
    assert continued, "no trained sample was continued by version 1 after version 0 began it"
    assert s1["carried_samples"] == sum(min(v) < 1 for v in second.token_versions if v) > 0
    assert all(v[-1:] in ([0], [1]) for g in carry2 for v in (s["versions"] for s in g["samples"]) if v)


@pytest.mark.parametrize("closing", [False, True], ids=["rounds", "closing"])
def test_drop_keeps_only_the_first_complete_groups(engine, policy, prompts, closing):
    batch, rest, stats = _roll(engine, policy, prompts, "drop", 0, [], closing=closing)
    assert rest == [] and stats["dropped_groups"] == 2 and stats["carry_out_groups"] == 0 and batch.n_groups == 2
    assert all(v == [0] * len(v) for v in batch.token_versions)


@pytest.mark.parametrize("closing", [False, True], ids=["rounds", "closing"])
def test_the_same_pool_and_seeds_give_the_same_batch(engine, policy, prompts, closing):
    a = _roll(engine, policy, prompts, "carry", 0, [], closing=closing)
    b = _roll(engine, policy, prompts, "carry", 0, [], closing=closing)
    assert a[0] == b[0] and a[1] == b[1] and a[2] == b[2]


def test_a_malformed_carry_is_named():
    good = {"prompt_ids": [1], "samples": [{"ids": [1], "logprobs": [0.0], "versions": [0]}]}
    assert pr.check_carry([good], 1, "x") == [good]
    bad = {"prompt_ids": [1], "samples": [{"ids": [1, 2], "logprobs": [0.0], "versions": [0]}]}
    with pytest.raises(ValueError, match="state.json: carried group 0 is malformed"):
        pr.check_carry([bad], 1, "state.json")
    with pytest.raises(ValueError, match="is dict, expected a list"):
        pr.check_carry({}, 1, "state.json")


def test_off_is_the_batched_path_and_records_no_versions(engine, policy, prompts):
    """rollout.partial=off (RolloutSettings.partial None) is the single batched request per engine of before."""
    sp = _sampling(policy)
    out = ro.generate(RolloutSettings([engine.url()], sp, N, 60.0, KEY, seed=3), BatchRequest(prompts[:3], 5))
    c = EngineClient(engine.url(), timeout=60, api_key=KEY)
    plain = generate_batch([c], [p.input_ids for p in prompts[:3]], sp, N, seeds=ro.sample_seeds(3, 5, 3 * N))
    assert out.response_ids == [list(o["output_ids"]) for o in plain] and out.token_versions is None
    assert "token_versions" not in ro.rollout_table(out).columns


def test_lengths_and_idle_share():
    s = pr.lengths_stats([1, 2, 3, 10])
    assert (s["response_len_p50"], s["response_len_p90"], s["response_len_p99"]) == (2.0, 10.0, 10.0)
    assert s["wait_all_idle_fraction"] == pytest.approx(1 - 16 / 40)


@pytest.mark.parametrize("extra, message", [
    (["rollout.max_staleness=1"], "rollout.max_staleness=1"),
    (["rollout.generate_fn=tests.rollout_fixtures:calculator_rollout"], "single-turn rollout only"),
    (["algorithm.dynamic_sampling=true"], "algorithm.dynamic_sampling"),
])
def test_partial_refuses_what_it_cannot_continue(extra, message):
    with pytest.raises(Exception, match=message):
        load_config(None, ["rollout.partial=carry", *extra])


def test_carry_always_corrects_with_tis():
    assert loss_settings(load_config(None, ["rollout.partial=carry"])).tis_cap == ASYNC_TIS_CAP
    assert loss_settings(load_config(None, ["rollout.partial=drop"])).tis_cap is None  # one version a batch


@pytest.mark.slow
def test_carried_samples_survive_a_checkpoint_and_a_resume_exactly(ray_cluster, prefect_server, tiny_policy, tmp_path):
    """rollout.partial=carry through the flow: 2 iterations, then the same experiment resumed from checkpoint 1 (the
    test removes checkpoint 2 and every stage record, so the carry can only come from checkpoint 1's state.json):
    iteration 1 again gives the same batch, with samples whose tokens span two versions, and the same weights,
    bit for bit."""
    from reflow.flows.train import train
    from reflow.infra.store import checkpoint as ckpt
    from tests.test_algorithms_e2e import _config

    policy = stopping_policy(tiny_policy, tmp_path / "policy", logit=2.5)  # most stop in a few tokens, a few run on
    cfg = _config(policy, tmp_path, "carry", [
        "rollout.partial=carry", "rollout.partial_chunk_tokens=1", "rollout.over_sample=1.0",
        "rollout.max_new_tokens=16", "num_iterations=2", "data.reward_fn=tests.ckpt_fixtures:digit_reward",
        "checkpoint.save_interval=1"])
    exp = tmp_path / "runs" / "algo-carry"
    straight = train(cfg)
    tables = [pd.read_parquet(exp / "iterations" / f"{i:06d}" / "rollouts.parquet") for i in range(2)]
    assert all(len(t) == 16 and (t["policy_version"] == i).all() for i, t in enumerate(tables))
    spans = [v for t in tables[1:] for v in t["token_versions"] if len(set(v)) > 1]
    assert spans, "no trained sample spans two versions: the carry was not exercised"
    for i, m in enumerate(straight["history"]):
        assert m["carry_out_groups"] >= 0 and 0 <= m["engine_idle_fraction"] < 1 and m["response_len_p99"] <= 16
        assert (m["carried_samples"] > 0) == (i > 0 and bool((tables[i]["first_version"] < i).any()))
    state = json.loads((exp / "checkpoints" / "iter_000001" / "state.json").read_text())
    assert state["rollout_carry"] and all(len(g["samples"]) == 4 for g in state["rollout_carry"])
    assert any(s["finish"] is None and s["ids"] for g in state["rollout_carry"] for s in g["samples"])
    weights = (exp / "checkpoints" / "iter_000002" / "model" / "model.safetensors").read_bytes()

    shutil.rmtree(exp / "checkpoints" / "iter_000002")
    (exp / ckpt.LATEST).write_text("iter_000001")
    for d in (exp / "iterations").glob("*/stages"):
        shutil.rmtree(d)
    second = train(cfg)
    assert (second["start"], second["iterations"]) == (1, 1)
    pd.testing.assert_frame_equal(pd.read_parquet(exp / "iterations" / "000001" / "rollouts.parquet"), tables[1])
    assert (exp / "checkpoints" / "iter_000002" / "model" / "model.safetensors").read_bytes() == weights


def test_stage_records_of_another_partial_setting_are_not_reused():
    """A crashed flow run's stage records are reused only under the settings that made them; off keeps the key
    records had before rollout.partial existed."""
    from reflow.tasks.stage_cache import stage_key

    keys = {tuple(o): stage_key(load_config(None, o), "generated") for o in
            ([], ["rollout.partial=off"], ["rollout.partial=carry"], ["rollout.partial=drop"],
             ["rollout.partial=carry", "rollout.partial_chunk_tokens=8"])}
    assert keys[()] == keys[("rollout.partial=off",)] and len(set(keys.values())) == 4
