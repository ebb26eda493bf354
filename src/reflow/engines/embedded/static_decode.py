"""Static-cache decoding for Llama-shaped HF models: a preallocated KV cache, decode steps replayed as
CUDA graphs on a GPU.

Why: a decode step of a 0.5B model at batch 64 does ~0.3 ms of GPU work but takes ~16 ms through HF's
modelling code (hundreds of kernel launches, each with Python and dispatcher overhead; measured in
bench/gpu.py). A CUDA graph replays the whole step's kernels from one launch. Graphs need fixed
shapes and addresses, hence the static cache and per-bucket graphs.

Layout: K and V are one pool each, [L, N + 1, H_kv, D]; a row of the running batch owns a contiguous
region of the pool (kv_pool.py: its prompt + its own max_new_tokens; admitted when a region is free),
its tokens at start .. start + len - 1. Running rows are rows 0..n-1 of the batch (finished ones leave;
nothing in the cache moves, only the per-row starts do), so a step over n rows runs the graph captured
for the batch bucket b >= n (rows n..b-1 are idle and write the scratch position N). Attention on a GPU
reads each row's own region for its own length (the long tail costs only what it reads): a Triton
flash-decoding kernel (decode_attention.py; bf16, fp16 and float32) where Triton is installed, else flash
attention's varlen kernel (bf16/fp16); elsewhere each row's first t positions are gathered and masked, t a
power-of-two bucket >= the longest row (every row of a step reads t positions: one long row makes the whole
batch pay for it).
Graphs are captured lazily, once per (b, t), on first need.

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

from reflow.engines.embedded import decode_attention as triton_decode
from reflow.engines.embedded.kv_pool import GRANULE, RegionPool
from reflow.engines.embedded.staging import on_device

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as HF's apply_rotary_pos_emb (rotate_half convention). x [B, H, T, D]; cos/sin [B, 1, T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def flash_ok(p: torch.Tensor) -> bool:
    """Whether flash attention's varlen kernel (with per-row used lengths) serves tensors like `p`."""
    if p.device.type != "cuda" or p.dtype not in (torch.bfloat16, torch.float16):
        return False
    schema = str(torch.ops.aten._flash_attention_forward.default._schema)
    return "seqused_k" in schema and torch.backends.cuda.is_flash_attention_available()


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
    return _norm(x, norm.weight, norm.variance_epsilon)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`_rms` on tensors alone (what the compiled step functions below take: no modules, so one compiled graph
    serves every layer)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _pre_attention(x, norm_w, eps: float, w, b, cos, sin, nq: int, nk: int, head_dim: int, qn_w, kn_w,
                   qk_eps: float):
    """`StaticDecoder._qkv` on tensors: norm, the q/k/v product, Qwen3's per-head norms (qn_w/kn_w, else None),
    RoPE. x [B, 1, hidden] -> q [B, Hq, 1, D], k/v [B, Hkv, 1, D]."""
    B, T = x.shape[:2]
    qkv = F.linear(_norm(x, norm_w, eps), w, b).view(B, T, -1, head_dim)
    if qn_w is not None:
        qk = torch.cat([_norm(qkv[:, :, :nq], qn_w, qk_eps), _norm(qkv[:, :, nq:nq + nk], kn_w, qk_eps)], dim=2)
    else:
        qk = qkv[:, :, :nq + nk]
    qk = _rotate(qk.transpose(1, 2), cos, sin)
    return qk[:, :nq], qk[:, nq:], qkv[:, :, nq + nk:].transpose(1, 2)


def _post_attention(x, a, o_w, o_b, norm_w, eps: float, gu_w, gu_b, down_w, down_b):
    """`StaticDecoder._rest` on tensors, for a fused gate/up (a SiLU MLP of Llama's shape)."""
    x = x + F.linear(a, o_w, o_b)
    gate, up = F.linear(_norm(x, norm_w, eps), gu_w, gu_b).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, down_w, down_b)


def _head(x, norm_w, eps: float, w, b):
    """The last norm and the LM head, float32 logits: x [B, hidden] -> [B, V]."""
    return F.linear(_norm(x, norm_w, eps), w, b).float()


class _Fused:
    """The decode step's work between its matrix products and attention, compiled (torch.compile with `backend`:
    inductor on a GPU) into a few fused kernels a layer instead of ~30 small ones (norms' casts and statistics,
    RoPE's cat/neg/mul/add, residual adds, SiLU and product). A GPU replays them inside the step's CUDA graph; they
    are compiled on the step's first (uncaptured) run, once per batch size until dynamo marks the batch dynamic."""

    def __init__(self, backend: str):
        self.pre = torch.compile(_pre_attention, backend=backend)
        self.post = torch.compile(_post_attention, backend=backend)
        self.head = torch.compile(_head, backend=backend)


@dataclass
class _Layer:
    """One decoder layer's tensors and modules, as the static step uses them."""

    layer: torch.nn.Module
    qkv: tuple[torch.Tensor, torch.Tensor | None]
    gate_up: tuple[torch.Tensor, torch.Tensor | None] | None  # None: the MLP module runs as is


class StaticDecoder:
    """Prefill and decode over a static KV cache; `graphs=True` replays decode steps as CUDA graphs."""

    def __init__(self, model, max_batch_size: int, graphs: bool, keep_params: bool = False, attention: str = "auto",
                 fuse: str | None = None, kv_dtype: torch.dtype | None = None):
        """keep_params: never re-point the model's parameters (they live in the engine's weight arena): fused
        tensors whose members are not back to back there are copies, `refresh`ed after weight writes.
        attention: "triton" (decode_attention.py: CUDA, bf16/fp16/fp32), "flash" (flash attention's varlen kernel:
        CUDA, bf16/fp16), "gather" (each row's positions gathered, then SDPA with a mask: any device and dtype)
        or "auto" (triton where it serves the pool's dtype, else flash where `flash_ok`, else gather).
        fuse: a torch.compile backend for the decode step's elementwise work (`_Fused`; "inductor" on a GPU), or
        None: eager kernels. Prefill stays eager either way.
        kv_dtype: the pool's keys and values in this dtype, None: the model's. Each step's new K/V is rounded into it
        when written; the attention reads it as is (the Triton kernel: q rounded to it for q.k, float32 sums) or cast
        to the queries' dtype (gather). Prefill attends over its own K/V before rounding, as SGLang's
        --kv-cache-dtype does within a prefill."""
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
        self.k: torch.Tensor | None = None  # [L, N + 1, H_kv, D]: N pool positions, then one scratch position
        self.v: torch.Tensor | None = None
        self.regions: RegionPool | None = None  # which pool positions each row owns (kv_pool.py)
        self.attention = attention
        self.kernel = "gather"  # decided per pool (reserve): "triton", "flash" or "gather" (`attention`)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._logits: torch.Tensor | None = None  # [slots, V] float32: the graphs' output (one buffer for all)
        self.fused = _Fused(fuse) if fuse else None
        self.kv_dtype = kv_dtype

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
        """Positions the pool holds (its scratch position aside)."""
        return 0 if self.k is None else int(self.k.shape[1]) - 1

    def reserve(self, positions: int, granule: int = GRANULE) -> None:
        """Make the pool hold `positions` token positions (kv_pool.py), regions rounded to `granule`. A
        larger pool (or another granule) replaces the old one, and the graphs captured over it are dropped;
        call between generations (every region is given back)."""
        if positions <= self.capacity and self.regions is not None and self.regions.granule == granule:
            assert not self.regions.in_use, "the pool is resized while rows hold regions"
            return
        p = next(self.model.parameters())
        shape = (len(self.layers), positions + 1, self.kv_heads, self.head_dim)  # [L, N + 1 scratch, H_kv, D]
        self.release()
        self.k = torch.zeros(shape, dtype=self.kv_dtype or p.dtype, device=p.device)
        self.v = torch.zeros(shape, dtype=self.kv_dtype or p.dtype, device=p.device)
        self.regions = RegionPool(positions, granule)
        same = self.k.dtype == p.dtype  # flash attention's kernel takes queries and keys of one dtype
        self.kernel = self.attention if self.attention != "auto" else (
            "triton" if triton_decode.serves(self.k) else "flash" if same and flash_ok(p) else "gather")
        self._sms = torch.cuda.get_device_properties(p.device).multi_processor_count if p.is_cuda else 1
        B = self.max_batch_size
        self._tok = torch.zeros(B, dtype=torch.long, device=p.device)  # graph inputs
        self._at = torch.zeros(2, B, dtype=torch.long, device=p.device)  # [position, region start] per row
        self._ar = torch.arange(B + 1, dtype=torch.int32, device=p.device)
        # Positions and starts come from the host each step. Two pinned buffers taken in turn: a copy from
        # pageable memory may wait for the stream, and a buffer is rewritten only after the step that read it ran.
        pin = p.device.type == "cuda"
        self._at_host = [torch.zeros(2, B, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._turn = 0

    def release(self) -> None:
        """Free the cache and the graphs (colocated mode's release_memory_occupation)."""
        self._graphs.clear()
        self._pool = None
        self._logits = None
        self.k = self.v = None
        self.regions = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()

    def copy_prefix(self, dst: list[int], src: list[int], lengths: list[int]) -> None:
        """Copy the first lengths[i] positions of the region at src[i] onto the region at dst[i] (a prompt's
        cache repeated for its other samples); each pair copies its own length, so no region is overrun."""
        assert self.k is not None and self.v is not None
        d = on_device(torch.cat([torch.arange(a, a + n) for a, n in zip(dst, lengths)]), self.k.device)
        s = on_device(torch.cat([torch.arange(a, a + n) for a, n in zip(src, lengths)]), self.k.device)
        self.k[:, d] = self.k[:, s]
        self.v[:, d] = self.v[:, s]

    # ------------------------------------------------------------ forward passes

    def prefill(self, prompts: list[list[int]], starts: list[int], pad_id: int) -> torch.Tensor:
        """Run right-padded prompts, writing each one's K/V into its region (start .. start + len - 1);
        logits of each prompt's last token, float32 [U, V]. Padding sits after each prompt, so causal
        attention alone keeps it out of every real position, and its K/V is never written."""
        assert self.k is not None and self.v is not None
        dev = self.k.device
        T = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)  # [U, T]
        for u, p in enumerate(prompts):
            ids[u, :len(p)] = torch.tensor(p)
        ids = on_device(ids, dev)
        lens = torch.tensor([len(p) for p in prompts])
        real_at = torch.arange(T)[None, :] < lens[:, None]  # [U, T] positions that are prompt tokens
        # the prompt tokens as flat indices into [U * T], and their pool positions, both made on the host: a
        # boolean mask on the device would cost a sync per layer (its count is read back)
        real = on_device(real_at.flatten().nonzero()[:, 0], dev)  # [sum len]
        where = on_device((torch.tensor(starts)[:, None] + torch.arange(T)[None, :])[real_at], dev)  # [sum len]
        last = on_device(lens - 1, dev)
        x = self.embed(ids)  # [U, T, hidden]
        cos, sin = (t[:, None] for t in self.rotary(x, torch.arange(T, device=dev).expand(len(prompts), T)))
        for i, p in enumerate(self.plan):
            q, k, v = self._qkv(p, x, cos, sin)  # [U, H, T, D]
            self.k[i, where] = k.transpose(1, 2).flatten(0, 1)[real].to(self.k.dtype)
            self.v[i, where] = v.transpose(1, 2).flatten(0, 1)[real].to(self.v.dtype)
            k, v = k.repeat_interleave(self.group, 1), v.repeat_interleave(self.group, 1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)  # [U, Hq, T, D]
            x = self._rest(p, x, a.transpose(1, 2).reshape(*x.shape[:2], -1))
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
        if p.gate_up is not None:
            return _post_attention(x, attn_out, *StaticDecoder._post_weights(p))
        x = x + p.layer.self_attn.o_proj(attn_out)
        return x + p.layer.mlp(_rms(p.layer.post_attention_layernorm, x))

    @staticmethod
    def _post_weights(p: _Layer) -> tuple:
        """`_post_attention`'s tensors of layer `p` (a fused gate/up)."""
        o, norm, down = p.layer.self_attn.o_proj, p.layer.post_attention_layernorm, p.layer.mlp.down_proj
        assert p.gate_up is not None
        return (o.weight, o.bias, norm.weight, norm.variance_epsilon, *p.gate_up, down.weight, down.bias)

    def _step(self, b: int, t: int) -> torch.Tensor:
        """One decode step for batch rows 0..b-1 from the static inputs `_tok`, `_at` (position, region start);
        attends over each row's positions 0..pos (at most t). Writes each row's new K/V at start + pos;
        returns logits float32 [b, V]."""
        assert self.k is not None and self.v is not None
        tok, pos, start = self._tok[:b], self._at[0, :b], self._at[1, :b]
        at = start + pos  # [b] pool position of each row's new token
        x = self.embed(tok[:, None])  # [b, 1, hidden]
        cos, sin = (c[:, None] for c in self.rotary(x, pos[:, None]))  # [b, 1, 1, D]
        splits = triton_decode.splits_for(b, self.kv_heads, t, self._sms)
        seen = (pos + 1).to(torch.int32)  # [b] keys each row attends to
        if self.kernel == "flash":
            first = torch.cat([start.to(torch.int32), self._ar[:1] + self.capacity + 1])  # [b + 1] region starts
        elif self.kernel == "gather":  # gather each row's first t positions (past its end: masked, clamped into the pool)
            idx = (start[:, None] + torch.arange(t, device=x.device)[None, :]).clamp_max(self.capacity)  # [b, t]
            bias = torch.zeros((b, 1, 1, t), dtype=x.dtype, device=x.device)  # [b, 1, 1, t] additive mask
            bias.masked_fill_(torch.arange(t, device=x.device)[None, None, None, :] > pos[:, None, None, None],
                              float("-inf"))
        for i, p in enumerate(self.plan):
            q, k, v = self._qkv(p, x, cos, sin) if self.fused is None else self._fused_qkv(p, x, cos, sin)
            self.k[i, at] = k[:, :, 0].to(self.k.dtype)
            self.v[i, at] = v[:, :, 0].to(self.v.dtype)
            if self.kernel == "triton":
                a = triton_decode.decode_attention(q.reshape(b, self.kv_heads, self.group, self.head_dim), self.k[i],
                                                   self.v[i], start, seen, t, self.scaling, splits)
            elif self.kernel == "flash":
                a = self._flash(q, self.k[i], self.v[i], first, seen, t)
            else:
                q = q.reshape(b, self.kv_heads, self.group, self.head_dim)  # a KV head's query heads as G queries
                a = F.scaled_dot_product_attention(q, self.k[i][idx].transpose(1, 2).to(q.dtype),
                                                   self.v[i][idx].transpose(1, 2).to(q.dtype),
                                                   attn_mask=bias, scale=self.scaling)  # [b, Hkv, G, D]
            if self.fused is not None and p.gate_up is not None:
                x = self.fused.post(x, a.reshape(b, 1, -1), *self._post_weights(p))
            else:
                x = self._rest(p, x, a.reshape(b, 1, -1))
        if self.fused is not None:
            head = self.model.lm_head
            return self.fused.head(x[:, 0], self.norm.weight, self.norm.variance_epsilon, head.weight, head.bias)
        return self.model.lm_head(_rms(self.norm, x[:, 0])).float()  # [b, V]

    def _fused_qkv(self, p: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """`_qkv` through the compiled `_pre_attention` (tensors only: one graph for every layer)."""
        attn, norm = p.layer.self_attn, p.layer.input_layernorm
        qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        return self.fused.pre(x, norm.weight, norm.variance_epsilon, *p.qkv, cos, sin, self.q_heads, self.kv_heads,
                              self.head_dim, None if qn is None else qn.weight, None if kn is None else kn.weight,
                              1e-6 if qn is None else qn.variance_epsilon)

    def _flash(self, q, k, v, first, seen, t: int) -> torch.Tensor:
        """Flash attention's varlen kernel over the rows' regions: the G query heads of a KV head are that
        head's G queries (one pass over its keys, not G), keys from first[b] for seen[b] positions.
        q [b, Hq, 1, D], k/v [N + 1, Hkv, D] -> [b, Hkv, G, D]."""
        b, G = q.shape[0], self.group
        qs = q.reshape(b, self.kv_heads, G, self.head_dim).transpose(1, 2).reshape(b * G, self.kv_heads, -1)
        out = torch.ops.aten._flash_attention_forward(
            qs, k, v, self._ar[:b + 1] * G, first, G, t, 0.0, False, False, scale=self.scaling, seqused_k=seen)[0]
        return out.view(b, G, self.kv_heads, -1).transpose(1, 2)  # [b, Hkv, G, D]

    def step_shape(self, n: int, last: int) -> tuple[int, int]:
        """(batch rows, keys) of the step that decodes `n` rows whose furthest writes position `last`: the rows
        rounded up to a graph's batch bucket (graphs only), the keys to a power of two (the kernels read each row's
        own length, t only bounds it; the gather reads t positions of every row)."""
        b = min(batch_bucket(n), self.max_batch_size) if self.graphs else n
        return b, _bucket(last + 1, 64 if self.kernel == "gather" else 512)

    def decode(self, tokens: torch.Tensor, positions: list[int], starts: list[int]) -> torch.Tensor:
        """Logits float32 [n, V] after feeding `tokens` [n] at `positions` in the regions at `starts` (rows
        0..n-1 of the batch). The caller waits for step k's results before asking for step k+2 (the pinned
        buffers' turn)."""
        n = tokens.shape[0]
        b, t = self.step_shape(n, max(positions))
        cap = self.capacity
        assert all(p + s < cap or (p == 0 and s == cap) for p, s in zip(positions, starts)), \
            "a row past the pool's end"  # (0, capacity): a row sitting the step out writes the scratch position
        self._tok[:n].copy_(tokens)
        staged = self._at_host[self._turn]
        self._turn ^= 1
        staged[0, :n], staged[1, :n] = torch.tensor(positions), torch.tensor(starts)
        staged[0, n:b], staged[1, n:b] = 0, self.capacity  # idle rows of the bucket write the scratch position
        self._at[:, :b].copy_(staged[:, :b], non_blocking=True)
        if not self.graphs:
            return self._step(n, t)
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
        if self._logits is None:  # every graph writes its logits here: what a graph allocates is then freed at the
            self._logits = torch.empty((self.max_batch_size, logits.shape[1]), dtype=logits.dtype,  # end of its
                                       device=logits.device)  # capture and reused by the next (one pool)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._logits[:b].copy_(self._step(b, t))
        self._graphs[(b, t)] = (graph, self._logits[:b])
        return logits

    @property
    def graph_count(self) -> int:
        return len(self._graphs)
