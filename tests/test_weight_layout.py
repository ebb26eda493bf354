"""The engine's weight arena and the copy runs of a mapped push (engines/embedded/weight_layout.py), on CPU.

The source is what a trainer rank hands the engine to map: its parameters as views into one flat buffer,
in `named_parameters` order, as DeepSpeed keeps them. After `adopt_layout` the engine's parameters live
in one buffer in exactly that order, a push is one copy, the static decoder views the fused tensors that
lie together there (Llama's q/k/v and gate/up) and keeps copies of the others that every push brings up to
date (Qwen2's q/k/v), and greedy outputs match the eager path at the pushed values.
"""
from __future__ import annotations

import copy

import pytest
import torch

from reflow.engines.embedded.generator import Generator
from reflow.engines.embedded.weight_layout import Arena, copy_runs
from tests.test_static_decode import _assert_same, _greedy, _tiny, tok  # noqa: F401 - tok: the fixture


def _flat_source(model, seed: int) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """New values for `model`'s parameters, laid back to back in one buffer (a trainer's flat storage)."""
    g = torch.Generator().manual_seed(seed)
    named = list(model.named_parameters())
    flat = torch.empty(sum(p.numel() for _, p in named), dtype=named[0][1].dtype)
    out, at = [], 0
    for n, p in named:
        view = flat[at:at + p.numel()].view(p.shape)
        view.copy_(torch.randn(p.shape, generator=g) * 0.05)
        out.append((n, view))
        at += p.numel()
    return flat, out


def _with(model, named) -> torch.nn.Module:
    ref = copy.deepcopy(model)
    ref.load_state_dict(dict(named), strict=False)
    return ref


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_adopted_layout_pushes_in_one_copy(kind, tok):  # noqa: F811 - the fixture
    model = _tiny(kind)
    gen = Generator(copy.deepcopy(model), tok, max_batch_size=4, decoder="static")
    _greedy(gen)  # the decoder exists (its fused tensors concatenated) before the engine adopts the layout
    flat, named = _flat_source(model, seed=1)
    assert gen.load_mapped("m1", named) > 1  # as loaded: one copy per tensor that does not happen to join
    assert gen.adopt_layout(named)
    assert gen.arena_bytes() == flat.numel() * flat.element_size()
    flat.mul_(-1.5)  # the trainer's next step
    assert gen.load_mapped("m1", named) == 1
    for n, t in named:
        assert torch.equal(gen._params[n], t), n
    _assert_same(_greedy(Generator(_with(model, named), tok, max_batch_size=16, decoder="eager")), _greedy(gen))
    arena = gen._arenas[0]
    assert arena.holds()  # the decoder made after the adoption left every parameter in the arena
    static = gen.static_decoder()
    q = gen._params["model.layers.0.self_attn.q_proj.weight"]
    if kind == "llama":  # q/k/v and gate/up lie together in the trainer's order: viewed in place
        assert static.plan[0].qkv[0].data_ptr() == q.data_ptr() and not static.copies
    else:  # Qwen2's q/k/v biases sit between the weights: the fused q/k/v weight and bias are copies
        assert static.plan[0].qkv[0].data_ptr() != q.data_ptr()
        assert len(static.copies) == 2 * model.config.num_hidden_layers
    for delta in (0.01, -0.02):  # pushes land where the decoder reads (a stale fused copy fails the comparison)
        flat.add_(delta)
        assert gen.load_mapped("m1", named) == 1
        _assert_same(_greedy(Generator(_with(model, named), tok, max_batch_size=16, decoder="eager")), _greedy(gen))
    # a write by another path (SGLang's tensor update, a LoRA merge) reaches the fused copies too
    name = "model.layers.0.self_attn.k_proj.bias" if kind == "qwen2" else "model.layers.0.self_attn.k_proj.weight"
    gen.load_named_tensors([(name, torch.randn_like(gen._params[name]))])
    _assert_same(_greedy(Generator(_with(model, [(n, gen._params[n].detach()) for n in gen._params]), tok,
                                   max_batch_size=16, decoder="eager")), _greedy(gen))
    assert arena.holds()


def test_a_parameter_moved_elsewhere_gets_its_copy_and_goes_back(tok):  # noqa: F811
    model = _tiny("llama")
    gen = Generator(copy.deepcopy(model), tok, max_batch_size=4, decoder="eager")
    flat, named = _flat_source(model, seed=2)
    assert gen.adopt_layout(named) and gen.load_mapped("m", named) == 1
    p = gen._params["model.norm.weight"]
    p.data = p.data.clone()  # something re-pointed it (as model.to would) and, as whatever does must,
    gen.layout_epoch += 1  # said so (release/resume, adopt_layout and the decoder's fusion do)
    flat.add_(1.0)
    assert gen.load_mapped("m", named) == 3  # re-planned: before it, it, after it
    assert torch.equal(p.data, dict(named)["model.norm.weight"])
    arena = gen._arenas[0]
    assert not arena.holds()
    arena.to("cpu")  # what colocated release/resume do: the moved one's values go back into the arena first
    gen.layout_epoch += 1  # (and they say so)
    assert arena.holds() and torch.equal(p.data, dict(named)["model.norm.weight"])
    assert gen.load_mapped("m", named) == 1


def test_no_arena_across_dtypes(tok):  # noqa: F811
    model = _tiny("llama")
    gen = Generator(copy.deepcopy(model), tok, max_batch_size=4, decoder="eager")
    _, named = _flat_source(copy.deepcopy(model).to(torch.bfloat16), seed=3)
    assert not gen.adopt_layout(named) and gen.arena_bytes() == 0
    assert gen.load_mapped("m", named) == len(named)  # cast copies, one each
    for n, t in named:
        assert torch.equal(gen._params[n], t.float()), n


def test_copy_runs_join_only_what_continues_on_both_sides():
    src, dst = torch.arange(10.0), torch.zeros(10)
    other = torch.zeros(4)
    pairs = [(src[0:3], dst[0:3]), (src[3:5], dst[3:5]),  # continue on both sides: one run
             (src[5:7], dst[6:8]),  # a gap on the destination side: a new run
             (src[7:9], other[0:2]),  # another destination storage
             (src[9:10], dst[9:10].to(torch.float64))]  # a cast: as it is
    runs = copy_runs(pairs)
    assert [(s.numel(), s.dtype) for s, _ in runs] == [(20, torch.uint8), (8, torch.uint8), (8, torch.uint8),
                                                       (1, torch.float32)]
    for s, d in runs[:3]:
        d.copy_(s)
    assert dst[:5].tolist() == [0, 1, 2, 3, 4] and dst[6:8].tolist() == [5, 6] and other[:2].tolist() == [7, 8]


def test_arena_keeps_values_and_aligns():
    params = {"a": torch.nn.Parameter(torch.arange(3, dtype=torch.float16)),
              "b": torch.nn.Parameter(torch.arange(2, dtype=torch.float32))}
    arena = Arena(params, ["a", "b"], torch.device("cpu"))
    assert arena.slots == [("a", 0), ("b", 8)]  # b's start rounded up to its element size
    assert params["a"].tolist() == [0, 1, 2] and params["b"].tolist() == [0, 1] and arena.holds()
