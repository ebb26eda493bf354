"""Activation checkpointing (engines/train/compiled.checkpoint_layers): the same log-probs and gradients as without,
with less kept for backward; and the estimate behind trainer.activation_checkpointing=auto."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from reflow.engines.train.compiled import checkpoint_layers, decoder_layers
from reflow.engines.train.memory import activation_bytes
from reflow.rl.losses import token_logprobs


def _kept_bytes(model, ids) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """(log-probs, gradients, bytes of the tensors autograd kept for backward) of one forward and backward."""
    kept = []

    def pack(t):
        kept.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp = token_logprobs(model(input_ids=ids, use_cache=False).logits[:, :-1], ids[:, 1:])
    lp.sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(kept)


def test_checkpointed_layers_give_the_same_gradients_and_keep_less(tiny_policy):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(3, 16, (4, 48))
    out = []
    for on in (False, True):
        model = AutoModelForCausalLM.from_pretrained(str(tiny_policy)).float().eval()  # eval: as the ranks run it
        if on:
            assert checkpoint_layers(model) == len(decoder_layers(model)) == 2
        out.append(_kept_bytes(model, ids))
    (lp_off, g_off, kept_off), (lp_on, g_on, kept_on) = out
    torch.testing.assert_close(lp_on, lp_off, rtol=0, atol=0)
    for name in g_off:
        torch.testing.assert_close(g_on[name], g_off[name], rtol=0, atol=1e-6, msg=name)
    assert kept_on < 0.6 * kept_off, (kept_on, kept_off)
    with torch.no_grad():  # no grad: the layers run plainly, nothing is recomputed or kept
        model(input_ids=ids, use_cache=False)


def test_activation_estimate_of_a_qwen25_7b_shape():
    qwen7b = SimpleNamespace(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                             num_hidden_layers=28, vocab_size=152064)
    per_token = activation_bytes(qwen7b, 1, 2)
    # 28 layers x (8 x 3584 + 2 x 512 + 4 x 18944) values + the logits, in bf16: ~6.1 MB a token
    assert per_token == 2 * (28 * (8 * 3584 + 2 * 512 + 4 * 18944) + 152064)
    assert 16_384 * per_token > 141e9 / 2  # a 16k-token micro-batch on a 141 GB H200: auto turns it on
    assert 2_048 * per_token < 141e9 / 2


def test_rank_memory_shards_by_zero_stage_and_checkpointing_keeps_layer_inputs():
    from reflow.engines.train.memory import rank_memory

    qwen7b = SimpleNamespace(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                             num_hidden_layers=28, vocab_size=152064)
    p = 7_615_616_512
    kw = dict(precision="bf16", world=8, tokens=8192)
    z1, z3 = (rank_memory(qwen7b, p, zero_stage=z, checkpointing=False, **kw) for z in (1, 3))
    assert (z1.weights, z1.gradients, z1.optimizer) == (2 * p, 2 * p, 12 * p // 8)
    assert (z3.weights, z3.gradients, z3.optimizer) == (2 * p // 8, 2 * p // 8, 12 * p // 8)
    ck = rank_memory(qwen7b, p, zero_stage=3, checkpointing=True, **kw)
    assert ck.activations < z3.activations / 5  # layer inputs + one layer + the logits, against every layer's
    assert rank_memory(qwen7b, p, zero_stage=0, world=1, tokens=1, precision="fp32", checkpointing=False).optimizer == 8 * p
