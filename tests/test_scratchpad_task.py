"""The scratchpad task (issue 56): worked traces checked by hand, the reward of right, wrong and malformed
responses, problems fixed by seed, the length tail, and the warm-up's labels on the worked response."""
from __future__ import annotations

import random
import re

import pytest

from reflow.rl import scratchpad_task as sp
from reflow.rl.demo_policy import CHARS, answer_batch, build_tokenizer

WORKED = "(7*6+0=42 4*6+4=28 =282)(7*3+0=21 4*3+2=14 =141)(2+0+0=02 8+1+0=09 2+4+0=06 0+1+0=01 =1692)=1692"
STEP = re.compile(r"(\d)([*+])(\d)\+(\d)=(\d\d)")


def test_worked_example_checked_on_paper():
    # 47*6: 7*6 = 42 (write 2, carry 4), 4*6 + 4 = 28 -> 282; 47*3: 21, 4*3 + 2 = 14 -> 141;
    # 282 + 1410 column by column: 2+0, 8+1, 2+4, 0+1 -> 1692 = 47*36
    assert sp.trace(47, 36) == WORKED
    # carries out of the last column, in the products and in the sum: 99*99 = 891 + 8910 = 9801
    assert sp.trace(99, 99) == ("(9*9+0=81 9*9+8=89 =891)(9*9+0=81 9*9+8=89 =891)"
                                "(1+0+0=01 9+1+0=10 8+9+1=18 0+8+1=09 =9801)=9801")
    # a zero digit gives a zero partial product; the sum still runs over every column
    assert sp.trace(12, 30) == "(2*0+0=00 1*0+0=00 =0)(2*3+0=06 1*3+0=03 =36)(0+0+0=00 0+6+0=06 0+3+0=03 =360)=360"
    assert sp.trace(5, 0) == "(5*0+0=00 =0)=0"


def test_every_step_of_random_traces_is_right_and_in_the_alphabet():
    rng = random.Random(1)
    for _ in range(300):
        a, b = rng.randrange(10**rng.randint(1, 6)), rng.randrange(10**rng.randint(1, 6))
        t = sp.trace(a, b)
        assert t.endswith(f")={a * b}") and set(t) <= set(CHARS), t
        for x, op, y, c, v in STEP.findall(t):
            assert (int(x) * int(y) if op == "*" else int(x) + int(y)) + int(c) == int(v), (a, b, x, op, y, c, v)
        assert t.count("(") == len(str(b)) * 2 - 1  # a product block per digit of b, a sum block per one after the first
        assert sp.answer(t) == str(a * b)


@pytest.mark.parametrize("response, score, exact", [
    (WORKED, 1.0, 1.0),
    ("(7*6+0=42)=1692", 1.0, 0.0),            # the answer is what counts, not the scratchpad
    (WORKED[:-1] + "3", 0.0, 0.0),            # a wrong answer
    (WORKED[:-1], 0.0, 0.0),                  # cut inside the answer (the length limit)
    (WORKED[:40], 0.0, 0.0),                  # cut inside the scratchpad: its last "=NN" is no answer
    (WORKED + " ", 0.0, 0.0),                 # text after the answer
    (WORKED.replace(")=1692", ")=01692"), 0.0, 0.0),
    ("1692", 0.0, 0.0),                       # no scratchpad: the answer must follow ")="
    ("=1692", 0.0, 0.0),
    ("", 0.0, 0.0),
])
def test_reward_of_right_wrong_and_malformed_responses(response, score, exact):
    assert sp.reward("47*36=", response, "1692") == {"score": score, "trace_exact": exact}
    assert sp.reward("47*36=", response, 1692)["score"] == score  # a label read as a number


def test_a_prompt_that_is_no_product_is_named():
    with pytest.raises(ValueError, match=r"not a scratchpad prompt \(want 'a\*b='\): '47\+36='"):
        sp.operands("47+36=")
    assert sp.reward("47+36=", WORKED, "1692") == {"score": 1.0, "trace_exact": 0.0}
    with pytest.raises(ValueError, match="non-negative"):
        sp.trace(-1, 3)
    with pytest.raises(ValueError, match="1 <= min_digits <= max_digits"):
        sp.Shape(3, 2)


def test_problems_are_fixed_by_seed_and_held_out_first():
    shape = sp.Shape(2, 4)
    train, held = sp.make_problems(7, 300, 50, shape)
    assert (train, held) == sp.make_problems(7, 300, 50, shape)
    assert sp.make_problems(8, 300, 50, shape)[1] != held
    assert sp.make_problems(7, 100, 50, shape)[1] == held  # the held-out split does not move with num_train
    prompts = [r["prompt"] for r in train + held]
    assert len(set(prompts)) == 350  # distinct, so disjoint
    for r in train + held:
        a, b = sp.operands(r["prompt"])
        assert r["label"] == str(a * b) and all(2 <= len(str(x)) <= 4 for x in (a, b))
    with pytest.raises(ValueError, match="only ~100 distinct"):
        sp.make_problems(0, 60, 0, sp.Shape(1, 1))


def test_length_stats_by_hand():
    rows = [{"prompt": "47*36="}, {"prompt": "5*0="}, {"prompt": "99*99="}, {"prompt": "12*30="}]
    # characters: 47*36 and 99*99 are 24 + 24 + 43 ("(" 4 steps of 8, 3 spaces, " =1692)") + 5 ("=1692") = 96;
    # 12*30 is 22 + 23 + 33 + 4 = 82; 5*0 is 13 + 2 = 15; one token each plus eos: 97, 97, 83, 16
    assert sp.length_stats(rows) == {"mean": (97 + 16 + 97 + 83) / 4, "median": 83, "p90": 97, "p99": 97,
                                     "max": 97}


def test_gpu_shape_has_long_responses_with_a_tail():
    """The GPU setting's responses: mean >= 200 tokens (the issue's bar), within 1,000, and a tail: p90 about
    twice the median. Seed 0's full held-out figures are in configs/gpu-scratchpad.yaml."""
    _, held = sp.make_problems(0, 0, 400, sp.SHAPES["gpu"])
    stats = sp.length_stats(held)
    assert stats["mean"] >= 200 and 250 <= stats["median"] <= 450, stats
    assert stats["p90"] >= 1.7 * stats["median"] and stats["max"] <= 913, stats
    tiny = sp.length_stats(sp.make_problems(0, 0, 200, sp.SHAPES["tiny"])[1])
    assert tiny["max"] <= 97 and tiny["median"] < 60, tiny


def test_warmup_batch_puts_labels_on_the_worked_response_and_eos():
    tok = build_tokenizer()
    row = {"prompt": "47*36=", "label": "1692"}
    ids, attn, labels = answer_batch(tok, [row, {"prompt": "5*0=", "label": "0"}], target=sp.row_trace)
    prompt = len(tok("47*36=")["input_ids"])
    assert tok.decode(ids[0, prompt:].tolist(), skip_special_tokens=True) == WORKED
    assert labels[0, :prompt].eq(-100).all() and labels[0, prompt:].tolist() == ids[0, prompt:].tolist()
    assert labels[0, -1].item() == tok.eos_token_id and int(attn[1].sum()) == len(tok("5*0=")["input_ids"]) + 16


def test_left_padded_greedy_decodes_each_prompt_as_it_would_alone():
    """The GPU setting's accuracy check decodes prompts of every length in one left-padded batch
    (demo_policy._greedy): token for token what each prompt's own group gives, so the check's
    figure does not depend on the batching (float32 on CPU; a tiny random model, which never says eos)."""
    import torch

    from reflow.rl.data import encode_prompt
    from reflow.rl.demo_policy import _greedy, build_model

    tok = build_tokenizer()
    model = build_model(tok, hidden=32, layers=2, heads=2, mlp=64, max_positions=128, seed=1).eval()
    prompts = encode_prompt(tok, ["3*4=", "47*36=", "123*45=", "9*9=", "6012*77="])
    with torch.no_grad():
        alone = [_greedy(model, [p], 24, tok.eos_token_id)[0] for p in prompts]
        batched = _greedy(model, prompts, 24, tok.eos_token_id, tok.pad_token_id)
    assert len({len(p) for p in prompts}) > 2 and batched == alone
    # a mutation check: the padding's mask matters here (attended, the pads change how the prompts' last tokens
    # are scored), so the equality above is not one any batching would pass
    width = max(len(p) for p in prompts)
    with torch.no_grad():
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
        attn = (ids != tok.pad_token_id).long()
        pos = (attn.cumsum(1) - 1).clamp(min=0)
        right = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -1]
        unmasked = model(input_ids=ids, attention_mask=torch.ones_like(attn), position_ids=pos).logits[:, -1]
        own = torch.cat([model(input_ids=torch.tensor([p])).logits[:, -1] for p in prompts])
    assert (right - own).abs().max() < 1e-4 < (unmasked - own).abs().max()


def test_sampled_continuations_follow_the_seed_and_the_temperature():
    """_greedy's temperature (bench/scratchpad_breakdown.py's pass@k): a seeded sample repeats with its seed,
    differs from greedy at temperature 1, and comes near greedy as the temperature falls (a tiny random model:
    flat logits, so temperature 1 wanders at once)."""
    import torch

    from reflow.rl.data import encode_prompt
    from reflow.rl.demo_policy import _greedy, build_model

    tok = build_tokenizer()
    model = build_model(tok, hidden=32, layers=2, heads=2, mlp=64, max_positions=128, seed=1).eval()
    prompts = encode_prompt(tok, ["47*36=", "47*36=", "123*45="])

    def sample(temperature: float, seed: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            return _greedy(model, prompts, 16, tok.eos_token_id, tok.pad_token_id, temperature=temperature, generator=g)

    with torch.no_grad():
        greedy = _greedy(model, prompts, 16, tok.eos_token_id, tok.pad_token_id)
    hot = sample(1.0, 0)
    assert hot == sample(1.0, 0) and hot != sample(1.0, 1)
    assert hot[0] != hot[1] and hot != greedy  # the same prompt twice: two samples, not one
    cold = sample(1e-4, 0)  # a random model's logits can tie to within 1e-4 somewhere: most tokens, not all
    agree = [x == y for c, w in zip(cold, greedy) for x, y in zip(c, w)]
    assert sum(agree) >= 0.9 * len(agree) and cold[0] == cold[1]


def test_a_warmup_step_in_micro_batches_by_length_is_the_one_forward_step():
    """A warm-up step in forwards cut by length (demo_policy.warmup's micro_batches, for a bootstrap short of memory): worked
    traces of very different lengths, each forward padded to its own longest, gradients weighted by label tokens. The
    loss and every weight after the AdamW step are the one-forward step's (float32, CPU); a mutation check: the
    same forwards' mean losses counted alike give another loss, so the weighting is what makes them equal."""
    import functools

    import torch

    from reflow.rl.demo_policy import _sft_step, build_model

    tok = build_tokenizer()
    rows = [{"prompt": f"{a}*{b}=", "label": str(a * b)} for a, b in
            [(3, 4), (47, 36), (123, 45), (9, 9), (6012, 77), (5, 0), (99, 99), (808, 3)]]
    batch_fn = functools.partial(answer_batch, target=sp.row_trace)
    out = {}
    for micro in (1, 3):
        model = build_model(tok, hidden=32, layers=2, heads=2, mlp=64, max_positions=256, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss = _sft_step(model, opt, tok, rows, batch_fn, micro_batches=micro)
        out[micro] = (loss, [p.detach().clone() for p in model.parameters()])
    assert abs(out[1][0] - out[3][0]) < 1e-6 * out[1][0], (out[1][0], out[3][0])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(out[1][1], out[3][1]))
    ids, attn, labels = batch_fn(tok, rows)
    model = build_model(tok, hidden=32, layers=2, heads=2, mlp=64, max_positions=256, seed=0)
    means, widths = [], []
    with torch.no_grad():
        for c in torch.argsort(attn.sum(1), stable=True).chunk(3):
            w = int(attn[c].sum(1).max())
            widths.append(w)
            means.append(model(input_ids=ids[c, :w], attention_mask=attn[c, :w], labels=labels[c, :w]).loss.item())
    assert min(widths) < ids.shape[1] // 2  # the short traces' forward is far narrower than the padded batch
    assert abs(sum(means) / 3 - out[1][0]) > 1e-4, (means, out[1][0])
