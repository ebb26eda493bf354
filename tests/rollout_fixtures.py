"""Rollout functions used by the tests as users would plug theirs in (`rollout.generate_fn`)."""
from __future__ import annotations

from reflow.engines.rollout_fns import AsyncEngine, RolloutRequest, Trajectory, result_logprobs

TOOL_TOKENS = 3  # how many prompt tokens the stand-in "tool" echoes back


async def two_turns(request: RolloutRequest, engine: AsyncEngine) -> Trajectory:
    """generate -> a "tool" answers with the first prompt tokens -> generate again from the whole
    context. Response = turn 1 + tool output + turn 2; the tool's tokens are masked out."""
    first = await engine.generate(request.prompt_ids, request.sampling_params)
    tool = list(request.prompt_ids[:TOOL_TOKENS])
    context = [*request.prompt_ids, *first["output_ids"], *tool]
    second = await engine.generate(context, request.sampling_params)
    ids = [*first["output_ids"], *tool, *second["output_ids"]]
    mask = [1] * len(first["output_ids"]) + [0] * len(tool) + [1] * len(second["output_ids"])
    return Trajectory(ids, result_logprobs(first) + result_logprobs(second), first["text"] + "|" + second["text"],
                      mask, second["meta_info"]["finish_reason"]["type"],
                      {"turns": 2, "tool_calls": 1, "context_ids": context})


async def raising_rollout(request: RolloutRequest, engine: AsyncEngine) -> Trajectory:
    if request.sample_index == 2:
        raise ConnectionRefusedError(f"calculator sandbox refused sample {request.sample_index}")
    return Trajectory([1], [0.0], "x")


async def short_logprobs(request: RolloutRequest, engine: AsyncEngine) -> Trajectory:
    return Trajectory([5, 6, 7], [-0.1], "abc", [1, 0, 1])


def not_async(request, engine):
    return Trajectory([1], [0.0], "x")
