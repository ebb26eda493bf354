"""What every DeepSpeed data-parallel rank does, whatever it trains: the policy
(`reflow.engines.train.trainer.TrainerRank`) and the PPO critic (`reflow.engines.train.critic.CriticRank`).

`DeepSpeedRank` joins the torch.distributed group (gloo on CPU, nccl on GPU), wraps a model in a
DeepSpeed engine with a client torch AdamW (no cpu_adam JIT build) and a LambdaLR schedule that it
steps itself only after an *applied* update, accumulates micro-batch gradients by hand
(`set_gradient_accumulation_boundary`, DeepSpeed's gradient_accumulation_steps=1) and vetoes the
update on every rank when any rank saw a non-finite loss. It also gathers full weights (ZeRO-3
included), offloads/reloads states for colocated mode and delegates checkpoints to
`engines/train/checkpoint.py`. Subclasses set `model_path`, `micro_batch_size`, `precision`,
`zero_stage` and call `_start` then `_build_engine`; they write their HF folder in `_write_hf`.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import math
import os
import random
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function  # phase names in profiles; ~free otherwise

from reflow.engines.hf_io import set_tf32
from reflow.rl.imports import mlflow_hidden


class NonFiniteLossError(FloatingPointError):
    """A loss or gradient was NaN/inf; the optimizer update was skipped."""


def lr_multiplier(step: int, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """LambdaLR factor after `step` applied updates: linear warm-up to 1, then constant or decay to 0."""
    if schedule not in ("constant", "cosine", "linear"):
        raise ValueError(f"unknown lr_schedule {schedule!r}; expected constant, cosine or linear")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress


class _VetoableAdamW(torch.optim.AdamW):
    """torch AdamW whose update can be vetoed for one `engine.step()`.

    Vetoing here rather than not calling `engine.step()` lets DeepSpeed run its whole step on every
    rank (reductions, clipping, clearing its partitioned gradient buffers), so no collective is left
    unmatched and no stale gradient leaks into the next step. It also refuses non-finite gradients
    on its own: a finite loss can still give them. Under ZeRO it sees this rank's fp32 partition.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.veto = False
        self.refused_nonfinite = False

    def step(self, closure=None):
        if self.veto:
            return None
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if grads and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):
            self.refused_nonfinite = True
            return None
        return super().step(closure)


def ds_config(zero_stage: int, precision: str, grad_clip: float, micro_batch_size: int, world_size: int,
              zero3_param_persistence_threshold: int, grad_accum_dtype: str = "fp32",
              immediate_grad_update: bool = False) -> dict:
    """The DeepSpeed config dict (see the module docstring for why accumulation steps is 1).

    bf16: `grad_accum_dtype` fp32 sums micro-batch gradients in fp32 (at ZeRO-1 DeepSpeed then uses
    its BF16_Optimizer, where `immediate_grad_update` folds each gradient in as backward makes it);
    bf16 sums them in bf16 (ZeRO's own optimizer), cheaper but lossy over many micro-batches.
    bf16-mixed: fp32 everywhere but the forward's autocast regions (DeepSpeed's `torch_autocast`)."""
    zero: dict = {"stage": zero_stage}
    if zero_stage == 3:
        # Parameters smaller than this stay whole on every rank. DeepSpeed's 1e5 default is right for
        # speed but leaves a tiny model unpartitioned; tests pass 0 so gather bugs cannot hide.
        zero["stage3_param_persistence_threshold"] = zero3_param_persistence_threshold
        # The optimizer steps the partition in sub-groups of about this many parameters, each with a float32 copy of
        # its gradients: DeepSpeed's 1e9 (3.8 GiB) did not fit beside a 7B policy's state on an H200 (RESULTS 32)
        zero["sub_group_size"] = 200_000_000
    cfg = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch_size * world_size,
        "gradient_clipping": grad_clip,
        "zero_optimization": zero,
        # ZeRO checks the client optimizer's exact type; our AdamW subclass only adds the veto.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if precision == "bf16":
        if zero_stage == 0:
            # DeepSpeed's stage-0 bf16 path lets AdamW update the bf16 weights directly (no fp32 master
            # copy), so small updates round away; stage 1 keeps fp32 master weights at little cost.
            raise ValueError("precision=bf16 needs zero_stage >= 1 (stage 0 has no fp32 master weights)")
        if grad_accum_dtype not in ("fp32", "bf16"):
            raise ValueError(f"grad_accum_dtype must be fp32 or bf16, got {grad_accum_dtype!r}")
        cfg["bf16"] = {"enabled": True, "immediate_grad_update": immediate_grad_update}
        cfg["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
    elif precision == "bf16-mixed":
        # fp32 weights, gradients and optimizer; the forward (and so its backward) under torch.autocast(bf16),
        # which DeepSpeed's engine enters around every forward. No module reduces its gradients in bf16.
        cfg["torch_autocast"] = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    elif precision != "fp32":
        raise ValueError(f"precision must be fp32, bf16 or bf16-mixed, got {precision!r} (fp16 does not run on CPU)")
    return cfg


_MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def import_deepspeed():
    """`import deepspeed`, without two imports that cost a CPU trainer process ~3.5 s of its start-up for nothing.

    `import deepspeed` tries `import mlflow` (its autotuner, unused here): ~1.1 s where MLflow is installed (reflow's
    `tracking` extra); it is hidden meanwhile (rl/imports.mlflow_hidden). And DeepSpeed's ZeRO optimizers import its
    Muon optimizer at their first step, whose module compiles three functions with torch.compile when it is imported, which imports inductor (~2 s; a
    CPU rank never compiles otherwise): it is imported here with that decorator made lazy, compiling at a first call
    that never comes (reflow steps its own AdamW). Measured on 2 cores: a tiny ZeRO-1 rank from start to its first
    step 8.9 s of CPU at 95fda04, ~5 s with this."""
    if "deepspeed" not in sys.modules:
        with mlflow_hidden():
            import deepspeed
    import deepspeed
    if _MUON in sys.modules:
        return deepspeed
    # Also where deepspeed came in earlier (transformers' save_pretrained imports it): Muon is imported at the first
    # ZeRO engine's sanity check otherwise, with inductor (1.3 s of a tiny rank's 1.6 s build, 2 cores).
    from deepspeed.runtime import compiler

    eager = compiler.compile
    compiler.compile = _lazy_compile
    try:
        importlib.import_module(_MUON)
    except ImportError:  # a DeepSpeed without Muon
        pass
    finally:
        compiler.compile = eager
    return deepspeed


def _lazy_compile():
    """A stand-in for deepspeed.runtime.compiler.compile: a decorator that calls torch.compile at the first call."""
    def decorate(fn):
        compiled = None

        @functools.wraps(fn)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = torch.compile(fn)
            return compiled(*args, **kwargs)
        return call
    return decorate


def _deepspeed_offloads(optimizer, zero_stage: int) -> bool:
    """Whether DeepSpeed's own `offload_states` moves this ZeRO optimizer's state: ZeRO-1/2's, and ZeRO-3's only
    around DeepSpeed's FusedAdam (its stage 3 asserts that type, "Offloading is supported only for DeepSpeed
    FusedAdam"; reflow's ranks step a torch AdamW). The others go through reflow.engines.train.offload, which
    moves the float32 storages the optimizer holds (ZeRO-3: Adam's moments only, see _move_states); ZeRO-3's bf16
    parameter partitions stay for the push."""
    if not hasattr(optimizer, "offload_states"):
        return False
    return zero_stage < 3 or type(getattr(optimizer, "optimizer", None)).__name__ == "FusedAdam"


def fold_grads_in_place(optimizer) -> bool:
    """DeepSpeed's BF16_Optimizer (ZeRO-1, bf16, float32 gradient accumulation) folds each micro-batch's bf16
    gradient into its float32 accumulator as `hp.add_(lp.grad.to(float32))`: a float32 copy of every gradient is
    written and read back at each micro-batch, besides the sum itself. `hp.add_(lp.grad)` promotes to float32
    inside the one kernel: the same bits, less memory traffic per micro-batch (bench/RESULTS.md 32: the packed step
    on an H200 at 0.945x a plain loop that sums in bf16, against 0.931x in section 31 on another machine and day; no
    A/B of this alone in one call). Patched on this optimizer instance only;
    DeepSpeed's own method where it does more (its expert-parallel folding correction). Returns whether it patched."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    if not isinstance(optimizer, BF16_Optimizer):
        return False
    deepspeeds = optimizer._update_hp_grad

    @torch.no_grad()
    def fold(lp, group_idx: int, param_idx: int, clear_lp_grads: bool) -> None:
        if lp.grad is None:
            return
        if getattr(optimizer, "autoep_folding_tp_group", None) is not None:
            return deepspeeds(lp, group_idx, param_idx, clear_lp_grads)
        hp = optimizer.fp32_groups_gradients[group_idx][param_idx]
        hp.add_(lp.grad.view(hp.shape))
        lp._hp_grad = hp
        optimizer.fp32_groups_has_gradients[group_idx][param_idx] = True
        if clear_lp_grads:
            lp.grad.zero_()

    optimizer._update_hp_grad = fold
    return True


def _init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, backend: str) -> None:
    """Join the DeepSpeed group, its store served by rank 0 on `master_addr` only (issue 51).

    torch's own rendezvous (DeepSpeed's env://, or tcp://) would have rank 0's TCPStore listen on every
    interface, unauthenticated. So the store comes from `weights.group.tcp_store`, the group is built on
    it here, and DeepSpeed adopts the initialized group. Backend and timeouts are those the rendezvous
    gave: gloo with DeepSpeed's default (DEEPSPEED_TIMEOUT, 10 min), "cpu:gloo,cuda:nccl" with torch's."""
    import_deepspeed()  # first: without its MLflow and Muon imports (the imports below would make them)
    import deepspeed
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.constants import default_pg_timeout as deepspeed_timeout

    from reflow.engines.weights.group import loopback_address, tcp_store

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=master_addr,
                      MASTER_PORT=str(master_port),
                      # With nccl, Ray gives each actor one GPU, visible as device 0.
                      LOCAL_RANK="0" if backend == "nccl" else str(rank))
    loopback_iface = _interface_of(loopback_address(master_addr))
    if loopback_iface is not None:
        # gloo (the whole group on CPU; CPU tensors beside nccl) listens where this machine's hostname resolves,
        # its LAN address on many hosts, unless named an interface. A loopback rendezvous means every rank runs
        # here: gloo then stays on loopback, for this group and every later one of this process (ZeRO's
        # subgroups, the weight-update group), whatever GLOO_SOCKET_IFNAME said.
        os.environ["GLOO_SOCKET_IFNAME"] = loopback_iface
    if get_accelerator().device_name() == "cpu":
        # DeepSpeed's shared-memory all-reduce kernel only serves inference_all_reduce (tensor-parallel
        # inference), never training; marking it incompatible skips its ~40 s JIT build. The probed
        # dict is documented as a persistent module-level cache.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not torch.distributed.is_initialized():
        # nccl: the step's veto flags and the metric sums are CPU tensors, which nccl cannot reduce ("No
        # backend type associated with device type cpu"): gloo serves CPU tensors, nccl CUDA ones.
        # (Found by bench/gpu.py on the H200.)
        group_backend, timeout = (("cpu:gloo,cuda:nccl", dist.constants.default_pg_timeout) if backend == "nccl"
                                  else (backend, deepspeed_timeout))
        # Under the prefix torch's rendezvous gives the default group's keys.
        store = dist.PrefixStore("default_pg", tcp_store(master_addr, master_port, world_size, rank == 0, timeout))
        dist.init_process_group(group_backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)


def _interface_of(address: str | None) -> str | None:
    """The name of the network interface holding `address` (e.g. "lo" for 127.0.0.1), None if none does."""
    if address is None:
        return None
    import psutil

    return next((name for name, addrs in psutil.net_if_addrs().items()
                 if any(a.address.split("%")[0] == address for a in addrs)), None)


def _hf_name(name: str) -> str:
    while name.startswith("module."):  # DeepSpeed / DDP wrappers
        name = name[len("module."):]
    return name

def _rows(t: dict[str, torch.Tensor], start: int, end: int, round_up=None) -> dict[str, torch.Tensor]:
    """Rows [start, end) cut to the longest sequence among them (padding shared by all is dropped),
    or to `round_up(longest)` (a compiled model's length bucket; `t` must be padded that far)."""
    out = {k: v[start:end] for k, v in t.items()}
    # "seq_len" (optional): the rows' lengths kept on the host, so cutting costs no device sync.
    lengths = out["seq_len"] if "seq_len" in out else out["attention_mask"].sum(dim=1)  # [b]
    L = max(int(lengths.max()), 2)
    if round_up is not None:
        L = min(round_up(L), out["attention_mask"].shape[1])
    return {k: v if v.dim() == 1 else v[:, :L] if k in ("input_ids", "attention_mask") else v[:, : L - 1]
            for k, v in out.items()}


class DeepSpeedRank:
    """One DeepSpeed data-parallel rank. Collective methods must be called on every rank together."""

    def _start(self, rank: int, world_size: int, master_addr: str, master_port: int, backend: str,
               threads: int, seed: int, tf32: bool = False) -> None:
        """Seed this process and join the process group (before any model is built)."""
        self.rank, self.world_size, self.iteration = rank, world_size, 0
        torch.set_num_threads(threads)
        set_tf32(tf32)
        random.seed(seed)
        torch.manual_seed(seed)
        _init_distributed(rank, world_size, master_addr, master_port, backend)

    def _build_engine(self, model, cfg: dict, lr: float, weight_decay: float, lr_lambda) -> None:
        import deepspeed

        # fused on CUDA: DeepSpeed hands the optimizer one flat fp32 tensor, on which the foreach
        # implementation still makes ~8 passes over memory (12.7 ms of a 0.28 s step on the H200).
        self.optimizer = _VetoableAdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                        weight_decay=weight_decay, fused=torch.cuda.is_available() or None)
        # Stepped by us after applied updates only, so vetoed steps do not advance the schedule.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=self.optimizer, config=cfg)
        fold_grads_in_place(self.engine.optimizer)
        self._live_params: list | None = None  # (HF name, parameter), listed once (_live_views)
        self._live_tensors: list = []  # the same parameters, for the address check
        self._live_cache = None  # LiveViews: their detached views, keyed by their addresses
        # Dropout off: the old-logprob pass and the training pass must score the same function
        # (ratio == 1 at the first mini-batch), as the rollout engine does.
        self.engine.module.eval()

    def ping(self) -> dict:
        import ray

        return {"rank": self.rank, "world_size": self.world_size, "pid": os.getpid(),
                "node_ip": ray.util.get_node_ip_address(), "init_time_s": self.init_time_s,
                "matmul_precision": torch.get_float32_matmul_precision()}  # "high": TF32 (trainer.tf32)

    def _micro_slices(self, rows: int) -> list[tuple[int, int]]:
        return [(s, min(s + self.micro_batch_size, rows)) for s in range(0, rows, self.micro_batch_size)]

    def _accumulate_and_step(self, micros: list, loss_of, k: int, n_minis: int) -> float:
        """Backward `loss_of(micro)` for each micro-batch of mini-batch k, then one step agreed by all
        ranks. Returns the grad norm; raises NonFiniteLossError (update skipped) on NaN/inf."""
        nonfinite = torch.zeros((), dtype=torch.bool)
        for j, micro in enumerate(micros):
            self.engine.set_gradient_accumulation_boundary(j == len(micros) - 1)
            with record_function("reflow.forward_loss"):
                loss = loss_of(micro)
            # Kept on the device until the step: a host read per micro-batch would stall the GPU.
            nonfinite = nonfinite | ~torch.isfinite(loss.detach())
            with record_function("reflow.backward"):
                self.engine.backward(loss)  # even when non-finite: the backward passes are collective
        with record_function("reflow.step"):
            return self._step(bool(nonfinite), k, n_minis)

    def _step(self, nonfinite: bool, k: int, n_minis: int) -> float:
        """Optimizer step agreed by all ranks; raises NonFiniteLossError after a skipped update."""
        flag = torch.tensor([float(nonfinite)], dtype=torch.float64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.optimizer.veto = bool(flag.item())
        pre_norm = self._full_grad_norm() if self.zero_stage == 0 and self.precision != "bf16" else None
        try:
            self.engine.step()
        finally:
            self.optimizer.veto = False
        refused = torch.tensor([float(self.optimizer.refused_nonfinite or not self.engine.was_step_applied())],
                               dtype=torch.float64)
        self.optimizer.refused_nonfinite = False
        dist.all_reduce(refused, op=dist.ReduceOp.MAX)
        where = f"train_iteration #{self.iteration}, mini-batch {k + 1}/{n_minis}"
        if flag.item():
            raise NonFiniteLossError(
                f"{where}: the loss was NaN/inf on at least one rank; the optimizer step was skipped on "
                f"every rank and the weights are unchanged. Check advantages/rewards and old logprobs for "
                f"NaN/inf, or lower the learning rate.")
        if refused.item():
            raise NonFiniteLossError(
                f"{where}: the loss was finite but gradients were NaN/inf; no non-finite update was applied "
                f"(under ZeRO, partitions with finite gradients may have been updated). Lower the learning "
                f"rate or check the batch.")
        self.scheduler.step()
        norm = self.engine.get_global_grad_norm()
        norm = pre_norm if norm is None else float(norm)
        return float("nan") if norm is None else norm

    def _full_grad_norm(self) -> float:
        """L2 norm of the (already all-reduced) full gradients; ZeRO stage 0 fp32 does not report it."""
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))

    # ---------------------------------------------------------------- weights

    def _gathered(self, keep: bool, on_device: bool = False) -> list[tuple[str, torch.Tensor]]:
        """Full parameters as (HF name, CPU copy), or on this rank's device (`on_device`: a CUDA IPC push packs
        them there; below ZeRO-3 the parameters themselves, not copies). Collective under ZeRO-3."""
        import deepspeed

        if on_device and self.zero_stage < 3:  # whole already: the parameters themselves (the push copies them
            return self._live_views() if keep else []  # before the next step)
        named = list(self.engine.module.named_parameters())
        where = self.engine.device if on_device else torch.device("cpu")
        # A no-op for parameters ZeRO-3 has not partitioned, so one code path serves every stage.
        with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            return [(_hf_name(n), p.detach().to(where, copy=True)) for n, p in named] if keep else []

    def _live_views(self) -> list[tuple[str, torch.Tensor]]:
        """(HF name, detached view) of every parameter where it lives, the same list while no parameter moved.
        Each push asks for it: walking the module and detaching 290 parameters (a Qwen2-0.5B) took 1.4 ms on
        the H200 machine's host, three times the device copy the push then makes (bench/RESULTS.md 7). The
        module's parameters are registered once (DeepSpeed wraps a fixed module), so they are listed once;
        their addresses are checked at every call (an offload or a reload moves them)."""
        from reflow.engines.weights.mapped import LiveViews, addresses

        params = self._live_params
        if params is None:
            params = self._live_params = [(_hf_name(n), p) for n, p in self.engine.module.named_parameters()]
            self._live_tensors = [p for _, p in params]
        ptrs = addresses(self._live_tensors)
        cached = self._live_cache
        if cached is None or cached.key != ptrs:  # the same object otherwise: the push sender knows it (LiveViews)
            cached = self._live_cache = LiveViews([(n, p.detach()) for n, p in params], ptrs)
        return cached

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """(HF name, full CPU tensor) for every parameter, as `from_pretrained` names them. Collective."""
        return self._gathered(keep=True)

    def save_hf(self, local_dir: str) -> str | None:
        """Rank 0 writes an HF folder (`_write_hf`). Collective; returns the path on rank 0."""
        named = self._gathered(keep=self.rank == 0)
        if self.rank != 0:
            return None
        out = Path(local_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._write_hf(named, out)
        return str(out)

    def _write_hf(self, named: list[tuple[str, torch.Tensor]], out: Path) -> None:
        raise NotImplementedError

    def weights_checksum(self) -> str:
        """sha256 over (name, dtype, shape, bytes) of the gathered weights in name order. Collective.
        Below ZeRO-3 it reads the parameters in place (a CUDA one is copied to the host one at a time): no
        copy of the whole model, which was two (a gathered copy, then `tobytes`) at every save."""
        h = hashlib.sha256()
        for name, t in sorted(self._gathered(keep=True, on_device=self.zero_stage < 3), key=lambda nt: nt[0]):
            t = t.contiguous().cpu()  # the same tensor when it is a contiguous host one
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy())
        return h.hexdigest()

    @torch.no_grad()
    def fill_weights(self, value: float) -> None:
        """Set every parameter (and its fp32 master copy, if any) to `value`. Collective."""
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param

        params = list(self.engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            for p in params:  # every rank fills: same constant, and ZeRO-3 re-partitions rank 0's copy
                p.data.fill_(value)
        # ZeRO 1-3 and bf16 keep fp32 master weights that the next step would copy back otherwise.
        for p in params:
            shape = (p.ds_numel,) if hasattr(p, "ds_numel") else p.shape
            safe_set_full_fp32_param(p, torch.full(shape, value, dtype=torch.float32, device=p.device))

    # ---------------------------------------------------------------- checkpoints (engines/train/checkpoint.py)

    def save_checkpoint(self, store, prefix: str) -> dict[str, dict]:
        """Upload this rank's part of a checkpoint under `prefix`; {relative path: sha256/bytes}. Collective."""
        from reflow.engines.train import checkpoint as trainer_ckpt

        with self._states_in_place():
            return trainer_ckpt.save(self, store, prefix)

    @contextmanager
    def _states_in_place(self):
        """Colocated mode saves between a push and the next rollout, with the optimizer state offloaded: put
        it back for the save. (reflow.engines.train.offload empties the storages; torch.save then wrote 0 bytes
        for full-size tensors and the resume failed in torch.load, "Trying to resize storage that is not
        resizable", on an H200.) It leaves again after, so the engines keep their memory."""
        copies = getattr(self, "_host_states", None)
        away = bool(copies is not None and copies.moved) or (
            getattr(self, "_offloaded", False) and self.engine.device.type != "cpu")
        if away:
            self._move_states(offload=False)
        try:
            yield
        finally:
            if away:
                self._move_states(offload=True)

    def fetch_checkpoint(self, store, prefix: str, manifest: dict[str, dict]) -> str:
        """Download + sha256-check what this rank needs (not collective); ChecksumError on a mismatch."""
        from reflow.engines.train import checkpoint as trainer_ckpt

        return trainer_ckpt.fetch(self, store, prefix, manifest)

    def load_checkpoint(self) -> dict:
        """Load the fetched checkpoint: weights, optimizer, ZeRO partitions, LR schedule, RNG. Collective.
        A colocated resume loads while the optimizer state is offloaded (the trainers start offloaded: the
        engines generate first); loading into the emptied storages crashed the process (SIGSEGV, on CPU in
        tests/test_trainer_offload.py), so the state comes back for the load and leaves again after it."""
        from reflow.engines.train import checkpoint as trainer_ckpt
        from reflow.engines.train.offload import own_storages

        with self._states_in_place():
            loaded = trainer_ckpt.load(self)
            own_storages(self.engine.optimizer)
        return loaded

    def drop_fetched_checkpoint(self) -> None:
        from reflow.engines.train import checkpoint as trainer_ckpt

        trainer_ckpt.drop_fetched(self)

    # ---------------------------------------------------------------- colocated mode

    def offload_states(self) -> dict:
        """Colocated mode, after training: optimizer/gradient state to host memory so the engines can resume
        theirs (DeepSpeed's offload_states where its optimizer has one, else reflow.engines.train.offload:
        BF16_Optimizer, ZeRO-1 + bf16). On CPU there is nowhere to move it: only the state is tracked."""
        if getattr(self, "_offloaded", False):
            raise RuntimeError("trainer states are already offloaded: call reload_states first")
        moved = 0
        if self.engine.device.type != "cpu":  # pragma: no cover - needs a GPU (and ZeRO >= 1 in DeepSpeed)
            if self.zero_stage == 0:
                raise RuntimeError("cluster.colocate on GPU needs trainer.zero_stage 1, 2 or 3: DeepSpeed offloads "
                                   "only ZeRO optimizer states, so with stage 0 the trainer's memory stays on the GPU")
            moved = self._move_states(offload=True)
        self._offloaded, self._state_moves = True, getattr(self, "_state_moves", 0) + 1
        return {"offloaded": True, "moves": self._state_moves, "bytes": moved}

    def reload_states(self) -> dict:
        """Colocated mode, before training (after the engines released their memory)."""
        if not getattr(self, "_offloaded", False):
            raise RuntimeError("trainer states are not offloaded: nothing to reload")
        moved = 0
        if self.engine.device.type != "cpu":  # pragma: no cover - needs a GPU
            moved = self._move_states(offload=False)
        self._offloaded, self._state_moves = False, self._state_moves + 1
        return {"offloaded": False, "moves": self._state_moves, "bytes": moved}

    def _move_states(self, offload: bool) -> int:
        """Optimizer state out (offload) or back; bytes moved where reflow moves them (DeepSpeed: unknown, 0)."""
        from reflow.engines.train.offload import HostCopies, optimizer_storages

        opt = self.engine.optimizer
        if _deepspeed_offloads(opt, self.zero_stage):
            if offload:
                self.engine.offload_states()
            else:
                self.engine.reload_states()
            return 0
        if offload:
            # ZeRO-3 (a 7B policy on one H200): Adam's moments only. Its fp32 master partitions stay for the rollout
            # (the GPU holds them beside the engine), while moving them too filled the host's 128 GiB: Ray's memory
            # monitor killed the trainer at the first hand-over (bench/RESULTS.md 32)
            self._host_states = HostCopies()
            return self._host_states.offload(optimizer_storages(opt, self.engine.device,
                                                                moments_only=self.zero_stage == 3))
        return self._host_states.reload()
