"""The KV pool of the static decoder (engines/embedded/kv_pool.py) and admission by free KV capacity, on CPU.

Rows take a region of one pool sized by a budget; more rows than fit wait and join as others finish, none is
lost, and what each row generates does not depend on who shared the batch. The default (no budget) keeps the
first static cache's layout and outputs.
"""
from __future__ import annotations

import copy
import hashlib
import json

import pytest
import torch

from reflow.engines.embedded.generator import Generator
from reflow.engines.embedded.kv_pool import RegionPool, bytes_per_position
from reflow.infra.config.schema import RolloutConfig
from reflow.rl.demo_policy import build_tokenizer
from tests.test_static_decode import LENGTHS, PROMPTS, _assert_same, _greedy, _tiny


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_region_pool_first_fit_and_merging():
    pool = RegionPool(1000, granule=100)
    assert [pool.alloc(n) for n in (150, 100, 1, 300)] == [0, 200, 300, 400]  # 200 + 100 + 100 + 300
    assert pool.alloc(301) is None and pool.in_use == 700  # 300 left, 400 asked
    pool.free(200)
    assert pool.alloc(250) == 700  # the 100 hole at 200 is too small: the tail's 300
    assert pool.alloc(150) is None  # 200 asked, one 100 hole left
    pool.free(0)
    pool.free(300)  # merges with the holes at 0..200 and 200..300: one hole 0..400
    assert pool.alloc(400) == 0 and pool.in_use == 1000
    for start in (0, 400, 700):
        pool.free(start)
    assert pool.in_use == 0 and pool.alloc(1000) == 0  # everything merged back into one region
    assert not pool.fits_ever(1001) and pool.fits_ever(1000)
    assert bytes_per_position(28, 2, 128, torch.bfloat16) == 28 * 1024  # Qwen2.5-1.5B: 28 KiB a token


def test_region_pool_grows_a_region_into_the_hole_after_it():
    pool = RegionPool(100, granule=10)
    a, b = pool.alloc(15), pool.alloc(10)  # 0..20, 20..30
    assert (a, b, pool.length(a)) == (0, 20, 20)
    assert pool.grow(a, 20) and pool.length(a) == 20  # already that long: nothing to take
    assert not pool.grow(a, 21)  # b sits right after it
    assert pool.grow(b, 31) and pool.length(b) == 40 and pool.in_use == 60  # 30..60 of the tail hole
    assert pool.alloc(45) is None and pool.alloc(40) == 60  # what is left: 60..100
    assert not pool.grow(b, 41)  # the region at 60 is in the way now
    pool.free(60)
    assert pool.grow(b, 80) and pool.length(b) == 80 and not pool.grow(b, 81)  # 20..100: the pool's end
    pool.free(a)
    pool.free(b)
    assert pool.in_use == 0 and pool.alloc(100) == 0  # the grown region merged back like any other


def _rows_at_once(gen: Generator, monkeypatch) -> list[int]:
    """Patches the generator's decoder to record how many rows each decode step ran."""
    dec = gen.static_decoder()
    seen: list[int] = []
    real = dec.decode
    monkeypatch.setattr(dec, "decode", lambda t, pos, starts: seen.append(len(starts)) or real(t, pos, starts))
    return seen


def test_rows_that_do_not_fit_wait_and_none_is_lost(tok, monkeypatch):
    model = _tiny("qwen2")
    want = _greedy(Generator(copy.deepcopy(model), tok, max_batch_size=16, decoder="eager"))
    # every row (prompt <= 8, max_new <= 70) needs one 256-position region: 2 of the 9 rows fit at once
    gen = Generator(model, tok, max_batch_size=16, decoder="static", kv_tokens=512)
    seen = _rows_at_once(gen, monkeypatch)
    got = _greedy(gen)
    _assert_same(want, got)
    assert len(got) == 9 and max(seen) == 2  # batch rows were free, KV room was not
    assert gen.static_decoder().regions.in_use == 0


def test_tight_regions_do_not_overrun_their_neighbours(tok, monkeypatch):
    """Regions of 16 positions back to back (granule 16): a prefill or a repeated prompt writing past a row's
    own region would change its neighbour's answers."""
    model = _tiny("llama")
    sps = [{"temperature": 0.0, "max_new_tokens": m, "ignore_eos": True} for m in (9, 3, 12, 5)]
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [20], [21, 22]]
    want = Generator(copy.deepcopy(model), tok, decoder="eager").generate(prompts, sps, n=[2, 1, 3, 1])
    gen = Generator(model, tok, max_batch_size=8, decoder="static", kv_tokens=64)
    gen.static_decoder().reserve(64, granule=16)
    seen = _rows_at_once(gen, monkeypatch)
    _assert_same(want, gen.generate(prompts, sps, n=[2, 1, 3, 1]))
    assert max(seen) == 4  # 4 regions of 16 in 64 positions: the 7 rows took turns


def test_budget_and_default_give_the_same_samples(tok):
    """Seeded sampling: a row's tokens depend on its seed and position, not on its batch-mates."""
    model = _tiny("qwen3")
    sp = {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 40, "sampling_seed": 11}
    default = Generator(copy.deepcopy(model), tok, max_batch_size=4, decoder="static").generate(PROMPTS, sp, n=3)
    budget = Generator(model, tok, max_batch_size=4, decoder="static", kv_tokens=768).generate(PROMPTS, sp, n=3)
    _assert_same(default, budget)


# Token ids of _greedy and a seeded sampled batch from the static decoder before the KV pool existed
# (commit 6517621, torch 2.13 on CPU): the default settings must keep producing exactly these.
BEFORE = {"llama": "10b926e4025366d2", "qwen2": "ed74a29822046fc0", "qwen3": "df40538ad05ce578"}


@pytest.mark.parametrize("kind", sorted(BEFORE))
def test_default_settings_reproduce_the_slot_cache(kind, tok):
    gen = Generator(_tiny(kind), tok, max_batch_size=4, decoder="static")
    sps = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in LENGTHS]
    recs = gen.generate(PROMPTS, sps, n=[2, 1, 3, 2, 1])
    recs += gen.generate(PROMPTS, {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 40, "sampling_seed": 7}, n=2)
    ids = json.dumps([r["output_ids"] for r in recs])
    assert hashlib.sha256(ids.encode()).hexdigest()[:16] == BEFORE[kind]
    dec = gen.static_decoder()  # the layout too: 4 slots of the longest row's bucket (8 + 70 -> 256)
    assert dec.regions.granule == 256 and dec.capacity == 4 * 256


def test_a_row_that_can_never_fit_is_refused(tok):
    gen = Generator(_tiny("llama"), tok, decoder="static", kv_tokens=128)
    with pytest.raises(ValueError, match="cannot fit the KV cache of 128 tokens"):
        gen.generate([[5, 6]], {"max_new_tokens": 200, "ignore_eos": True})
    assert gen.generate([[5, 6]], {"max_new_tokens": 5, "ignore_eos": True})[0]["completion_tokens"] == 5
    with pytest.raises(ValueError, match="kv_mem_fraction must be in"):
        Generator(_tiny("llama"), tok, kv_mem_fraction=1.5)


def test_release_frees_the_pool_and_the_next_generate_makes_it_again(tok):
    gen = Generator(_tiny("llama"), tok, decoder="static", kv_tokens=1024)
    first = gen.generate([[5, 6, 7]], {"temperature": 0.0, "max_new_tokens": 8})
    dec = gen.static_decoder()
    assert dec.nbytes() == 2 * 2 * 1025 * 4 * 8 * 4  # K and V, [L, N + 1, H_kv, D] float32
    dec.release()
    assert dec.nbytes() == 0 and dec.regions is None
    assert gen.generate([[5, 6, 7]], {"temperature": 0.0, "max_new_tokens": 8})[0]["output_ids"] == first[0]["output_ids"]
    assert dec.capacity == 1024


def test_sglang_reads_the_same_memory_fraction():
    assert RolloutConfig(backend="sglang", kv_mem_fraction=0.6).mem_fraction_static == 0.6
    assert RolloutConfig(kv_mem_fraction=0.6).mem_fraction_static == 0.8  # embedded: its own pool
    with pytest.raises(ValueError, match="disagree"):
        RolloutConfig(backend="sglang", kv_mem_fraction=0.6, mem_fraction_static=0.7)
    with pytest.raises(ValueError):
        RolloutConfig(kv_mem_fraction=1.0)
    assert RolloutConfig(kv_reserve=0.25).kv_reserve == 0.25  # the embedded engine's growing regions
    with pytest.raises(ValueError, match="schedule_conservativeness"):  # SGLang admits on its own estimate
        RolloutConfig(backend="sglang", kv_reserve=0.25)


@pytest.mark.parametrize("precision", ["highest", "high"])
def test_triton_decode_attention_matches_sdpa_per_region(precision):
    """The GPU decode kernel (engines/embedded/decode_attention.py) against SDPA over each row's own keys, with
    the keys split 1, 3 and 4 ways, on float32 regions (an fp32 engine's): IEEE products at torch's default
    float32 matmul precision, TF32 ones at "high" (trainer.tf32). Runs where Triton is installed: on a GPU, or
    on CPU under TRITON_INTERPRET=1 (set before reflow is imported; triton 3.9's interpreter runs it, 3.6's does
    not); skipped elsewhere (the CPU build of torch has no Triton)."""
    import os

    from reflow.engines.embedded import decode_attention as TD

    if not TD.available() or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("needs Triton on a GPU, or TRITON_INTERPRET=1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    N, H, G, D = 3000, 2, 6, 128
    k, v = torch.randn(N + 1, H, D, generator=g).to(dev), torch.randn(N + 1, H, D, generator=g).to(dev)
    start = torch.tensor([0, 700, 1500, 2000, N], device=dev)  # the last: one key at the scratch position
    used = torch.tensor([300, 513, 1, 900, 1], dtype=torch.int32, device=dev)
    q = torch.randn(5, H, G, D, generator=g).to(dev)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        assert TD.ieee_products(q.dtype) == (precision == "highest")
        got = [TD.decode_attention(q, k, v, start, used, 1024, 0.088, splits) for splits in (1, 3, 4)]
    finally:
        torch.set_float32_matmul_precision(before)
    tol = 1e-3 if precision == "highest" else 1e-2  # TF32: 10-bit mantissas in the products
    for got_s in got:
        for r in range(5):
            keys = slice(int(start[r]), int(start[r] + used[r]))
            want = torch.nn.functional.scaled_dot_product_attention(
                q[r], k[keys].transpose(0, 1), v[keys].transpose(0, 1), scale=0.088)  # [H, G, D]
            torch.testing.assert_close(got_s[r], want, rtol=tol, atol=tol)


def test_decode_kernel_reads_bfloat16_regions_under_float32_queries():
    """rollout.kv_cache_dtype=bf16 under an fp32 engine: the kernel rounds q to the regions' bfloat16 for q.k and
    keeps the softmax and sums in float32; against SDPA in float32 over the same (rounded) keys and values, within
    bfloat16's rounding of q. Runs where Triton is installed, as the test above."""
    import os

    from reflow.engines.embedded import decode_attention as TD

    if not TD.available() or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("needs Triton on a GPU, or TRITON_INTERPRET=1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1)
    N, H, G, D = 2000, 12, 1, 64  # the scratchpad policy's shape: 12 heads, no grouping
    k = torch.randn(N + 1, H, D, generator=g).to(torch.bfloat16).to(dev)
    v = torch.randn(N + 1, H, D, generator=g).to(torch.bfloat16).to(dev)
    start = torch.tensor([0, 400, 1200], device=dev)
    used = torch.tensor([377, 700, 64], dtype=torch.int32, device=dev)
    q = torch.randn(3, H, G, D, generator=g).to(dev)
    for splits in (1, 2):
        got = TD.decode_attention(q, k, v, start, used, 1024, 0.125, splits)
        assert got.dtype == torch.float32
        for r in range(3):
            keys = slice(int(start[r]), int(start[r] + used[r]))
            want = torch.nn.functional.scaled_dot_product_attention(
                q[r], k[keys].float().transpose(0, 1), v[keys].float().transpose(0, 1), scale=0.125)
            torch.testing.assert_close(got[r], want, rtol=2e-2, atol=2e-2)


def test_a_call_that_fails_midway_leaves_the_pool_free(tok):
    gen = Generator(_tiny("llama"), tok, max_batch_size=4, decoder="static", kv_tokens=512)
    sp = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}

    def boom(rids):
        raise RuntimeError("checkpoint failed")

    with pytest.raises(RuntimeError, match="checkpoint failed"):
        gen.generate([[5, 6], [7, 8]], sp, checkpoint=boom)
    assert gen.static_decoder().regions.in_use == 2 * 256  # the failed call's rows still hold their regions
    recs = gen.generate([[5, 6], [7, 8]], sp)  # both fit again: the next call starts with a free pool
    assert [r["completion_tokens"] for r in recs] == [6, 6]


def test_a_new_kv_budget_recreates_a_long_lived_clusters_engines():
    """The budget shapes the engine actor itself (its pool is sized once): on a long-lived cluster a run with another
    one must not reuse the engines of the last (infra/cluster/actors.actor_spec)."""
    from reflow.infra.cluster.actors import actor_spec, fingerprint
    from reflow.infra.config.schema import RunConfig

    base = RunConfig.model_validate({})
    budget = RunConfig.model_validate({"rollout": {"kv_mem_fraction": 0.6}})
    assert actor_spec(budget)["engines"]["kv_mem_fraction"] == 0.6
    assert fingerprint(budget) != fingerprint(base)


def test_prefill_groups_by_length_give_the_same_samples(tok, monkeypatch):
    """A batch whose prompts differ widely in length (a partial rollout continues samples of hundreds of tokens
    beside new prompts of a few) is prefilled in length-sorted groups of bounded padded size, not one call padded
    to the longest; every row decodes as it would after one padded call."""
    from reflow.engines.embedded import generator as G

    assert G.prefill_groups([5] * 10) == [list(range(10))]  # fits: one call, the order kept
    assert G.prefill_groups([3000, 10, 10, 2000, 10], budget=4000) == [[0], [3, 1], [2, 4]]
    assert G.prefill_groups([9000, 1], budget=4000) == [[0], [1]]  # longer than the budget: alone
    model = _tiny("qwen2")
    prompts = [[3 + (7 * i + n) % 90 for i in range(n)] for n in (150, 4, 90, 2, 7, 120)]
    sps = [{"temperature": 0.0, "max_new_tokens": m, "ignore_eos": True} for m in (20, 40, 9, 30, 25, 12)]
    one = Generator(copy.deepcopy(model), tok, max_batch_size=8, decoder="static").generate(prompts, sps)
    calls: list[int] = []
    gen = Generator(model, tok, max_batch_size=8, decoder="static")
    monkeypatch.setattr(G, "PREFILL_TOKENS", 300)  # 6 x 150 padded > 300: groups
    dec = gen.static_decoder()
    real = dec.prefill
    monkeypatch.setattr(dec, "prefill", lambda p, s, pad: calls.append(len(p)) or real(p, s, pad))
    _assert_same(one, gen.generate(prompts, sps))
    assert calls == [2, 3, 1], calls  # [150, 120] (2 x 150), [90, 7, 4] (3 x 90), [2]


@pytest.mark.parametrize("decoder, kv_tokens, batch", [("static", None, 16), ("static", 512, 16), ("eager", None, 3)],
                         ids=["static", "static-rows-wait", "eager-chunks"])
def test_a_closing_call_stops_once_enough_groups_have_finished(tok, decoder, kv_tokens, batch):
    """Generator.generate(close=(group per prompt, K)): decoding stops at the step where K groups have every row
    finished, in both decode paths and whether rows run at once, wait for KV room or run in chunks; the rows cut
    (finish abort, message CLOSED) hold a prefix of what they draw uncut, the rest exactly that."""
    from reflow.engines.rollout_client import CLOSED

    model = _tiny("qwen2")
    sps = [{"temperature": 0.0, "max_new_tokens": m, "ignore_eos": True} for m in LENGTHS]  # 30, 7, 70, 3, 12
    n = [2, 1, 3, 2, 1]
    whole = Generator(copy.deepcopy(model), tok, max_batch_size=16, decoder="eager").generate(PROMPTS, sps, n=n)
    gen = Generator(model, tok, max_batch_size=batch, decoder=decoder, kv_tokens=kv_tokens)
    groups = [0, 1, 1, 2, 3]  # prompts 1 and 2 form one group; it completes when prompt 2's 70 tokens are done
    got = gen.generate(PROMPTS, sps, n=n, close=(groups, 2))
    row_group = [g for g, k in zip(groups, n) for _ in range(k)]
    finished = {g: all(r["finish_reason"]["type"] == "length" for r, h in zip(got, row_group) if h == g)
                for g in set(groups)}
    assert sum(finished.values()) >= 2
    # rows together: groups 2 (3 tokens) and 3 (12) first; in chunks of 3 rows, run one after another: 0, then 1
    assert finished[1] == (decoder == "eager")
    cut = [r for r in got if r["finish_reason"] == {"type": "abort", "message": CLOSED}]
    assert cut and all(r["finish_reason"]["type"] in ("length", "abort") for r in got)
    for a, b in zip(whole, got):
        assert b["output_ids"] == a["output_ids"][:len(b["output_ids"])]
        assert (b["output_ids"] == a["output_ids"]) == (b["finish_reason"]["type"] == "length")
    if decoder == "static" and kv_tokens is None:  # all rows at once: cut at the step group 3 completes
        assert {len(r["output_ids"]) for r in cut} == {12}
    with pytest.raises(ValueError, match="one id per prompt"):
        gen.generate(PROMPTS, sps, n=n, close=([0, 1], 2))


def _moves_seen(gen: Generator, monkeypatch) -> list[tuple[int, int]]:
    """Patches the decoder to record, each step, (rows decoded, rows sitting it out on the scratch position)."""
    dec = gen.static_decoder()
    seen: list[tuple[int, int]] = []
    real = dec.decode

    def decode(t, pos, starts):
        seen.append((len(starts), sum(s == dec.capacity for s in starts)))
        return real(t, pos, starts)
    monkeypatch.setattr(dec, "decode", decode)
    return seen


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_regions_that_grow_as_rows_go_answer_as_whole_ones(kind, tok, monkeypatch):
    """kv_reserve 0.1: a row is admitted with room for a tenth of its new tokens and grows its region as it reaches
    the end, in place where the hole after it is free, else moved (its K/V copied), else it leaves the batch and is
    prefilled again with what it generated. Greedy answers are the eager decoder's token for token; more rows fit at
    once than whole regions allow; no region is left taken."""
    model = _tiny(kind)
    want = _greedy(Generator(copy.deepcopy(model), tok, max_batch_size=16, decoder="eager"))
    whole = Generator(copy.deepcopy(model), tok, max_batch_size=16, decoder="static", kv_tokens=160)
    whole.static_decoder().reserve(160, granule=16)
    at_once_whole = _rows_at_once(whole, monkeypatch)
    _assert_same(want, _greedy(whole))
    gen = Generator(model, tok, max_batch_size=16, decoder="static", kv_tokens=160, kv_reserve=0.1)
    gen.static_decoder().reserve(160, granule=16)
    seen = _moves_seen(gen, monkeypatch)
    _assert_same(want, _greedy(gen))
    moves = gen.kv_moves
    assert moves["grown"] > 0 and moves["moved"] > 0 and moves["preempted"] > 0, moves
    assert max(n - idle for n, idle in seen) > max(at_once_whole)  # rows decoding together
    assert any(idle for _, idle in seen)  # a row sat a step out while others went on
    assert gen.static_decoder().regions.in_use == 0
    again = gen.generate(PROMPTS[:2], {"temperature": 0.0, "max_new_tokens": 30, "ignore_eos": True})
    for got, w in zip(again, (want[0], want[2])):  # the pool whole again: the same greedy answers, longer
        assert got["output_ids"][:len(w["output_ids"])] == w["output_ids"] and got["completion_tokens"] == 30


def test_growing_regions_keep_seeded_samples_and_a_closing_call(tok):
    """Seeded sampling depends on a row's seed and position only, so growth, moves and rows sent back give the same
    tokens as whole regions; under a closing call (partial rollouts) a row sent back and then cut comes back with
    the tokens it had, a prefix of its uncut answer."""
    model = _tiny("qwen3")
    sp = {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 40, "sampling_seed": 11, "ignore_eos": True}
    whole = Generator(copy.deepcopy(model), tok, max_batch_size=8, decoder="static", kv_tokens=256)
    whole.static_decoder().reserve(256, granule=16)
    want = whole.generate(PROMPTS, sp, n=3)
    gen = Generator(model, tok, max_batch_size=8, decoder="static", kv_tokens=256, kv_reserve=0.2)
    gen.static_decoder().reserve(256, granule=16)
    _assert_same(want, gen.generate(PROMPTS, sp, n=3))
    assert gen.kv_moves["preempted"] > 0, gen.kv_moves
    before = dict(gen.kv_moves)
    cut = gen.generate(PROMPTS, sp, n=3, close=(list(range(len(PROMPTS))), 2))
    assert gen.kv_moves["preempted"] > before["preempted"]
    reasons = [r["finish_reason"]["type"] for r in cut]
    assert reasons.count("length") >= 6 and "abort" in reasons  # two groups of three complete, the rest cut
    for full, part in zip(want, cut):
        assert full["output_ids"][:len(part["output_ids"])] == part["output_ids"]
    assert gen.static_decoder().regions.in_use == 0


def test_kv_reserve_is_checked(tok):
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="kv_reserve must be in"):
            Generator(_tiny("llama"), tok, kv_reserve=bad)


def test_the_sampling_kernel_draws_as_sample_tokens():
    """The GPU sampling kernel (engines/embedded/sample_kernel.py) against exact sampling and sample_tokens's torch
    path, on the same logits and draws: greedy rows take their first maximum; a sampled row takes the token whose
    interval of the cumulative distribution (float64 here) holds its draw, up to float32 rounding (the kernel sums
    in another order than torch's cumsum, so a draw within ~1e-5 of a boundary may land on the neighbour), the
    same token as sample_tokens elsewhere; draws at either end give the first token, and the last or the mode;
    logprobs are log_softmax(x / T); vocabularies across and within its blocks; -inf logits (min_new_tokens's
    mask). Runs where Triton is installed (a GPU, or CPU under TRITON_INTERPRET=1); skipped elsewhere, as the
    decode kernel's test."""
    import os

    from reflow.engines.embedded import sample_kernel as SK
    from reflow.engines.embedded.sampling import SAMPLING_EPS, TOP_K_ALL, sample_tokens

    if not SK.available() or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("needs Triton on a GPU, or TRITON_INTERPRET=1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    B = 40
    for V in (5000, 4096, 37, 9000):
        logits = (torch.randn(B, V, generator=g) * 3).to(dev)
        logits[3, :30] = float("-inf")  # a row's masked tokens
        logits[4, 7] = logits[4, 9] = logits[4].max() + 1.0  # a tie for the maximum: the first one
        temp = (torch.rand(B, generator=g) * 1.5 + 0.3).to(dev)
        temp[0] = temp[4] = 0.0  # greedy rows
        u = torch.rand(B, generator=g, dtype=torch.float64).to(dev)
        u[5], u[6] = 2.0**-53, 1 - 2.0**-53  # draws at either end
        ones, alls, zeros = torch.ones(B, device=dev), torch.full((B,), TOP_K_ALL, device=dev), torch.zeros(B, device=dev)
        want = sample_tokens(logits.clone(), temp, ones, alls, zeros, u, filtered=False)
        got = sample_tokens(logits.clone(), temp, ones, alls, zeros, u, filtered=False, fused=True)
        t = torch.where(temp < SAMPLING_EPS, 1.0, temp).double()
        exact = torch.log_softmax(logits.double() / t[:, None], -1)  # [B, V]
        cdf = exact.exp().cumsum(-1)  # [B, V]
        for b in range(B):
            tok, ref = int(got[0][b]), int(want[0][b])
            if temp[b] == 0:
                assert tok == ref == int(logits[b].argmax()), (V, b)
            elif b == 5:
                assert tok == ref == int((cdf[b] > 0).nonzero()[0]), (V, b)
            elif b == 6:
                assert tok in (V - 1, int(logits[b].argmax())), (V, b)
            else:
                lo, hi = (float(cdf[b, tok - 1]) if tok else 0.0), float(cdf[b, tok])
                assert lo - 1e-5 <= float(u[b]) <= hi + 1e-5, (V, b, lo, float(u[b]), hi)
                rlo = float(cdf[b, ref - 1]) if ref else 0.0
                if min(abs(float(u[b]) - rlo), abs(float(u[b]) - float(cdf[b, ref]))) > 1e-5:
                    assert tok == ref, (V, b)  # away from a boundary: sample_tokens's token
        torch.testing.assert_close(got[1].double(), exact.gather(1, got[0][:, None])[:, 0], rtol=1e-5, atol=1e-5)
        assert int(got[0][4]) == 7 and int(got[0][3]) >= 30
        greedy = SK.sample(logits, torch.zeros(B, device=dev), None, SAMPLING_EPS)  # every row greedy, no draws
        assert greedy[0].tolist() == logits.argmax(-1).tolist()
        torch.testing.assert_close(greedy[1], torch.log_softmax(logits, -1).gather(1, greedy[0][:, None])[:, 0])
