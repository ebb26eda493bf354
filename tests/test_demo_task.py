"""The demo task, reward-function contract, prompt data and the bootstrap policy."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pandas as pd
import pytest

from reflow.rl.data import PromptSampler, load_prompt_rows, tokenize_prompts
from reflow.rl.demo_policy import bootstrap, build_tokenizer
from reflow.rl.demo_task import make_problems, reward
from reflow.rl.rewards import RewardError, compute_rewards, load_reward_fn


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


# ---------------------------------------------------------------- task
def test_splits_disjoint_deterministic_and_well_formed():
    train, held = make_problems(seed=3, num_train=500, num_eval=100, digits=2)
    assert (len(train), len(held)) == (500, 100)
    assert make_problems(3, 500, 100, 2) == (train, held)
    assert make_problems(4, 500, 100, 2) != (train, held)
    prompts = [r["prompt"] for r in train + held]
    assert len(set(prompts)) == 600  # no repeats inside or across splits
    for r in train + held:
        a, b = r["prompt"].rstrip("=").split("+")
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99 and r["label"] == str(int(a) + int(b))
    # the held-out split does not move when num_train changes
    assert make_problems(3, 50, 100, 2)[1] == held
    with pytest.raises(ValueError, match="distinct problems"):
        make_problems(0, 8100, 1, 2)  # 90 * 90 = 8100 two-digit pairs


def test_reward_exact_match_only():
    assert reward("12+34=", "46", "46") == 1.0
    assert reward("12+34=", "46", 46) == 1.0  # label type does not matter
    for wrong in ["47", "46 ", " 46", "046", "4", "466", ""]:
        assert reward("12+34=", wrong, "46") == 0.0, wrong


# ---------------------------------------------------------------- reward functions
def test_load_reward_fn_errors_name_the_field():
    assert load_reward_fn("reflow.rl.demo_task:reward") is reward
    with pytest.raises(ValueError, match=r"data\.reward_fn.*module 'no_such_mod' not found"):
        load_reward_fn("no_such_mod:f")
    with pytest.raises(ValueError, match=r"data\.reward_fn.*no attribute 'nope'"):
        load_reward_fn("reflow.rl.demo_task:nope")
    with pytest.raises(ValueError, match=r"data\.reward_fn.*not a function"):
        load_reward_fn("reflow.rl.data:_MAX_LISTED")
    with pytest.raises(ValueError, match=r"data\.reward_fn must look like"):
        load_reward_fn("reflow.rl.demo_task.reward")


def test_compute_rewards_sync():
    out = compute_rewards(reward, ["1+1=", "2+2="], ["2", "5"], ["2", "4"])
    assert out == [1.0, 0.0] and all(isinstance(x, float) for x in out)


def test_raising_reward_fn_names_sample_and_chains():
    def picky(prompt, response, label):
        if response == "boom":
            raise KeyError("bad label")
        return 1.0

    with pytest.raises(RewardError, match=r"picky raised KeyError.*sample 1.*prompt='2\+2='.*response='boom'") as e:
        compute_rewards(picky, ["1+1=", "2+2="], ["2", "boom"], ["2", "4"])
    assert isinstance(e.value.__cause__, KeyError)


@pytest.mark.parametrize("value, what", [(None, "NoneType"), ("1", "str"), (float("nan"), "nan"), (True, "bool")])
def test_non_number_or_nan_reward_is_an_error(value, what):
    with pytest.raises(RewardError, match=rf"{what}.*sample 0"):
        compute_rewards(lambda p, r, lab: value, ["1+1="], ["2"], ["2"])


def test_async_reward_fn_runs_concurrently():
    started = []

    async def slow(prompt, response, label):
        started.append(prompt)
        await asyncio.sleep(0.05)
        assert len(started) == 3  # all three started before any finished: gathered, not serial
        return float(response == label)

    assert compute_rewards(slow, ["a", "b", "c"], ["1", "2", "3"], ["1", "0", "3"]) == [1.0, 0.0, 1.0]

    async def broken(prompt, response, label):
        raise ValueError("judge down")

    with pytest.raises(RewardError, match="sample 0") as e:
        compute_rewards(broken, ["a"], ["1"], ["1"])
    assert isinstance(e.value.__cause__, ValueError)


def test_reward_overflowing_a_float_or_raising_system_exit_is_a_reward_error():
    """10**400 is a number float() cannot hold; SystemExit and KeyboardInterrupt raised by the function are its
    failure, not the process's end (`reflow config --check` exited 0 with no output on SystemExit(0))."""
    with pytest.raises(RewardError, match=r"returned int 1000.*too large for a float.*sample 0"):
        compute_rewards(lambda p, r, lab: 10**400, ["1+1="], ["2"], ["2"])
    for exc in (SystemExit(0), KeyboardInterrupt()):
        def leaves(p, r, lab, exc=exc):
            raise exc

        async def leaves_async(p, r, lab, exc=exc):
            raise exc

        for fn in (leaves, leaves_async):
            with pytest.raises(RewardError, match=rf"{fn.__name__} raised {type(exc).__name__}.*sample 0") as e:
                compute_rewards(fn, ["1+1="], ["2"], ["2"])
            assert e.value.__cause__ is exc


def _threads_named(prefix: str) -> list:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


@pytest.mark.parametrize("kind", ["sleeps", "loops in Python", "awaits", "blocks its event loop"])
def test_a_reward_call_past_its_deadline_fails_naming_the_sample(kind):
    """Each call has timeout_s (reward.fn_timeout_s); a late answer is never used. A sync call runs in a worker
    thread, which a call looping in Python is stopped in; one blocked in C ends on its own, abandoned."""
    def slow(p, r, lab):
        if r == "late":
            if kind == "sleeps":
                time.sleep(1.0)
            else:
                while True:
                    pass
        return 1.0

    async def slow_async(p, r, lab):
        if r == "late":
            await asyncio.sleep(30) if kind == "awaits" else time.sleep(1.0)
        return 1.0

    fn = slow if kind in ("sleeps", "loops in Python") else slow_async
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=rf"{fn.__name__} did not return within 0.2 s on sample 1 \(prompt='b', "
                                          r"response='late'\); reward.fn_timeout_s"):
        compute_rewards(fn, ["a", "b", "c"], ["1", "late", "1"], ["1", "1", "1"], timeout_s=0.2)
    assert time.monotonic() - t0 < 0.9
    if kind == "loops in Python":
        deadline = time.monotonic() + 5
        while _threads_named("reward ") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _threads_named("reward "), "the looping call was not stopped"
    assert compute_rewards(fn, ["a"], ["1"], ["1"], timeout_s=0.2) == [1.0]


# ---------------------------------------------------------------- data
def test_malformed_rows_are_all_reported(tok):
    rows = [{"prompt": "1+1=", "label": "2"}, {"label": "3"}, {"prompt": 5}, {"prompt": "  "}, "x",
            {"prompt": "2+2="}, {"label": 1}, {"label": 1}, {"label": 1}]
    with pytest.raises(ValueError) as e:
        tokenize_prompts(rows, tok, max_prompt_len=16)
    msg = str(e.value)
    assert "7 of 9 prompt rows are invalid" in msg and "(and 2 more)" in msg
    assert "row 1: has no prompt" in msg and "row 2: prompt is a int" in msg
    assert "row 3: prompt is empty" in msg and "row 4: is a str" in msg


def test_over_long_prompt_rejected_and_good_rows_tokenized(tok):
    rows = [{"prompt": "12+34=", "label": "46"}, {"prompt": "1" * 20 + "=", "label": "x"}]
    with pytest.raises(ValueError, match=r"1 of 2 .*row 1: 21 tokens > data\.max_prompt_len=16"):
        tokenize_prompts(rows, tok, max_prompt_len=16)
    [p] = tokenize_prompts(rows[:1], tok, max_prompt_len=16)
    assert (p.index, p.text, p.label, len(p.input_ids)) == (0, "12+34=", "46", 6)
    assert tok.decode(p.input_ids) == "12+34="


def test_load_rows_from_file_jsonl_and_parquet(tmp_path):
    df = pd.DataFrame({"q": [f"{i}+1=" for i in range(10)], "a": [str(i + 1) for i in range(10)]})
    df.to_json(tmp_path / "d.jsonl", orient="records", lines=True)
    df.to_parquet(tmp_path / "d.parquet")
    for name in ("d.jsonl", "d.parquet"):
        train, held = load_prompt_rows("file", str(tmp_path / name), "q", "a", 0, 1, 3, 2)
        assert [r["prompt"] for r in held] == ["7+1=", "8+1=", "9+1="] and len(train) == 7
        assert train[0] == {"prompt": "0+1=", "label": "1"}
    train, held = load_prompt_rows("file", str(tmp_path / "d.jsonl"), "q", "a", 0, 1, 3, 2,
                                   eval_path=f"file://{tmp_path / 'd.parquet'}")
    assert len(train) == 10 and len(held) == 10
    with pytest.raises(ValueError, match=r"no column 'prompt' \(data\.prompt_key\)"):
        load_prompt_rows("file", str(tmp_path / "d.jsonl"), "prompt", "a", 0, 1, 3, 2)
    assert load_prompt_rows("addition", None, "p", "l", 1, 20, 5, 2) == make_problems(1, 20, 5, 2)


def test_metadata_columns_reach_the_prompts(tmp_path, tok):
    df = pd.DataFrame({"q": ["1+1=", "2+2=", "3+3="], "a": ["2", "4", "6"], "level": [1, None, 3],
                       "tags": [["x"], ["y", "z"], []]})
    df.to_json(tmp_path / "d.jsonl", orient="records", lines=True)
    df.to_parquet(tmp_path / "d.parquet")
    for name in ("d.jsonl", "d.parquet"):
        train, held = load_prompt_rows("file", str(tmp_path / name), "q", "a", 0, 1, 1, 2,
                                       metadata_keys=["level", "tags"])
        prompts = tokenize_prompts(train + held, tok, 16)
        assert [p.metadata for p in prompts] == [{"level": 1, "tags": ["x"]}, {"level": None, "tags": ["y", "z"]},
                                                 {"level": 3, "tags": []}], name
    assert tokenize_prompts(load_prompt_rows("file", str(tmp_path / "d.jsonl"), "q", "a", 0, 1, 1, 2)[0], tok, 16)[0].metadata == {}
    with pytest.raises(ValueError, match=r"no column 'nope' \(data\.metadata_keys\)"):
        load_prompt_rows("file", str(tmp_path / "d.jsonl"), "q", "a", 0, 1, 1, 2, metadata_keys=["nope"])
    with pytest.raises(ValueError, match="data.task=file"):
        load_prompt_rows("addition", None, "p", "l", 1, 20, 5, 2, metadata_keys=["level"])


def test_sampler_deterministic_epochs_and_exact_resume(tok):
    prompts = tokenize_prompts([{"prompt": f"{i}+0="} for i in range(10)], tok, 16)
    a, b = PromptSampler(prompts, seed=7), PromptSampler(prompts, seed=7)
    first = [p.index for p in a.next_batch(4)]
    assert first == [p.index for p in b.next_batch(4)]
    epoch0 = first + [p.index for p in a.next_batch(6)]
    assert sorted(epoch0) == list(range(10)) and a.state_dict()["cursor"] == 10
    crossing = [p.index for p in a.next_batch(13)]  # finishes epoch 1, enters epoch 2
    assert sorted(crossing[:10]) == list(range(10)) and crossing[:10] != epoch0
    state = a.state_dict()
    assert (state["epoch"], state["cursor"]) == (2, 3)
    c = PromptSampler(prompts, seed=7)
    c.load_state_dict(json.loads(json.dumps(state)))
    assert [p.index for p in c.next_batch(25)] == [p.index for p in a.next_batch(25)]
    with pytest.raises(ValueError, match="sampler state is for 10 prompts"):
        PromptSampler(prompts[:5], seed=7).load_state_dict(state)


# ---------------------------------------------------------------- bootstrap policy
def test_bootstrap_writes_loadable_hf_folder(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    report = bootstrap(tmp_path / "policy", seed=0, num_train=200, num_eval=20, steps=3, batch=8,
                       hidden=32, layers=2, heads=2, mlp=64, progress=False)
    assert json.loads((tmp_path / "policy" / "bootstrap.json").read_text()) == report
    assert 0.0 <= report["eval_accuracy_after"] <= 1.0 and report["warmup"]["steps"] == 3
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    tok = AutoTokenizer.from_pretrained(tmp_path / "policy")
    ids = tok("12+34=46", add_special_tokens=False)["input_ids"]
    assert len(ids) == 8 and tok.decode(ids) == "12+34=46"
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == "12+34=46"
    assert model.config.vocab_size == len(tok) and model.config.eos_token_id == tok.eos_token_id


def test_warmup_bar_ends_at_100_percent_and_says_why_it_stopped_early(tok, capsys):
    """The target is reached at the first check (any accuracy >= 0): the bar must not stop at 5/50."""
    from reflow.rl.demo_policy import build_model, warmup

    rows, _ = make_problems(0, 64, 8, 2)
    model = build_model(tok, hidden=32, layers=2, heads=2, mlp=64, seed=0)
    metrics = warmup(model, tok, rows, steps=50, batch=8, stop_accuracy=0.0, check_rows=rows[:8], check_every=5)
    assert metrics["steps"] == 5
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "reached the target 0.0 at step 5" in last and "100%" in last and "5/5" in last, last


def test_warmup_checks_wait_for_the_loss_to_come_down(tok):
    """check_below_loss: no greedy check runs while the last 10 steps' mean loss is above it (the GPU scratchpad
    bootstrap's first four checks all scored 0 at ~16 s each); once it is at or below, the checks run as before."""
    from reflow.rl.demo_policy import build_model, warmup

    rows, _ = make_problems(0, 64, 8, 2)
    never = warmup(build_model(tok, hidden=32, layers=2, heads=2, mlp=64, seed=0), tok, rows, steps=12, batch=8,
                   stop_accuracy=0.0, check_rows=rows[:8], check_every=5, check_below_loss=0.0, progress=False)
    assert never["steps"] == 12 and never["checks"] == 0 and never["check_accuracy"] is None, never
    always = warmup(build_model(tok, hidden=32, layers=2, heads=2, mlp=64, seed=0), tok, rows, steps=12, batch=8,
                    stop_accuracy=0.0, check_rows=rows[:8], check_every=5, check_below_loss=1e9, progress=False)
    assert always["steps"] == 5 and always["checks"] == 1, always  # the target 0.0 is met at the first check
    (step, acc, loss), = always["check_history"]  # each check's step, accuracy and loss, for bootstrap.json
    assert step == 5 and acc == always["check_accuracy"] and loss == always["loss_last"] and never["check_history"] == []


def test_an_autocast_warmup_step_runs_its_forward_in_bf16_and_keeps_float32_weights(tok):
    """The GPU bootstrap's warm-up runs its forwards under bf16 autocast (scratchpad_demo.SETTINGS["gpu"]); checked here
    on CPU, where autocast works the same way: the step's loss is the float32 one within bf16's rounding, the products
    ran in bf16 (a float32 step's loss differs from it), and the weights stay float32."""
    import torch

    from reflow.rl.demo_policy import _sft_step, build_model

    rows, _ = make_problems(0, 16, 4, 2)
    losses, weights = {}, {}
    for autocast in (False, True):
        model = build_model(tok, hidden=32, layers=2, heads=2, mlp=64, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[autocast] = _sft_step(model, opt, tok, rows[:8], autocast=autocast)
        weights[autocast] = next(model.parameters()).detach().clone()
    assert losses[True] != losses[False] and abs(losses[True] - losses[False]) < 0.02 * losses[False], losses
    assert weights[True].dtype == torch.float32
