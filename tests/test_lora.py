"""LoRA (issue 20, points 1-2) without Ray: the merge against peft's own, the embedded engine's
adapter endpoints (merged on receipt, re-merged from its base copy on every push) against SGLang
0.5.23's request class, and an adapter push verified against the effective weights. The trainer,
checkpoints, resume and export run in tests/test_lora_e2e.py."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from reflow.engines.hf_io import load_causal_lm
from reflow.engines.rollout_client import EngineClient, EngineError
from reflow.engines.train import lora as train_lora
from reflow.engines.train.settings import LoraSettings
from reflow.engines.weights import lora
from reflow.engines.weights.adapter_push import push_adapter
from reflow.engines.weights.buckets import SharedBucket
from reflow.engines.weights.push import WeightSyncError
from reflow.engines.weights.settings import PushSettings
from tests.test_engine import KEY
from tests.test_engine import fresh_engine as _fresh_engine_fixture

fresh_engine = _fresh_engine_fixture  # test_engine's engine whose weights a test may change, reached with KEY
SETTINGS = LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
ADAPTER_NAME = lora.adapter_name(1)


def _peft_model(path, seed: int):
    """The tiny policy with adapters whose B halves are random (peft starts them at zero: no update)."""
    model = train_lora.wrap(load_causal_lm(str(path)), SETTINGS)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def test_split_merges_as_peft_does(tiny_policy):
    model = _peft_model(tiny_policy, 0)
    named = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    adapter, effective = train_lora.split(named, SETTINGS)
    assert {n.rsplit(".", 2)[-2] for n, _ in adapter} == {"lora_A", "lora_B"}
    assert all(n.startswith(lora.PREFIX) and ".default." not in n for n, _ in adapter)
    merged = model.merge_and_unload().state_dict()
    assert {n for n, _ in effective} <= set(merged)
    for name, t in effective:
        assert torch.equal(t, merged[name]), name  # bit for bit: the engine and export use the same merge
    assert sum(t.numel() for _, t in adapter) * 10 < sum(t.numel() for _, t in effective)


def test_scaling_refuses_merges_it_does_not_compute():
    assert lora.scaling({"r": 4, "lora_alpha": 8}) == 2.0
    for bad in ({"r": 4, "lora_alpha": 8, "use_rslora": True}, {"r": 0, "lora_alpha": 8}, {"lora_alpha": 8}):
        with pytest.raises(ValueError, match="adapter_config"):
            lora.scaling(bad)
    with pytest.raises(KeyError, match="lack their lora_A or lora_B"):
        lora.pairs([(f"{lora.PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight", torch.ones(1))])


def _load(client: EngineClient, adapter, name: str = ADAPTER_NAME) -> dict:
    shared = SharedBucket(adapter)
    try:
        return client.load_lora_adapter_from_tensors(name, lora.adapter_config(4, 8.0, ["q_proj", "v_proj"], "x"),
                                                     shared.payloads(1), "flattened_bucket")
    finally:
        shared.release()


def test_engine_merges_each_adapter_into_its_base(fresh_engine, tiny_policy):
    c = EngineClient(fresh_engine.url(), api_key=KEY)
    q = "model.layers.0.self_attn.q_proj.weight"
    base = torch.tensor(c.get_weights_by_name(q, truncate_size=1000))
    for seed in (1, 2):  # the second merge starts from the base again, not from the first merge
        adapter, effective = train_lora.split([(n, p.detach()) for n, p in _peft_model(tiny_policy, seed)
                                               .named_parameters()], SETTINGS)
        out = _load(c, adapter)
        assert out["success"] and out["loaded_adapters"] == {ADAPTER_NAME: "__tensor__"}
        assert torch.equal(torch.tensor(c.get_weights_by_name(q, truncate_size=1000)), dict(effective)[q])
    c.unload_lora_adapter(ADAPTER_NAME)
    assert torch.equal(torch.tensor(c.get_weights_by_name(q, truncate_size=1000)), base)
    with pytest.raises(EngineError, match="not loaded"):
        c.unload_lora_adapter(ADAPTER_NAME)
    with pytest.raises(EngineError, match="not a LoRA adapter tensor"):
        _load(c, [("model.norm.weight", torch.ones(32))])
    assert torch.equal(torch.tensor(c.get_weights_by_name(q, truncate_size=1000)), base)  # nothing was written


def test_adapter_push_is_verified_against_effective_weights(fresh_engine, tiny_policy):
    c = EngineClient(fresh_engine.url(), api_key=KEY)
    adapter, effective = train_lora.split([(n, p.detach()) for n, p in _peft_model(tiny_policy, 3)
                                           .named_parameters()], SETTINGS)
    config = lora.adapter_config(4, 8.0, ["q_proj", "v_proj"], "x")
    stats = push_adapter([c], adapter, config, effective, "v7", PushSettings(verify="full"))
    assert stats["verified_tensors"] == len(effective) and c.model_info()["weight_version"] == "v7"
    assert stats["bytes"] * 10 < stats["full_bytes"]
    q = "model.layers.1.self_attn.v_proj.weight"
    wrong = [(n, t + 1e-3 if n == q else t) for n, t in effective]
    with pytest.raises(WeightSyncError, match=q.replace(".", r"\.")):
        push_adapter([c], adapter, config, wrong, "v8", PushSettings(verify="full"))


def test_adapter_versions_are_named_and_requests_name_them(fresh_engine, tiny_policy):
    """One adapter name per version (`reflow-v<version>`): rollout requests name it in lora_path and a
    request naming another version is refused; the same version pushed again is unloaded first (SGLang
    refuses a name it holds); the probe of verify=logprobs names it too; a payload whose tensors differ
    from expected_checksums is refused before anything is written."""
    from reflow.engines import rollout_stages as ro
    from reflow.engines.rollout_client import generate_batch
    from reflow.engines.rollout_fns import DEFAULT as DEFAULT_ROLLOUT_FN
    from reflow.engines.rollout_fns import BatchRequest, RolloutSettings, rollout_with_fn
    from reflow.rl.types import Prompt

    c = EngineClient(fresh_engine.url(), api_key=KEY)
    config = lora.adapter_config(4, 8.0, ["q_proj", "v_proj"], "x")
    model = _peft_model(tiny_policy, 5)
    adapter, effective = train_lora.split([(n, p.detach()) for n, p in model.named_parameters()], SETTINGS)
    probe = _probe(model)
    for version in ("3", "3", "4"):  # "3" again: held already, so unloaded and loaded again
        stats = push_adapter([c], adapter, config, effective, version, PushSettings(verify="logprobs"), probe=probe)
        assert stats["verify_method"] == "logprobs" and stats["logprob_max_diff"] < 1e-4
        assert c.lora_adapters() == [lora.adapter_name(version)]
    assert stats["unloaded"] == 0  # the embedded engine merges one adapter: loading replaced the previous one
    sp = {"max_new_tokens": 2, "temperature": 0.0}
    assert len(generate_batch([c], [[5, 6]], sp, lora_path="reflow-v4")) == 1
    with pytest.raises(EngineError, match="'reflow-v3': LoRA adapter not loaded") as e:
        generate_batch([c], [[5, 6]], sp, lora_path="reflow-v3")
    assert e.value.status == 400
    # The rollout stage names the version it samples: batched, and through a rollout function's engine.
    prompts = [Prompt(0, "1+2=", [5, 6, 7])]
    two = RolloutSettings([c.url], sp, 2, 60.0, KEY, adapter=True)
    assert len(ro.generate(two, BatchRequest(prompts, 4))) == 2
    with pytest.raises(EngineError, match="'reflow-v3'"):
        ro.generate(two, BatchRequest(prompts, 3))
    one = RolloutSettings([c.url], sp, 1, 60.0, KEY, DEFAULT_ROLLOUT_FN)
    assert len(rollout_with_fn(one, BatchRequest(prompts, 4), lora_path="reflow-v4")) == 1
    with pytest.raises(EngineError, match="'reflow-v3'"):
        rollout_with_fn(one, BatchRequest(prompts, 3), lora_path="reflow-v3")
    shared = SharedBucket(adapter)
    try:
        sums = {**lora.checksums(adapter), adapter[0][0]: "0" * 64}
        with pytest.raises(EngineError, match="1 value-diff"):
            c.load_lora_adapter_from_tensors("reflow-v5", config, shared.payloads(1), "flattened_bucket", sums)
    finally:
        shared.release()
    assert c.lora_adapters() == ["reflow-v4"]


@torch.no_grad()
def _probe(model):
    """The trainer's logprob probe at the adapter's effective weights (TrainerRank._logprob_probe)."""
    from reflow.engines.weights.verify import LogprobProbe, probe_prompts

    prompts = probe_prompts(model.config.vocab_size)
    ids = torch.tensor(prompts)  # [P, T]
    logits = model(input_ids=ids).logits[:, :-1].float()  # [P, T-1, V]
    ref = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]  # [P, T-1]
    return LogprobProbe(prompts, list(ref), torch.float32)


def test_adapter_request_fields_are_sglangs():
    """What the client sends is LoadLoRAAdapterFromTensorsReqInput's / UnloadLoRAAdapterReqInput's /
    GenerateReqInput's (lora_path) fields (io_struct needs the GPU runtime to import, so its source is read)."""
    from reflow.engines.sglang import contract as sglang_contract

    root = sglang_contract.installed_root()
    if root is None:
        pytest.skip("sglang==0.5.23 is not installed")
    tree = ast.parse((Path(root) / "srt" / "managers" / "io_struct.py").read_text())
    fields = {n.name: {a.target.id for a in n.body if isinstance(a, ast.AnnAssign)}
              for n in tree.body if isinstance(n, ast.ClassDef)}
    sent: dict[str, dict] = {}
    client = EngineClient("http://127.0.0.1:9", api_key=KEY)
    client._call = lambda method, path, body: sent.setdefault(path, body)  # what would go on the wire
    client.load_lora_adapter_from_tensors("a", {}, ["x"], "flattened_bucket", {"t": "0" * 64})
    client.unload_lora_adapter("a")
    client.generate(input_ids=[[5]], sampling_params={}, lora_path="reflow-v1")  # as generate_batch sends it
    assert set(sent["/load_lora_adapter_from_tensors"]) <= fields["LoadLoRAAdapterFromTensorsReqInput"]
    assert "expected_checksums" in sent["/load_lora_adapter_from_tensors"]
    assert set(sent["/unload_lora_adapter"]) <= fields["UnloadLoRAAdapterReqInput"]
    assert set(sent["/generate"]) <= fields["GenerateReqInput"] and "lora_path" in sent["/generate"]


def test_checksums_are_sglangs_own_expression():
    """lora.checksums hashes as SGLang 0.5.23's TP worker does for expected_checksums: its expression,
    taken from tp_worker.py (that module needs the GPU runtime to import) and evaluated here."""
    from reflow.engines.sglang import contract as sglang_contract

    root = sglang_contract.installed_root()
    if root is None:
        pytest.skip("sglang==0.5.23 is not installed")
    tree = ast.parse((Path(root) / "srt" / "managers" / "tp_worker.py").read_text())
    method = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "load_lora_adapter_from_tensors")
    call = next(n for n in ast.walk(method) if isinstance(n, ast.Call) and ast.unparse(n.func) == "hashlib.sha256")
    expr = compile(f"({ast.unparse(call)}).hexdigest()", "tp_worker.py", "eval")
    import hashlib

    named = [("a", torch.randn(3, 5)), ("b", torch.randn(4, 2).to(torch.bfloat16).t())]  # one non-contiguous
    theirs = {n: eval(expr, {"hashlib": hashlib, "torch": torch, "tensors": dict(named), "name": n}) for n, _ in named}
    assert theirs == lora.checksums(named)


def test_lora_config_refusals():
    from reflow.infra.config.schema import ConfigError, load_config
    from reflow.infra.config.settings import policy_rank_settings

    cfg = load_config(None, ["trainer.lora.rank=8"])
    assert policy_rank_settings(cfg).lora == LoraSettings(8, 16.0, ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert policy_rank_settings(load_config(None, [])).lora is None
    with pytest.raises(ConfigError, match="weight_sync.mode=tensor"):
        load_config(None, ["trainer.lora.rank=8", "weight_sync.mode=disk"])
    assert load_config(None, ["trainer.lora.rank=8", "rollout.backend=sglang"]).trainer.lora.rank == 8
    with pytest.raises(ConfigError, match="trainer.lora.dropout"):
        load_config(None, ["trainer.lora.rank=8", "trainer.lora.dropout=0.1"])


def lora_checkpoint(tiny_policy, tmp_path):
    """(peft model, its store, the URL of a committed step-1 checkpoint holding its adapter/ as a LoRA run saves
    it) in experiment 'lora' under `tmp_path`/runs."""
    from reflow.infra.store import checkpoint as ckpt
    from reflow.infra.store.storage import ExperimentStore

    model = _peft_model(tiny_policy, 4)
    adapter, _ = train_lora.split([(n, p.detach()) for n, p in model.named_parameters()], SETTINGS)
    train_lora.write_adapter(adapter, SETTINGS, str(tiny_policy), tmp_path / "adapter")
    store = ExperimentStore.open(f"file://{tmp_path}/runs", "lora")
    ck = ckpt.at_step(store, 1)
    files = {f"adapter/{f.name}": store.put_file(f, ck.rel(f"adapter/{f.name}")) for f in (tmp_path / "adapter").iterdir()}
    return model, store, ckpt.commit(ck, files, ckpt.state_for(1, 4, 0, 1), "x: 1\n")


def test_export_and_evaluate_merge_a_lora_checkpoint(tiny_policy, tmp_path, monkeypatch):
    """A committed checkpoint holding adapter/ (as a LoRA run saves it): `reflow export-merged` writes
    peft's merge of it, and the eval flow's checkpoint resolution evaluates that same merge."""
    from reflow.flows.cli import main
    from reflow.infra.config.schema import load_config
    from reflow.tasks.checkpoint import resolve_checkpoint
    from tests.ckpt_fixtures import final_weights

    model, _, url = lora_checkpoint(tiny_policy, tmp_path)
    main(["export-merged", url, str(tmp_path / "merged")])
    expected = model.merge_and_unload().state_dict()
    got = final_weights(tmp_path / "merged")
    assert all(torch.equal(got[n], expected[n]) for n in got) and "model.layers.1.self_attn.q_proj.weight" in got
    cfg = load_config(None, ["experiment=lora", f"storage.root=file://{tmp_path}/runs"])
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # where evaluation's merged copy goes
    for which in ("latest", url):
        evaluated = resolve_checkpoint.fn(cfg, which)["model"]
        assert tmp_path in Path(evaluated).parents  # a private folder in the temp dir
        assert final_weights(Path(evaluated)).keys() == got.keys()
        assert all(torch.equal(final_weights(Path(evaluated))[n], got[n]) for n in got)
    with pytest.raises(SystemExit):  # the folder is not empty now: nothing of it is overwritten
        main(["export-merged", url, str(tmp_path / "merged")])
