"""The weight-update process group of `update_weights_from_distributed`, both ends.

The trainer (rank 0) and every engine TP rank (rank_offset + tp_rank) form a group of their own,
separate from the trainer's DeepSpeed group: SGLang builds it in `init_weights_update_group`
with torch's TCP rendezvous (rank 0 hosts the store) and its process-group helper. We build the
same group from public torch classes, with the same store-key layout the helper uses
(<group_name> / <group_name>/ / <device>/ prefixes), so a reflow trainer can meet a real SGLang
server, and the embedded engine (the CPU stand-in) can meet a reflow trainer. gloo on CPU, nccl
on GPU (the nccl constructor is the one path CPU tests cannot run).

A bucket travels as one uint8 buffer laid out as SGLang's `FlattenedTensorBucket.empty(names,
dtypes, shapes)` allocates it on the receiving side: tensors back to back, no padding. Ordering
tensors by element size, largest first, keeps every offset aligned for its dtype, which
`FlattenedTensorBucket.empty` requires.
"""
from __future__ import annotations

import datetime
import ipaddress
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reflow.engines.sglang import contract as sglang_contract

GROUP_TIMEOUT_S = 300.0


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")  # SGLang's request carries "bfloat16", not "torch.bfloat16"


def tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout: datetime.timedelta) -> dist.TCPStore:
    """torch's TCPStore at host:port; the master's server listens on `host` only (port 0: the OS picks one,
    `store.port` tells which).

    torch's own server listens on every interface (`::`) whatever host it is given, and the store asks
    no credentials: whoever reaches the port can read and write the group's keys (issue 51). So the
    master binds and listens itself, on the address the run chose (loopback by default; a multi-node
    run's node IP), and hands the socket to torch (`master_listen_fd`), which owns it from then on: it
    closes it with the store, or when the constructor fails (both measured with torch 2.13, libuv
    server and the older one alike). Everything else is as torch's tcp:// and env:// rendezvous make
    it: multi-tenant, torch's default (libuv) server, the master waits for `world_size` members."""
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout, multi_tenant=True)
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own listener
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
        bound_port = sock.getsockname()[1]
        fd = sock.detach()  # torch's now; the `with` closes nothing
    return dist.TCPStore(host, bound_port, world_size, True, timeout=timeout, multi_tenant=True,
                         master_listen_fd=fd)


def loopback_address(host: str) -> str | None:
    """The address `host` resolves to first (the one `tcp_store` binds) when it is a loopback one, else None."""
    try:
        ip = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, IndexError):
        return None
    return ip if ipaddress.ip_address(ip.split("%")[0]).is_loopback else None


def gloo_group(store, rank: int, world_size: int, master_address: str, timeout: datetime.timedelta):
    """A gloo group; it listens on `master_address` too when that is a loopback address (every member then
    runs on this host). torch's default device listens where this machine's hostname resolves, its LAN
    address on many hosts, even when the run chose loopback. Any other address keeps torch's choice
    (GLOO_SOCKET_IFNAME, else the hostname's address), as a multi-node cluster needs."""
    ip = loopback_address(master_address)
    if ip is None:
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    opts = dist.ProcessGroupGloo._Options()  # as torch's default: 2 threads per device
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=ip)]
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


def open_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str = "gloo", timeout_s: float = GROUP_TIMEOUT_S):
    """Join (rank 0: host) the weight-update group. Blocks until every member has joined."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight-update group backend must be 'gloo' or 'nccl', got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    tcp = tcp_store(master_address, int(master_port), world_size, rank == 0, timeout)
    device = "cpu" if backend == "gloo" else "cuda"
    store = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, tcp)))
    if backend == "gloo":
        pg = gloo_group(store, rank, world_size, master_address, timeout)
    else:  # pragma: no cover - needs GPUs
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    return WeightGroup(pg, tcp, rank, world_size)


@dataclass
class WeightGroup:
    """A joined weight-update group; holds the TCP store, which rank 0 must keep alive."""

    pg: object
    store: object
    rank: int
    world_size: int
    device: str = "cpu"  # where a receiving engine allocates its buckets (nccl: the engine's GPU)


def broadcast(group: WeightGroup, tensor: torch.Tensor, src: int = 0) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    group.pg.broadcast([tensor], opts).wait()


def bucket_order(named_tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Largest element size first (stable), so back-to-back offsets stay dtype-aligned."""
    return sorted(named_tensors, key=lambda nt: -nt[1].element_size())


def pack(named_tensors: list[tuple[str, torch.Tensor]], device: str = "cpu"):
    """(flat uint8 [N], names, dtype names, shapes) of one bucket, in the order given."""
    names = [n for n, _ in named_tensors]
    dtypes = [dtype_name(t.dtype) for _, t in named_tensors]
    shapes = [list(t.shape) for _, t in named_tensors]
    parts = [t.detach().to(device).contiguous().reshape(-1).view(torch.uint8) for _, t in named_tensors]
    return torch.cat(parts), names, dtypes, shapes


def receive(pg, names: list[str], dtypes: list[str], shapes: list[list[int]], load_format: str | None,
            device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """Engine side: receive one update broadcast from rank 0; returns named tensors."""
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ValueError(f"names, dtypes and shapes must be non-empty and of one length "
                         f"(got {len(names)}, {len(dtypes)}, {len(shapes)})")
    torch_dtypes = [_parse(d) for d in dtypes]
    if load_format == "flattened_bucket":
        bucket = _empty_bucket(names, torch_dtypes, shapes, device)
        broadcast(pg, bucket.get_flattened_tensor())
        return bucket.reconstruct_tensors()
    if load_format not in (None, "direct"):
        raise ValueError(f"unknown load_format {load_format!r}: use null, 'direct' or 'flattened_bucket'")
    out = []
    for name, dt, shape in zip(names, torch_dtypes, shapes):  # one broadcast per tensor, in order
        t = torch.empty(shape, dtype=dt, device=device)
        broadcast(pg, t)
        out.append((name, t))
    return out


def _parse(name: str) -> torch.dtype:
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in update_weights_from_distributed")
    return dt


def _empty_bucket(names, dtypes, shapes, device):
    """The receive buffer as the installed SGLang's own receiver makes it (`FlattenedTensorBucket.empty`; 0.5.17,
    which has no `.empty`, flattens empty tensors of those shapes: the same layout), else a local equivalent."""
    code = sglang_contract.bucket_code()
    if code is None:
        return _LocalBucket(names, dtypes, shapes, device)
    if hasattr(code.FlattenedTensorBucket, "empty"):
        return code.FlattenedTensorBucket.empty(names, dtypes, shapes, device)
    return code.FlattenedTensorBucket(named_tensors=[(n, torch.empty(s, dtype=dt, device=device))
                                                     for n, dt, s in zip(names, dtypes, shapes)])


class _LocalBucket:
    """Receive buffer with FlattenedTensorBucket.empty's layout (used when sglang is absent)."""

    def __init__(self, names, dtypes, shapes, device):
        self.entries, offset = [], 0
        for name, dt, shape in zip(names, dtypes, shapes):
            if offset % dt.itemsize:
                raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dt}")
            size = torch.Size(shape).numel() * dt.itemsize
            self.entries.append((name, dt, torch.Size(shape), offset, offset + size))
            offset += size
        self.flat = torch.empty(offset, dtype=torch.uint8, device=device)

    def get_flattened_tensor(self) -> torch.Tensor:
        return self.flat

    def reconstruct_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, self.flat[a:b].view(dt).reshape(shape)) for n, dt, shape, a, b in self.entries]
