"""Reward functions used by the tests as users would plug theirs in (`data.reward_fn`)."""


def raising_reward(prompt: str, response: str, label) -> float:
    raise KeyError(f"verifier has no answer key for {prompt!r}")


def label_as_reward(prompt: str, response: str, label) -> float:
    """The row's label *is* the reward: a canary eval set whose score a test sets by rewriting the
    file, to force an evaluation to improve or regress through the real eval path."""
    return float(label)


def finish_aware_reward(prompt: str, response: str, label, *, sample) -> float:
    """A reward that needs more than the text: 1 only for the right answer that ended on a stop token
    (not one cut at the length limit), minus 0.01 per response token."""
    correct = response == str(label) and sample.finish_reason == "stop"
    return float(correct) - 0.01 * sample.response_tokens


async def async_sample_reward(prompt: str, response: str, label, sample=None) -> float:
    """Async, `sample` with a default: still receives it."""
    return float(sample.response_tokens) if sample is not None else -1.0


def dict_reward(prompt: str, response: str, label, *, sample) -> dict:
    """A score plus an extra metric (`reward/tokens` in the iteration's metrics)."""
    return {"score": float(response == label), "tokens": sample.response_tokens}


def dict_without_score(prompt: str, response: str, label) -> dict:
    return {"correct": 1.0}


def slow_on_late(prompt: str, response: str, label) -> float:
    """Answers a response "late" after 1 s: past a short reward.fn_timeout_s."""
    if response == "late":
        import time

        time.sleep(1.0)
    return 1.0


def nan_on_answers(prompt: str, response: str, label) -> float:
    """A finite reward for the empty response the preflight scores, NaN for every real one."""
    return float("nan") if response else 0.0
