"""LoRA training on real Ray + DeepSpeed (CPU, ZeRO-2, 2 ranks): only the adapters train and sit in
the optimizer; checkpoints hold the adapter and its optimizer state, not the model; resume is exact;
the adapter push lands verified in an embedded engine; `reflow export-merged` writes a folder that
AutoModelForCausalLM loads and that decodes greedily exactly as the engine does."""
from __future__ import annotations

import json

import pytest
import ray
import torch

from reflow.infra.store import checkpoint as ckpt
from reflow.infra.store.storage import ExperimentStore

pytestmark = pytest.mark.slow


def _optimizer_view(rank) -> dict:
    """What one rank trains: its optimizer's parameter count and the trainable parameters' names."""
    n_opt = sum(p.numel() for g in rank.optimizer.param_groups for p in g["params"])
    return {"optimizer": n_opt, "trainable": [n for n, p in rank.engine.module.named_parameters() if p.requires_grad],
            "all": sum(p.numel() for p in rank.engine.module.parameters())}


def test_lora_trains_adapters_resumes_exactly_pushes_and_exports(ray_cluster, tiny_policy, tmp_path):
    from transformers import AutoModelForCausalLM

    from reflow.engines.embedded.engine import EmbeddedEngine
    from reflow.engines.hf_io import load_tokenizer
    from reflow.engines.http_serve import new_api_key
    from reflow.engines.rollout_client import EngineClient
    from reflow.engines.train.group import TrainerGroup
    from reflow.engines.train.settings import LoraSettings, RankSettings
    from reflow.engines.weights.settings import PushSettings
    from reflow.infra.store.export import export_merged
    from reflow.tasks.checkpoint import load_first_valid, save
    from tests.reference import greedy_reference
    from tests.test_trainer import RANK_KW, _batch, _train_kw

    store = ExperimentStore.open(f"file://{tmp_path}/runs", "lora")
    lora = LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    kw = dict(model_path=str(tiny_policy), settings=RankSettings(**(RANK_KW | dict(zero_stage=2, lr=1e-2, lora=lora))))
    a = TrainerGroup.create(2, "test-lora", "a", init_timeout_s=300, **kw)
    view = ray.get(a.actors[0].__ray_call__.remote(_optimizer_view))
    assert view["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in view["trainable"]), view
    assert 0 < view["optimizer"] * 5 < view["all"], view  # ZeRO-2 on 2 ranks: half the adapters each, no base
    base = dict(ray.get(a.named_weights()[0]))
    batch = ray.put(_batch(tiny_policy))
    ray.get(a.train_iteration(batch, **_train_kw(0)))
    save(a, store, 1, ckpt.state_for(1, 4, 0, 2), "x: 1\n", keep_last=3)
    files = json.loads(store.read_bytes(ckpt.at_step(store, 1).rel(ckpt.MANIFEST)))["files"]
    assert {"adapter/adapter_model.safetensors", "adapter/adapter_config.json"} <= set(files)
    assert not any(f.startswith("model/") for f in files), "a LoRA checkpoint holds the adapter, not the model"
    base_bytes = sum(t.numel() * t.element_size() for t in base.values())
    assert sum(m["bytes"] for f, m in files.items() if f.startswith("optim/")) < base_bytes, "frozen base saved"

    ray.get(a.train_iteration(batch, **_train_kw(0)))
    after_two, trained = ray.get(a.weights_checksum())[0], dict(ray.get(a.named_weights()[0]))
    changed = {n for n in base if not torch.equal(base[n], trained[n])}
    assert changed and all(n.endswith(("q_proj.weight", "v_proj.weight")) for n in changed), changed
    save(a, store, 2, ckpt.state_for(2, 4, 0, 2), "x: 2\n", keep_last=3)
    a.kill()

    b = TrainerGroup.create(2, "test-lora", "b", init_timeout_s=300, **kw)
    found = [(ck, f) for ck, f, _ in ckpt.valid_candidates(store) if ck.step == 1]
    assert load_first_valid(b, found, num_ranks=2).step == 1
    ray.get(b.train_iteration(batch, **_train_kw(0)))
    assert ray.get(b.weights_checksum())[0] == after_two, "LoRA resume is not exact"

    key = new_api_key()
    # The engine in its own process, as in a run: a receiver in the test process would open the trainer's
    # shared-memory handles there, and once that trainer is killed this process's own torch_shm_manager was
    # gone too (every later test pushing from here failed with "Broken pipe").
    engine = ray.remote(EmbeddedEngine).options(num_cpus=0).remote(str(tiny_policy), "lora-e2e", threads=1, api_key=key)
    try:
        assert ray.get(engine.ready.remote())
        url = ray.get(engine.url.remote())
        report = [r for r in ray.get(b.push_weights([url], "2", PushSettings(verify="full"), api_key=key)) if r]
        assert report[0]["mode"] == "lora" and report[0]["bytes"] * 5 < report[0]["full_bytes"], report
        assert report[0]["verified_tensors"] == len(base)
        merged = export_merged(store.url(ckpt.ROOT, ckpt.name_of(2)), tmp_path / "merged", store)
        assert merged["merged_modules"] == 4  # q and v of 2 layers
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        tok = load_tokenizer(str(tmp_path / "merged"))
        client = EngineClient(url, api_key=key)
        for prompt in ("12+34=", "7+8=", "55+1="):
            ids = tok.encode(prompt)
            got = client.generate(input_ids=ids, sampling_params={"temperature": 0.0, "max_new_tokens": 8})
            assert got["output_ids"] == greedy_reference(hf, ids, 8, {tok.eos_token_id}), prompt
    finally:
        ray.kill(engine)
        b.kill()
