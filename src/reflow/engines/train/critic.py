"""PPO's critic: a value model trained by DeepSpeed in its own Ray actor group (name prefix "critic").

Model: the backbone of the critic checkpoint (`AutoModel`: the causal LM without its LM head, by
default the policy's own checkpoint) plus a scalar head `nn.Linear(hidden, 1)` on the last hidden
state, giving one value per position. The LM head is left out on purpose: it would be a parameter
without gradient inside the ZeRO-partitioned optimizer.

Alignment. Train tensors are shifted (`reflow.rl.types.to_train_tensors`): position t of a [B, T-1]
tensor scores token t+1 of `input_ids`. The critic's value at position t is head(h_t), h_t the last
hidden state after reading tokens 0..t: V(s_t) of the state in which response token t+1 is sampled,
the state that token's PPO advantage is measured against. So response token j (input position
p+j, p = prompt length) gets the value read at position p+j-1 (the first response token: the last
prompt token), and `loss_mask` selects exactly these positions. The state after the last response
token is terminal: its value is 0 and is never computed (`reflow.rl.algorithms.gae`). OpenRLHF and verl
slice values[:, :-1] the same way.

Per iteration (collective, every rank together, strided shards as the policy trainer):
`compute_values` (no grad) -> `attach_values` + `reflow.rl.algorithms.ppo.gae_batch` (outside the
actors, on the whole batch) -> `train_iteration`: the clipped value loss `reflow.rl.algorithms.gae.value_loss_tokens` against
the GAE returns, one optimizer step per mini-batch, token-mean over the *global* mini-batch (each
micro-batch back-propagates sum(loss)/tokens(global mini-batch) * world_size, as engines/train/trainer.py).
Process group, step veto, weights, offload and checkpoints come from `reflow.engines.train.ds_rank`.
"""
from __future__ import annotations

import time
from pathlib import Path

import ray
import torch
import torch.distributed as dist
from torch import nn

from reflow.engines.hf_io import from_pretrained, load_tokenizer, resolve_checkpoint, torch_dtype
from reflow.engines.train.ds_rank import DeepSpeedRank, _rows, ds_config
from reflow.engines.train.group import TrainerGroup
from reflow.engines.train.settings import RankSettings, weights_precision
from reflow.rl.algorithms.gae import value_loss_tokens
from reflow.rl.types import RolloutBatch, to_train_tensors

VALUE_HEAD_FILE = "value_head.safetensors"  # next to the backbone's HF files in a saved critic


class ValueModel(nn.Module):
    """backbone (HF base model) + scalar head: (input_ids, attention_mask) [B, L] -> values [B, L]."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.head(h).squeeze(-1).float()  # [B, L]


def load_value_model(path: str, dtype: str = "fp32", seed: int = 0, storage=None) -> ValueModel:
    """Backbone from the HF checkpoint at `path`; the head from its `value_head.safetensors` when the
    folder is a saved critic, else freshly initialised (seeded: every rank builds the same one)."""
    from safetensors.torch import load_file
    from transformers import AutoModel

    local = resolve_checkpoint(path, storage)
    backbone = from_pretrained(AutoModel, local, dtype=torch_dtype(dtype))
    hidden = backbone.config.hidden_size
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = ValueModel(backbone, hidden)
        # Small head, zero bias: values start near 0 (OpenRLHF initialises its head with std 1/(H+1)).
        nn.init.normal_(model.head.weight, std=1.0 / (hidden + 1))
        nn.init.zeros_(model.head.bias)
    if (local / VALUE_HEAD_FILE).is_file():
        model.head.load_state_dict(load_file(local / VALUE_HEAD_FILE))
    return model.to(torch_dtype(dtype))


class CriticRank(DeepSpeedRank):
    """One data-parallel rank of the critic. Collective methods must be called on every rank together."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, model_path: str,
                 settings: RankSettings):
        """`settings.lr_schedule` is not used: the critic's learning rate is constant."""
        t0 = time.perf_counter()
        s = settings
        self.zero_stage, self.model_path, self.storage = s.zero_stage, model_path, s.storage
        self.micro_batch_size, self.precision = s.micro_batch_size, s.precision
        self._start(rank, world_size, master_addr, master_port, s.backend, s.threads, s.seed, s.tf32)
        cfg = ds_config(s.zero_stage, s.precision, s.grad_clip, s.micro_batch_size, world_size,
                        s.zero3_param_persistence_threshold, s.grad_accum_dtype, s.immediate_grad_update)
        self._build_engine(load_value_model(model_path, weights_precision(s.precision), s.seed, s.storage), cfg, s.lr, s.weight_decay, lambda _: 1.0)
        self.init_time_s = time.perf_counter() - t0

    def _shard(self, batch: RolloutBatch, pad_id: int, minibatches: int = 1) -> dict[str, torch.Tensor]:
        n, W = len(batch), self.world_size
        if n == 0 or n % (W * minibatches):  # checked on the whole batch: every rank fails alike
            raise ValueError(f"a batch of {n} samples must split evenly over world_size={W} x "
                             f"minibatches={minibatches} (forward/backward passes are collective)")
        tensors = to_train_tensors(batch.select(list(range(self.rank, n, W))), pad_id)
        return {k: v.to(self.engine.device) for k, v in tensors.items()}

    def _values(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.engine(mb["input_ids"], mb["attention_mask"])[:, :-1]  # [b, L-1]: V(s_t), see docstring

    @torch.no_grad()
    def compute_values(self, batch: RolloutBatch, pad_id: int) -> list[list[float]]:
        """V(s_t) of every response token of this rank's samples (r, r+W, ...). Collective."""
        shard = self._shard(batch, pad_id)
        out: list[list[float]] = []
        for s, e in self._micro_slices(shard["input_ids"].shape[0]):
            mb = _rows(shard, s, e)
            # A value for every response token, tool tokens of a multi-turn rollout included (GAE skips them).
            v, mask = self._values(mb).cpu(), mb.get("response_positions", mb["loss_mask"]).cpu() != 0  # [b, L-1]
            out += [v[i][mask[i]].tolist() for i in range(v.shape[0])]
        return out

    def train_iteration(self, batch: RolloutBatch, *, minibatches: int, pad_id: int,
                        clip_eps: float | None) -> dict[str, float]:
        """One optimizer step per mini-batch on the clipped value loss against `batch.returns`;
        `batch.values` (from `compute_values` before this update) are the old values. Collective."""
        t0 = time.perf_counter()
        if batch.values is None or batch.returns is None:
            raise ValueError("the critic trains on batch.values and batch.returns: run compute_values and gae_batch first")
        self.iteration += 1
        shard = self._shard(batch, pad_id, minibatches)
        m = shard["input_ids"].shape[0] // minibatches
        minis = [{k: v[i * m:(i + 1) * m] for k, v in shard.items()} for i in range(minibatches)]
        units = torch.stack([mb["loss_mask"].sum() for mb in minis]).double()  # [minibatches] tokens
        dist.all_reduce(units)
        acc = {"loss": 0.0, "clipped": 0.0, "tokens": 0.0}
        norms = []
        for k, mb in enumerate(minis):
            micros = [_rows(mb, s, e) for s, e in self._micro_slices(m)]
            loss_of = lambda micro, u=float(units[k]): self._micro_loss(micro, u, clip_eps, acc)  # noqa: E731
            norms.append(self._accumulate_and_step(micros, loss_of, k, minibatches))
        sums = torch.tensor([acc["loss"], acc["clipped"], acc["tokens"]], dtype=torch.float64)
        slowest = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(sums)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return {"value_loss": float(sums[0]) / minibatches, "value_clip_frac": float(sums[1] / max(sums[2], 1.0)),
                "critic_grad_norm": sum(norms) / len(norms), "critic_lr": self.scheduler.get_last_lr()[0],
                "critic_step_time_s": float(slowest)}

    def _micro_loss(self, mb: dict, units_global: float, clip_eps: float | None, acc: dict) -> torch.Tensor:
        """Sum of the micro-batch's per-token value losses / tokens of the global mini-batch."""
        values, mask = self._values(mb), mb["loss_mask"]  # [b, L-1]
        loss_tok = value_loss_tokens(values, mb["old_values"], mb["returns"], mask, clip_eps)  # [b, L-1]
        loss = loss_tok.sum() / max(units_global, 1.0)
        acc["loss"] += float(loss.detach())
        if clip_eps is not None:  # tokens whose clipped error is the larger one (they get no gradient from V - R)
            plain = value_loss_tokens(values.detach(), mb["old_values"], mb["returns"], mask, None)  # [b, L-1]
            acc["clipped"] += float(((loss_tok.detach() > plain) & (mask != 0)).sum())
        acc["tokens"] += float(mask.sum())
        return loss * self.world_size  # DeepSpeed divides gradients by world_size

    def _write_hf(self, named: list[tuple[str, torch.Tensor]], out: Path) -> None:
        """The backbone as an HF folder (AutoModel-loadable) + the head as value_head.safetensors:
        `critic.path` can point at it to start a later run from this critic."""
        from safetensors.torch import save_file

        weights = dict(named)
        backbone = {k[len("backbone."):]: v for k, v in weights.items() if k.startswith("backbone.")}
        self.engine.module.backbone.save_pretrained(out, state_dict=backbone)
        save_file({k[len("head."):]: v.contiguous() for k, v in weights.items() if k.startswith("head.")},
                  out / VALUE_HEAD_FILE)
        load_tokenizer(self.model_path, storage=self.storage).save_pretrained(out)


class CriticGroup(TrainerGroup):
    """The critic's ranks: `TrainerGroup` (create/attach/kill, checkpoints, offload) over CriticRank."""

    rank_cls = CriticRank

    def compute_values(self, batch, pad_id: int) -> list:
        """One ref per rank: that rank's per-sample values (samples r, r+W, ...); see `attach_values`."""

        ref = batch if isinstance(batch, ray.ObjectRef) else ray.put(batch)
        return self._all("compute_values", ref, pad_id)


# ---------------------------------------------------------------- outside the actors (Ray tasks)


def attach_values(batch: RolloutBatch, *rank_values: list[list[float]]) -> RolloutBatch:
    """Interleave the ranks' strided shards back into batch order: sample i came from rank i % W."""
    W = len(rank_values)
    values = [rank_values[i % W][i // W] for i in range(len(batch))]
    bad = [i for i, (v, r) in enumerate(zip(values, batch.response_ids)) if len(v) != len(r)]
    if bad:
        raise ValueError(f"samples {bad[:5]}: the critic returned a value count different from the response length")
    return batch.with_(values=values)
