"""The static-cache decoder (engines/embedded/static_decode.py) against the eager path, on CPU.

On a GPU the same steps are replayed as CUDA graphs (bench/gpu.py checks greedy identity there in
float32); here the steps run eagerly, so what is tested is everything around the graphs: the fused
q/k/v and gate/up views, the cache layout and slot moves, continuous admission, aborts, weight pushes
landing in the fused tensors, and the choice of decoder.
"""
from __future__ import annotations

import copy

import pytest
import torch

from reflow.engines.embedded.generator import Generator
from reflow.engines.embedded.static_decode import StaticDecoder, batch_bucket
from reflow.engines.hf_io import load_causal_lm, load_tokenizer


def _tiny(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=256, pad_token_id=0, eos_token_id=2, attn_implementation="sdpa")
    if kind == "qwen2":  # grouped KV heads and q/k/v biases, tied embeddings
        return Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **common)).eval()
    if kind == "qwen3":  # per-head q/k norms
        return Qwen3ForCausalLM(Qwen3Config(num_key_value_heads=2, head_dim=8, **common)).eval()
    return LlamaForCausalLM(LlamaConfig(num_key_value_heads=4, **common)).eval()


@pytest.fixture(scope="module")
def tok(tiny_policy):
    return load_tokenizer(str(tiny_policy))


PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20], [21, 22, 23]]
LENGTHS = [30, 7, 70, 3, 12]


def _greedy(gen: Generator, n=(2, 1, 3, 2, 1)) -> list[dict]:
    sps = [{"temperature": 0.0, "max_new_tokens": m, "ignore_eos": True} for m in LENGTHS]
    return gen.generate(PROMPTS, sps, n=list(n))


def _assert_same(a: list[dict], b: list[dict]) -> None:
    assert [r["output_ids"] for r in a] == [r["output_ids"] for r in b]
    got = torch.tensor([lp for r in b for lp, _, _ in r["output_token_logprobs"]])
    want = torch.tensor([lp for r in a for lp, _, _ in r["output_token_logprobs"]])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert [r["finish_reason"] for r in a] == [r["finish_reason"] for r in b]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_static_matches_eager_greedy(kind, tok):
    model = _tiny(kind)
    reference = _greedy(Generator(copy.deepcopy(model), tok, max_batch_size=16, decoder="eager"))
    static = Generator(model, tok, max_batch_size=4, decoder="static")  # 9 rows, 4 slots: rows wait and join
    _assert_same(reference, _greedy(static))
    assert [len(r["output_ids"]) for r in reference] == [m for m, k in zip(LENGTHS, (2, 1, 3, 2, 1)) for _ in range(k)]
    # the eager path on the same (now fused) model still gives the same answers
    _assert_same(reference, _greedy(Generator(model, tok, max_batch_size=16, decoder="eager")))


@pytest.mark.slow  # dynamo traces the three step functions for each family: ~3 s each, like the trainer's compile tests
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_fused_step_matches_the_eager_one(kind, tok):
    """decode_fusion: the step's norms, RoPE, residuals and SiLU through torch.compile'd functions of tensors
    (static_decode._Fused; aot_eager here, inductor on a GPU) decode what the eager path does, for each family's
    layer shape (Qwen2's q/k/v biases and tied head, Qwen3's per-head norms); one compiled graph serves every layer."""
    model = _tiny(kind)
    reference = _greedy(Generator(copy.deepcopy(model), tok, max_batch_size=16, decoder="eager"))
    fused = Generator(model, tok, max_batch_size=4, decoder="static", decode_fusion="aot_eager")
    _assert_same(reference, _greedy(fused))
    dec = fused.static_decoder()
    assert dec is not None and dec.fused is not None and dec.plan[0].gate_up is not None


def test_sampled_rows_with_seeds_match_eager(tok):
    model = _tiny("qwen2")
    sp = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "max_new_tokens": 20, "sampling_seed": 7}
    want = Generator(copy.deepcopy(model), tok, decoder="eager").generate(PROMPTS, sp, n=2)
    got = Generator(model, tok, max_batch_size=3, decoder="static").generate(PROMPTS, sp, n=2)
    _assert_same(want, got)


def test_finished_rows_leave_and_waiting_rows_take_their_slots(tok, monkeypatch):
    model = _tiny("llama")
    gen = Generator(model, tok, max_batch_size=3, decoder="static")
    dec = gen.static_decoder()
    admitted, batches = [], []
    real_prefill, real_decode = dec.prefill, dec.decode
    monkeypatch.setattr(dec, "prefill", lambda p, starts, pad: admitted.append(list(starts)) or real_prefill(p, starts, pad))
    monkeypatch.setattr(dec, "decode", lambda t, pos, starts: batches.append(list(starts)) or real_decode(t, pos, starts))
    sps = [{"temperature": 0.0, "max_new_tokens": m, "ignore_eos": True} for m in (2, 9, 4, 6, 1, 3, 8)]
    prompts = [[5 + i, 6, 7 + i] for i in range(7)]
    recs = gen.generate(prompts, sps)
    single = Generator(copy.deepcopy(model), tok, decoder="eager")
    assert [r["output_ids"] for r in recs] == [single.generate([p], [sp])[0]["output_ids"] for p, sp in zip(prompts, sps)]
    slot = dec.regions.granule  # default sizing: every region is a slot of the longest row's bucket
    assert admitted[0] == [0, slot, 2 * slot]  # the first three fill the slots
    assert len(admitted) > 1 and all(len(s) < 3 for s in admitted[1:])  # later rows join behind running ones
    assert max(len(b) for b in batches) == 3 and any(b[0] != 0 for b in batches)  # a finished row's region reused
    assert dec.regions.in_use == 0  # every region given back
    # the loop's clock: one count a sampling step (each step's decode launch is the next one's logits, so the
    # steps are the decode calls + the final step with no next), its waits inside its wall
    clock = gen.decode_time
    assert clock["steps"] == len(batches) + 1, (clock, len(batches))
    assert 0 <= clock["device_wait_s"] <= clock["loop_s"] and clock["loop_s"] > 0


def test_pushed_weights_land_in_the_fused_tensors(tok):
    model = _tiny("qwen2")
    gen = Generator(model, tok, decoder="static")
    before = _greedy(gen)
    twin = copy.deepcopy(model)  # the same change applied to an unfused copy, run eagerly
    names = ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight",
             "model.layers.0.self_attn.v_proj.bias"]
    new = [(n, twin.state_dict()[n] * -3.0) for n in names]
    gen.load_named_tensors(new)
    twin.load_state_dict(dict(new), strict=False)
    after = _greedy(gen)
    lps = [[lp for lp, _, _ in r["output_token_logprobs"]] for r in (before[0], after[0])]
    assert lps[0] != lps[1]  # the push changed what the static path computes
    _assert_same(_greedy(Generator(twin, tok, decoder="eager")), after)
    for n, t in new:
        torch.testing.assert_close(gen.get_weight(n), t)


def test_replaced_model_tensors_make_a_new_decoder(tok):
    model = _tiny("llama")
    gen = Generator(model, tok, decoder="static")
    first = gen.static_decoder()
    assert not first.stale()
    model.double()  # every parameter gets a new tensor: the fused views are gone
    assert first.stale() and gen.static_decoder() is not first
    _assert_same(_greedy(Generator(copy.deepcopy(model), tok, decoder="eager")), _greedy(gen))


def test_abort_ends_a_static_row(tok):
    gen = Generator(_tiny("llama"), tok, decoder="static")
    steps = []

    def checkpoint(rids):
        steps.append(rids)
        return {"r1": "stop now"} if len(steps) == 3 and "r1" in rids else {}

    recs = gen.generate([[5, 6], [7, 8]], {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True},
                        rids=["r0", "r1"], checkpoint=checkpoint)
    assert recs[1]["finish_reason"] == {"type": "abort", "message": "stop now"} and len(recs[1]["output_ids"]) == 3
    assert recs[0]["finish_reason"]["type"] == "length" and len(recs[0]["output_ids"]) == 10


def test_decoder_choice(tiny_policy, tok):
    from transformers import GPT2Config, GPT2LMHeadModel

    llama = load_causal_lm(str(tiny_policy))
    assert Generator(llama, tok).static_decoder() is None  # auto: eager on CPU
    assert Generator(llama, tok, decoder="eager").static_decoder() is None
    with pytest.raises(ValueError, match="CUDA"):
        Generator(llama, tok, decoder="graphs").static_decoder()
    with pytest.raises(ValueError, match="decoder must be"):
        Generator(llama, tok, decoder="fast")
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=16, n_layer=1, n_head=2)).eval()
    assert "gpt2" in StaticDecoder.supports(gpt2)
    with pytest.raises(ValueError, match="cannot run this model: model type 'gpt2'"):
        Generator(gpt2, tok, decoder="static").static_decoder()


def test_batch_buckets_and_cache_growth():
    assert [batch_bucket(n) for n in (1, 3, 5, 16, 17, 40, 64, 65, 200, 256)] == [1, 4, 8, 16, 32, 48, 64, 96, 224, 256]
    dec = StaticDecoder(_tiny("llama"), max_batch_size=4, graphs=False)
    dec.reserve(4 * 256, granule=256)
    assert dec.capacity == 1024 and dec.k.shape == (2, 1025, 4, 8)  # [L, positions + scratch, H_kv, D]
    dec.reserve(4 * 512, granule=512)
    assert dec.capacity == 2048 and dec.regions.granule == 512
    dec.release()
    assert dec.capacity == 0 and dec.nbytes() == 0


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_bfloat16_kv_cache_under_float32_weights(kind, tok):
    """rollout.kv_cache_dtype=bf16: the pool holds keys and values in bfloat16 (half the bytes, the same positions)
    while the weights and products stay float32. Greedy rows decode the float32 cache's tokens here (random tiny
    weights, well-separated logits) and their log-probs move by bfloat16's rounding only: nonzero (the rounded
    cache is what the steps read) and within 2e-2. The eager path has no such cache: it says it keeps float32."""
    model = _tiny(kind)
    reference = _greedy(Generator(copy.deepcopy(model), tok, max_batch_size=4, decoder="static"))
    gen = Generator(model, tok, max_batch_size=4, decoder="static", kv_dtype=torch.bfloat16)
    out = _greedy(gen)
    dec = gen.static_decoder()
    assert dec is not None and dec.k.dtype == torch.bfloat16 and dec.v.dtype == torch.bfloat16
    assert dec.kernel == "gather" and gen.kv_cache_dtype() == "bfloat16"
    ref_dec = Generator(copy.deepcopy(model), tok, max_batch_size=4, decoder="static")
    ref_dec.generate([[5, 6]], [{"max_new_tokens": 1}])
    assert 2 * dec.nbytes() == ref_dec.static_decoder().nbytes()  # the same positions in half the bytes
    agree = [a == b for x, y in zip(reference, out) for a, b in zip(x["output_ids"], y["output_ids"])]
    assert sum(agree) >= 0.95 * len(agree), (sum(agree), len(agree))
    same = [(x, y) for x, y in zip(reference, out) if x["output_ids"] == y["output_ids"]]
    got = torch.tensor([lp for _, y in same for lp, _, _ in y["output_token_logprobs"]])
    want = torch.tensor([lp for x, _ in same for lp, _, _ in x["output_token_logprobs"]])
    diff = (got - want).abs().max().item()
    assert 0 < diff < 2e-2, diff
    assert Generator(copy.deepcopy(model), tok, decoder="eager", kv_dtype=torch.bfloat16).kv_cache_dtype() == "float32"
