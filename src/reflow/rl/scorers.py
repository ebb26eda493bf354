"""What scores samples (the `reward:` config section): the `Scorer` interface and its registry.

Built in: `function` (data.reward_fn, a `module:function`; reflow.rl.rewards holds its contract),
`builtin` (a verifier of reflow.rl.verifiers) and `http` (a reward server, reflow.rl.reward_http).
A scorer of one's own is a `Scorer` subclass, chosen with `reward.type: custom` and `reward.scorer:`
its registered name or `package.module:Class`:

    from reflow.rl.scorers import Scorer, register_scorer

    class LengthScorer(Scorer):
        def __init__(self, reward, reward_fn):  # the `reward:` section and data.reward_fn
            ...
        def score(self, samples, timeout_s):
            return [float(s.response_tokens) for s in samples], {}

    register_scorer("length", LengthScorer)   # or reward.scorer: my_project.scoring:LengthScorer

The scorer is built on the driver (`reward_source`) and travels to the Ray workers that score
rollouts and evaluations, so it must pickle, and its module must import there.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from reflow.rl.registry import Registry
from reflow.rl.rewards import RewardError, load_reward_fn, score_with_metrics, split_value
from reflow.rl.verifiers import BUILTINS

if TYPE_CHECKING:
    from reflow.rl.types import Sample

Scores = tuple[list[float], dict[str, float]]  # one reward per sample, in order; means of extra metrics


class Scorer(ABC):
    """Rewards of a batch of samples. `score` is the whole contract; the rest has defaults."""

    @abstractmethod
    def score(self, samples: Sequence[Sample], timeout_s: float) -> Scores:
        """One finite reward per sample, in order, plus {"reward/<key>": mean} of any extra metrics.
        `timeout_s` (reward.fn_timeout_s): the deadline of one call of an in-process function; a scorer
        that calls out bounds its requests itself. Failures raise `reflow.rl.rewards.RewardError`."""

    def load(self, used_by: str | None = None) -> None:
        """Import what scoring needs, now: a bad config then stops the run before any actor starts
        (eval sets, infra/inputs/eval_sets.py). `used_by` (e.g. "eval.sets.0: heldout") goes into errors."""
        return None  # nothing to import by default

    def describe(self) -> str:
        """`field: value` saying which scorer the config chose (`reflow config --check` prints it)."""
        return f"reward.scorer: {type(self).__module__}:{type(self).__qualname__}"

    def check(self, sample: Sample, timeout_s: float) -> None:
        """The preflight: score one sample once (an empty answer to the first prompt)."""
        self.score([sample], timeout_s)

    def check_failed(self, source: str, error: str) -> str:
        """The preflight's one line when `check` raised RewardError (`error`, folded), naming the fix."""
        return (f"{self.describe().replace(': ', '=', 1)} fails on the first row of {source} with an empty "
                f"response: {error}. Make it return a float for any response")


@dataclass(frozen=True)
class FunctionScorer(Scorer):
    """A `module:function` reward function (data.reward_fn, a built-in verifier, an eval set's reward_fn),
    imported where it scores; `field` is the config field that named it (errors name it)."""

    spec: str
    field: str = "data.reward_fn"

    def score(self, samples: Sequence[Sample], timeout_s: float) -> Scores:
        return score_with_metrics(load_reward_fn(self.spec, self.field), [s.prompt for s in samples],
                                  [s.response for s in samples], [s.label for s in samples], samples, timeout_s)

    def load(self, used_by: str | None = None) -> None:
        load_reward_fn(self.spec, f"{self.field} (used by {used_by})" if used_by else self.field)

    def describe(self) -> str:
        return f"{self.field}: {self.spec}"

    def check_failed(self, source: str, error: str) -> str:
        return (f"{self.field}={self.spec!r} fails on the first row of {source} with an empty response: {error}. "
                f"Make it return a float for any response")


# (the `reward:` config section, data.reward_fn) -> a Scorer
ScorerFactory = Callable[[Any, str], Scorer]
SCORERS: Registry[ScorerFactory] = Registry(
    "scorer", "subclass reflow.rl.scorers.Scorer and name it in reward.scorer as 'package.module:Class', "
              "or register it with reflow.rl.scorers.register_scorer")


def register_scorer(name: str, factory: ScorerFactory) -> ScorerFactory:
    """Make a scorer choosable as `reward.scorer: <name>` (with reward.type: custom); `factory(reward,
    reward_fn)` builds it (a Scorer subclass whose __init__ takes those two is one)."""
    return SCORERS.register(name, factory)


def _http(reward: Any, function: str) -> Scorer:
    from reflow.rl.reward_http import http_scorer

    return http_scorer(reward)


register_scorer("function", lambda reward, function: FunctionScorer(function))
register_scorer("builtin", lambda reward, function: FunctionScorer(BUILTINS[reward.builtin], "reward.builtin"))
register_scorer("http", _http)


def reward_source(reward: Any, function: str) -> Scorer:
    """The scorer the `reward:` config section chooses: reward.type's (function: `function`, which is
    data.reward_fn; builtin; http), or with type custom reward.scorer's. Built on the driver: a reward
    server's token is read from its environment here (reward.token_env)."""
    if reward.type != "custom":
        return SCORERS.resolve(reward.type, "reward.type")(reward, function)
    built = SCORERS.resolve(reward.scorer, "reward.scorer")(reward, function)
    if not isinstance(built, Scorer):  # deliberate: a user's factory is checked once, here, with the fix named
        raise ValueError(f"reward.scorer={reward.scorer!r} built a {type(built).__name__}, not a "
                         f"reflow.rl.scorers.Scorer: subclass Scorer and implement score(samples, timeout_s)")
    return built


def as_scorer(source: Scorer | str, field: str = "data.reward_fn") -> Scorer:
    """A scorer, or a `module:function` string (data.reward_fn's form, which callers may still pass)."""
    return FunctionScorer(source, field) if isinstance(source, str) else source


def score_samples(scorer: Scorer, samples: Sequence[Sample], timeout_s: float) -> Scores:
    """`scorer.score`, holding any scorer to the contract: one finite float per sample."""
    rewards, metrics = scorer.score(samples, timeout_s)
    if len(rewards) != len(samples):
        raise RewardError(f"{scorer.describe()} returned {len(rewards)} rewards for {len(samples)} samples")
    who = scorer.describe()
    return [split_value(who, i, s.prompt, s.response, r)[0] for i, (s, r) in enumerate(zip(samples, rewards))], metrics
