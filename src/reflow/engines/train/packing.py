"""Sequence packing for the trainer: token-budget micro-batches, each one row of several samples end to end.

A padded micro-batch of `b` samples costs `b * longest` tokens of compute and activations; with responses of
512-8k tokens whose lengths spread widely most of that is padding. Packed, a micro-batch is one row holding whole
samples back to back, at most `budget` tokens (`trainer.max_tokens_per_micro_batch`): position ids restart at 0
for every sample, and the attention mask is block-diagonal (a token sees earlier tokens of its own sample only).
HF models build that mask themselves when given `position_ids` and no `attention_mask` (transformers'
`find_packed_sequence_indices`: a position that does not follow its predecessor by one starts a new sequence), for
the eager, SDPA, flex and varlen-flash kernels alike.

Only positions that score a response token go through the LM head (`logits_to_keep` as an index tensor); their
log-probs are scattered back into the `[b, L-1]` layout of the padded path, so the loss, its normalisation and every
metric are computed by the same code on the same numbers (`loss_agg_mode` unchanged).

The plan (which sample goes to which rank and micro-batch) is a pure function of the global batch's lengths:
every rank computes the same one. Per mini-batch, samples are spread over the data-parallel ranks by tokens
(longest first, each to the rank with the fewest tokens so far), then packed per rank first-fit decreasing; every
rank gets the same number of micro-batches (ZeRO's forward and backward passes are collective): a rank with fewer
splits its fullest bins, and only a rank with nothing left to split runs an empty micro-batch (a two-token
forward whose loss is zero).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def balance(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Indices 0..n-1 over `parts` lists with near-equal token sums: longest first, each to the lightest list so far
    (ties: the lower list). Each list in ascending index order."""
    load, out = [0] * parts, [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        p = min(range(parts), key=lambda p: (load[p], p))
        out[p].append(i)
        load[p] += lengths[i]
    return [sorted(o) for o in out]


def first_fit(indices: Sequence[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    """`indices` packed into bins of at most `budget` tokens, first-fit decreasing; a sample longer than the
    budget gets a bin of its own (the config check refuses a budget below the longest possible sample)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        for b, r in enumerate(room):
            if lengths[i] <= r:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return [sorted(b) for b in bins]


def _split_to(bins: list[list[int]], count: int, lengths: Sequence[int]) -> list[list[int]]:
    """Split the fullest multi-sample bins in two (alternating samples by length) until there are `count`;
    then empty bins for the rest."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        multi = [b for b in bins if len(b) > 1]
        if not multi:
            bins.append([])
            continue
        full = max(multi, key=lambda b: sum(lengths[i] for i in b))
        bins.remove(full)
        by_len = sorted(full, key=lambda i: (-lengths[i], i))
        bins += [sorted(by_len[0::2]), sorted(by_len[1::2])]
    return bins


@dataclass(frozen=True)
class PackPlan:
    """`micros[k][r]`: rank r's micro-batches of mini-batch k, each a list of global sample indices (ascending);
    every rank has as many micro-batches in a mini-batch as every other (some may be empty)."""

    micros: list[list[list[list[int]]]]

    def rank_samples(self, rank: int) -> list[int]:
        """Rank `rank`'s samples in shard order: mini-batch by mini-batch, micro-batch by micro-batch."""
        return [i for mini in self.micros for micro in mini[rank] for i in micro]


def plan(lengths: Sequence[int], minibatches: int, world: int, budget: int) -> PackPlan:
    """The packing of a global batch: mini-batch k is samples [k*m, (k+1)*m) as in the padded path."""
    n = len(lengths)
    m = n // minibatches
    micros = []
    for k in range(minibatches):
        idx = list(range(k * m, (k + 1) * m))
        per_rank = [[idx[j] for j in part] for part in balance([lengths[i] for i in idx], world)]
        bins = [first_fit(rows, lengths, budget) for rows in per_rank]
        count = max(len(b) for b in bins)
        micros.append([_split_to(b, count, lengths) for b in bins])
    return PackPlan(micros)


@dataclass
class Packed:
    """One packed micro-batch: the model's inputs and where its scored log-probs go in the `[b, L-1]` layout."""

    input_ids: torch.Tensor  # [1, N]
    position_ids: torch.Tensor  # [1, N]
    keep: torch.Tensor  # [K] packed positions whose logits score a response token
    labels: torch.Tensor  # [1, K] the token each of them scores
    dst_rows: torch.Tensor  # [K] row of the [b, L-1] layout
    dst_cols: torch.Tensor  # [K] column of the [b, L-1] layout

    def scatter(self, values: torch.Tensor, rows: int, width: int) -> torch.Tensor:
        """[1, K] values -> [rows, width], zeros where no position scores."""
        out = values.new_zeros((rows, width))
        out[self.dst_rows, self.dst_cols] = values[0]
        return out


def pack(input_ids: torch.Tensor, seq_len: Sequence[int], scored_from: Sequence[int], pad_id: int,
         length: int | None = None) -> Packed:
    """Rows of a right-padded `[b, T]` micro-batch end to end in one row (`seq_len[i]` tokens of row i), padded to
    `length` (a compiled model's bucket) with a segment of its own. Row i's positions scored_from[i] ..
    seq_len[i]-2 are kept: position t scores token t+1, as in the padded layout."""
    device = input_ids.device
    ids, pos, keep, rows, cols = [], [], [], [], []
    offset = 0
    for i, (n, first) in enumerate(zip(seq_len, scored_from)):
        n, first = int(n), int(first)
        ids.append(input_ids[i, :n])
        pos.append(torch.arange(n, device=device))
        cols_i = torch.arange(first, n - 1, device=device)
        keep.append(cols_i + offset)
        rows.append(torch.full_like(cols_i, i))
        cols.append(cols_i)
        offset += n
    if length is not None and length > offset:
        ids.append(torch.full((length - offset,), pad_id, dtype=input_ids.dtype, device=device))
        pos.append(torch.arange(length - offset, device=device))  # a segment of its own: attends to no sample
    flat = torch.cat(ids)
    keep_t = torch.cat(keep)
    return Packed(input_ids=flat[None], position_ids=torch.cat(pos)[None], keep=keep_t,
                  labels=flat[keep_t + 1][None], dst_rows=torch.cat(rows), dst_cols=torch.cat(cols))
