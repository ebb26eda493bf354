"""Static-cache decoding for Llama-shaped HF models: a preallocated KV cache, decode steps replayed as
CUDA graphs on a GPU.

Why: a decode step of a 0.5B model at batch 64 does ~0.3 ms of GPU work but takes ~16 ms through HF's
modelling code (hundreds of kernel launches, each with Python and dispatcher overhead; measured in
bench/gpu.py). A CUDA graph replays the whole step's kernels from one launch. Graphs need fixed
shapes and addresses, hence the static cache and per-bucket graphs.

Layout: K and V are one tensor each, [L, slots, H_kv, T_cap, D]; a row of the running batch owns a
slot, its tokens at positions 0..len-1. Active rows always occupy slots 0..n-1 (a finished row's slot
is refilled by moving a later row down: one batched copy), so a step over n rows runs the graph
captured for the batch bucket b >= n on slots 0..b-1 (rows n..b-1 are idle and ignored) and attends
over the first t cache positions, t a power-of-two bucket >= the longest row. Graphs are captured
lazily, once per (b, t), on first need.

Fewer kernels per layer (a graph replays them back to back, so their count sets the step time at small
batches): q/k/v are one matrix product and gate/up another, over one fused tensor each that the model's
q/k/v (gate/up) weights are views of (where the engine's weight arena already lays them back to back,
the fused tensor is a view of them instead): pushed weights land in place in the fused tensors,
and HF's own forward (the eager path, prompt logprobs) runs on the same memory. RMSNorm is
torch's fused `rms_norm` with HF's float32 arithmetic; q and k are rotated together; the attention mask
is made once per step as an additive bias. The query heads sharing a KV head attend as a group of G
queries (GQA without repeating K/V). If the model's tensors are replaced (moved to another device),
the fused views are gone: `stale()` says so and the generator builds a new decoder.
Supported: models whose layers are Llama's shape (llama, qwen2, qwen3 with its q/k norms, mistral
without a sliding window); others keep the eager HF path (`StaticDecoder.supports`).
On CPU the same code runs without graphs (tests compare it with the eager path).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as HF's apply_rotary_pos_emb (rotate_half convention). x [B, H, T, D]; cos/sin [B, 1, T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _bucket(n: int, floor: int) -> int:
    """The power of two >= max(n, floor)."""
    return max(floor, 1 << max(n - 1, 0).bit_length())


def batch_bucket(n: int) -> int:
    """Graph batch sizes: powers of two to 16, then multiples of 16 to 64, then of 32 (few graphs, little
    padding: at most 1/3 idle rows above 16)."""
    if n <= 16:
        return _bucket(n, 1)
    step = 16 if n <= 64 else 32
    return -(-n // step) * step


def _adjacent(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One tensor over `tensors` where they already lie back to back in one storage (contiguous, one dtype,
    the same trailing shape): a view, nothing copied; else None."""
    first = tensors[0]
    at = first.storage_offset()
    for t in tensors:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or t.storage_offset() != at):
            return None
        at += t.numel()
    shape = (sum(t.shape[0] for t in tensors), *first.shape[1:])
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(first.untyped_storage(), first.storage_offset(), shape)


def _fuse_one(tensors: list[torch.Tensor], copies: list | None = None) -> torch.Tensor:
    """One tensor over `tensors` (dim 0) whose writes both sides see: a view where they lie back to back
    (the engine's weight arena lays them so where the trainer does: weight_layout.py), else a concatenation
    they are re-pointed into. With `copies` (a list, the parameters must stay where they are: an arena holds
    them) the concatenation is a copy instead, recorded in `copies` as (copy, members) for
    `StaticDecoder.refresh` to bring up to date after every weight write."""
    whole = _adjacent([t.data for t in tensors])
    if whole is not None:
        return whole
    whole = torch.cat([t.data for t in tensors])
    if copies is not None:
        copies.append((whole, list(tensors)))
        return whole
    for t, part in zip(tensors, whole.split([t.shape[0] for t in tensors])):
        t.data = part
    return whole


def _fuse(linears, copies: list | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several linears on the same input (`_fuse_one`)."""
    w = _fuse_one([m.weight for m in linears], copies)
    if any(m.bias is None for m in linears):
        return w, None
    return w, _fuse_one([m.bias for m in linears], copies)


def _rms(norm, x: torch.Tensor) -> torch.Tensor:
    """HF's Llama/Qwen RMSNorm (float32 statistics, cast back, then the weight) in fewer kernels."""
    y = F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)
    return norm.weight * y


@dataclass
class _Layer:
    """One decoder layer's tensors and modules, as the static step uses them."""

    layer: torch.nn.Module
    qkv: tuple[torch.Tensor, torch.Tensor | None]
    gate_up: tuple[torch.Tensor, torch.Tensor | None] | None  # None: the MLP module runs as is


class StaticDecoder:
    """Prefill and decode over a static KV cache; `graphs=True` replays decode steps as CUDA graphs."""

    def __init__(self, model, max_batch_size: int, graphs: bool, keep_params: bool = False):
        """keep_params: never re-point the model's parameters (they live in the engine's weight arena): fused
        tensors whose members are not back to back there are copies, `refresh`ed after weight writes."""
        self.model, self.max_batch_size, self.graphs = model, max_batch_size, graphs
        self.copies: list[tuple[torch.Tensor, list[torch.Tensor]]] | None = [] if keep_params else None
        self.synced = None  # the generator's weight_writes the copies were last brought up to (Generator sets it)
        core = model.model
        self.embed, self.layers, self.norm, self.rotary = core.embed_tokens, list(core.layers), core.norm, core.rotary_emb
        cfg = model.config
        attn = self.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.group = int(cfg.num_attention_heads) // self.kv_heads
        self.scaling = float(attn.scaling)
        self.q_heads = int(cfg.num_attention_heads)
        self.plan = [self._plan(layer, cfg, self.copies) for layer in self.layers]
        self._anchor = self.layers[0].self_attn.q_proj.weight.data_ptr()  # where the fusion left the parameters
        self.k: torch.Tensor | None = None  # [L, slots, H_kv, T_cap, D]
        self.v: torch.Tensor | None = None
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    @staticmethod
    def _plan(layer, cfg, copies: list | None) -> _Layer:
        a, mlp = layer.self_attn, layer.mlp
        return _Layer(layer, _fuse([a.q_proj, a.k_proj, a.v_proj], copies),
                      _fuse([mlp.gate_proj, mlp.up_proj], copies) if StaticDecoder.fuses_mlp(layer, cfg) else None)

    def refresh(self) -> int:
        """Copy the parameters into the fused copies (keep_params; one multi-tensor launch on a GPU). Returns how
        many tensors were copied."""
        if not self.copies:
            return 0
        dst, src = [], []
        for whole, members in self.copies:
            dst.extend(whole.split([m.shape[0] for m in members]))
            src.extend(m.data for m in members)
        with torch.no_grad():
            if whole.is_cuda:
                torch._foreach_copy_(dst, src)
            else:
                for d, s in zip(dst, src):
                    d.copy_(s)
        return len(dst)

    @staticmethod
    def fuses_mlp(layer, cfg) -> bool:
        """Whether this layer's gate and up projections run as one product (a SiLU MLP of Llama's shape)."""
        return getattr(cfg, "hidden_act", None) == "silu" and all(hasattr(layer.mlp, n) for n in
                                                                  ("gate_proj", "up_proj", "down_proj"))

    def stale(self) -> bool:
        """Whether the model's tensors were replaced since the fusion (e.g. moved to another device)."""
        return self.layers[0].self_attn.q_proj.weight.data_ptr() != self._anchor

    @staticmethod
    def supports(model) -> str | None:
        """None when this decoder can run `model`; otherwise why not (the engine then decodes eagerly)."""
        cfg = getattr(model, "config", None)
        kind = getattr(cfg, "model_type", None)
        if kind not in FAMILIES:
            return f"model type {kind!r} is not one of {FAMILIES}"
        if getattr(cfg, "use_sliding_window", False) or (kind == "mistral" and getattr(cfg, "sliding_window", None)):
            return "sliding-window attention"
        types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
        if types != {"full_attention"}:
            return f"layer types {sorted(types)}"
        core = getattr(model, "model", None)
        if not all(hasattr(core, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
            return "the model does not have Llama's module layout"
        layer = core.layers[0]
        if not all(hasattr(n, "variance_epsilon") for n in (layer.input_layernorm, layer.post_attention_layernorm)):
            return "its norms are not Llama's RMSNorm"
        return None

    # ------------------------------------------------------------ cache

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else int(self.k.shape[3])

    def reserve(self, positions: int) -> None:
        """Make the cache hold `positions` per slot (rounded up to a power of two >= 256). A larger cache
        replaces the old one, and the graphs captured over it are dropped."""
        if positions <= self.capacity:
            return
        p = next(self.model.parameters())
        shape = (len(self.layers), self.max_batch_size, self.kv_heads, _bucket(positions, 256), self.head_dim)
        self.release()
        self.k = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.v = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self._tok = torch.zeros(self.max_batch_size, dtype=torch.long, device=p.device)  # graph inputs
        self._pos = torch.zeros(self.max_batch_size, dtype=torch.long, device=p.device)
        # Positions come from the host each step. Two pinned buffers taken in turn: a copy from pageable
        # memory may wait for the stream, and a buffer is rewritten only after the step that read it ran.
        pin = p.device.type == "cuda"
        self._pos_host = [torch.zeros(self.max_batch_size, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._turn = 0

    def release(self) -> None:
        """Free the cache and the graphs (colocated mode's release_memory_occupation)."""
        self._graphs.clear()
        self._pool = None
        self.k = self.v = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()

    def move_slots(self, dst: list[int], src: list[int], upto: int) -> None:
        """Copy the first `upto` positions of slots `src` onto slots `dst` (compaction, or a prompt's cache
        repeated for its other samples). The right side is gathered first, so overlaps are safe."""
        assert self.k is not None and self.v is not None
        d = torch.tensor(dst, device=self.k.device)
        s = torch.tensor(src, device=self.k.device)
        self.k[:, d, :, :upto] = self.k[:, s, :, :upto]
        self.v[:, d, :, :upto] = self.v[:, s, :, :upto]

    # ------------------------------------------------------------ forward passes

    def prefill(self, prompts: list[list[int]], slots: list[int], pad_id: int) -> torch.Tensor:
        """Run right-padded prompts, writing their K/V into `slots` at positions 0..len-1; logits of each
        prompt's last token, float32 [U, V]. Padding sits after each prompt, so causal attention alone keeps
        it out of every real position; what it writes past a prompt's end is overwritten before it is read."""
        assert self.k is not None and self.v is not None
        dev = self.k.device
        T = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)  # [U, T]
        for u, p in enumerate(prompts):
            ids[u, :len(p)] = torch.tensor(p)
        ids = ids.to(dev)
        rows = torch.tensor(slots, device=dev)
        x = self.embed(ids)  # [U, T, hidden]
        cos, sin = (t[:, None] for t in self.rotary(x, torch.arange(T, device=dev).expand(len(prompts), T)))
        for i, p in enumerate(self.plan):
            q, k, v = self._qkv(p, x, cos, sin)  # [U, H, T, D]
            self.k[i, rows, :, :T] = k
            self.v[i, rows, :, :T] = v
            k, v = k.repeat_interleave(self.group, 1), v.repeat_interleave(self.group, 1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)  # [U, Hq, T, D]
            x = self._rest(p, x, a.transpose(1, 2).reshape(*x.shape[:2], -1))
        last = torch.tensor([len(p) - 1 for p in prompts], device=dev)
        h = _rms(self.norm, x[torch.arange(len(prompts), device=dev), last])  # [U, hidden]
        return self.model.lm_head(h).float()

    def _qkv(self, p: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Norm, one q/k/v product, Qwen3's per-head norms, RoPE on q and k together.
        x [B, T, hidden] -> q [B, Hq, T, D], k/v [B, Hkv, T, D]."""
        B, T = x.shape[:2]
        attn = p.layer.self_attn
        h = _rms(p.layer.input_layernorm, x)
        qkv = F.linear(h, *p.qkv).view(B, T, -1, self.head_dim)  # [B, T, Hq + 2 Hkv, D]
        nq, nk = self.q_heads, self.kv_heads
        if hasattr(attn, "q_norm"):
            qk = torch.cat([attn.q_norm(qkv[:, :, :nq]), attn.k_norm(qkv[:, :, nq:nq + nk])], dim=2)
        else:
            qk = qkv[:, :, :nq + nk]
        qk = _rotate(qk.transpose(1, 2), cos, sin)  # [B, Hq + Hkv, T, D]
        return qk[:, :nq], qk[:, nq:], qkv[:, :, nq + nk:].transpose(1, 2)

    @staticmethod
    def _rest(p: _Layer, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, norm, MLP (gate/up as one product where fused), residual."""
        x = x + p.layer.self_attn.o_proj(attn_out)
        h = _rms(p.layer.post_attention_layernorm, x)
        if p.gate_up is None:
            return x + p.layer.mlp(h)
        gate, up = F.linear(h, *p.gate_up).chunk(2, dim=-1)
        return x + p.layer.mlp.down_proj(F.silu(gate) * up)

    def _step(self, b: int, t: int) -> torch.Tensor:
        """One decode step for slots 0..b-1 from the static inputs `_tok`, `_pos`; attends over the first
        t positions. Writes each row's new K/V at its position; returns logits float32 [b, V]."""
        assert self.k is not None and self.v is not None
        tok, pos = self._tok[:b], self._pos[:b]
        rows = torch.arange(b, device=tok.device)
        x = self.embed(tok[:, None])  # [b, 1, hidden]
        cos, sin = (c[:, None] for c in self.rotary(x, pos[:, None]))  # [b, 1, 1, D]
        bias = torch.zeros((b, 1, 1, t), dtype=x.dtype, device=x.device)  # [b, 1, 1, t] additive mask
        bias.masked_fill_(torch.arange(t, device=x.device)[None, None, None, :] > pos[:, None, None, None],
                          float("-inf"))
        for i, p in enumerate(self.plan):
            q, k, v = self._qkv(p, x, cos, sin)  # q [b, Hq, 1, D]
            self.k[i, rows, :, pos] = k[:, :, 0]
            self.v[i, rows, :, pos] = v[:, :, 0]
            q = q.reshape(b, self.kv_heads, self.group, self.head_dim)  # a KV head's query heads as G queries
            a = F.scaled_dot_product_attention(q, self.k[i, :b, :, :t], self.v[i, :b, :, :t], attn_mask=bias,
                                               scale=self.scaling)  # [b, Hkv, G, D]
            x = self._rest(p, x, a.reshape(b, 1, -1))
        return self.model.lm_head(_rms(self.norm, x[:, 0])).float()  # [b, V]

    def decode(self, tokens: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """Logits float32 [n, V] after feeding `tokens` [n] at `positions` (rows in slots 0..n-1).
        The caller waits for step k's results before asking for step k+2 (the pinned buffers' turn)."""
        n = tokens.shape[0]
        t = _bucket(max(positions) + 1, 64)
        assert t <= self.capacity, f"position {max(positions)} past the cache ({self.capacity})"
        self._tok[:n].copy_(tokens)
        staged = self._pos_host[self._turn]
        self._turn ^= 1
        staged[:n] = torch.tensor(positions)
        self._pos[:n].copy_(staged[:n], non_blocking=True)
        if not self.graphs:
            return self._step(n, t)
        b = min(batch_bucket(n), self.max_batch_size)
        graph = self._graphs.get((b, t))
        if graph is None:
            return self._capture(b, t)[:n]
        graph[0].replay()
        return graph[1][:n]

    def _capture(self, b: int, t: int) -> torch.Tensor:
        """Run the step once on a side stream (warm-up: cuBLAS handles, lazy inits; its result is this
        step's), then capture it; the capture itself runs nothing."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = self._step(b, t)
        torch.cuda.current_stream().wait_stream(side)
        logits = logits.clone()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._step(b, t)
        self._graphs[(b, t)] = (graph, out)
        return logits

    @property
    def graph_count(self) -> int:
        return len(self._graphs)
