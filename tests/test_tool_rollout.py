"""The multi-turn tool loop (engines/tool_rollout.py) and the calculator task (rl/tool_task.py): turns,
masks, the turn/total/turn-count limits, and tool errors and timeouts that end a trajectory with a
reward instead of failing the run. The engine is a scripted stand-in answering /generate the way
the embedded engine does (stop token kept in output_ids); the tokenizer is the demo's real one."""
from __future__ import annotations

import asyncio
import time

import pytest

from reflow.engines.rollout_fns import RolloutRequest, TurnLimits
from reflow.engines.tool_rollout import calculator_rollout, tool_loop
from reflow.rl import tool_task
from reflow.rl.demo_policy import build_tokenizer
from reflow.rl.types import Sample

TOK = build_tokenizer()


class ScriptedEngine:
    """Answers each /generate with the next scripted text (cut at max_new_tokens and at a stop token)."""

    def __init__(self, turns: list[str]):
        self.turns, self.contexts = list(turns), []

    async def tokenizer(self):
        return TOK

    async def generate(self, input_ids, sampling_params, return_logprob=True):
        self.contexts.append(list(input_ids))
        ids = TOK(self.turns.pop(0), add_special_tokens=False)["input_ids"]
        stops, cut, finish = set(sampling_params["stop_token_ids"]), [], "length"
        for i in ids[: sampling_params["max_new_tokens"]]:
            cut.append(i)
            if i in stops:
                finish = "stop"
                break
        return {"output_ids": cut, "text": TOK.decode(cut, skip_special_tokens=True),
                "meta_info": {"finish_reason": {"type": finish}, "output_token_logprobs": [[-0.5, i, None] for i in cut]}}


LIMITS = TurnLimits(4, 64, 5.0)


def _run(turns: list[str], limits: TurnLimits = LIMITS, fn=calculator_rollout):
    engine = ScriptedEngine(turns)
    req = RolloutRequest(TOK("23*47=")["input_ids"], "23*47=", "1081", {},
                         {"max_new_tokens": 12, "stop_token_ids": [TOK.eos_token_id]}, 0, 0, limits)
    return asyncio.run(fn(req, engine)), engine


def test_a_tool_call_then_the_answer():
    traj, engine = _run(["(23*47)99", "1081<eos>"])
    assert traj.response_text == "(23*47)=1081 1081" and traj.finish_reason == "stop"
    tool = TOK("=1081 ", add_special_tokens=False)["input_ids"]
    assert traj.loss_mask == [1] * 7 + [0] * len(tool) + [1] * 5  # the call, the tool's tokens, the answer + eos
    assert traj.response_ids[7:7 + len(tool)] == tool and len(traj.rollout_logprobs) == 12
    assert engine.contexts[1] == engine.contexts[0] + traj.response_ids[:7 + len(tool)]  # ids kept, not re-encoded
    assert traj.reward_info == {"turns": 2, "tool_calls": ["(23*47)"], "answer": "1081"}
    sample = Sample("23*47=", traj.response_text, "1081", "stop", 7, 18, tuple(traj.response_ids), traj.reward_info)
    assert tool_task.reward("23*47=", traj.response_text, "1081", sample=sample) == 1.0


@pytest.mark.parametrize("turns, limits, finish, info", [
    (["(1*2)", "(3*4)", "(5*6)"], TurnLimits(2, 64, 5.0), "length", {"turns": 2}),  # out of turns
    (["(23*47)", "1081<eos>"], TurnLimits(4, 10, 5.0), "length", {"turns": 1}),  # total budget spent by the tool
    (["(2**3)", "8"], TurnLimits(4, 64, 5.0), "stop", {"tool_error": "cannot evaluate '2**3'"}),
    (["12)", "8"], TurnLimits(4, 64, 5.0), "stop", {"tool_error": "the turn ended at ')' without a call: '12)'"}),
    (["0000000000000000"], TurnLimits(4, 64, 5.0), "length", {"answer": "000000000000"}),  # the turn's own limit
])
def test_limits_and_tool_errors_end_the_trajectory(turns, limits, finish, info):
    traj, _ = _run(turns, limits)
    assert traj.finish_reason == finish and info.items() <= traj.reward_info.items(), traj.reward_info
    assert len(traj.response_ids) <= limits.max_response_tokens and len(traj.loss_mask) == len(traj.response_ids)
    sample = Sample("", traj.response_text, "1081", finish, 7, 1, (), traj.reward_info)
    assert tool_task.reward("", traj.response_text, "1081", sample=sample) == 0.0


def test_a_slow_tool_times_out():
    async def slow(text):
        await asyncio.sleep(5)

    async def rollout(req, engine):
        return await tool_loop(req, engine, slow, TOK.convert_tokens_to_ids(")"))

    traj, _ = _run(["(1*2)"], TurnLimits(4, 64, 0.05), rollout)
    assert traj.reward_info["tool_error"] == "timeout after 0.05s" and traj.loss_mask == [1] * 5


@pytest.mark.parametrize("kind", ["async, blocking", "sync"])
def test_a_tool_that_blocks_is_cut_at_its_deadline_and_its_late_answer_dropped(kind):
    """A tool that blocks instead of awaiting (asyncio.wait_for alone cannot interrupt it: it took 3 s against 0.5 s
    and its answer was used) runs in a worker thread; sync tools too."""
    def blocking(text):
        time.sleep(0.5)
        return "=999 "

    async def blocking_async(text):
        return blocking(text)

    async def rollout(req, engine):
        tool = blocking_async if kind.startswith("async") else blocking
        return await tool_loop(req, engine, tool, TOK.convert_tokens_to_ids(")"))

    t0 = time.monotonic()
    traj, engine = _run(["(1*2)", "2<eos>"], TurnLimits(4, 64, 0.05), rollout)
    assert time.monotonic() - t0 < 0.4
    assert traj.reward_info["tool_error"] == "timeout after 0.05s" and "999" not in traj.response_text
    assert traj.loss_mask == [1] * 5 and engine.turns == ["2<eos>"]  # the trajectory ended at the call

    async def quick(text):
        return "=2 "

    def quick_sync(text):
        return "=2 "

    for tool in (quick, quick_sync):
        async def answered(req, engine, tool=tool):
            return await tool_loop(req, engine, tool, TOK.convert_tokens_to_ids(")"))

        traj, _ = _run(["(1*2)", "2<eos>"], TurnLimits(4, 64, 5.0), answered)
        assert traj.response_text == "(1*2)=2 2" and "tool_error" not in traj.reward_info


def test_calculator_task():
    assert tool_task.calculator("(23*47)") == "=1081 " and tool_task.calculator("(2+3*4-1)") == "=13 "
    train, held = tool_task.make_problems(0, 50, 10)
    assert len(train) == 50 and not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert all(set(r["prompt"]) <= set("0123456789*=") for r in train + held)
    assert tool_task.trace({"prompt": "23*47=", "label": "1081"}) == [("(23*47)", True), ("=1081 ", False),
                                                                      ("1081", True)]
    assert tool_task.trace({"prompt": "23*47=", "label": "1081"}, tool=False) == [("1081", True)]


def test_warmup_traces_put_labels_on_the_policy_tokens_only():
    from reflow.rl.tool_demo import trace_batch

    ids, attn, labels = trace_batch(TOK, [{"prompt": "23*47=", "label": "1081"}, {"prompt": "10*10=", "label": "100"}])
    row = TOK.decode(ids[0][attn[0] == 1].tolist(), skip_special_tokens=False)
    assert row == "23*47=(23*47)=1081 1081<eos>"
    kept = TOK.decode([t for t in labels[0].tolist() if t != -100], skip_special_tokens=False)
    assert kept == "(23*47)1081<eos>"  # not the prompt, not the tool's "=1081 "
    assert (labels[1][attn[1] == 0] == -100).all()


def test_warmup_mix_answers_a_fixed_share_directly():
    from reflow.rl.tool_demo import trace_batch, uses_tool

    ids, attn, labels = trace_batch(TOK, [{"prompt": "23*47=", "label": "1081"}], direct_share=1.0)
    assert TOK.decode(ids[0].tolist(), skip_special_tokens=False) == "23*47=1081<eos>"
    assert TOK.decode([t for t in labels[0].tolist() if t != -100], skip_special_tokens=False) == "1081<eos>"
    train, _ = tool_task.make_problems(0, 2000, 0)
    direct = [r for r in train if not uses_tool(r, 0.75)]
    assert 0.72 < len(direct) / len(train) < 0.78
    assert all(uses_tool(r, 0.0) for r in train[:50])
