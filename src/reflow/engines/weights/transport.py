"""How a push's tensors reach the engines: the `WeightTransport` interface, its registry and the built-ins.

A transport `send`s one push (pausing and resuming the engines itself, push.update_window); `push` around
it checks the settings, times the send, verifies what the engines hold (verify.check_pushed) and reports.
Built in (push.py holds their wire work):
- `SharedMemory` (mode tensor): buckets in this host's shared memory, or the engines' mapping of them
  (weight_sync.map_once, mapped.py); `CudaIpc` is the same with the buckets on the trainer's GPU.
- `Broadcast` (mode distributed): a weight-update group, one broadcast per bucket.
- `Disk` (mode disk): an HF folder the trainer writes (push.publish_weights), engines reload.
- `Adapter` (trainer.lora.rank > 0): the LoRA adapter only (adapter_push.py).
- `Fallback`: steps tried in order, each kept until an error says it is gone for the life of this
  process (`WeightTransport.lost`); weight_sync.mode=tensor is CudaIpc -> SharedMemory -> Disk.

The runtime chooses once (infra/config/settings.push_settings: weight_sync.transport, a registered name
or `package.module:Class`, else the mode's) and hands the factory to the trainer ranks in PushSettings;
each rank builds it at its first push and keeps it (so a fallback holds). One of one's own:

    class MyTransport(WeightTransport):
        mode = "mine"
        def send(self, job):  # every engine must hold job.named as job.version afterwards
            ...
            return {"buckets": 1}
    register_transport("mine", MyTransport)   # weight_sync.transport: mine (or my_project.push:MyTransport)
"""
from __future__ import annotations

import dataclasses
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from reflow.engines.rollout_client import EngineClient
from reflow.engines.weights import push as wire
from reflow.engines.weights.adapter_push import push_adapter
from reflow.engines.weights.buckets import SharedMemoryUnavailable
from reflow.engines.weights.mapped import MAPPED
from reflow.engines.weights.settings import PushSettings
from reflow.engines.weights.verify import VERIFY_MODES, Named, ProbeSource, check_pushed
from reflow.rl.registry import Registry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushJob:
    """One push: what to send where, and what the trainer lends a transport to do it."""

    clients: list[EngineClient]
    named: Named  # (HF name, tensor), gathered where the transport asked (gather_on_device)
    version: str
    settings: PushSettings
    device: torch.device = torch.device("cpu")  # where the trainer computes
    master_address: str = "127.0.0.1"  # this node's IP (Ray's)
    probe: ProbeSource = None  # the trainer's logprobs of the probe batch (verify.py)
    stable: bool = False  # `named` are the trainer's live tensors (an engine may map them where they are)
    model_path: str | None = None  # an HF folder / URL already written (disk), with its DiskPush.files
    model_files: dict[str, dict] | None = None
    write_hf: Callable[[Named, Path], None] | None = None  # writes an HF folder of tensors (disk)
    adapter: tuple[Named, dict, Named] | None = None  # LoRA: (adapter tensors, PEFT config, effective weights)


class WeightTransport(ABC):
    """How one push reaches the engines. `send` is the contract; `push` adds the checks, timing and proof."""

    mode: ClassVar[str] = "custom"  # reported as the push's `mode`
    ipc: ClassVar[bool] = False  # the buckets are CUDA IPC handles (reported by Fallback)

    def gather_on_device(self, device: torch.device) -> bool:
        """Whether the trainer hands over its tensors where they are (no gathered host copy)."""
        return False

    def applies(self, device: torch.device) -> bool:
        """Whether this transport can serve a trainer computing on `device` (Fallback skips it otherwise)."""
        return True

    def lost(self, error: BaseException) -> str | None:
        """Why `error` means this transport is gone for the life of this process (Fallback moves on), or None."""
        return None

    def prepare(self, job: PushJob) -> PushJob:
        """Checks and work before any engine is paused; may return a completed job."""
        return job

    @abstractmethod
    def send(self, job: PushJob) -> dict:
        """Every engine holds `job.named` as `job.version` afterwards. Returns {"buckets": n, <stats>...}."""

    def push(self, job: PushJob) -> dict:
        """prepare, send (timed), verify (job.settings.verify), report."""
        if job.settings.verify not in VERIFY_MODES:  # before anything is sent
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {job.settings.verify!r}")
        job = self.prepare(job)
        t0 = time.perf_counter()
        extra = self.send(job)
        buckets = extra.pop("buckets")
        seconds = time.perf_counter() - t0
        checked = check_pushed(job.clients, job.named, job.version, job.settings, job.probe)
        nbytes = extra.pop("bytes", None)  # the mapped push knows it already (a walk over every tensor otherwise)
        if nbytes is None:
            nbytes = sum(t.numel() * t.element_size() for _, t in job.named)
        return {"mode": self.mode, "bytes": nbytes, "seconds": seconds, "buckets": buckets,
                "engines": len(job.clients), **extra, **checked,
                "verify_seconds": time.perf_counter() - t0 - seconds}


class SharedMemory(WeightTransport):
    """update_weights_from_tensor of buckets in this host's shared memory (engines on this host only), or one
    call per engine through the mapping it keeps (settings.map_once, engines that offer it)."""

    mode = "tensor"

    def gather_on_device(self, device: torch.device) -> bool:
        return device.type == "cpu"  # packed straight from the parameters (whole below ZeRO-3)

    def lost(self, error: BaseException) -> str | None:
        if isinstance(error, SharedMemoryUnavailable):
            return f"shared memory unavailable, pushing through disk from now on: {error}"
        return None

    def prepare(self, job: PushJob) -> PushJob:
        wire.check_same_host(job.clients, job.master_address)
        return job

    def send(self, job: PushJob) -> dict:
        s = job.settings
        if s.map_once and MAPPED.supports(job.clients):
            return MAPPED.push(job.clients, job.named, job.version, s.pause_mode, job.stable)  # pauses itself
        with wire.update_window(job.clients, s.pause_mode):
            return {"buckets": wire._send_buckets(job.clients, job.named, s.bucket_bytes, job.version)}


class CudaIpc(SharedMemory):
    """SharedMemory with the buckets (or the mapped parameters) on the trainer's GPU, as CUDA IPC handles:
    colocated engines, which must see that GPU."""

    ipc = True
    _REFUSALS = ("not visible to this engine", "this engine has no GPU")  # an engine's 400 (EngineError)

    def gather_on_device(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def applies(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def lost(self, error: BaseException) -> str | None:
        if isinstance(error, RuntimeError) and any(m in str(error) for m in self._REFUSALS):
            return f"CUDA IPC refused ({error}); pushing through host shared memory from now on"
        return None


class Broadcast(WeightTransport):
    """A weight-update group (this process rank 0, kept open between pushes) and one broadcast per bucket."""

    mode = "distributed"

    def prepare(self, job: PushJob) -> PushJob:
        wire.group_device(job.settings.backend)  # refuses nccl without a GPU before any engine is paused
        return job

    def send(self, job: PushJob) -> dict:
        s = job.settings
        with wire.update_window(job.clients, s.pause_mode):
            buckets, reused = wire._send_distributed(job.clients, job.named, s.bucket_bytes, job.version,
                                                     job.master_address, s.backend, wire.group_device(s.backend))
        return {"buckets": buckets, "group_reused": reused}


class Disk(WeightTransport):
    """update_weights_from_disk of an HF folder: `job.model_path`, or one written now (push.publish_weights)."""

    mode = "disk"

    def prepare(self, job: PushJob) -> PushJob:
        if job.model_path:
            return job
        if job.write_hf is None:
            raise ValueError("mode='disk' needs model_path: the HF folder (or URL) the trainer saved")
        s, named, write = job.settings, job.named, job.write_hf
        disk = wire.publish_weights(lambda out: write(named, out), s.disk_dir, job.version, s.storage)
        return dataclasses.replace(job, model_path=disk.path, model_files=disk.files)

    def send(self, job: PushJob) -> dict:
        assert job.model_path is not None
        with wire.update_window(job.clients, job.settings.pause_mode, session=False):
            return {"buckets": 0, "disk_files_checked": wire._send_disk(job.clients, job.model_path, job.version,
                                                                        job.model_files)}


class Adapter(WeightTransport):
    """The LoRA adapter only (load_lora_adapter_from_tensors), verified against the effective weights."""

    mode = "lora"

    def gather_on_device(self, device: torch.device) -> bool:
        return True  # split into adapter and effective weights on the trainer's device, as mode=tensor hands them

    def send(self, job: PushJob) -> dict:
        raise NotImplementedError("Adapter.push does the whole push (adapter_push.push_adapter)")

    def push(self, job: PushJob) -> dict:
        if job.adapter is None:
            raise ValueError("an adapter push needs the trainer's LoRA adapter (trainer.lora.rank > 0)")
        adapter, config, effective = job.adapter
        return push_adapter(job.clients, adapter, config, effective, job.version, job.settings,
                            master_address=job.master_address, probe=job.probe)


class Fallback(WeightTransport):
    """Transports tried in order, written out as one object. It starts with the first that applies to the
    trainer's device; when a push fails with an error that one of the remaining steps declares fatal for
    this process (`lost`), that step and those before it are dropped, the push is made again with the next,
    and every later push goes there too, its report naming why (`fallback`). Reports say `ipc` (CUDA IPC)."""

    def __init__(self, *steps: WeightTransport):
        self.steps, self.why = list(steps), ""

    def _current(self, device: torch.device) -> WeightTransport:
        for step in self.steps:
            if step.applies(device):
                return step
        raise RuntimeError(f"no weight transport of {self!r} applies to a trainer on {device}")

    def __repr__(self) -> str:
        return "Fallback(" + ", ".join(type(s).__name__ for s in self.steps) + ")"

    def gather_on_device(self, device: torch.device) -> bool:
        return self._current(device).gather_on_device(device)

    def send(self, job: PushJob) -> dict:
        raise NotImplementedError("Fallback.push pushes through its steps")

    def push(self, job: PushJob) -> dict:
        step = self._current(job.device)
        while True:
            try:
                report = {**step.push(job), "ipc": step.ipc}
                return {**report, "fallback": self.why} if self.why else report
            except Exception as e:  # deliberate: only an error a step declares fatal moves on; others re-raise
                later = self.steps[self.steps.index(step):]
                why = next(((i, r) for i, s in enumerate(later) if (r := s.lost(e))), None)
                if why is None or why[0] + 1 >= len(later):
                    raise
                del self.steps[:self.steps.index(step) + why[0] + 1]
                self.why = why[1]
                log.warning("weight push %s: %s", job.version, self.why)
                step = self._current(job.device)
                if not step.gather_on_device(job.device):  # e.g. no CUDA IPC: the tensors go through host memory
                    job = dataclasses.replace(job, named=[(n, t.to("cpu")) for n, t in job.named], stable=False)


TransportFactory = Callable[[], WeightTransport]
TRANSPORTS: Registry[TransportFactory] = Registry(
    "weight transport", "subclass reflow.engines.weights.transport.WeightTransport and name it in "
                        "weight_sync.transport as 'package.module:Class', or register it with register_transport")


def register_transport(name: str, factory: TransportFactory) -> TransportFactory:
    """Make a transport choosable as `weight_sync.transport: <name>`; `factory()` builds it (once per trainer rank)."""
    return TRANSPORTS.register(name, factory)


# Module-level factories: PushSettings carries the chosen one to the trainer ranks by reference (a rank keeps
# the transport it built per factory, so the factory must be the same object there at every push).
def tensor_transport() -> WeightTransport:
    """weight_sync.mode=tensor: CUDA IPC where the trainer is on a GPU, else (or once an engine refused the
    handles) host shared memory, and once this process cannot allocate shared memory, disk."""
    return Fallback(CudaIpc(), SharedMemory(), Disk())


def distributed_transport() -> WeightTransport:
    return Fallback(Broadcast())


def disk_transport() -> WeightTransport:
    return Fallback(Disk())


register_transport("tensor", tensor_transport)
register_transport("distributed", distributed_transport)
register_transport("disk", disk_transport)
register_transport("adapter", Adapter)
_ONE_STEP: dict[str, type[WeightTransport]] = {"tensor": SharedMemory, "distributed": Broadcast, "disk": Disk}


def choose(name: str, field: str = "weight_sync.mode") -> TransportFactory:
    """The factory `name` (a registered name or `package.module:Class`) stands for; errors name `field`."""
    return TRANSPORTS.resolve(name, field)


def build(factory: Any, field: str = "weight_sync.transport") -> WeightTransport:
    built = factory()
    if not isinstance(built, WeightTransport):  # deliberate: a user's factory is checked once, here
        raise ValueError(f"{field} built a {type(built).__name__}, not a "
                         f"reflow.engines.weights.transport.WeightTransport: subclass it and implement send(job)")
    return built


def one_step(mode: str) -> WeightTransport:
    """weight_sync.mode's own transport, without fallbacks (push.push_weights: one push as asked)."""
    if mode not in _ONE_STEP:
        raise ValueError(f"weight push mode must be one of {tuple(_ONE_STEP)}, got {mode!r}")
    return _ONE_STEP[mode]()
