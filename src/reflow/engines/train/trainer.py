"""One data-parallel DeepSpeed policy rank; `trainer_group.TrainerGroup` hosts one per Ray actor.

Each rank loads the HF policy, joins a torch.distributed group (gloo on CPU, nccl on GPU) and wraps
the model in a DeepSpeed engine with a client torch AdamW (no cpu_adam JIT build) and a LambdaLR
warm-up/decay schedule that this class steps itself, only after an *applied* update. That plumbing
(process group, engine, step veto, weights, offload, checkpoints) is `reflow.engines.train.ds_rank.DeepSpeedRank`,
shared with the PPO critic (`reflow.engines.train.critic`).

Sharding: the global batch is cut into `minibatches` contiguous slices (one optimizer step each);
rank r keeps samples r, r+W, r+2W, ... (strided), so mini-batch k of every rank's shard together is
exactly slice k, and ranks see similar response lengths. Every rank must run the same number of
forward/backward passes (they are collective under ZeRO-2/3), hence `len(batch)` must divide by
world_size * minibatches.

Loss normalisation: one optimizer step minimises the aggregate over the whole *global* mini-batch.
`aggregate(..., "token-mean")` on a micro-batch divides by that micro-batch's tokens, so averaging
micro-batch means would weigh tokens unequally. Each micro-batch therefore back-propagates
    aggregate(micro) * units(micro) / units(global mini-batch) * world_size,
units being response tokens (token-mean), sequences with >= 1 response token
(seq-mean-token-mean, seq-mean-token-sum, as `aggregate` counts them) or all rows
(seq-mean-token-sum-norm, whose per-row normaliser is the constant `loss_norm_len`).
DeepSpeed averages gradients over the W ranks, so the accumulated gradient is exactly that of the
global aggregate. Accumulation boundaries are
set by hand (`set_gradient_accumulation_boundary`) with DeepSpeed's gradient_accumulation_steps=1,
so DeepSpeed never rescales the loss and the micro-batch count may differ between calls.

Non-finite losses: every micro-batch still runs backward (keeping collectives matched), then the
ranks agree on a flag and, if any loss was NaN/inf, the optimizer update is vetoed inside
`engine.step()` -- DeepSpeed still clears its gradient buffers -- and `NonFiniteLossError` is raised.
Updates of earlier mini-batches of the same call stay applied; the lr schedule does not advance.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function

from reflow.engines.hf_io import fp32_lm_head, load_causal_lm, load_tokenizer
from reflow.engines.rollout_client import EngineClient
from reflow.engines.train import lora, packing
from reflow.engines.train.compiled import (
    checkpoint_layers,
    compile_cache_hits,
    compile_layers,
    compiled_graphs,
    length_bucket,
    packed_bucket,
    use_compile,
)
from reflow.engines.train.ds_rank import DeepSpeedRank, NonFiniteLossError, _rows, ds_config, lr_multiplier  # noqa: F401
from reflow.engines.train.memory import activation_bytes
from reflow.engines.train.settings import RankSettings, attention_kernel, weights_precision
from reflow.engines.weights.settings import PushSettings
from reflow.engines.weights.verify import LogprobProbe, probe_prompts, verify_due
from reflow.rl.algorithms.base import AlgorithmBase
from reflow.rl.losses import LossSettings, logprobs_and_entropy, tis_weights, token_logprobs
from reflow.rl.objectives import PolicyObjective, PolicyTerms
from reflow.rl.types import RolloutBatch, to_train_tensors

log = logging.getLogger("reflow.trainer")

# Local sums all-reduced with SUM, and maxima with MAX (minima are sent negated): the trainer's own, around
# those of the policy objective (reflow.rl.objectives), which `_metric_keys` adds.
_SUM_KEYS = ("tis_weight", "tis_capped", "tokens", "mismatch_sum", "mismatch_tokens", "forward_tokens", "sample_tokens")
_MAX_KEYS = ("logprob_mismatch_max", "tis_weight_max", "step_time_s", "old_logprob_time_s")


def _metric_keys(obj: PolicyObjective) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(summed, maximised) accumulator keys of a step with objective `obj`."""
    clash = set(obj.metric_names()) & {"loss", *_SUM_KEYS, *_MAX_KEYS}
    if clash:
        raise ValueError(f"policy objective {type(obj).__name__} reports {sorted(clash)}, names the trainer keeps "
                         f"for its own metrics: rename them")
    return (("loss", *obj.means, *obj.token_means, *_SUM_KEYS),
            (*obj.maxima, *(f"neg_{k}" for k in obj.minima), *_MAX_KEYS))


def _units(mask: torch.Tensor, agg_mode: str) -> torch.Tensor:
    """What `aggregate` divides by: response tokens, sequences with >= 1 response token, or rows."""
    if agg_mode == "token-mean":
        return mask.sum()
    if agg_mode == "seq-mean-token-sum-norm":
        return torch.tensor(float(mask.shape[0]), dtype=mask.dtype)
    return (mask != 0).any(dim=-1).sum().to(mask.dtype)


def _mismatch(acc: dict, rollout: torch.Tensor, old: torch.Tensor, loss_mask: torch.Tensor) -> None:
    """Engine-vs-trainer log-prob gap over response tokens, summed into acc (as device tensors)."""
    keep = loss_mask != 0  # [b, L-1]
    diff = torch.where(keep, (rollout - old).abs(), torch.zeros_like(old)).double()  # [b, L-1]
    acc["mismatch_sum"] = acc["mismatch_sum"] + diff.sum()
    acc["mismatch_tokens"] = acc["mismatch_tokens"] + keep.sum().double()
    acc["logprob_mismatch_max"] = torch.maximum(torch.as_tensor(acc["logprob_mismatch_max"]).to(diff),
                                                diff.max() if diff.numel() else diff.new_zeros(()))


def _pad_length(t: dict[str, torch.Tensor], length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad [B, L] tensors to `length` and [B, L-1] ones to `length - 1` (pad_id / zeros)."""
    L = t["input_ids"].shape[1]
    if length <= L:
        return t
    fill = {"input_ids": pad_id}
    return {k: v if v.dim() == 1 else torch.nn.functional.pad(v, (0, length - L), value=fill.get(k, 0))
            for k, v in t.items()}


def _columns(mb: dict[str, torch.Tensor], first: int, end: int | None = None) -> dict[str, torch.Tensor]:
    """mb with its [b, L-1] per-position tensors cut to columns first..end (input ids and mask kept whole)."""
    return {k: v[:, first:end] if v.dim() == 2 and k not in ("input_ids", "attention_mask") else v
            for k, v in mb.items()}


def _ranges(sizes: list[int]) -> list[tuple[int, int]]:
    """Consecutive [start, end) row ranges of the given sizes (empty ones kept)."""
    ends = list(itertools.accumulate(sizes))
    return list(zip([0] + ends[:-1], ends))


class TrainerRank(DeepSpeedRank):
    """One policy rank (PPO-clip updates, weight pushes). Collective methods must be called on every
    rank together; the DeepSpeed plumbing shared with the critic is in `reflow.engines.train.ds_rank`."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, model_path: str,
                 settings: RankSettings, ref_model_path: str | None = None):
        t0 = time.perf_counter()
        s = settings
        lr_multiplier(0, s.lr_schedule, s.warmup_steps, s.total_steps)  # fail fast on a bad schedule name
        self.zero_stage, self.model_path, self.storage = s.zero_stage, model_path, s.storage
        self.micro_batch_size, self.precision = s.micro_batch_size, s.precision
        self.max_tokens = s.max_tokens_per_micro_batch  # packed token-budget micro-batches (packing.py); None: padded
        self._plan: packing.PackPlan | None = None  # this iteration's packing, when packed
        self._transports: dict = {}  # weight transports by factory, built at their first push (_transport)
        self.probes_made = 0  # logprob probes computed for pushes (_logprob_probe; tests read it)
        self._start(rank, world_size, master_addr, master_port, s.backend, s.threads, s.seed, s.tf32)
        cfg = ds_config(s.zero_stage, s.precision, s.grad_clip, s.micro_batch_size, world_size,
                        s.zero3_param_persistence_threshold, s.grad_accum_dtype, s.immediate_grad_update)
        attention = attention_kernel(s.attn_implementation, bool(s.max_tokens_per_micro_batch), torch.cuda.is_available())

        def load(path: str):  # the policy and the reference model alike: weights' dtype, head precision
            model = load_causal_lm(path, dtype=weights_precision(s.precision), storage=s.storage,
                                   attn_implementation=attention)
            return fp32_lm_head(model) if s.fp32_lm_head else model

        model = load(model_path)  # its head patched before LoRA wraps it and DeepSpeed hooks it
        self.lora, self.hf_folder = s.lora, "adapter" if s.lora else "model"  # LoRA: engines/train/lora.py
        self._build_engine(lora.wrap(model, s.lora) if s.lora else model, cfg, s.lr, s.weight_decay,
                           lambda step: lr_multiplier(step, s.lr_schedule, s.warmup_steps, s.total_steps))
        self.old_logprob_pass = s.old_logprob_pass
        self._round_up = None  # compiled layers: micro-batch lengths padded to a bucket (compiled.py)
        if use_compile(s.compile, self.engine.device, s.zero_stage):
            compile_layers(self.engine.module, s.compile_backend)
            self._round_up = length_bucket
        self.activation_checkpointing = self._wants_checkpointing(model, s)
        if self.activation_checkpointing:  # after compiling: the recompute replays the compiled layers
            checkpoint_layers(self.engine.module)
        self.ref_model = None
        if ref_model_path is not None:
            self.ref_model = load(ref_model_path).to(self.engine.device)
            self.ref_model.eval().requires_grad_(False)
        self.init_time_s = time.perf_counter() - t0

    def _wants_checkpointing(self, model, s: RankSettings) -> bool:
        """trainer.activation_checkpointing: on, off, or auto: on when one micro-batch's activations (a rough
        estimate at the most tokens a micro-batch can hold) would take over half of this rank's GPU memory."""
        if s.activation_checkpointing != "auto":
            return s.activation_checkpointing == "on"
        if self.engine.device.type != "cuda" or not s.max_micro_batch_tokens:
            return False
        need = activation_bytes(model.config, s.max_micro_batch_tokens, 2 if s.precision == "bf16" else 4)
        have = torch.cuda.get_device_properties(self.engine.device).total_memory
        log.info("activations of a %d-token micro-batch: ~%.1f GiB of %.1f GiB: checkpointing %s",
                 s.max_micro_batch_tokens, need / 2**30, have / 2**30, "on" if need > have / 2 else "off")
        return need > have / 2

    # ---------------------------------------------------------------- training

    def train_iteration(self, batch: RolloutBatch, *, minibatches: int, pad_id: int, loss: LossSettings,
                        algorithm: AlgorithmBase | None = None) -> dict[str, float]:
        """Recompute old (and ref) logprobs, then one optimizer step per mini-batch. Collective.

        `loss`: the options of `reflow.rl.losses.policy_loss` plus KL and entropy terms. `algorithm`
        (default: none) finishes the batch's advantages here when its spec says so (REINFORCE++ with
        KL in the reward: per-sequence scores -> token-level advantages after the reference pass).
        """
        t0 = time.perf_counter()
        self.iteration += 1
        cuda = self.engine.device.type == "cuda"
        if cuda:  # this call's own peak (gpu_mem_peak_gib), not the rank's since it started
            torch.cuda.reset_peak_memory_stats(self.engine.device)
        finish = algorithm.spec.finish_advantages if algorithm is not None and algorithm.kl_reward_coef > 0 else None
        need_ref = loss.kl_coef > 0 or finish is not None
        if need_ref and self.ref_model is None:
            raise ValueError("kl_coef > 0 or kl_in_reward > 0 needs a reference model: create the trainer "
                             "with ref_model_path")
        if finish is not None and not batch.extra.get("advantages_are_scores"):
            raise ValueError("kl_in_reward > 0 needs per-sequence scores from the rollout stage "
                             "(advantages computed with kl_in_reward > 0), not finished advantages")
        with record_function("reflow.shard"):
            shard = self._shard(batch, minibatches, pad_id)
        sum_keys, max_keys = _metric_keys(loss.objective)
        acc = dict.fromkeys(sum_keys + max_keys, 0.0)
        acc.update(dict.fromkeys([*loss.objective.maxima, *(f"neg_{k}" for k in loss.objective.minima)], -math.inf))
        # One mini-batch and nothing to finish before training: the policy that scores the batch is
        # the one the training forward runs, so that forward's log-probs (detached) are the old ones.
        reuse = self.old_logprob_pass == "auto" and minibatches == 1 and finish is None
        self._old_logprobs(shard, loss.temperature, policy=not reuse, ref=need_ref, acc=acc)
        finished = finish(shard, algorithm, dist.all_reduce) if finish is not None else {}
        acc["old_logprob_time_s"] = time.perf_counter() - t0
        minis = [{k: v[s:e] for k, v in shard.items()} for s, e in self._mini_slices(shard, minibatches)]
        units = torch.stack([_units(mb["loss_mask"], loss.loss_agg) for mb in minis]).double()  # [minibatches]
        dist.all_reduce(units)
        grad_norms, lrs = [], []
        for k, mb in enumerate(minis):
            lrs.append(self.scheduler.get_last_lr()[0])
            grad_norms.append(self._train_minibatch(mb, float(units[k]), k, minibatches, loss, acc))
        acc["step_time_s"] = time.perf_counter() - t0
        with record_function("reflow.metrics"):
            out = self._reduce_metrics(acc, minibatches, loss.objective)
        out.update(grad_norm=sum(grad_norms) / len(grad_norms), lr=lrs[-1], samples=float(len(batch)),
                   old_logprobs_reused=float(reuse), compile_graphs=float(compiled_graphs()),
                   activation_checkpointing=float(self.activation_checkpointing),
                   compile_cache_hits=float(compile_cache_hits()), **finished)
        if cuda:  # what the train stage took on this rank's GPU at most (PyTorch's allocator; a CUDA context aside)
            out["gpu_mem_peak_gib"] = torch.cuda.max_memory_allocated(self.engine.device) / 2**30
        return out

    def _shard(self, batch: RolloutBatch, minibatches: int, pad_id: int) -> dict[str, torch.Tensor]:
        n, W = len(batch), self.world_size
        if n == 0 or n % (W * minibatches):
            raise ValueError(f"a batch of {n} samples must split evenly over world_size={W} x "
                             f"minibatches={minibatches}: every rank must run the same number of "
                             f"forward/backward passes (they are collective under ZeRO)")
        if batch.advantages is None or len(batch.advantages) != n:
            raise ValueError("batch.advantages must hold one value per sample: compute advantages first")
        # Checked on the whole batch (identical on every rank), so a bad sample fails every rank
        # alike instead of leaving the others blocked in a collective.
        bad = [i for i in range(n) if len(batch.rollout_logprobs[i]) != len(batch.response_ids[i])]
        if bad:
            raise ValueError(f"samples {bad[:5]}: rollout_logprobs and response_ids differ in length")
        self._plan, self._pad_id = None, pad_id
        if self.max_tokens is not None:  # every rank plans the same packing from the whole batch
            lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
            self._plan = packing.plan(lengths, minibatches, W, self.max_tokens)
            mine = self._plan.rank_samples(self.rank)
        else:
            mine = list(range(self.rank, n, W))
        tensors = to_train_tensors(batch.select(mine), pad_id)
        if self._round_up is not None and self._plan is None:  # room for every micro-batch's bucket (see compiled.py)
            tensors = _pad_length(tensors, self._round_up(tensors["input_ids"].shape[1]), pad_id)
        # Host-side [B] facts, so cutting micro-batches needs no device sync: lengths, and the first
        # position whose logits score a response token (the LM head is skipped before it).
        scored = tensors["loss_mask"] != 0  # [B, T-1]
        first = torch.where(scored.any(dim=1), scored.int().argmax(dim=1), scored.shape[1])  # [B]
        return {**{k: v.to(self.engine.device) for k, v in tensors.items()},
                "seq_len": tensors["attention_mask"].sum(dim=1), "scored_from": first}

    def _logits(self, model, mb: dict[str, torch.Tensor], first: int = 0) -> torch.Tensor:
        """Logits of positions first .. L-2 [b, L-1-first, V]: position t scores token t+1. Prompt
        positions before `first` score no response token, so the LM head (a fifth or more of a small
        model's FLOPs, and a [b, T, V] tensor) is not run there (HF's `logits_to_keep`)."""
        L = mb["input_ids"].shape[1]
        # An index tensor rather than a slice of all logits: the LM head's output is already the
        # [b, L-1-first, V] tensor the loss reads, so backward never zero-fills a [b, L, V] gradient.
        keep = torch.arange(first, L - 1, device=mb["input_ids"].device)  # [L-1-first]
        out = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False,
                    logits_to_keep=keep)
        return out.logits  # [b, L-1-first, V]

    @staticmethod
    def _scored(mb: dict[str, torch.Tensor]) -> tuple[int, dict[str, torch.Tensor]]:
        """(first scored position, mb with its [b, L-1] tensors cut to positions first..L-2)."""
        first = int(mb["scored_from"].min()) if "scored_from" in mb else 0
        first = min(first, mb["input_ids"].shape[1] - 2)
        return first, {**_columns(mb, first), "labels": mb["input_ids"][:, first + 1:]}

    @torch.no_grad()
    def _old_logprobs(self, shard: dict, temperature: float, policy: bool, ref: bool, acc: dict) -> None:
        """Adds `ref_logprobs` [B, T-1] to the shard and, if `policy`, `old_logprobs` (with the logprob
        mismatch stats in acc); without it the training forward supplies them (`_micro_loss`)."""
        old = torch.zeros_like(shard["loss_mask"])  # [B, T-1]
        refs = torch.zeros_like(old)  # [B, T-1]
        for s, e in self._all_micro_ranges(old.shape[0]) if policy or ref else ():
            mb = self._micro(shard, s, e)
            if policy:
                with self._training_graph():
                    first, lp, _ = self._token_logprobs(self.engine, mb, temperature)  # [b, W]
                old[s:e, first:first + lp.shape[1]] = lp
            if ref and e > s:
                with torch.autocast(self.engine.device.type, torch.bfloat16, enabled=self.precision == "bf16-mixed"):
                    # the reference model scores as the policy does (DeepSpeed's engine enters the policy's autocast)
                    first, lp, _ = self._token_logprobs(self.ref_model, mb, temperature)
                refs[s:e, first:first + lp.shape[1]] = lp
        shard["ref_logprobs"] = refs
        if policy:
            shard["old_logprobs"] = old
            _mismatch(acc, shard["rollout_logprobs"], old, shard["loss_mask"])

    @contextlib.contextmanager
    def _training_graph(self):
        """Around the old-logprob forward (called under no_grad): with compiled layers, run them in grad mode, so
        this pass replays the graph the training forward compiles instead of compiling a second, no-grad one
        (2.9 s of an H200 run's first iteration), and its log-probs come from the very function the update
        scores. The LM head and what follows stay without grad (its input detached): no [b, L, V] graph is
        kept, and the layers' activations go with the forward's hidden states. A no-op without compiled layers
        (eager layers compile nothing; ZeRO-3, where compile is off, gathers parameters for a backward)."""
        head = self.engine.module.get_output_embeddings() if self._round_up is not None else None
        if head is None:  # eager layers, or a model without a separate output layer to stop the graph at
            yield
            return
        modes: list[bool] = []

        def enter(module, args):
            modes.append(torch.is_grad_enabled())
            torch.set_grad_enabled(False)
            return tuple(a.detach() if torch.is_tensor(a) else a for a in args)

        def leave(module, args, output):
            torch.set_grad_enabled(modes.pop())

        hooks = [head.register_forward_pre_hook(enter), head.register_forward_hook(leave)]
        try:
            with torch.enable_grad():
                yield
        finally:
            for h in hooks:
                h.remove()

    def _train_minibatch(self, mb: dict, units_global: float, k: int, n_minis: int, loss: LossSettings,
                         acc: dict) -> float:
        """Accumulate gradients over the micro-batches of mini-batch k, then one step. Returns grad norm."""
        micros = [self._micro(mb, s, e) for s, e in self._micro_ranges(k, mb["input_ids"].shape[0])]
        return self._accumulate_and_step(micros, lambda m: self._micro_loss(m, units_global, loss, acc), k, n_minis)

    # ---------------------------------------------------------------- micro-batches: padded or packed

    def _mini_slices(self, shard: dict, minibatches: int) -> list[tuple[int, int]]:
        """This rank's rows of each mini-batch, contiguous in the shard (packed: as many as the plan gave it)."""
        if self._plan is None:
            m = shard["input_ids"].shape[0] // minibatches
            return [(i * m, (i + 1) * m) for i in range(minibatches)]
        return _ranges([sum(len(micro) for micro in mini[self.rank]) for mini in self._plan.micros])

    def _micro_ranges(self, k: int, rows: int) -> list[tuple[int, int]]:
        """Micro-batches of mini-batch k as row ranges of it: micro_batch_size rows each, or the plan's (packed;
        an empty range is a micro-batch this rank runs only to keep the collective passes matched)."""
        if self._plan is None:
            return self._micro_slices(rows)
        return _ranges([len(micro) for micro in self._plan.micros[k][self.rank]])

    def _all_micro_ranges(self, rows: int) -> list[tuple[int, int]]:
        """Every micro-batch of the shard, mini-batch after mini-batch, as row ranges of the whole shard."""
        if self._plan is None:
            return self._micro_slices(rows)
        out, base = [], 0
        for k in range(len(self._plan.micros)):
            ranges = self._micro_ranges(k, rows)
            out += [(base + s, base + e) for s, e in ranges]
            base += ranges[-1][1] if ranges else 0
        return out

    def _micro(self, t: dict[str, torch.Tensor], s: int, e: int) -> dict[str, torch.Tensor]:
        """Rows [s, e): padded, cut to their longest sequence (or its bucket); packed, as they are (packing.pack
        lays them end to end at the forward)."""
        if self._plan is None:
            return _rows(t, s, e, self._round_up)
        return {k: v[s:e] for k, v in t.items()}

    def _forward_tokens(self, mb: dict[str, torch.Tensor]) -> float:
        """Tokens the training forward of this micro-batch runs on, padding included (pad_fraction's denominator)."""
        if self._plan is None:
            return float(mb["input_ids"].numel())  # rows x their longest (or its bucket)
        n = int(mb["seq_len"].sum())
        return 2.0 if n == 0 else float(self._packed_length(n))

    def _packed_length(self, n: int) -> int:
        """A packed row of n tokens runs at its compiled packed bucket (compiled layers), else as it is."""
        return packed_bucket(n, self.max_tokens) if self._round_up is not None else n

    def _token_logprobs(self, model, mb: dict[str, torch.Tensor], temperature: float, entropy: bool = False
                        ) -> tuple[int, torch.Tensor, torch.Tensor | None]:
        """(first, log-probs [b, W], entropy [b, W] or None) of a micro-batch: column j is position first + j of
        the [b, L-1] layout (position t scores token t+1). Padded: one forward of the rows, the LM head from the
        first scored position on (`first` > 0). Packed: one forward of the rows end to end, the LM head on scored
        positions only, scattered back (`first` = 0). An empty packed micro-batch runs a two-token forward (its
        collective passes) and scores nothing."""
        if self._plan is None:
            first, cut = self._scored(mb)
            logits = self._logits(model, cut, first)  # [b, L-1-first, V]
            lp, ent = logprobs_and_entropy(logits, cut["labels"], temperature, entropy=entropy)
            return first, lp, ent
        device = mb["input_ids"].device
        rows = mb["input_ids"].shape[0]
        if rows == 0:
            ids = torch.full((1, 2), self._pad_id, dtype=torch.long, device=device)
            out = model(input_ids=ids, position_ids=torch.arange(2, device=device)[None], use_cache=False,
                        logits_to_keep=torch.zeros(1, dtype=torch.long, device=device))
            zero = out.logits.sum() * 0.0  # [] keeps the graph (and ZeRO's hooks) of the empty pass
            empty = zero.reshape(1, 1)[:0, :0].float()  # [0, 0]
            return 0, empty, (empty if entropy else None)
        seq_len = mb["seq_len"].tolist()
        pk = packing.pack(mb["input_ids"], seq_len, mb["scored_from"].tolist(), self._pad_id,
                          length=self._packed_length(sum(seq_len)))
        out = model(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False, logits_to_keep=pk.keep)
        lp, ent = logprobs_and_entropy(out.logits, pk.labels, temperature, entropy=entropy)  # [1, K]
        width = max(seq_len) - 1
        return 0, pk.scatter(lp, rows, width), (pk.scatter(ent, rows, width) if ent is not None else None)

    def _micro_loss(self, mb: dict, units_global: float, hp: LossSettings, acc: dict) -> torch.Tensor:
        """hp.objective's loss of one micro-batch, scaled for the global mean; its metrics accumulated."""
        obj = hp.objective
        # One pass over the logits for both; the entropy is a metric unless the objective asks its gradient.
        first, logp, ent_tok = self._token_logprobs(self.engine, mb, hp.temperature, entropy=True)  # [b, W] each
        assert ent_tok is not None
        acc["forward_tokens"] = acc["forward_tokens"] + self._forward_tokens(mb)
        acc["sample_tokens"] = acc["sample_tokens"] + float(mb["seq_len"].sum())
        if mb["input_ids"].shape[0] == 0:  # an empty packed micro-batch: its pass only, nothing to learn or count
            return logp.sum() * 0.0
        mb = _columns(mb, first, first + logp.shape[1])
        mask = mb["loss_mask"]  # [b, W]
        old = mb.get("old_logprobs")  # [b, L-1]; absent: this forward's own (train_iteration's reuse)
        if old is None:
            old = logp.detach()
            _mismatch(acc, mb["rollout_logprobs"], old, mask)
        isw = tis_weights(old, mb["rollout_logprobs"], mask, hp.tis_cap) \
            if hp.tis_cap is not None else None  # [b, L-1]
        total, metrics = obj.loss(PolicyTerms(logp, old, mb["advantages"], mask, ent_tok, mb.get("ref_logprobs"), isw),
                                  hp)
        # This micro-batch's share of the global mini-batch aggregate (see the module docstring).
        # Metrics stay device tensors (no host round trip per micro-batch: on a GPU each one would
        # stall the launch queue); _reduce_metrics reads them once.
        share = _units(mask, hp.loss_agg).double() / max(units_global, 1.0)  # []
        acc["loss"] = acc["loss"] + total.detach().double() * share
        for key in obj.means:
            acc[key] = acc[key] + metrics[key].detach().double() * share
        n_tok = mask.sum().double()  # []
        for key in obj.token_means:
            acc[key] = acc[key] + metrics[key].double() * n_tok  # token-weighted, divided by all tokens at the end
        acc["tis_weight"] = acc["tis_weight"] + ((isw * mask).sum().double() if isw is not None else n_tok)
        if isw is not None:  # how far the rollout's policy was from the trainer's, and how often the cap cut it
            acc["tis_capped"] = acc["tis_capped"] + ((isw >= hp.tis_cap) & (mask != 0)).sum().double()
            acc["tis_weight_max"] = torch.maximum(torch.as_tensor(acc["tis_weight_max"]).to(share),
                                                  (isw * mask).max().double())
        acc["tokens"] = acc["tokens"] + n_tok
        seen = n_tok > 0  # a micro-batch without response tokens leaves the extremes alone
        for key, sign in [(k, 1.0) for k in obj.maxima] + [(k, -1.0) for k in obj.minima]:
            slot = key if sign > 0 else f"neg_{key}"
            acc[slot] = torch.where(seen, torch.maximum(torch.as_tensor(acc[slot]).to(share),
                                                        sign * metrics[key].double()), acc[slot])
        return total * (share * self.world_size).to(total.dtype)  # DeepSpeed divides gradients by world_size

    def _reduce_metrics(self, acc: dict, minibatches: int, obj: PolicyObjective) -> dict[str, float]:
        sum_keys, max_keys = _metric_keys(obj)
        sums, maxs = (torch.stack([torch.as_tensor(acc[k], dtype=torch.float64).cpu() for k in keys])
                      for keys in (sum_keys, max_keys))
        dist.all_reduce(sums)
        dist.all_reduce(maxs, op=dist.ReduceOp.MAX)
        s, m = dict(zip(sum_keys, sums.tolist())), dict(zip(max_keys, maxs.tolist()))
        tokens = max(s["tokens"], 1.0)
        return {
            "loss": s["loss"] / minibatches, **{k: s[k] / minibatches for k in obj.means},
            **{k: s[k] / tokens for k in obj.token_means}, "tis_weight_mean": s["tis_weight"] / tokens,
            "tis_weight_max": m["tis_weight_max"] or 1.0,  # 0: no TIS, every weight 1
            "tis_capped_frac": s["tis_capped"] / tokens,
            **{k: -m[f"neg_{k}"] if s["tokens"] else empty for k, empty in obj.minima.items()},
            **{k: m[k] if s["tokens"] else empty for k, empty in obj.maxima.items()},
            "logprob_mismatch": s["mismatch_sum"] / max(s["mismatch_tokens"], 1.0),
            "logprob_mismatch_max": m["logprob_mismatch_max"], "response_tokens": s["tokens"],
            "step_time_s": m["step_time_s"], "old_logprob_time_s": m["old_logprob_time_s"],
            # share of the training forwards' tokens that were padding (packing keeps it near 0)
            "pad_fraction": 1.0 - s["sample_tokens"] / s["forward_tokens"] if s["forward_tokens"] else 0.0,
        }

    # ---------------------------------------------------------------- weights

    def push_weights(self, urls: list[str], version: str, settings: PushSettings, api_key: str | None = None) -> dict:
        """Every rank gathers; rank 0 pushes to the engines at `urls` with their `api_key` through the transport
        the runtime chose (reflow.engines.weights.transport; its fallbacks hold for the life of this rank), and
        returns the report. Collective."""
        transport = self._transport(settings)
        # On a GPU, mode=tensor hands the engines CUDA IPC handles (colocated: same GPU, no host copy); on CPU the
        # bucket is packed straight from the parameters (below ZeRO-3 they are whole: no gathered copy).
        direct = transport.gather_on_device(self.engine.device)
        named = self._gathered(keep=self.rank == 0, on_device=direct)
        due = settings.verify != "off" and verify_due(version, settings.verify_every)
        # The probe (a forward pass) only where an engine is checked by logprobs: made on demand by rank 0, except
        # under ZeRO-3 where it is collective (every rank sees the same version). Made at every due push before, it
        # compiled the decoder layers for its shape in the run's first push: 4.6 s of an H200 run's start-up.
        probe = (self._logprob_probe() if self.zero_stage == 3 else self._logprob_probe) if due else None
        if self.rank != 0:
            return {}
        import ray

        from reflow.engines.weights.transport import PushJob

        adapter = None
        if self.lora is not None:  # what an adapter-only push sends, and the effective weights it is verified against
            part, effective = lora.split(named, self.lora)
            adapter = (part, lora.config(self.lora, self.model_path), effective)
        return transport.push(PushJob(
            [EngineClient(u, api_key=api_key) for u in urls], named, version, settings, device=self.engine.device,
            master_address=ray.util.get_node_ip_address(), probe=probe,
            stable=direct and self.zero_stage < 3,  # the parameters themselves: engines may map them once (map_once)
            write_hf=self._write_hf, adapter=adapter))

    def _transport(self, settings: PushSettings):
        """The transport of `settings`, built at its first push and kept (a fallback it took holds)."""
        from reflow.engines.weights.transport import build, choose

        factory = settings.transport or choose("adapter" if self.lora is not None else settings.mode)
        if factory not in self._transports:
            self._transports[factory] = build(factory)
        return self._transports[factory]

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """(HF name, full CPU tensor) of the weights the engines compute with (LoRA: merged). Collective."""
        named = self._gathered(keep=True)
        return lora.split(named, self.lora)[1] if self.lora is not None else named

    def _write_hf(self, named: list[tuple[str, torch.Tensor]], out: Path) -> None:
        if self.lora is not None:  # the adapter alone (PEFT folder); `reflow export-merged` merges it
            lora.write_adapter(lora.split(named, self.lora)[0], self.lora, self.model_path, out)
            return
        self.engine.module.save_pretrained(out, state_dict=dict(named))
        load_tokenizer(self.model_path, storage=self.storage).save_pretrained(out)

    @torch.no_grad()
    def _logprob_probe(self):
        """The policy's logprobs of the fixed probe batch at the weights being pushed, for the logprob
        check of engines that cannot read weights back (reflow.engines.weights.verify). Collective: a
        forward under ZeRO-3."""

        self.probes_made += 1
        module = self.engine.module  # always in eval mode (DeepSpeedRank._build_engine)
        prompts = probe_prompts(int(module.config.vocab_size))
        ids = torch.tensor(prompts, device=self.engine.device)  # [P, T]
        mb = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        ref = token_logprobs(self._logits(self.engine, mb), ids[:, 1:]).cpu()  # [P, T-1]
        return LogprobProbe(prompts, list(ref), next(module.parameters()).dtype)
