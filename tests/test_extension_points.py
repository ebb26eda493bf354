"""The three extension points (issue 53): a `Scorer`, a `PolicyObjective` and a `WeightTransport` of one's own,
each one class plus one registry line outside the package (tests/extension_fixtures.py), chosen by config
(a registered name, or `package.module:Class`) and used by a real iteration on Ray + DeepSpeed + Prefect.
One run carries all three (one iteration, tiny shapes); each test reads the trace of its own piece."""
from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

import tests.extension_fixtures as ext  # registers token_count, reinforce and counted in this (the driver's) process
from reflow.engines.weights.settings import PushSettings
from reflow.engines.weights.transport import Fallback, PushJob, WeightTransport, tensor_transport
from reflow.infra.config.schema import ConfigError, load_config
from reflow.infra.config.settings import loss_settings, push_settings
from reflow.rl.objectives import PPOClip
from reflow.rl.scorers import reward_source

CUSTOM = ["reward.type=custom", "reward.scorer=token_count", "algorithm.objective=tests.extension_fixtures:Reinforce",
          "weight_sync.transport=counted"]


def _config(policy, tmp_path, *extra):
    return load_config(None, [
        "experiment=extension-points", f"model.path={policy}", "num_iterations=1", "eval.before_train=false",
        "data.num_train=64", "data.num_eval=8", "rollout.prompts_per_iteration=4", "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=4", "trainer.num_ranks=1", "trainer.micro_batch_size=16", "trainer.lr=1e-3",
        "weight_sync.verify=full", f"storage.root=file://{tmp_path}/runs", *extra])


@pytest.fixture(scope="module")
def run(ray_cluster, prefect_server, tiny_policy, tmp_path_factory):
    """One iteration with the custom scorer, objective and transport: (summary, rollouts of iteration 0)."""
    from reflow.flows.train import train

    tmp = tmp_path_factory.mktemp("extension_points")
    summary = train(_config(tiny_policy, tmp, *CUSTOM))
    assert summary["iterations"] == 1
    rollouts = pd.read_parquet(tmp / "runs" / "extension-points" / "iterations" / "000000" / "rollouts.parquet")
    return summary, rollouts


def test_config_chooses_the_custom_pieces_by_name_or_class(tiny_policy, tmp_path):
    cfg = _config(tiny_policy, tmp_path, *CUSTOM)
    assert isinstance(reward_source(cfg.reward, cfg.data.reward_fn), ext.TokenCountScorer)
    assert isinstance(loss_settings(cfg).objective, ext.Reinforce)
    assert push_settings(cfg).transport is ext.CountingTransport
    plain = _config(tiny_policy, tmp_path)  # the defaults: the algorithm's own objective, the mode's transport
    assert loss_settings(plain).objective == PPOClip() and push_settings(plain).transport.__name__ == "tensor_transport"


@pytest.mark.parametrize("overrides, message", [
    (["reward.type=custom"], "reward.type=custom needs reward.scorer"),
    (["reward.scorer=token_count"], "reward.scorer='token_count' is read only with reward.type=custom"),
    (["algorithm.objective=no way"], "algorithm.objective='no way' names no policy objective"),
    (["weight_sync.transport=a:b:c"], "weight_sync.transport='a:b:c' names no weight transport"),
])
def test_malformed_names_are_refused_with_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_unknown_names_are_refused_where_they_are_resolved():
    cfg = load_config(None, ["reward.type=custom", "reward.scorer=nope", "algorithm.objective=tests.nowhere:Loss",
                             "weight_sync.transport=nope"])
    with pytest.raises(ValueError, match=r"reward.scorer='nope' is not a registered scorer \(builtin, function, http, "
                                         r"token_count\) nor 'package.module:Name': subclass reflow.rl.scorers.Scorer"):
        reward_source(cfg.reward, cfg.data.reward_fn)
    with pytest.raises(ValueError, match=r"algorithm.objective='tests.nowhere:Loss': module 'tests.nowhere' not found"):
        loss_settings(cfg)
    with pytest.raises(ValueError, match=r"weight_sync.transport='nope' is not a registered weight transport"):
        push_settings(cfg)


def test_custom_scorer_scores_the_batch(run):
    summary, rollouts = run
    assert len(rollouts) == 16
    assert rollouts.reward.tolist() == pytest.approx((ext.TOKEN_REWARD * rollouts.response_tokens).tolist())
    m = summary["history"][0]
    assert m["reward/extension_scorer"] == 1.0
    assert m["reward_mean"] == pytest.approx(ext.TOKEN_REWARD * rollouts.response_tokens.mean())


def test_custom_objective_is_what_the_trainer_minimised(run):
    m = run[0]["history"][0]
    for key in ("loss", "reinforce_loss", "logprob_mean", "advantage_max", "grad_norm"):
        assert math.isfinite(m[key]), (key, m.get(key))
    assert m["loss"] == pytest.approx(m["reinforce_loss"])  # the trainer reports the objective's loss as it is
    assert m["logprob_mean"] < 0 and m["advantage_max"] >= 0
    assert not {"pg_loss", "clip_frac", "ratio_max"} & set(m)  # PPO-clip's metrics: not this objective's


def test_custom_transport_carried_the_pushes(run):
    m = run[0]["history"][0]
    assert m["push_counted_pushes"] >= 1  # the push after the update went through CountingTransport.send
    assert m["push_verified_tensors"] > 0  # and the engine holds exactly the trainer's weights (verify=full)


class _Step(WeightTransport):
    """A step that answers or fails as told (what Fallback calls: push, lost, applies)."""

    def __init__(self, mode: str, fails: Exception | None = None, gone_on: type | None = None, ipc: bool = False):
        self.mode, self.fails, self.gone_on, self.ipc, self.calls = mode, fails, gone_on, ipc, 0

    def push(self, job):
        self.calls += 1
        if self.fails is not None:
            raise self.fails
        return {"mode": self.mode}

    def send(self, job):
        raise AssertionError("Fallback calls push")

    def lost(self, error):
        return f"{self.mode} gone: {error}" if self.gone_on and isinstance(error, self.gone_on) else None


def test_fallback_chain_moves_on_only_for_a_lost_step_and_stays_there():
    job = PushJob([], [("w", torch.zeros(2))], "1", PushSettings())
    ipc, shm, disk = _Step("ipc", RuntimeError("refused"), RuntimeError, ipc=True), _Step("shm"), _Step("disk")
    chain = Fallback(ipc, shm, disk)
    assert chain.push(job) == {"mode": "shm", "ipc": False, "fallback": "ipc gone: refused"}
    assert chain.push(job) == {"mode": "shm", "ipc": False, "fallback": "ipc gone: refused"}  # and from then on
    assert (ipc.calls, shm.calls, disk.calls) == (1, 2, 0)
    shm.fails = ValueError("a bug, not a lost transport")
    with pytest.raises(ValueError, match="a bug"):
        chain.push(job)
    last = Fallback(_Step("only", KeyError("k"), KeyError))
    with pytest.raises(KeyError):  # nothing after it to fall back to
        last.push(job)
    assert Fallback(_Step("first", ipc=True)).push(job) == {"mode": "first", "ipc": True}
    tensor = tensor_transport()  # CUDA IPC only serves a trainer on a GPU; on CPU shared memory leads
    assert [tensor.gather_on_device(torch.device(d)) for d in ("cpu", "cuda")] == [True, True]
    assert tensor._current(torch.device("cpu")).mode == "tensor" and not tensor._current(torch.device("cpu")).ipc
    assert tensor._current(torch.device("cuda")).ipc
