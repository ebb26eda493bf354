"""DeepSpeed trainer ranks on a real local Ray cluster (CPU, gloo).

The numbers are checked against a plain single-process torch computation of the same objective:
at the first mini-batch the policy equals the old policy, so the trainer's pre-clip gradient norm
must equal that of `policy_loss` over the *whole* batch. That holds only if the loss is normalised
by the global token count across micro-batches and ranks.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import ray
import torch

from reflow.engines.hf_io import fp32_lm_head, load_causal_lm, load_tokenizer
from reflow.engines.train.group import TrainerGroup
from reflow.engines.train.settings import RankSettings
from reflow.engines.train.trainer import ds_config, lr_multiplier
from reflow.engines.weights.settings import PushSettings
from reflow.rl.algorithms import ReinforcePPConfig
from reflow.rl.losses import LossSettings, aggregate, entropy_from_logits, kl_estimate, policy_loss, token_logprobs
from reflow.rl.types import RolloutBatch, to_train_tensors

pytestmark = pytest.mark.slow

NAMESPACE = "test-trainer"
TEMPERATURE = 0.7
# Prompts and responses of different lengths, so per-micro-batch means differ from the global mean.
PROBLEMS = [("12+34=", "46<eos>"), ("5+7=", "1"), ("99+1=", "100<eos>"), ("3+3=", "6<eos>"),
            ("40+2=", "42"), ("7+8=", "15<eos>"), ("11+11=", "2222"), ("60+39=", "9<eos>")]
ADVANTAGES = [1.0, -0.5, 0.3, -1.2, 0.8, -0.1, 1.5, -1.0]

RANK_KW = dict(precision="fp32", lr=1e-3, lr_schedule="constant", warmup_steps=0, total_steps=10,
               weight_decay=0.01, grad_clip=1.0, micro_batch_size=2, threads=1, seed=0,
               zero3_param_persistence_threshold=0)  # partition even this tiny model's tensors


def _train_kw(pad_id: int, minibatches: int = 1, kl_in_reward: float = 0.0, **loss) -> dict:
    """train_iteration's arguments: `loss` are LossSettings fields (temperature TEMPERATURE unless
    given); kl_in_reward > 0 trains as REINFORCE++ with KL in the reward."""
    loss = {"temperature": TEMPERATURE} | loss
    algorithm = ReinforcePPConfig(kl_in_reward=kl_in_reward, kl_estimator=loss.get("kl_estimator", "low_var_kl")) \
        if kl_in_reward else None
    return dict(minibatches=minibatches, pad_id=pad_id, loss=LossSettings(**loss), algorithm=algorithm)


def _batch(policy, advantages=ADVANTAGES, problems=PROBLEMS) -> RolloutBatch:
    tok = load_tokenizer(str(policy))
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts, responses = zip(*problems)
    return RolloutBatch(
        group_index=[i // 2 for i in range(len(problems))], prompt_text=list(prompts),
        prompt_ids=[ids(p) for p in prompts], response_text=list(responses),
        response_ids=[ids(r) for r in responses], rollout_logprobs=[[0.0] * len(ids(r)) for r in responses],
        finish_reason=["stop"] * len(problems), label=[None] * len(problems), advantages=list(advantages))


def _reference(policy, named, batch, kl_coef=0.0, entropy_coef=0.0, agg="token-mean", autocast=False,
               fp32_head=False):
    """Single-process objective on the whole batch with weights `named`: (batch with engine-like
    rollout logprobs at TEMPERATURE, loss, pre-clip gradient norm). `autocast`: the forward under
    torch.autocast(bf16), as HF Trainer's bf16=True runs it; `fp32_head`: its LM head in float32 (fp32_lm_head)."""
    model = load_causal_lm(str(policy)).eval()
    model.load_state_dict(dict(named))
    if fp32_head:
        fp32_lm_head(model)
    pad = load_tokenizer(str(policy)).pad_token_id
    t = to_train_tensors(batch, pad)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        logits = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).logits[:, :-1]  # [B, T-1, V]
    logp = token_logprobs(logits, t["input_ids"][:, 1:], TEMPERATURE)  # [B, T-1]
    mask = t["loss_mask"]
    pg, _ = policy_loss(logp, logp.detach(), t["advantages"], mask, 0.2, 0.2, agg)
    kl = aggregate(kl_estimate(logp, logp.detach(), "low_var_kl"), mask, agg)
    ent = aggregate(entropy_from_logits(logits / TEMPERATURE), mask, agg)
    loss = pg + kl_coef * kl - entropy_coef * ent
    loss.backward()
    norm = math.sqrt(sum(float(p.grad.square().sum()) for p in model.parameters() if p.grad is not None))
    rollout = [logp[i][mask[i] != 0].tolist() for i in range(len(batch))]
    return batch.with_(rollout_logprobs=rollout), float(loss.detach()), norm


def _create(prefix, num_ranks, policy, ref_model_path=None, **kw) -> TrainerGroup:
    return TrainerGroup.create(num_ranks, NAMESPACE, prefix, model_path=str(policy), init_timeout_s=300,
                               settings=RankSettings(**(RANK_KW | kw)), ref_model_path=ref_model_path)


def _one_iteration(group, policy, batch=None, **train_over):
    """Train one iteration; check it against the reference and the ranks against each other."""
    named = ray.get(group.named_weights()[0])
    batch, ref_loss, ref_norm = _reference(policy, named, batch or _batch(policy), train_over.get("kl_coef", 0.0),
                                           train_over.get("entropy_coef", 0.0))
    before = ray.get(group.weights_checksum())
    pad = load_tokenizer(str(policy)).pad_token_id
    metrics = ray.get(group.train_iteration(batch, **_train_kw(pad, **train_over)))
    after = ray.get(group.weights_checksum())
    m = metrics[0]
    assert all(x == m for x in metrics), "ranks must return the same all-reduced metrics"
    assert all(math.isfinite(v) for v in m.values()), m
    assert m["response_tokens"] == sum(len(r) for r in batch.response_ids)
    assert m["logprob_mismatch"] < 1e-5 and m["logprob_mismatch_max"] < 1e-4  # same temperature scaling
    assert m["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
    assert m["loss"] == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and m["clip_frac"] == 0.0
    assert len(set(after)) == 1, "ranks disagree on the weights"
    assert after[0] != before[0], "the optimizer step changed nothing"
    return m


@pytest.fixture(scope="module")
def _zero3_group(ray_cluster, tiny_policy, tmp_path_factory):
    """One ZeRO-3 group (two ranks, a reference model) for the module, and a checkpoint of its first state."""
    from reflow.infra.config.schema import StorageConfig
    from reflow.infra.store.storage import ExperimentStore

    group = _create("z3", 2, tiny_policy, zero_stage=3, ref_model_path=str(tiny_policy))
    store = ExperimentStore.from_config(StorageConfig(root=f"file://{tmp_path_factory.mktemp('z3')}"), "z3-initial")
    manifest: dict = {}
    for part in ray.get(group.save_checkpoint(store, "initial")):
        manifest |= part
    yield group, store, manifest
    group.kill()


@pytest.fixture()
def zero3(_zero3_group):
    """The module's ZeRO-3 group back at its first state (weights, optimizer, step) for each test: the tests change
    the weights (a step, a fill), and one needs policy == reference, so without this they would depend on their
    order; a group of their own each cost two rank processes' start-up (~5 s of CPU each)."""
    group, store, manifest = _zero3_group
    ray.get(group.fetch_checkpoint(store, "initial", manifest))
    ray.get(group.load_checkpoint())
    return group


def test_lr_multiplier_and_config_checks():
    assert [lr_multiplier(s, "constant", 2, 10) for s in range(3)] == [0.5, 1.0, 1.0]
    assert lr_multiplier(2, "cosine", 2, 10) == 1.0 and lr_multiplier(10, "cosine", 2, 10) == pytest.approx(0.0)
    assert lr_multiplier(6, "linear", 2, 10) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="zero_stage >= 1"):
        ds_config(0, "bf16", 1.0, 2, 1, 0)
    mixed = ds_config(0, "bf16-mixed", 1.0, 2, 1, 0)  # fp32 weights: stage 0 is fine
    assert mixed["torch_autocast"]["dtype"] == "bfloat16" and "bf16" not in mixed
    with pytest.raises(ValueError, match="fp32, bf16 or bf16-mixed"):
        ds_config(1, "fp16", 1.0, 2, 1, 0)


@pytest.mark.parametrize("stage", [0, 2])
def test_two_ranks_one_iteration(ray_cluster, tiny_policy, stage):
    group = _create(f"z{stage}", 2, tiny_policy, zero_stage=stage)
    try:
        _one_iteration(group, tiny_policy, entropy_coef=0.01)
    finally:
        group.kill()


def test_zero3_one_iteration_with_reference_model(zero3, tiny_policy):
    m = _one_iteration(zero3, tiny_policy, kl_coef=0.1, kl_estimator="low_var_kl")
    assert m["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first step


def test_zero3_packed_micro_batches_with_an_empty_one_match_the_reference(ray_cluster, tiny_policy):
    """Packed (trainer.max_tokens_per_micro_batch): samples of 12, 5, 5 and 3 tokens over two ranks in 12-token
    rows: rank 0 holds the 12-token sample, rank 1 needs two rows, so rank 0 runs an empty micro-batch to keep
    ZeRO-3's collective passes matched. Loss, gradient norm and old log-probs equal the padded single-process
    reference's; the reference model's KL is 0 before the step."""
    from reflow.engines.train import packing

    problems = [("1+1=", "12345678"), ("1+1=", "2"), ("2+2=", "4"), ("9=", "1")]
    batch = _batch(tiny_policy, advantages=[1.0, -0.5, 0.7, -1.0], problems=problems)
    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    assert lengths == [12, 5, 5, 3]
    assert [] in packing.plan(lengths, 1, 2, 12).micros[0][0]  # the empty micro-batch this test is about
    group = _create("z3pack", 2, tiny_policy, zero_stage=3, ref_model_path=str(tiny_policy),
                    max_tokens_per_micro_batch=12)
    try:
        m = _one_iteration(group, tiny_policy, batch=batch, kl_coef=0.1, kl_estimator="low_var_kl", entropy_coef=0.01)
        assert m["kl"] == pytest.approx(0.0, abs=1e-6)
        assert m["logprob_mismatch_max"] < 1e-5
        # rows are exactly their samples (no compiled buckets); the empty micro-batch's two-token pass is the padding
        assert m["pad_fraction"] == pytest.approx(2 / (sum(lengths) + 2))
    finally:
        group.kill()


def test_nan_loss_raises_and_leaves_weights_untouched(zero3, tiny_policy):
    pad = load_tokenizer(str(tiny_policy)).pad_token_id
    # Sample 7 is on rank 1 only: rank 0 must skip its update too.
    bad = _batch(tiny_policy, advantages=ADVANTAGES[:7] + [float("nan")])
    before = ray.get(zero3.weights_checksum())
    with pytest.raises(ray.exceptions.RayTaskError, match=r"train_iteration #\d+, mini-batch 1/1: the loss was NaN"):
        ray.get(zero3.train_iteration(bad, **_train_kw(pad)))
    assert ray.get(zero3.weights_checksum()) == before
    # No NaN gradient survives into the next step.
    m = ray.get(zero3.train_iteration(_batch(tiny_policy), **_train_kw(pad)))[0]
    assert math.isfinite(m["grad_norm"]) and ray.get(zero3.weights_checksum()) != before


def test_save_hf_loads_with_transformers(zero3, tiny_policy, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    paths = ray.get(zero3.save_hf(str(tmp_path / "hf")))
    assert paths[0] == str(tmp_path / "hf") and paths[1] is None
    loaded = AutoModelForCausalLM.from_pretrained(paths[0]).state_dict()
    named = dict(ray.get(zero3.named_weights()[1]))  # rank 1's gathered view
    assert set(named) <= set(loaded)
    for name, tensor in named.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)
    assert AutoTokenizer.from_pretrained(paths[0]).pad_token == "<pad>"


def test_fill_weights_then_push_to_an_engine(zero3, tiny_policy):
    """ZeRO-3 gathered weights reach an embedded engine; a known constant proves they are the trainer's."""
    from reflow.engines.embedded.engine import EmbeddedEngine
    from reflow.engines.rollout_client import EngineClient

    engine = ray.remote(EmbeddedEngine).options(num_cpus=1).remote(str(tiny_policy), "trainer-test-engine")
    try:
        url, key = ray.get([engine.url.remote(), engine.api_key.remote()])
        assert ray.get(engine.ready.remote())
        ray.get(zero3.fill_weights(0.25))
        for named in ray.get(zero3.named_weights()):
            assert named and all(bool((t == 0.25).all()) for _, t in named)
        reports = ray.get(zero3.push_weights([url], "filled", PushSettings(bucket_bytes=32 << 10, verify="full"), key))
        assert reports[1] == {} and reports[0]["verified_tensors"] == len(named)
        assert EngineClient(url, api_key=key).get_weights_by_name("model.norm.weight") == pytest.approx([0.25] * 32)
    finally:
        ray.get(engine.shutdown.remote(), timeout=10)
        ray.kill(engine)


def _train_alike(policy, a: dict, b: dict, keys: tuple[str, ...]) -> tuple[dict, dict]:
    """Two single-rank groups built with RankSettings overrides `a` and `b` train two mini-batches
    (seq-mean-token-mean, an entropy bonus) on the same batch: equal `keys` metrics and weights. Their metrics."""
    pad = load_tokenizer(str(policy)).pad_token_id
    groups = [_create(f"alike-{'-'.join(f'{k}{v}' for k, v in kw.items())}", 1, policy, zero_stage=0, **kw)
              for kw in (a, b)]
    try:
        kw = _train_kw(pad, minibatches=2, loss_agg="seq-mean-token-mean", entropy_coef=0.01)
        batch = ray.put(_batch(policy))
        m_a, m_b = ray.get([g.train_iteration(batch, **kw)[0] for g in groups])
        for key in keys:
            assert m_b[key] == pytest.approx(m_a[key], rel=1e-5), key
        w_a, w_b = ray.get([g.named_weights()[0] for g in groups])
        for (name, x), (_, y) in zip(w_a, w_b):
            torch.testing.assert_close(y, x, msg=name)
        return m_a, m_b
    finally:
        for g in groups:
            g.kill()


def test_micro_batch_accumulation_matches_one_micro_batch(ray_cluster, tiny_policy):
    """Per step, 4 micro-batches of 1 sample must give the same update as 1 micro-batch of 4."""
    _train_alike(tiny_policy, {"micro_batch_size": 1}, {"micro_batch_size": 4}, ("loss", "pg_loss", "entropy", "grad_norm"))


def test_packed_micro_batches_train_like_padded_ones(ray_cluster, tiny_policy):
    """16-token packed rows against padded micro-batches of 4: the same losses, gradient norms and weights after
    two steps; packing pads less."""
    m_pad, m_pack = _train_alike(tiny_policy, {"micro_batch_size": 4}, {"max_tokens_per_micro_batch": 16},
                                 ("loss", "pg_loss", "entropy", "grad_norm", "response_tokens"))
    assert m_pack["pad_fraction"] == 0.0 < m_pad["pad_fraction"]


def test_bf16_zero2_two_ranks(ray_cluster, tiny_policy):
    pad = load_tokenizer(str(tiny_policy)).pad_token_id
    group = _create("bf16", 2, tiny_policy, zero_stage=2, precision="bf16", lr=1e-2)
    try:
        before = ray.get(group.weights_checksum())
        m = ray.get(group.train_iteration(_batch(tiny_policy), **_train_kw(pad)))[0]
        after = ray.get(group.weights_checksum())
        assert all(math.isfinite(v) for v in m.values()), m
        assert len(set(after)) == 1 and after[0] != before[0]
    finally:
        group.kill()


@pytest.mark.parametrize("fp32_head", [False, True])
def test_bf16_mixed_keeps_fp32_weights_and_computes_under_autocast(ray_cluster, tiny_policy, fp32_head):
    """precision=bf16-mixed: the weights (and so checkpoints and pushes) stay float32 and the training forward
    runs under torch.autocast(bf16): its loss and gradient norm are those of a single-process autocast forward,
    not of the float32 one (the two differ here by far more than the tolerance). With fp32_lm_head the head
    stays float32 inside that autocast (and the result differs from the bf16 head's by far more than the tolerance).
    trainer.tf32 (with the fp32 head here) reaches every rank's process (its products are float32 on CPU anyway)."""
    pad = load_tokenizer(str(tiny_policy)).pad_token_id
    group = _create(f"mixed{int(fp32_head)}", 2, tiny_policy, zero_stage=1, precision="bf16-mixed",
                    fp32_lm_head=fp32_head, tf32=fp32_head)
    try:
        want = "high" if fp32_head else "highest"
        assert [p["matmul_precision"] for p in ray.get(group.ping())] == [want, want]
        named = ray.get(group.named_weights()[0])
        assert {str(w.dtype) for _, w in named} == {"torch.float32"}
        batch, mixed_loss, mixed_norm = _reference(tiny_policy, named, _batch(tiny_policy), autocast=True,
                                                   fp32_head=fp32_head)
        _, fp32_loss, fp32_norm = _reference(tiny_policy, named, batch)
        _, _, other_norm = _reference(tiny_policy, named, batch, autocast=True, fp32_head=not fp32_head)
        # on this tiny model most of what autocast changes is the head's product: with the head in float32 the norm
        # is within 1e-4 of the float32 model's (3.51011 vs 3.51034; bf16 head 3.51453)
        assert fp32_head or abs(mixed_norm - fp32_norm) > 1e-3 * fp32_norm, "autocast changed nothing here: no test"
        assert abs(mixed_norm - other_norm) > 1e-3 * mixed_norm, "the head's precision changed nothing: no test"
        before = ray.get(group.weights_checksum())
        m = ray.get(group.train_iteration(batch, **_train_kw(pad)))[0]
        assert m["grad_norm"] == pytest.approx(mixed_norm, rel=2e-4)
        assert m["loss"] == pytest.approx(mixed_loss, rel=2e-4, abs=1e-6)
        after = ray.get(group.named_weights()[0])
        assert {str(w.dtype) for _, w in after} == {"torch.float32"}
        assert len(set(ray.get(group.weights_checksum()))) == 1 and ray.get(group.weights_checksum())[0] != before[0]
    finally:
        group.kill()


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_bf16_mixed_resumes_bit_exactly(ray_cluster, tiny_policy, tmp_path, packed):
    """bf16-mixed with the float32 LM head: a checkpoint after one step, loaded into fresh ranks, gives exactly
    the weights of the run that went on (DeepSpeed's fp32 path, the autocast config and the patched head alike);
    with packed micro-batches too (the packing is a function of the batch alone)."""
    from reflow.infra.config.schema import StorageConfig
    from reflow.infra.store.storage import ExperimentStore

    pad = load_tokenizer(str(tiny_policy)).pad_token_id
    batch, kw = _batch(tiny_policy), dict(zero_stage=1, precision="bf16-mixed", fp32_lm_head=True)
    if packed:
        kw["max_tokens_per_micro_batch"] = 16
    store = ExperimentStore.from_config(StorageConfig(root=f"file://{tmp_path}"), "mixed-resume")
    first = _create(f"mixres-a{int(packed)}", 2, tiny_policy, **kw)
    try:
        ray.get(first.train_iteration(batch, **_train_kw(pad)))
        manifest: dict = {}
        for part in ray.get(first.save_checkpoint(store, "ckpt")):
            manifest |= part
        ray.get(first.train_iteration(batch, **_train_kw(pad)))
        went_on = ray.get(first.weights_checksum())[0]
    finally:
        first.kill()
    second = _create(f"mixres-b{int(packed)}", 2, tiny_policy, **kw)
    try:
        ray.get(second.fetch_checkpoint(store, "ckpt", manifest))
        ray.get(second.load_checkpoint())
        ray.get(second.train_iteration(batch, **_train_kw(pad)))
        assert ray.get(second.weights_checksum()) == [went_on, went_on]
    finally:
        second.kill()


def test_push_survives_a_lost_shared_memory_manager(ray_cluster, tiny_policy, tmp_path):
    """torch's file_system sharing registers every shared buffer with a torch_shm_manager child of
    the trainer process; once that process is gone every allocation fails ("Broken pipe") for the
    life of the trainer. The push then goes through disk (HF safetensors the engine reloads), this
    time and from then on, and the engine still ends up with exactly the trainer's weights. A push through
    the buffer the engine already maps (weight_sync.map_once) needs no new shared memory and goes on."""
    import psutil

    from reflow.engines.embedded.engine import EmbeddedEngine
    from reflow.engines.rollout_client import EngineClient

    group = _create("shm", 1, tiny_policy, zero_stage=1)
    engine = ray.remote(EmbeddedEngine).options(num_cpus=1).remote(str(tiny_policy), "shm-test-engine")
    try:
        url, key = ray.get([engine.url.remote(), engine.api_key.remote()])
        assert ray.get(engine.ready.remote())
        settings = PushSettings(bucket_bytes=32 << 10, verify="full", disk_dir=str(tmp_path / "pushes"))
        first = ray.get(group.push_weights([url], "1", settings, key))[0]
        assert "fallback" not in first
        rank = psutil.Process(ray.get(group.ping())[0]["pid"])
        managers = [c for c in rank.children(recursive=True) if c.name() == "torch_shm_manager"]
        assert managers, "no torch_shm_manager under the trainer rank: nothing to lose"
        for m in managers:
            m.kill()
        psutil.wait_procs(managers, timeout=10)
        ray.get(group.fill_weights(0.25))
        mapped = ray.get(group.push_weights([url], "2", settings, key))[0]
        assert mapped["mode"] == "tensor" and "fallback" not in mapped and mapped["mapped"] == 0, mapped
        assert EngineClient(url, api_key=key).get_weights_by_name("model.norm.weight") == pytest.approx([0.25] * 32)
        ray.get(group.fill_weights(0.5))
        # SGLang's calls with larger buckets than any before: no pooled buffer (buckets.BufferPool) can take
        # them, so a new one must be allocated, which is what fails without the manager.
        larger = dataclasses.replace(settings, bucket_bytes=1 << 20, map_once=False)
        for version in ("3", "4"):
            report = ray.get(group.push_weights([url], version, larger, key))[0]
            assert report["mode"] == "disk" and "shared memory" in report["fallback"], report
            assert report["verified_tensors"] > 0
        assert EngineClient(url, api_key=key).get_weights_by_name("model.norm.weight") == pytest.approx([0.5] * 32)
    finally:
        group.kill()
        ray.get(engine.shutdown.remote(), timeout=10)
        ray.kill(engine)
