"""The run's train and eval prompts, read and tokenized as every part of a run sees them (the runtime, the trainer's
compile warm-up): without Ray or Prefect, so a helper process imports it cheaply."""
from __future__ import annotations

from reflow.infra.config.schema import RunConfig
from reflow.infra.config.settings import storage_access
from reflow.rl.data import PromptFormat, load_prompt_rows, tokenize_prompts
from reflow.rl.types import Prompt


def load_prompts(cfg: RunConfig, tokenizer) -> tuple[list[Prompt], list[Prompt]]:
    """(train, eval) prompts of `cfg.data`, in one rendering (plain or chat template) for training, rollout and eval."""
    d = cfg.data
    train_rows, eval_rows = load_prompt_rows(d.task, d.path, d.prompt_key, d.label_key, d.seed,
                                             d.num_train, d.num_eval, d.digits, d.eval_path,
                                             storage_access(cfg).read_bytes, d.metadata_keys)
    fmt = PromptFormat.of(d)
    return (tokenize_prompts(train_rows, tokenizer, d.max_prompt_len, fmt),
            tokenize_prompts(eval_rows, tokenizer, d.max_prompt_len, fmt))
