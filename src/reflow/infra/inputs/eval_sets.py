"""Builder of the eval sets: `eval.sets` config -> tokenized prompts plus explicit sampling/scoring arguments.

Runs before any actor starts (infra/cluster/runtime.py), so a missing file, a malformed row or a bad reward
function stops the run at once and names the set.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from reflow.infra.config.schema import EvalSetConfig, RunConfig
from reflow.infra.config.settings import storage_access
from reflow.rl.data import PromptFormat, Reader, read_rows, tokenize_prompts
from reflow.rl.scorers import FunctionScorer, Scorer, reward_source
from reflow.rl.types import Prompt


@dataclass(frozen=True)
class EvalSet:
    """One eval set, resolved: everything the evaluation needs, no config object."""

    name: str
    prompts: list[Prompt]
    reward_fn: Scorer  # the set's own `module:function`, or the run's scorer (reward_source)
    correct_threshold: float
    n: int  # samples per prompt
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    ks: list[int]
    skip_special_tokens: bool  # decoding of the response text: the rollout's (rollout.*)
    no_stop_trim: bool
    seed: int  # sampling seed stream of this set (per-sample seeds derive from it and the policy version)


def set_seed(run_seed: int, name: str) -> int:
    """A seed of its own per set, apart from the rollouts' (same policy version, other samples)."""
    digest = hashlib.sha256(f"reflow-eval:{run_seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _prompts(s: EvalSetConfig, where: str, cfg: RunConfig, tokenizer, heldout: list[Prompt],
             read: Reader) -> list[Prompt]:
    if s.source == "heldout":
        prompts = list(heldout)[: s.max_prompts]
    else:
        rows = read_rows(s.source, s.prompt_key or cfg.data.prompt_key, s.label_key or cfg.data.label_key, where, read,
                         cfg.data.metadata_keys)
        try:
            prompts = tokenize_prompts(rows[: s.max_prompts], tokenizer, cfg.data.max_prompt_len,
                                       PromptFormat.of(cfg.data))
        except ValueError as e:
            raise ValueError(f"{where} ({s.name}, {s.source}): {e}") from None
    if not prompts:
        raise ValueError(f"{where} ({s.name}): {s.source!r} holds no prompts")
    return prompts


def load_eval_sets(cfg: RunConfig, tokenizer, heldout: list[Prompt]) -> list[EvalSet]:
    """Every configured eval set, loaded (files through the run's storage access), tokenized and
    validated (reward function importable)."""
    out, read = [], storage_access(cfg).read_bytes
    for i, s in enumerate(cfg.eval.sets):
        where = f"eval.sets.{i}"
        # the set's own reward_fn, or the run's reward (reward.type: data.reward_fn, a builtin, a server)
        if s.reward_fn:
            reward_fn: Scorer = FunctionScorer(s.reward_fn, f"{where}.reward_fn ({s.name})")
            reward_fn.load()
        else:
            reward_fn = reward_source(cfg.reward, cfg.data.reward_fn)
            reward_fn.load(used_by=f"{where}: {s.name}")
        sp = s.sampling(cfg.rollout)
        out.append(EvalSet(name=s.name, prompts=_prompts(s, where, cfg, tokenizer, heldout, read), reward_fn=reward_fn,
                           correct_threshold=s.correct_threshold, n=sp["n"], temperature=sp["temperature"],
                           top_p=sp["top_p"], top_k=sp["top_k"], max_new_tokens=sp["max_new_tokens"],
                           ks=sorted(set(s.k)), skip_special_tokens=cfg.rollout.skip_special_tokens,
                           no_stop_trim=cfg.rollout.no_stop_trim, seed=set_seed(cfg.seed, s.name)))
    return out
