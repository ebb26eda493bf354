"""Prompt data: load rows, validate and tokenize them, and sample batches resumably.

Rows handed between these functions are dicts `{"prompt": str, "label": Any}` (label optional);
with `data.chat_template` the prompt may also be a list of `{"role", "content"}` messages, rendered
by the tokenizer's chat template (`render_chat`).

Sources (`load_prompt_rows`):
  * task "addition": the synthetic task of `reflow.rl.demo_task` (seed, num_train, num_eval, digits).
  * task "file": a jsonl (`.jsonl`/`.json`, one object per line) or parquet (`.parquet`/`.pq`)
    file at a local path, or at a URL (s3://, ...) through the reader infra passes in (the run's
    storage access: its endpoint and retries), parsed with pandas; columns
    `prompt_key` and `label_key` become "prompt" and "label", and the columns named in
    `metadata_keys` (data.metadata_keys) become the row's "metadata", which `tokenize_prompts` puts
    in `Prompt.metadata` (what a rollout function gets). The held-out split is `eval_path`
    when given (the whole file), else the LAST `num_eval` rows of `path` (the rest train). File
    order is kept, so put held-out rows at the end or pass a separate file.
"""
from __future__ import annotations

import io
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from reflow.rl.types import Prompt

_MAX_LISTED = 5  # bad rows quoted in an error message; the rest are counted


Reader = Callable[[str], bytes]  # the bytes at a path or URL; infra passes its storage access's read_bytes


def read_local(path: str) -> bytes:
    """The default reader: local files only (a plain path or file://). URLs go through the storage
    access infra passes in, so the run's endpoint and retries apply to them."""
    if "://" in path and not path.startswith("file://"):
        raise ValueError(f"{path!r} is a URL: pass a reader that reaches it (reflow.infra.config.settings."
                         f"storage_access(cfg).read_bytes, which uses storage.endpoint_url)")
    return Path(path.removeprefix("file://")).expanduser().read_bytes()


def _parse_jsonl(data: bytes, path: str, label_key: str | None = None, label_field: str = "data.label_key"):
    """One JSON object per line (blank lines skipped); a bad line is named by its 1-based number. A label
    (`label_key`) written as NaN or Infinity (Python's json writes them; they are not JSON) is refused:
    read, it would become a missing label (None) without a word."""

    import pandas as pd

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path!r} line {lineno} is not valid JSON ({e.msg}): {line.strip()[:120]!r}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path!r} line {lineno} is a JSON {type(obj).__name__}, not an object")
        label = obj.get(label_key) if label_key is not None else None
        if isinstance(label, float) and not math.isfinite(label):
            raise ValueError(f"{path!r} line {lineno}: the label (column {label_key!r}, {label_field}) is "
                             f"{json.dumps(label)}, not a value; write null for a row without a label")
        records.append(obj)
    return pd.DataFrame.from_records(records)


def _read_table(path: str, section: str = "data", read: Reader = read_local, label_key: str | None = None):

    import pandas as pd

    name = path.lower().split("?")[0]
    if name.endswith((".parquet", ".pq")):
        data = read(path)
        try:
            return pd.read_parquet(io.BytesIO(data))
        except (ValueError, OSError) as e:  # pyarrow's errors name a buffer, not the file
            raise ValueError(f"{section} file {path!r} is not a readable parquet file ({str(e)[:200]})") from None
    if name.endswith((".jsonl", ".json")):
        return _parse_jsonl(read(path), path, label_key, f"{section}.label_key")
    raise ValueError(f"{section} file {path!r}: unknown file type; expected .jsonl, .json (lines) or .parquet")


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _plain(value: Any) -> Any:
    """A metadata cell as plain Python: None for a missing one, a list for parquet's numpy arrays."""
    return None if _is_missing(value) else value.tolist() if hasattr(value, "tolist") else value


def read_rows(path: str, prompt_key: str, label_key: str, section: str = "data",
              read: Reader = read_local, metadata_keys: Sequence[str] = ()) -> list[dict]:
    """All rows of a jsonl/parquet file as {"prompt", "label"} dicts, plus {"metadata": {column:
    value}} of the `metadata_keys` columns when any are named; a row whose prompt cell is empty
    keeps no "prompt" key (reported by `tokenize_prompts`), a missing (null) label or metadata cell becomes
    None. `section` names the config section in errors (e.g. "eval.sets.1"); `read` fetches the file."""
    df = _read_table(path, section, read, label_key)
    for key, field, holds in ((prompt_key, f"{section}.prompt_key", "prompt text"),
                              (label_key, f"{section}.label_key", "ground truth")):
        if key not in df.columns:
            raise ValueError(f"{path!r} has no column {key!r} ({field}); its columns are {list(df.columns)}: "
                             f"set {field} to the one holding the {holds}")
    if missing := [key for key in metadata_keys if key not in df.columns]:
        raise ValueError(f"{path!r} has no column {missing[0]!r} (data.metadata_keys); its columns are "
                         f"{list(df.columns)}: add the column to the file or drop it from data.metadata_keys")
    meta = {key: df[key].tolist() for key in metadata_keys}
    rows = []
    for i, (prompt, label) in enumerate(zip(df[prompt_key].tolist(), df[label_key].tolist())):
        row = {"label": None if _is_missing(label) else label}
        if not _is_missing(prompt):
            row["prompt"] = prompt
        if meta:
            row["metadata"] = {key: _plain(values[i]) for key, values in meta.items()}
        rows.append(row)
    return rows


def load_prompt_rows(task: str, path: str | None, prompt_key: str, label_key: str, seed: int,
                     num_train: int, num_eval: int, digits: int,
                     eval_path: str | None = None, read: Reader = read_local,
                     metadata_keys: Sequence[str] = ()) -> tuple[list[dict], list[dict]]:
    """(train_rows, eval_rows) for `task` ("addition" or "file"; see the module docstring); `read`
    fetches the files (default: local files only); `metadata_keys` (task file): the columns kept
    as each row's metadata."""
    if task == "addition":
        if metadata_keys:
            raise ValueError(f"data.metadata_keys={list(metadata_keys)} names file columns, and data.task='addition' "
                             "reads no file: set data.task=file, or leave data.metadata_keys empty")
        from reflow.rl.demo_task import make_problems
        return make_problems(seed, num_train, num_eval, digits)
    if task != "file":
        raise ValueError(f"data.task={task!r}: expected 'addition' or 'file'")
    if not path:
        raise ValueError("data.task='file' needs data.path (a jsonl or parquet file or URL)")
    rows = read_rows(path, prompt_key, label_key, read=read, metadata_keys=metadata_keys)
    if eval_path:
        return rows, read_rows(eval_path, prompt_key, label_key, read=read, metadata_keys=metadata_keys)
    if num_eval >= len(rows):
        raise ValueError(f"{path!r} has {len(rows)} rows; holding out the last num_eval={num_eval} "
                         f"leaves none to train on (lower data.num_eval or give an eval file)")
    return rows[: len(rows) - num_eval], rows[len(rows) - num_eval:]


def encode_prompt(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of prompt texts, exactly as the engines will see them (tokenizer's own specials)."""
    return tokenizer(list(texts), add_special_tokens=True)["input_ids"]


@dataclass(frozen=True)
class PromptFormat:
    """How a row's prompt becomes token ids (data.chat_template, data.system_prompt): plain text with
    the tokenizer's own specials, or messages rendered by the tokenizer's chat template."""

    chat_template: bool = False
    system_prompt: str | None = None

    @classmethod
    def of(cls, data: Any) -> PromptFormat:
        """From a `data:` config section (anything with `chat_template` and `system_prompt`)."""
        return cls(bool(getattr(data, "chat_template", False)), getattr(data, "system_prompt", None))


def _messages(prompt: Any) -> list | None:
    """A chat prompt as a list (parquet gives numpy arrays of dicts), or None when it is not a list."""
    if hasattr(prompt, "tolist") and not isinstance(prompt, str):
        prompt = prompt.tolist()
    return list(prompt) if isinstance(prompt, (list, tuple)) else None


def _message_problem(prompt: Any) -> str | None:
    msgs = _messages(prompt)
    if msgs is None:
        return None if isinstance(prompt, str) and prompt.strip() else \
            f"prompt is a {type(prompt).__name__}, not a list of {{role, content}} messages or a string"
    if not msgs:
        return "prompt is an empty list of messages"
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"message {j} is not a {{\"role\": str, \"content\": str}} object: {str(m)[:80]}"
    return None


def _row_problem(row: Any, fmt: PromptFormat = PromptFormat()) -> str | None:
    if not isinstance(row, dict):
        return f"is a {type(row).__name__}, not a mapping"
    if "prompt" not in row:
        return "has no prompt (missing key or empty cell)"
    if fmt.chat_template:
        return _message_problem(row["prompt"])
    if not isinstance(row["prompt"], str):
        hint = "; set data.chat_template=true for chat messages" if _messages(row["prompt"]) is not None else ""
        return f"prompt is a {type(row['prompt']).__name__}, not a string{hint}"
    if not row["prompt"].strip():
        return "prompt is empty"
    return None


def render_chat(tokenizer, prompts: Sequence[Any], system_prompt: str | None) -> tuple[list[str], list[list[int]]]:
    """(texts, token ids) of chat prompts rendered by the tokenizer's chat template with the generation
    prompt appended; a plain string is one user message; `system_prompt` goes first unless the
    messages start with their own. The ids are the template's own tokenization (never a re-encoding
    of the text), and every stage (training, rollout, eval) uses these same ids."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("data.chat_template=true, but the tokenizer of model.path has no chat template: add "
                         "`chat_template` to its tokenizer_config.json (or chat_template.jinja), or set "
                         "data.chat_template=false and give prompts as text")
    texts, ids = [], []
    for prompt in prompts:
        msgs = _messages(prompt) or [{"role": "user", "content": prompt}]
        msgs = [{"role": m["role"], "content": m["content"]} for m in msgs]
        if system_prompt and msgs[0]["role"] != "system":
            msgs = [{"role": "system", "content": system_prompt}, *msgs]
        texts.append(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
        out = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        ids.append(list(out["input_ids"] if isinstance(out, Mapping) else out))
    return texts, ids


def _raise_bad(bad: list[tuple[int, str]], total: int) -> None:
    listed = "; ".join(f"row {i}: {msg}" for i, msg in bad[:_MAX_LISTED])
    more = f" (and {len(bad) - _MAX_LISTED} more)" if len(bad) > _MAX_LISTED else ""
    raise ValueError(f"{len(bad)} of {total} prompt rows are invalid: {listed}{more}")


def tokenize_prompts(rows: Sequence[dict], tokenizer, max_prompt_len: int,
                     fmt: PromptFormat = PromptFormat()) -> list[Prompt]:
    """Validate and tokenize every row; one `Prompt` per row, `index` = row position. With
    `fmt.chat_template`, prompts are message lists rendered by `render_chat` (the Prompt's text is
    the rendered template).

    Nothing is dropped silently: all malformed rows (not a dict, missing/non-string/empty prompt)
    and prompts longer than `max_prompt_len` tokens (data.max_prompt_len) are collected and
    reported together in one ValueError.
    """
    bad = [(i, msg) for i, row in enumerate(rows) if (msg := _row_problem(row, fmt))]
    if bad:
        _raise_bad(bad, len(rows))
    if fmt.chat_template:
        texts, ids = render_chat(tokenizer, [row["prompt"] for row in rows], fmt.system_prompt)
    else:
        texts = [row["prompt"] for row in rows]
        ids = encode_prompt(tokenizer, texts) if rows else []
    too_long = [(i, f"{len(x)} tokens > data.max_prompt_len={max_prompt_len}")
                for i, x in enumerate(ids) if len(x) > max_prompt_len]
    if too_long:
        _raise_bad(too_long, len(rows))
    return [Prompt(index=i, text=text, input_ids=list(x), label=row.get("label"),
                   metadata=dict(row.get("metadata") or {}))
            for i, (row, text, x) in enumerate(zip(rows, texts, ids))]


class PromptSampler:
    """Shuffled passes over the prompts; each epoch uses a fresh permutation derived from
    (seed, epoch), so `state_dict()` = {epoch, cursor} is enough to resume exactly.

    A batch that runs past the end of an epoch continues into the next epoch's permutation.
    """

    def __init__(self, prompts: Sequence[Prompt], seed: int = 0):
        if not prompts:
            raise ValueError("PromptSampler needs at least one prompt")
        self.prompts = list(prompts)
        self.seed = seed
        self.epoch = 0
        self.cursor = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:

        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)  # stable across runs and machines
        return torch.randperm(len(self.prompts), generator=g).tolist()

    def next_batch(self, k: int) -> list[Prompt]:
        if k < 1:
            raise ValueError(f"next_batch needs k >= 1, got {k}")
        out: list[Prompt] = []
        while len(out) < k:
            if self.cursor == len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(k - len(out), len(self._order) - self.cursor)
            out.extend(self.prompts[j] for j in self._order[self.cursor : self.cursor + take])
            self.cursor += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "num_prompts": len(self.prompts)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_prompts", len(self.prompts)) != len(self.prompts):
            raise ValueError(f"sampler state is for {state['num_prompts']} prompts, this dataset has "
                             f"{len(self.prompts)}: resuming would not replay the same order")
        if not 0 <= state["cursor"] <= len(self.prompts):
            raise ValueError(f"sampler cursor {state['cursor']} out of range 0..{len(self.prompts)}")
        self.seed = state.get("seed", self.seed)
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._permutation(self.epoch)


def prompts_for_iteration(prompts: list[Prompt], seed: int, iteration: int, k: int) -> list[Prompt]:
    """The k prompts of `iteration`: a pure function of (seed, iteration), so retries and resumes
    take exactly the same prompts. `PromptSampler` positioned at the iteration's cursor: each epoch
    is a fresh seeded permutation of the dataset."""
    epoch, cursor = divmod(iteration * k, len(prompts))
    sampler = PromptSampler(prompts, seed)
    sampler.load_state_dict({"epoch": epoch, "cursor": cursor})
    return sampler.next_batch(k)
