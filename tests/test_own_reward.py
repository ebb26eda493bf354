"""Bringing one's own reward and data: a reward function that declares a `sample` parameter sees the
finish reason and token counts (plain `(prompt, response, label)` functions keep working), the rollout's
decoding options reach the engine, eval sets name the reward field the user set, and `--check` warns when
the held-out set is carved out of the training file. A real embedded engine on loopback; no Ray, no Prefect.
"""
from __future__ import annotations

import json

import pytest

from reflow.engines import rollout_stages as ro
from reflow.engines.embedded.sampling import SamplingConfig
from reflow.engines.hf_io import load_tokenizer
from reflow.engines.rollout_fns import BatchRequest, RolloutSettings
from reflow.rl.demo_task import reward as plain_reward
from reflow.rl.rewards import compute_rewards, wants_sample
from reflow.rl.types import Prompt, Sample
from tests.reward_fixtures import async_sample_reward, finish_aware_reward
from tests.test_engine import KEY
from tests.test_engine import engine as _engine_fixture

engine = _engine_fixture  # test_engine's embedded engine on loopback (module-scoped here too), reached with KEY


def _sample(response: str, finish: str, tokens: int) -> Sample:
    return Sample("1+1=", response, "2", finish, 4, tokens, tuple(range(tokens)))


def test_sample_functions_get_the_record_and_plain_ones_do_not():
    samples = [_sample("2", "stop", 2), _sample("2", "length", 1), _sample("3", "stop", 2)]
    texts = [s.response for s in samples]
    assert compute_rewards(finish_aware_reward, ["1+1="] * 3, texts, ["2"] * 3, samples) == [0.98, -0.01, -0.02]
    assert compute_rewards(async_sample_reward, ["1+1="] * 3, texts, ["2"] * 3, samples) == [2.0, 1.0, 2.0]
    assert compute_rewards(plain_reward, ["1+1="] * 3, texts, ["2"] * 3, samples) == [1.0, 1.0, 0.0]
    assert compute_rewards(plain_reward, ["1+1="], ["2"], ["2"]) == [1.0]  # no samples: the plain contract
    assert [wants_sample(f) for f in (finish_aware_reward, async_sample_reward, plain_reward, len)] == \
        [True, True, False, False]
    with pytest.raises(ValueError, match="finish_aware_reward takes a `sample` parameter; pass samples="):
        compute_rewards(finish_aware_reward, ["1+1="], ["2"], ["2"])


def test_decoding_options_are_sglang_sampling_params():
    sp = ro.sampling_params(1.0, 1.0, -1, 4, [0], skip_special_tokens=False, no_stop_trim=True)
    cfg = SamplingConfig.from_dict(sp)  # the embedded engine takes SGLang's names as they are
    assert (cfg.skip_special_tokens, cfg.no_stop_trim) == (False, True)
    assert ro.sampling_params(1.0, 1.0, -1, 4)["skip_special_tokens"] is True


def test_finish_reason_and_decoding_options_reach_the_reward(engine, tiny_policy):
    """Every token id is a stop token, so each response is one token that ends it ("stop"): trimmed
    by default, kept with no_stop_trim (special tokens decoded with skip_special_tokens=false only).
    With no stop tokens the responses hit the length limit."""
    tok = load_tokenizer(str(tiny_policy))
    prompts = [Prompt(i, t, tok(t)["input_ids"], str(sum(map(int, t[:-1].split("+")))))
               for i, t in enumerate(["12+34=", "5+6="])]
    every = list(range(len(tok)))
    runs = {name: ro.generate(RolloutSettings([engine.url()], ro.sampling_params(0.0, 1.0, -1, 3, stop, skip, keep), 2,
                                              60.0, KEY, seed=0), BatchRequest(prompts, 0))
            for name, stop, skip, keep in (("trimmed", every, True, False), ("kept", every, True, True),
                                           ("raw", every, False, True), ("length", None, True, False))}
    assert [s.response for s in runs["trimmed"].samples()] == [""] * 4
    for name, skip in (("kept", True), ("raw", False)):
        got = runs[name].samples()
        assert [s.response for s in got] == [tok.decode(list(s.response_ids), skip_special_tokens=skip) for s in got]
        assert all(s.finish_reason == "stop" and s.response_tokens == 1 and s.prompt_tokens > 0 for s in got), got
    # the tiny policy answers "5+6=" with a special token (<unk>): only skip_special_tokens=false shows it
    assert [s.response for s in runs["kept"].samples()] != [s.response for s in runs["raw"].samples()]
    assert all(s.finish_reason == "length" and s.response_tokens == 3 for s in runs["length"].samples())
    scored, stats = ro.score(runs["length"], "tests.reward_fixtures:finish_aware_reward")
    assert scored.rewards == [-0.03] * 4 and stats["truncated_frac"] == 1.0


def test_eval_reward_errors_name_the_field_the_user_set(tiny_policy):
    from reflow.infra.config.schema import load_config
    from reflow.infra.inputs.eval_sets import load_eval_sets

    tok = load_tokenizer(str(tiny_policy))
    heldout = [Prompt(0, "1+1=", tok("1+1=")["input_ids"], "2")]
    own = load_config(None, ['eval.sets=[{name: own, reward_fn: "tests.reward_fixtures:nope"}]'])
    with pytest.raises(ValueError, match=r"^eval\.sets\.0\.reward_fn \(own\)='tests\.reward_fixtures:nope': module"):
        load_eval_sets(own, tok, heldout)
    inherited = load_config(None, ["data.reward_fn=tests.reward_fixtures:nope"])
    with pytest.raises(ValueError, match=r"^data\.reward_fn \(used by eval\.sets\.0: heldout\)='tests\.reward_fixt"):
        load_eval_sets(inherited, tok, heldout)
    decoded = load_eval_sets(load_config(None, ["rollout.skip_special_tokens=false", "rollout.no_stop_trim=true"]),
                             tok, heldout)[0]
    assert (decoded.skip_special_tokens, decoded.no_stop_trim) == (False, True)


def test_check_warns_when_the_heldout_set_is_carved_out_of_the_training_file(tmp_path, tiny_policy, capsys):
    from reflow.flows.cli import main

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(12)))
    base = ["--check", f"model.path={tiny_policy}", "data.task=file", f"data.path={data}", "data.num_eval=4",
            f"storage.root=file://{tmp_path}/runs"]
    main(["config", *base])
    err = capsys.readouterr().err
    assert (f"reflow: warning: data.eval_path is not set: the last data.num_eval=4 rows of data.path='{data}' are "
            f"held out of training and are the eval set(s) ['heldout']; give data.eval_path") in err, err
    main(["config", *base, f"data.eval_path={data}"])
    assert "warning" not in capsys.readouterr().err
