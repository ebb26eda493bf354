"""Chat data (`data.chat_template`): message rows rendered by the tokenizer's chat template, with the
same token ids in the training prompts, the eval sets, the engine's rollout and the trainer's tensors."""
from __future__ import annotations

import json

import pytest

from reflow.engines import rollout_stages as ro
from reflow.engines.hf_io import load_tokenizer
from reflow.engines.rollout_fns import BatchRequest, RolloutSettings
from reflow.infra.config.schema import load_config
from reflow.infra.inputs.eval_sets import load_eval_sets
from reflow.rl.data import PromptFormat, load_prompt_rows, tokenize_prompts
from reflow.rl.types import to_train_tensors
from tests.test_engine import KEY
from tests.test_engine import engine as _engine_fixture

engine = _engine_fixture  # test_engine's embedded engine on loopback (module-scoped here too), reached with KEY

# The demo's character tokenizer has no chat template; this one uses only characters it knows.
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}(({{ m['content'] }})){% elif m['role'] == 'user' %}"
            "({{ m['content'] }}){% else %}{{ m['content'] }}={% endif %}{% endfor %}"
            "{% if add_generation_prompt %} {% endif %}")
CHATS = [[{"role": "user", "content": "12+34"}],
         [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}, {"role": "user", "content": "2*3"}],
         [{"role": "system", "content": "0"}, {"role": "user", "content": "7"}]]


@pytest.fixture(scope="module")
def chat_policy(tiny_policy, tmp_path_factory):
    """The tiny policy's folder with a chat template added to its tokenizer."""
    import shutil

    folder = tmp_path_factory.mktemp("chat_policy") / "policy"
    shutil.copytree(tiny_policy, folder)
    tok = load_tokenizer(str(folder))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    return folder


@pytest.mark.slow  # ~3 s of CPU: make test-fast stays under a minute
def test_rendering_is_the_same_in_training_eval_rollout_and_trainer(chat_policy, engine, tmp_path):
    tok = load_tokenizer(str(chat_policy))
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": c, "label": str(i)}) + "\n" for i, c in enumerate(CHATS)))
    cfg = load_config(None, [f"model.path={chat_policy}", "data.task=file", f"data.path={data}", "data.num_eval=1",
                             "data.chat_template=true", "data.system_prompt='9'",
                             f'eval.sets=[{{name: chat, source: "{data}", temperature: 0}}]'])
    train_rows, held_rows = load_prompt_rows("file", str(data), "prompt", "label", 0, 1, 1, 2)
    train = tokenize_prompts(train_rows + held_rows, tok, 64, PromptFormat.of(cfg.data))
    assert [p.text for p in train] == ["((9))(12+34) ", "((9))(1+1)2=(2*3) ", "((0))(7) "]  # own system message kept
    assert [p.input_ids for p in train] == [tok(p.text, add_special_tokens=False)["input_ids"] for p in train]
    [chat_set] = load_eval_sets(cfg, tok, [])
    assert [p.input_ids for p in chat_set.prompts] == [p.input_ids for p in train]
    batch = ro.generate(RolloutSettings([engine.url()], ro.sampling_params(1.0, 1.0, -1, 3, None), 2, 60.0, KEY, seed=1),
                        BatchRequest(train, 0))
    assert batch.prompt_ids == [p.input_ids for p in train for _ in range(2)]
    assert batch.prompt_text == [p.text for p in train for _ in range(2)]  # what the reward function sees
    ids = to_train_tensors(batch.with_(advantages=[0.0] * len(batch)), pad_id=0)["input_ids"]
    for row, p, r in zip(ids.tolist(), batch.prompt_ids, batch.response_ids):
        assert row[:len(p) + len(r)] == p + r  # the trainer scores exactly what the engine was given


def test_chat_rows_are_checked(chat_policy, tiny_policy):
    tok = load_tokenizer(str(chat_policy))
    chat = PromptFormat(chat_template=True)
    rows = [{"prompt": "5+5"}, {"prompt": []}, {"prompt": [{"role": "user"}]}, {"prompt": 3}]
    with pytest.raises(ValueError, match=r"3 of 4 prompt rows are invalid: row 1: prompt is an empty list of messages; "
                                         r"row 2: message 0 is not a \{\"role\": str, \"content\": str\} object: "
                                         r"\{'role': 'user'\}; row 3: prompt is a int"):
        tokenize_prompts(rows, tok, 64, chat)
    assert tokenize_prompts(rows[:1], tok, 64, chat)[0].text == "(5+5) "  # a string is one user message
    with pytest.raises(ValueError, match="prompt is a list, not a string; set data.chat_template=true"):
        tokenize_prompts([{"prompt": CHATS[0]}], tok, 64)
    with pytest.raises(ValueError, match="the tokenizer of model.path has no chat template"):
        tokenize_prompts([{"prompt": CHATS[0]}], load_tokenizer(str(tiny_policy)), 64, chat)
