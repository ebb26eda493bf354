"""A scorer, a policy objective and a weight transport of a user's own, outside the package: each is one
class here plus one registry line. Ray workers import this module to unpickle them (the scorer in the
scoring tasks, the objective and the transport in the trainer ranks)."""
from __future__ import annotations

from reflow.engines.weights.transport import SharedMemory, register_transport
from reflow.rl.losses import aggregate, masked_mean
from reflow.rl.objectives import PolicyObjective, register_objective
from reflow.rl.scorers import Scorer, register_scorer

TOKEN_REWARD = 0.25  # the scorer's reward per response token: a value no built-in reward gives


class TokenCountScorer(Scorer):
    """Reward = TOKEN_REWARD x response tokens, and a marker metric (`reward/extension_scorer`)."""

    def __init__(self, reward, reward_fn):
        self.scale = TOKEN_REWARD

    def score(self, samples, timeout_s):
        return [self.scale * s.response_tokens for s in samples], {"reward/extension_scorer": 1.0}


class Reinforce(PolicyObjective):
    """Plain REINFORCE, -A log p reduced with the run's aggregation (no ratio, no clip), with its own metrics."""

    means = ("reinforce_loss",)
    token_means = ("logprob_mean",)
    maxima = {"advantage_max": 0.0}

    def loss(self, t, hp):
        adv = t.advantages.unsqueeze(-1).expand_as(t.logprobs) if t.advantages.dim() == 1 else t.advantages
        loss = aggregate(-adv * t.logprobs, t.mask, hp.loss_agg, hp.loss_norm_len)
        return loss, {"reinforce_loss": loss.detach(), "logprob_mean": masked_mean(t.logprobs.detach(), t.mask),
                      "advantage_max": (adv * t.mask).max().detach()}


class CountingTransport(SharedMemory):
    """Shared-memory buckets, counted: the report says how many pushes went through this object."""

    mode = "counted"

    def __init__(self):
        self.pushes = 0

    def send(self, job):
        self.pushes += 1
        return {**super().send(job), "counted_pushes": self.pushes}


register_scorer("token_count", TokenCountScorer)
register_objective("reinforce", Reinforce)
register_transport("counted", CountingTransport)
