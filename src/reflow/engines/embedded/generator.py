"""Generation core of the embedded engine: batched sampling with a KV cache on a HF causal LM.

No HTTP here. `Generator.generate` takes token-id prompts and SGLang-style sampling params and
returns one SGLang-shaped record per sample, prompt-major (p0s0..p0s(n-1), p1s0, ...).

Semantics follow SGLang 0.5.23 (see docs/ENGINE_CONTRACT.md, Logprobs) because importance ratios in
the trainer depend on them:
- logprob of a token = log_softmax(logits / temperature) taken BEFORE top-p/top-k/min-p
  filtering; greedy (temperature < 1e-6) reports plain log_softmax(logits).
- min_new_tokens masks every stop token to -inf while too short, and the returned logprobs see
  that mask (SGLang applies it as a logit penalty before sampling).
- finish checks run stop string -> stop token -> length; `ignore_eos` disables every
  token-based stop (eos and stop_token_ids), exactly as SGLang does.
- output_ids keep the matched stop token; `text` drops it unless `no_stop_trim`.
- `sampling_seed` makes a sample a function of (seed, position) only, so two samples of the
  same request with the same seed are identical (as in SGLang).
- input_token_logprobs (logprob_start_len >= 0): plain log_softmax of each prompt token given
  the tokens before it, the first entry null, as SGLang's scheduler reports them; computed by one
  extra cache-free forward of the prompt (`input_logprobs`), since decoding keeps only the last logits.
Departure: penalties, logit_bias, grammars and stop_regex are not implemented (the HTTP layer
rejects them with a 400 instead of silently ignoring them).

Speed: finished rows leave the running batch (the KV cache is index-selected and leading
all-padding columns are cut), so a batch with widely varying response lengths only pays for
rows still running. A prompt sampled `n` times is prefilled once and its cache repeated.
Inputs are built on the model's device, so the same code drives a model moved to a GPU
(bench/gpu.py); sampled tokens come back to the host once per step.
On a GPU (decoder="auto") Llama-shaped models decode through reflow.engines.embedded.static_decode
instead: a static KV cache, steps replayed as CUDA graphs, continuous batching (waiting rows join as
others finish), and the next step launched before the host reads this one's tokens (`_run_static`).
The sampling math, finish checks and records are the same code for both paths.
"""
from __future__ import annotations

import inspect
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from reflow.engines.embedded.kv_cache import _new_cache, _PreallocLayer
from reflow.engines.embedded.kv_pool import budget_positions, bytes_per_position
from reflow.engines.embedded.sampling import (
    SAMPLING_EPS,
    TOP_K_ALL,
    SamplingConfig,
    SamplingTensors,
    filter_probs,
    sample_tokens,
    seeded_uniform,
)
from reflow.engines.embedded.staging import on_device
from reflow.engines.embedded.static_decode import StaticDecoder
from reflow.engines.embedded.weight_layout import Arena, byte_order, copy_runs
from reflow.engines.rollout_client import CLOSED

PREFILL_TOKENS = 32768  # padded tokens one static prefill call takes at most (prefill_groups)
BIG_COPY_BYTES = 4 << 20  # a mapped load copies runs this large one by one, the rest in one multi-tensor launch

__all__ = ["Generator", "SamplingConfig", "SAMPLING_EPS", "TOP_K_ALL", "filter_probs", "sample_tokens"]


# Between decode steps the generator calls checkpoint(rids of running rows) -> {rid: message}.
# It may block (pause) and returns the rows to abort. Called without the model lock held.
Checkpoint = Callable[[list[str]], dict[str, str]]


# ---------------------------------------------------------------- per-sample bookkeeping


def _to_host(tokens: torch.Tensor, logprobs: torch.Tensor):
    """Queue the copy of a step's tokens and logprobs to the host; returns (host tensor [2, B] float64,
    wait), `wait()` blocking until the copy has landed. float64 holds every token id exactly."""
    pair = torch.stack([tokens.double(), logprobs.double()])  # [2, B]
    if pair.device.type != "cuda":
        return pair, lambda: None
    host = torch.empty(pair.shape, dtype=pair.dtype, pin_memory=True)
    host.copy_(pair, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done.synchronize


def _positions(rows: list[_Row]) -> list[int]:
    """The position each row's next token takes: its prompt and what it generated so far."""
    return [len(r.prompt) + len(r.out) for r in rows]


def prefill_groups(lengths: list[int], budget: int | None = None) -> list[list[int]]:
    """Prompts (by index) for each prefill call: all at once where their padded batch (count x longest) fits
    `budget` tokens, else length-sorted groups, longest first, each filled while its padded size fits (a prompt
    longer than the budget alone). A batch of prompts of very different lengths (a partial rollout's continued
    samples: prompt + hundreds of tokens beside new prompts of ten) otherwise pads every one to the longest."""
    budget = PREFILL_TOKENS if budget is None else budget
    if not lengths or len(lengths) * max(lengths) <= budget:
        return [list(range(len(lengths)))]
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _distinct_prompts(rows: list[_Row]) -> tuple[list[list[int]], list[int]]:
    """The distinct prefixes (prompt + what the row generated before it left the batch; the prompt for a new
    row) among `rows` in first-seen order, and each row's index into them; both prefill paths run a prefix
    once. By content: a seeded rollout sends each sample as its own request (n=1, its own sampling_seed), so
    the samples of one prompt arrive as equal lists, not one."""
    index: dict[tuple[int, ...], int] = {}  # prefix -> position among distinct prefixes
    prompts: list[list[int]] = []
    picks = []
    for r in rows:
        prefix = r.prompt + r.out if r.out else r.prompt
        key = tuple(prefix)
        if key not in index:
            index[key] = len(prompts)
            prompts.append(prefix)
        picks.append(index[key])
    return prompts, picks


@dataclass
class _Row:
    """One sample being generated."""

    prompt: list[int]
    cfg: SamplingConfig
    rid: str  # the request id aborts refer to
    sample_id: str  # meta_info.id of this sample
    stop_ids: frozenset[int]  # token ids that end this row (empty when ignore_eos)
    mask_ids: list[int]  # token ids masked while shorter than min_new_tokens
    max_new: int
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict | None = None
    kv_start: int = -1  # where its KV region starts in the static decoder's pool (kv_pool.py)
    group: int = -1  # its group under a closing call (Generator.generate's `close`)


class _Closer:
    """A call that closes once `complete` groups of rows have finished (every row of each): the rows still
    running or waiting are then cut, finish {"type": "abort", "message": CLOSED}, with what they generated.
    The decode loops report each row once, at the step it finishes; closing depends on token counts alone
    (the step at which the last row of the complete-th group finishes), never on time."""

    def __init__(self, rows: list[_Row], complete: int):
        self.rows, self.complete = rows, complete
        self.left: dict[int, int] = {}  # group -> its rows not yet finished
        for r in rows:
            self.left.setdefault(r.group, 0)
            self.left[r.group] += r.finish is None
        self.done = sum(v == 0 for v in self.left.values())
        self.closed = False
        self._close_if_due()

    def finished(self, rows) -> bool:
        """Count `rows` (just finished, each reported once); True once the call is closed."""
        for r in rows:
            self.left[r.group] -= 1
            self.done += self.left[r.group] == 0
        return self._close_if_due()

    def _close_if_due(self) -> bool:
        if not self.closed and self.done >= self.complete:
            self.closed = True
            for r in self.rows:
                if r.finish is None:
                    r.finish = {"type": "abort", "message": CLOSED}
        return self.closed


def _pow2_bucket(n: int, floor: int) -> int:
    """The power of two >= max(n, floor)."""
    return max(floor, 1 << max(n - 1, 0).bit_length())


class Generator:
    """Batched generation on a HF causal LM (see module docstring for semantics)."""

    def __init__(self, model, tokenizer, max_batch_size: int = 256, threads: int | None = None,
                 decoder: str = "auto", kv_mem_fraction: float | None = None, kv_tokens: int | None = None,
                 decode_fusion: str | None = None, kv_reserve: float = 1.0, kv_dtype: torch.dtype | None = None):
        """decoder: "eager" (HF forward with a growing cache), "static" (static KV cache, no graphs), "graphs"
        (static cache + CUDA graphs; CUDA only) or "auto": graphs on a GPU where the model's family allows
        (reflow.engines.embedded.static_decode), eager otherwise.
        The static decoder's KV pool (reflow.engines.embedded.kv_pool): `kv_tokens` positions, else
        `kv_mem_fraction` of the GPU's memory for weights + KV (SGLang's mem_fraction_static), else (both None)
        max_batch_size slots of the longest row of each generate call (rows never wait for KV room).
        decode_fusion: a torch.compile backend for the static decoder's elementwise work between its products
        (static_decode._Fused: "inductor" on a GPU), or None (eager kernels).
        kv_reserve: the share of a row's new tokens its KV region holds when it is admitted to a pool (`kv_tokens`
        or `kv_mem_fraction`); 1.0 holds all of them (max_new_tokens: a row never outgrows its region). Below 1
        more rows fit at once: a row that reaches its region's end grows it by the same share of what it has left,
        in place or moved, else leaves the batch and waits to be prefilled again with what it generated
        (`kv_moves` counts each).
        kv_dtype: the static decoder's keys and values in this dtype (e.g. bfloat16 under float32 weights: half the
        bytes a decode step reads, twice the positions a pool holds); None: the model's. The eager path keeps the
        model's (`kv_cache_dtype` says which holds)."""
        if kv_mem_fraction is not None and not 0.0 < kv_mem_fraction < 1.0:
            raise ValueError(f"kv_mem_fraction must be in (0, 1), got {kv_mem_fraction}")
        if kv_tokens is not None and kv_tokens < 1:
            raise ValueError(f"kv_tokens must be >= 1, got {kv_tokens}")
        self.kv_mem_fraction, self.kv_tokens = kv_mem_fraction, kv_tokens
        if not 0.0 < kv_reserve <= 1.0:
            raise ValueError(f"kv_reserve must be in (0, 1], got {kv_reserve}")
        self.kv_reserve = kv_reserve
        self.kv_moves = {"grown": 0, "moved": 0, "preempted": 0}  # regions grown in place, moved, rows sent back
        # The static decode loop's time (cumulative, like kv_moves): its steps, its wall seconds, and the seconds the
        # host sat waiting for a step's tokens to land (`device_wait_s`). A loop whose waits are a small share of
        # its wall kept the device waiting for the host (Python bookkeeping, launches): host-bound.
        self.decode_time = {"steps": 0, "loop_s": 0.0, "device_wait_s": 0.0}
        if decoder not in ("auto", "eager", "static", "graphs"):
            raise ValueError(f"decoder must be 'auto', 'eager', 'static' or 'graphs', got {decoder!r}")
        self.decoder = decoder
        self.decode_fusion = decode_fusion
        self.kv_dtype = kv_dtype
        self._static: StaticDecoder | None = None
        if threads:
            torch.set_num_threads(threads)
        self.model = model.eval()
        self.device = next(model.parameters()).device  # inputs are built here (a GPU model works too)
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.weight_version = "default"
        self.weight_writes = 0  # bumped by each load_named_tensors: tells a merged LoRA adapter its base changed
        self.lock = threading.RLock()  # held for each forward pass and each weight write
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        self.context_len = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
        self.pad_id = next(t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if t is not None)
        self.eos_ids = self._eos_ids()
        self._params = dict(model.state_dict(keep_vars=True))  # name -> Parameter/buffer (tied aliases too)
        self._arenas: list[Arena] = []  # the parameters' memory once adopt_layout ran (weight_layout.py)
        self._runs: tuple | None = None  # (key, big copies, small copies, count) of the last mapped load (load_mapped)
        self.layout_epoch = 0  # bumped whenever the parameters are re-pointed (arena, release/resume, fusion)
        # transformers >= 5.2x renamed `past_key_values` to `cache` (the old name warns)
        fwd = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in fwd else "past_key_values"

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        gen_cfg = getattr(self.model, "generation_config", None)
        for src in (self.model.config.eos_token_id, getattr(gen_cfg, "eos_token_id", None),
                    self.tokenizer.eos_token_id):
            if src is not None:
                ids.update([src] if isinstance(src, int) else src)
        return frozenset(ids)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    # ------------------------------------------------------------ public generation API

    def generate(self, prompts: list[list[int]], params: list[dict] | dict | None = None,
                 n: int | list[int] = 1, rids: list[str] | None = None,
                 checkpoint: Checkpoint | None = None, close: tuple[list[int], int] | None = None) -> list[dict]:
        """Sample `n` completions per prompt; records are prompt-major.

        params: one dict per prompt, or one dict for all. n: int, or one per prompt.
        rids: request id per prompt (for aborts and meta ids; random when None).
        close: (a group id per prompt, complete): stop once `complete` groups have every sample finished; the
        samples still running (or not started) come back cut, finish {"type": "abort", "message": CLOSED}
        (a partial rollout's closing, engines/partial_rollout.py: one call instead of rounds).
        """
        rows = self._make_rows(prompts, params, n, rids)
        closer = None
        if close is not None:
            groups, complete = close
            if len(groups) != len(prompts) or complete < 1:
                raise ValueError(f"close: {len(groups)} group ids for {len(prompts)} prompts, complete={complete} "
                                 f"(expected one id per prompt and complete >= 1)")
            ns = n if isinstance(n, list) else [n] * len(prompts)
            for r, g in zip(rows, [g for g, k in zip(groups, ns) for _ in range(k)]):
                r.group = int(g)
            closer = _Closer(rows, int(complete))
        todo = [r for r in rows if r.finish is None]
        static = self.static_decoder() if todo else None
        if static is not None:
            self._run_static(static, todo, checkpoint, closer)
        else:
            for start in range(0, len(todo), self.max_batch_size):
                chunk = [r for r in todo[start:start + self.max_batch_size] if r.finish is None]  # closed: cut
                if chunk:
                    self._run_chunk(chunk, checkpoint, closer)
        return [self._record(r) for r in rows]

    def static_decoder(self) -> StaticDecoder | None:
        """The static-cache decoder this generator uses (made on first use, on the model's current device),
        or None for the eager path (see `decoder` in __init__)."""
        if self.decoder == "eager":
            return None
        cuda = self.device.type == "cuda"
        if self._static is None or self._static.stale():
            why = self._static_refusal()
            if why is not None:
                if self.decoder in ("static", "graphs"):
                    raise ValueError(f"decoder={self.decoder!r} cannot run this model: {why}")
                return None
            if self.decoder == "graphs" and not cuda:
                raise ValueError("decoder='graphs' needs the model on a CUDA device")
            if self._static is not None:
                self._static.release()
            # In an arena the parameters stay put: what the fusion cannot view there it copies (refreshed below)
            self._static = StaticDecoder(self.model, self.max_batch_size, graphs=self.decoder != "static",
                                         keep_params=bool(self._arenas), fuse=self.decode_fusion,
                                         kv_dtype=self.kv_dtype)
            self._static.synced = self.weight_writes
            self.layout_epoch += 1  # its fusion may have re-pointed q/k/v and gate/up
        elif self._static.copies and self._static.synced != self.weight_writes:
            with self.lock:  # weights written since its copies were made (every writer refreshes: a safety net)
                self._refresh_fused()
        return self._static

    def _static_refusal(self) -> str | None:
        """Why this generator decodes without the static decoder (decoder "eager", a model it cannot run, or "auto"
        off a GPU), None where static_decoder makes one."""
        if self.decoder == "eager":
            return "decoder='eager'"
        why = StaticDecoder.supports(self.model)
        if why is None and self.decoder == "auto" and self.device.type != "cuda":
            return "no GPU"
        return why

    def kv_cache_dtype(self) -> str:
        """The dtype keys and values are held in: the static decoder's (kv_dtype, else the model's); the eager path's
        is the model's whatever kv_dtype says."""
        static = self._static_refusal() is None
        dtype = self.kv_dtype if self.kv_dtype is not None and static else self.dtype
        return str(dtype).removeprefix("torch.")

    def _refresh_fused(self) -> int:
        """Bring the static decoder's fused copies (keep_params) up to the weights just written; under the lock."""
        static = self._static
        if static is None or not static.copies:
            return 0
        n = static.refresh()
        static.synced = self.weight_writes
        return n

    def _make_rows(self, prompts, params, n, rids) -> list[_Row]:
        P = len(prompts)
        params = params if isinstance(params, list) else [params] * P
        ns = n if isinstance(n, list) else [n] * P
        if len(params) != P or len(ns) != P:
            raise ValueError(f"got {P} prompts but {len(params)} sampling params and {len(ns)} n values")
        rows = []
        for i, (prompt, p, k) in enumerate(zip(prompts, params, ns)):
            cfg = p if isinstance(p, SamplingConfig) else SamplingConfig.from_dict(p)
            rid = rids[i] if rids else uuid.uuid4().hex
            prompt = list(prompt)
            for _ in range(k):
                rows.append(self._new_row(prompt, cfg, rid, rid if k == 1 else uuid.uuid4().hex))
        return rows

    def check_prompt(self, prompt: list[int]) -> None:
        """Raise ValueError for a prompt this model cannot take (checked before batching)."""
        if not prompt:
            raise ValueError("a prompt must have at least one token")
        if len(prompt) >= self.context_len:
            raise ValueError(f"the input ({len(prompt)} tokens) is longer than the model's context "
                             f"length ({self.context_len} tokens); shorten the prompt")
        if max(prompt) >= self.vocab_size or min(prompt) < 0:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size - 1}]")

    def _new_row(self, prompt: list[int], cfg: SamplingConfig, rid: str, sample_id: str) -> _Row:
        self.check_prompt(prompt)
        stops = frozenset(cfg.stop_token_ids) | self.eos_ids
        row = _Row(prompt=prompt, cfg=cfg, rid=rid, sample_id=sample_id,
                   stop_ids=frozenset() if cfg.ignore_eos else stops, mask_ids=sorted(stops),
                   max_new=min(cfg.max_new_tokens, self.context_len - len(prompt)))
        if row.max_new == 0:
            row.finish = {"type": "length", "length": row.max_new}
        return row

    def _record(self, r: _Row) -> dict:
        if not math.isfinite(sum(r.logprobs)):  # NaN/inf propagate through the sum: one C pass a row
            raise FloatingPointError(f"sample {r.sample_id}: a non-finite log-prob (NaN or inf) among its "
                                     f"{len(r.logprobs)} tokens: the policy's logits are not finite (check the "
                                     f"weights last pushed and the trainer's loss)")
        return {
            "output_ids": list(r.out), "text": self._text(r), "finish_reason": r.finish,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(r.logprobs, r.out)],
            "prompt_tokens": len(r.prompt), "completion_tokens": len(r.out), "id": r.sample_id,
        }

    def _text(self, r: _Row) -> str:
        ids, matched = r.out, (r.finish or {}).get("matched")
        if isinstance(matched, int) and not r.cfg.no_stop_trim and ids:
            ids = ids[:-1]  # SGLang trims the matched stop token from the text only
        text = self.tokenizer.decode(ids, skip_special_tokens=r.cfg.skip_special_tokens)
        if isinstance(matched, str) and (pos := text.find(matched)) >= 0:
            text = text[:pos + len(matched)] if r.cfg.no_stop_trim else text[:pos]
        return text

    # ------------------------------------------------------------ the decode loop

    @torch.inference_mode()
    def _run_chunk(self, rows: list[_Row], checkpoint: Checkpoint | None, closer: _Closer | None = None) -> None:
        """Prefill the chunk's distinct prompts once, then decode until every row finishes (or `closer` closes)."""
        cache, logits, mask, pos = self._prefill(rows)
        active = list(range(len(rows)))  # row index of each batch slot
        while True:
            tokens, lps = self._sample(logits, [rows[i] for i in active])
            # one host transfer per step, not one per row (on a GPU each element read is a sync)
            for i, tok, lp in zip(active, tokens.tolist(), lps.tolist()):
                self._append(rows[i], tok, lp)
            if checkpoint is not None:
                self._apply_aborts(rows, active, checkpoint)
            if closer is not None:
                closer.finished([rows[i] for i in active if rows[i].finish is not None])
            keep = [s for s, i in enumerate(active) if rows[i].finish is None]
            if not keep:
                return
            if len(keep) < len(active):
                mask = self._compact(cache, mask, keep)
                tokens, pos = tokens[keep], pos[keep]
                active = [active[s] for s in keep]
            mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)  # [B, T+1]
            pos = pos + 1  # [B]
            logits = self._forward(tokens[:, None], mask, pos[:, None], cache)

    @torch.inference_mode()
    def _run_static(self, dec: StaticDecoder, rows: list[_Row], checkpoint: Checkpoint | None,
                    closer: _Closer | None = None) -> None:
        """Continuous batching over the static cache: up to max_batch_size rows decode together, each in a
        region of the KV pool (kv_pool.py); finished rows leave after each step and give their region back,
        and waiting rows are admitted, in order, while a region fits (a row that does not fit waits).

        The next step is launched before the host reads this step's tokens (their copy is queued first):
        finish checks and bookkeeping run while the GPU decodes. Rows found finished have taken one step
        too many, which is dropped with them (its K/V lies inside their region, before its end)."""
        self._size_pool(dec, rows)
        clock = self.decode_time
        began = time.perf_counter()
        try:
            self._static_loop(dec, rows, checkpoint, closer, clock)
        finally:
            clock["loop_s"] += time.perf_counter() - began

    def _static_loop(self, dec: StaticDecoder, rows: list[_Row], checkpoint: Checkpoint | None,
                     closer: _Closer | None, clock: dict) -> None:
        assert dec.regions is not None
        waiting, active = deque(rows), []  # active[b] is the row in batch row b
        logits: torch.Tensor | None = None
        params: SamplingTensors | None = None
        while True:
            new = self._take(dec, waiting, self.max_batch_size - len(active))
            if new:
                fresh = self._admit(dec, new)  # [k, V]
                logits = fresh if logits is None else torch.cat([logits, fresh])
                active += new
                params = SamplingTensors.of([r.cfg for r in active], logits.device)
            assert logits is not None and params is not None, "a waiting row fits no region of an empty pool"
            at = _positions(active)  # one list a step, for the draws, the regions and the decode
            tokens, lps = self._sample(logits, active, params, at)
            host, ready = _to_host(tokens, lps)
            ahead = None  # logits of the next step, launched before this step's tokens are read
            short: list[int] = []  # batch rows whose regions could not reach the next position: they leave
            if any(len(r.out) + 1 < r.max_new for r in active):  # after this step's token
                short = self._room(dec, active, at)
                ahead = self._decode(dec, tokens, active, at, short)
            waited = time.perf_counter()
            ready()
            clock["device_wait_s"] += time.perf_counter() - waited
            clock["steps"] += 1
            for r, tok, lp in zip(active, host[0].long().tolist(), host[1].tolist()):
                self._append(r, tok, lp)
            if checkpoint is not None:
                self._apply_aborts(active, list(range(len(active))), checkpoint)
            if closer is not None and closer.finished([r for r in active if r.finish is not None]):
                waiting.clear()  # cut before they started (the closer marked them)
            back = [s for s in short if active[s].finish is None]  # wait to be prefilled again with what they
            waiting.extendleft(reversed([active[s] for s in back]))  # generated, first in line (their step in
            self.kv_moves["preempted"] += len(back)  # flight writes the scratch position)
            keep = [s for s, r in enumerate(active) if r.finish is None and s not in back]
            for s, r in enumerate(active):
                if r.finish is not None or s in back:  # the step in flight writes inside a finished row's region:
                    dec.regions.free(r.kv_start)  # stream order keeps a new owner's prefill after it
            if len(keep) < len(active) and keep:
                idx = on_device(keep, tokens.device)
                tokens, params = tokens[idx], params.select(keep, idx)
                ahead = None if ahead is None else ahead[idx]
            active = [active[s] for s in keep]
            if not active:
                if not waiting:
                    return
                logits = params = None
                continue
            # a row still running had room for another token before this one: its step was launched above
            assert ahead is not None, "a running row without its next step"
            logits = ahead

    def _size_pool(self, dec: StaticDecoder, rows: list[_Row]) -> None:
        """Size the decoder's KV pool (kv_pool.py): `kv_tokens`, else `kv_mem_fraction` of the GPU (both
        fixed once made), else max_batch_size slots of the longest row's power-of-two bucket, each region a
        slot (the first static cache exactly). Raises when a row could never fit."""
        longest = max(len(r.prompt) + r.max_new for r in rows)
        if dec.regions is not None:  # generate calls never overlap (one worker thread): each starts with all free
            dec.regions.reset()
        if self.kv_tokens is None and self.kv_mem_fraction is None:
            slot = max(_pow2_bucket(longest, 256), dec.regions.granule if dec.regions else 0)  # grows only
            dec.reserve(self.max_batch_size * slot, granule=slot)
            return
        if dec.regions is None:
            tokens = self.kv_tokens
            if tokens is None:
                assert self.kv_mem_fraction is not None
                p = next(self.model.parameters())
                per_position = bytes_per_position(len(dec.layers), dec.kv_heads, dec.head_dim, dec.kv_dtype or p.dtype)
                tokens = budget_positions(self.kv_mem_fraction, per_position, self.device, self.max_batch_size,
                                          self.vocab_size)
            dec.reserve(tokens)
        assert dec.regions is not None
        if not dec.regions.fits_ever(longest):
            raise ValueError(f"a row of {longest} tokens (prompt + max_new_tokens) cannot fit the KV cache of "
                             f"{dec.regions.size} tokens; raise kv_mem_fraction (kv_tokens) or lower max_new_tokens")

    def _reserve(self, r: _Row) -> int:
        """Positions a row's region holds when admitted or grown: its prompt, what it generated, and kv_reserve
        of the new tokens it may still take (at least one; all of them at kv_reserve 1)."""
        left = r.max_new - len(r.out)
        return len(r.prompt) + len(r.out) + max(1, min(left, math.ceil(self.kv_reserve * left)))

    def _room(self, dec: StaticDecoder, rows: list[_Row], positions: list[int]) -> list[int]:
        """Make each row's region reach the position the next step writes (`positions`: prompt + out): rows past
        their region's end grow it in place where the hole after it is free, else move to a larger region (their
        K/V copied, all in one copy); returns the batch rows for which neither was possible (they sit out the step
        and leave the batch)."""
        regions = dec.regions
        assert regions is not None
        short: list[int] = []
        if self.kv_reserve >= 1.0:  # every region holds its row's prompt + max_new_tokens: none outgrows it
            return short
        moves: tuple[list[int], list[int], list[int]] = ([], [], [])  # (to, from, positions written so far)
        for b, (r, at) in enumerate(zip(rows, positions)):  # at: the position this step writes
            if at < regions.length(r.kv_start):
                continue
            want = max(at + 1, self._reserve(r))
            if regions.grow(r.kv_start, want):
                self.kv_moves["grown"] += 1
                continue
            start = regions.alloc(want)
            if start is None:
                short.append(b)
                continue
            for part, v in zip(moves, (start, r.kv_start, at)):
                part.append(v)
            regions.free(r.kv_start)  # after the new region was taken: the two never overlap
            r.kv_start = start
            self.kv_moves["moved"] += 1
        if moves[0]:  # one gather of every source before any write: a region freed above and taken by a later
            dec.copy_prefix(*moves)  # row of this loop is still read intact
        return short

    def _take(self, dec: StaticDecoder, waiting: deque[_Row], room: int) -> list[_Row]:
        """The waiting rows admitted now: in order, while batch rows are free and a KV region fits the next
        (first come, first served: a large row at the head waits for room rather than being overtaken)."""
        assert dec.regions is not None
        new: list[_Row] = []
        while waiting and len(new) < room:
            start = dec.regions.alloc(self._reserve(waiting[0]))
            if start is None:
                break
            row = waiting.popleft()
            row.kv_start = start
            new.append(row)
        return new

    def _decode(self, dec: StaticDecoder, tokens: torch.Tensor, rows: list[_Row], at: list[int],
                idle: Sequence[int] = ()) -> torch.Tensor:
        """The next step's logits; each row's token goes at its position in `at` (prompt + out) of its region (the
        batch rows in `idle` write the pool's scratch position instead: their logits mean nothing)."""
        positions = list(at) if idle else at  # a copy only where idle rows are rewritten below
        starts = [r.kv_start for r in rows]
        for b in idle:
            positions[b], starts[b] = 0, dec.capacity
        with self.lock:
            return dec.decode(tokens, positions, starts)

    def _admit(self, dec: StaticDecoder, rows: list[_Row]) -> torch.Tensor:
        """Prefill `rows` into their regions (a prompt sampled n times is run once, its cache copied to the
        other samples' regions); logits float32 [len(rows), V]."""
        prompts, picks = _distinct_prompts(rows)
        first: dict[int, _Row] = {}  # distinct index -> its first sample
        for row, u in zip(rows, picks):
            first.setdefault(u, row)
        groups = prefill_groups([len(p) for p in prompts])
        with self.lock:
            parts = [dec.prefill([prompts[u] for u in g], [first[u].kv_start for u in g], self.pad_id) for g in groups]
        if len(parts) == 1:
            logits = parts[0]  # [U, V]
        else:
            logits = torch.empty((len(prompts), parts[0].shape[1]), dtype=parts[0].dtype, device=parts[0].device)
            for g, part in zip(groups, parts):
                logits[on_device(g, logits.device)] = part
        repeats = [(row, first[u]) for row, u in zip(rows, picks) if first[u] is not row]
        if repeats:
            dec.copy_prefix([r.kv_start for r, _ in repeats], [f.kv_start for _, f in repeats],
                            [len(r.prompt) + len(r.out) for r, _ in repeats])
        return logits[on_device(picks, logits.device)]

    def _prefill(self, rows: list[_Row]):
        """Left-padded prefill of the distinct prompts; cache and logits repeated per row."""
        prompts, picks = _distinct_prompts(rows)
        T = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), T), self.pad_id, dtype=torch.long)  # [U, T]
        mask = torch.zeros((len(prompts), T), dtype=torch.long)  # [U, T]
        for u, p in enumerate(prompts):
            ids[u, T - len(p):] = torch.tensor(p)
            mask[u, T - len(p):] = 1
        ids, mask = on_device(ids, self.device), on_device(mask, self.device)
        pos_ids = (mask.cumsum(-1) - 1).clamp_min(0)  # [U, T] positions restart at each prompt
        cache = _new_cache(capacity=T + max(r.max_new for r in rows))
        logits = self._forward(ids, mask, pos_ids, cache)  # [U, V]
        sel = on_device(picks, self.device)  # [B]
        if picks != list(range(len(prompts))):
            cache.batch_select_indices(sel)  # n > 1: repeat each prompt's cache per sample
        return cache, logits[sel], mask[sel], pos_ids[sel, -1]

    def _forward(self, ids, mask, pos_ids, cache) -> torch.Tensor:
        """Logits of the last position, float32 [B, V]; the lock keeps weight writes out."""
        with self.lock:
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos_ids,
                             use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        return out.logits[:, -1].float()

    @staticmethod
    def _compact(cache, mask: torch.Tensor, keep: list[int]) -> torch.Tensor:
        """Drop finished rows from the cache and mask, then cut columns that are padding for all."""
        idx = on_device(keep, mask.device)
        mask = mask[idx]  # [B', T]
        if not all(isinstance(layer, _PreallocLayer) for layer in cache.layers):
            cache.batch_select_indices(idx)  # a layer kind we do not own: rows only
            return mask
        first = int(mask.any(0).long().argmax())  # first column some remaining row attends to
        for layer in cache.layers:
            layer.select(idx, first)
        return mask[:, first:]

    def _sample(self, logits: torch.Tensor, rows: list[_Row], params: SamplingTensors | None = None,
                positions: list[int] | None = None):
        """Apply the min_new_tokens mask, draw each row's uniform (a seeded row's from its seed and the position its
        token takes), then sample; `params` are the rows' parameters as device tensors and `positions` their
        prompt + out (each built here when not given)."""
        B, V = logits.shape
        params = params or SamplingTensors.of([r.cfg for r in rows], logits.device)
        if params.any_min_new:  # every row still short of min_new_tokens, all at once: [b, token] pairs
            masked = [(b, t) for b, r in enumerate(rows) if len(r.out) < r.cfg.min_new_tokens for t in r.mask_ids]
            if masked:
                at = on_device(masked, logits.device)
                logits[at[:, 0], at[:, 1]] = float("-inf")
        uniform = None
        if not params.all_greedy:
            seeded = params.seeded  # the seeds live on the device with the batch's parameters
            if seeded:  # one hashed draw per seeded row, all rows at once (the rollout seeds every sample)
                positions = _positions(rows) if positions is None else positions
                at = on_device(positions if len(seeded) == B else [positions[b] for b in seeded], logits.device)
                drawn = seeded_uniform(params.seeds, at)  # [S], on the device (integer ops: the host's bits)
            if len(seeded) == B:
                uniform = drawn
            else:
                uniform = torch.rand(B, device=logits.device, dtype=torch.float64)  # [B]
                if seeded:
                    uniform[on_device(seeded, logits.device)] = drawn
        return sample_tokens(logits, params.temperature, params.top_p, params.top_k, params.min_p, uniform,
                             filtered=params.filtered, fused=self.decode_fusion is not None)

    def _append(self, r: _Row, token: int, logprob: float) -> None:
        """Record one token and run SGLang's finish checks: stop string, stop token, length."""
        r.out.append(token)
        r.logprobs.append(logprob)
        if r.cfg.stop and (s := self._matched_stop_str(r)) is not None:
            r.finish = {"type": "stop", "matched": s}
        elif token in r.stop_ids:
            r.finish = {"type": "stop", "matched": token}
        elif len(r.out) >= r.max_new:
            r.finish = {"type": "length", "length": r.max_new}

    def _matched_stop_str(self, r: _Row) -> str | None:
        tail = self.tokenizer.decode(r.out[-(max(len(s) for s in r.cfg.stop) + 1):])
        return next((s for s in r.cfg.stop if s and s in tail), None)

    @staticmethod
    def _apply_aborts(rows: list[_Row], active: list[int], checkpoint: Checkpoint) -> None:
        running = [i for i in active if rows[i].finish is None]
        aborted = checkpoint(sorted({rows[i].rid for i in running}))
        for i in running:
            if rows[i].rid in aborted:
                rows[i].finish = {"type": "abort", "message": aborted[rows[i].rid]}

    @torch.inference_mode()
    def input_logprobs(self, prompt: list[int], start: int) -> list[float | None]:
        """SGLang's input_token_logprobs values for logprob_start_len=`start`: one per prompt token from
        `start` on, the logprob of that token given the ones before it (plain log_softmax), the first
        entry null (SGLang's scheduler drops the last position's and puts None first)."""
        if start >= len(prompt):
            return []
        ids = torch.tensor([prompt], device=self.device)  # [1, T]
        with self.lock:
            logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()  # [T-1, V]
        lp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]  # [T-1]: token t+1 given <= t
        return [None, *lp[start:].tolist()]

    # ------------------------------------------------------------ weights

    def load_named_tensors(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors into the model in place (cast to the model dtype); strict on names/shapes.

        Everything is checked before anything is written, so a bad call leaves the model intact.
        Returns the number of tensors written.
        """
        self.check_named(named_tensors)
        with self.lock, torch.no_grad():
            self.weight_writes += 1
            dst = [self._params[name].data for name, _ in named_tensors]
            if self.device.type == "cuda" and all(t.device == self.device for _, t in named_tensors):
                torch._foreach_copy_(dst, [t for _, t in named_tensors])  # one launch group, not one per tensor
            else:
                for d, (_, t) in zip(dst, named_tensors):
                    d.copy_(t)
            self._refresh_fused()
            if self.device.type == "cuda":  # sources may be another process's memory (CUDA IPC): done before
                torch.cuda.synchronize(self.device)  # the call returns and the sender frees or reuses it
        return len(named_tensors)

    def check_named(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Every name is one of the model's tensors, with its shape (KeyError / ValueError naming it)."""
        for name, t in named_tensors:
            p = self._params.get(name)
            if p is None:
                raise KeyError(f"unknown weight name {name!r}: the engine's model has no such tensor "
                               f"(names look like {next(iter(self._params))!r}); send HF parameter names")
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"shape mismatch for {name!r}: got {tuple(t.shape)}, "
                                 f"engine has {tuple(p.shape)}")

    def adopt_layout(self, named_tensors: list[tuple[str, torch.Tensor]]) -> bool:
        """Move the parameters named in `named_tensors` (a mapped source: the trainer's tensors) into one
        buffer per source storage, in the source's byte order with fused tensors together
        (reflow.engines.embedded.weight_layout), so that later loads from that source are a few large
        copies. Values are kept. Only where every named tensor has its parameter's dtype and the parameter
        is on this engine's device; returns whether it moved them. Call with no generation running: the
        static decoder (its fused views, cache and graphs) is dropped and made again by the next generate."""
        names = byte_order(named_tensors)
        by_name = dict(named_tensors)
        if any(by_name[n].dtype != self._params[n].dtype or self._params[n].device != self.device for n in names):
            return False
        with self.lock:
            if self._static is not None:  # free its cache and graphs before the arena takes its memory
                self._static.release()
                self._static = None
            self._arenas = []
            storages: dict[int, list[str]] = {}
            for n in names:
                storages.setdefault(by_name[n].untyped_storage().data_ptr(), []).append(n)
            # exactly the source's byte order: a push is then one copy per source storage; the static decoder views
            # the fused tensors that lie together in it and keeps copies of the others (StaticDecoder keep_params)
            self._arenas = [Arena(self._params, part, self.device) for part in storages.values()]
            self._runs = None
            self.layout_epoch += 1
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # what the parameters held before goes back to the driver
        return True

    def load_mapped(self, mapping_id: str, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """`load_named_tensors` for mapping `mapping_id`'s tensors (checked when it was mapped): the copies
        joined into runs of bytes that continue on both sides (weight_layout.copy_runs), planned once per
        mapping and parameter layout. Returns the number of copies made."""
        with self.lock, torch.no_grad():
            plan = self._runs
            # The plan holds while the parameters stay where it found them: checked on the first and last
            # (every move re-points all of them: adopt_layout, release and resume, the decoder's fusion) and on
            # the layout epoch those moves bump, not on all 290 addresses (0.1 ms a push on the H200's host).
            if plan is None or plan[0] != (mapping_id, self.layout_epoch, self._params[named_tensors[0][0]].data_ptr(),
                                           self._params[named_tensors[-1][0]].data_ptr()):
                dst = [self._params[n].data for n, _ in named_tensors]
                pairs = copy_runs([(t, d) for (_, t), d in zip(named_tensors, dst)])
                big = [p for p in pairs if p[0].numel() * p[0].element_size() >= BIG_COPY_BYTES]
                small = [p for p in pairs if p[0].numel() * p[0].element_size() < BIG_COPY_BYTES]
                on_gpu = self.device.type == "cuda" and all(s.device == self.device for s, _ in pairs)
                plan = self._runs = ((mapping_id, self.layout_epoch, dst[0].data_ptr(), dst[-1].data_ptr()),
                                     big, small, len(pairs), on_gpu)
            _, big, small, count, on_gpu = plan
            self.weight_writes += 1
            if on_gpu:
                self._copy_on_gpu(plan)
                self._refresh_fused()  # fused q/k/v copies where the trainer's order interleaves them (Qwen2's biases)
                torch.cuda.synchronize(self.device)  # the sources are another process's memory: done before we answer
            else:
                for s, d in big + small:
                    d.copy_(s)
                self._refresh_fused()
        return count

    @staticmethod
    def _copy_on_gpu(plan: tuple) -> None:
        """The plan's copies on this engine's GPU: runs of 4 MiB or more one plain copy each (the multi-tensor
        kernel moves large runs at ~60 % of its speed), the rest in one multi-tensor launch. (Replaying them as
        one CUDA graph was measured: 0.78-0.80 ms inside the engine's call against 0.73 for these launches, the
        same H200; bench/RESULTS.md 25.)"""
        _, big, small, _, _ = plan
        for s, d in big:
            d.copy_(s)
        if small:
            torch._foreach_copy_([d for _, d in small], [s for s, _ in small])

    def forget_mapped(self) -> None:
        """Drop the planned copies (they hold the mapped memory, which a new mapping lets go of)."""
        with self.lock:
            self._runs = None

    def arena_bytes(self) -> int:
        """Bytes of the parameters' arenas (0 before adopt_layout)."""
        return sum(a.nbytes for a in self._arenas)

    def release_memory(self, tags: set[str]) -> None:
        """Colocated mode on a GPU (SGLang's release_memory_occupation): "kv_cache" and "cuda_graph" free the
        static decoder's cache and graphs (made again on the next generate); "weights" moves the model to
        host memory. The caching allocator gives the freed blocks back to the driver. On CPU: nothing to
        free (the engine state tracks the tags)."""
        if self.device.type != "cuda":
            return
        with self.lock:
            if self._static is not None and tags & {"kv_cache", "cuda_graph", "weights"}:
                self._static.release()
                if "weights" in tags:
                    self._static = None  # it holds the fused q/k/v and gate/up tensors: they go too
            if "weights" in tags:
                self._runs = None  # its copies hold views of the GPU memory going now
                self.layout_epoch += 1
                for arena in self._arenas:  # whole, so the layout comes back with them
                    arena.to("cpu")
                self.model.to("cpu")  # parameters keep their identity (the name map stays valid)
            torch.cuda.empty_cache()

    def memory_stats(self) -> dict:
        """GPU memory this engine's process holds (torch's allocator), for /server_info; {} on CPU."""
        if self.device.type != "cuda":
            return {}
        static = self._static
        return {"gpu_allocated_gib": torch.cuda.memory_allocated(self.device) / 2**30,
                "gpu_reserved_gib": torch.cuda.memory_reserved(self.device) / 2**30,
                "kv_cache_gib": (static.nbytes() if static else 0) / 2**30,
                "kv_pool_tokens": static.capacity if static else 0, "kv_tokens_in_use": static.regions.in_use
                if static and static.regions else 0, "attention_kernel": static.kernel if static else None,
                "cuda_graphs": static.graph_count if static else 0}

    def resume_memory(self, tags: set[str]) -> None:
        """Undo `release_memory`: weights back on the GPU (a push follows in colocated mode); the cache and
        graphs are made lazily by the next generate."""
        if self.device.type == "cuda" and "weights" in tags:
            with self.lock:
                self.layout_epoch += 1
                for arena in self._arenas:
                    arena.to(self.device)
                self.model.to(self.device)

    def get_weight(self, name: str, rows: int | None = None) -> torch.Tensor:
        """A detached copy of one model tensor, by HF name (its first `rows` along dim 0 when given)."""
        if name not in self._params:
            raise KeyError(f"unknown weight name {name!r}")
        with self.lock:
            t = self._params[name].detach()
            return (t[:rows] if rows is not None and t.dim() else t).clone()
