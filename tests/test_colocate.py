"""End to end on real Ray + DeepSpeed + Prefect: colocated mode, router, and the other push modes.

Colocated mode must run the whole hand-over every iteration (unless cluster.hand_over=false), in
SGLang's order: engines release their memory tags, the trainer reloads, trains and offloads, engines
resume weights, the push writes them, engines resume kv_cache + cuda_graph.
"""
from __future__ import annotations

import math

import pytest

from reflow.engines.rollout_client import EngineClient
from reflow.infra.cluster.runtime import shutdown_runtime, start_runtime
from tests.test_e2e import e2e_config

pytestmark = pytest.mark.slow


def _assert_placed_together(rt) -> None:
    """Every engine and trainer rank runs inside the runtime's placement group (infra/cluster/placement.py)."""
    import ray

    where = lambda self: ray.get_runtime_context().get_placement_group_id()  # noqa: E731
    got = ray.get([a.__ray_call__.remote(where) for a in rt.engines + rt.trainers.actors])
    assert rt.placement is not None and set(got) == {rt.placement.id.hex()}, got
    n = max(len(rt.trainers.actors), len(rt.engines))
    assert len(rt.placement.bundle_specs) == n


def _assert_frozen(rt) -> None:
    """Once ready, each engine and trainer rank froze what it held (engines/gc_freeze.py: tens of thousands of objects
    at the least, torch's alone), except with hand-overs (their releases free memory by dropping references); the
    driver, this process, froze for its loop only and thawed after it."""
    import gc

    import ray

    frozen = ray.get([a.__ray_call__.remote(lambda self: __import__("gc").get_freeze_count())
                      for a in rt.engines + rt.trainers.actors])
    want = rt.cfg.cluster.gc_freeze and not (rt.cfg.cluster.colocate and rt.cfg.cluster.hand_over)
    assert all((n > 20_000) is want for n in frozen), (frozen, want)
    assert gc.get_freeze_count() == 0


def _run(cfg):
    from reflow.flows.train import train

    try:
        summary = train(cfg, release_cluster=False)
        rt = start_runtime(cfg)
        infos = [EngineClient(u, api_key=rt.api_key).server_info() for u in rt.engine_urls]
        _assert_placed_together(rt)
        _assert_frozen(rt)
        return summary, infos
    finally:
        shutdown_runtime(cfg.experiment)


def test_colocated_distributed_push_through_router(ray_cluster, prefect_server, tiny_policy, tmp_path):
    cfg = e2e_config(tiny_policy, tmp_path, "experiment=e2e-colocate", "num_iterations=2", "eval.interval=null",
                     "eval.before_train=false", "trainer.num_ranks=1", "rollout.num_engines=2",
                     "cluster.colocate=true", "rollout.router=true", "weight_sync.mode=distributed",
                     "weight_sync.verify=full")
    summary, infos = _run(cfg)
    assert summary["iterations"] == 2
    for i, m in enumerate(summary["history"]):
        assert m["push_verified_tensors"] > 0 and math.isfinite(m["loss"])
        assert m["trainer_state_moves"] == 2 * i + 2  # initial offload + (reload, offload) per iteration
        assert {"time_engines_release", "time_engines_resume_weights", "time_engines_resume_rest"} <= set(m)
    one_iteration = [["release", ["cuda_graph", "kv_cache", "weights"]], ["resume", ["weights"]],
                     ["resume", ["cuda_graph", "kv_cache"]]]
    for info in infos:
        assert info["memory_events"] == one_iteration * 2
        assert info["memory_released"] == [] and info["weight_version"] == "2"


def test_disk_push_with_partial_release_tags(ray_cluster, prefect_server, tiny_policy, tmp_path):
    cfg = e2e_config(tiny_policy, tmp_path, "experiment=e2e-disk", "num_iterations=1", "eval.interval=null",
                     "eval.before_train=false", "trainer.num_ranks=1", "rollout.num_engines=1",
                     "cluster.colocate=true", "cluster.release_tags=[kv_cache]", "weight_sync.mode=disk",
                     f"weight_sync.disk_dir={tmp_path}/push", "weight_sync.verify=full")
    summary, infos = _run(cfg)
    assert summary["history"][0]["push_verified_tensors"] > 0
    assert infos[0]["memory_events"] == [["release", ["kv_cache"]], ["resume", ["kv_cache"]]]
    assert [p.name for p in (tmp_path / "push").iterdir()] == ["reflow-weight-push"]  # its own subfolder only
    assert [p.name for p in (tmp_path / "push" / "reflow-weight-push").iterdir()] == ["v1"]  # older pushes removed


def test_colocation_bundles():
    from reflow.infra.cluster.placement import bundles

    # 2 ranks + PPO critic, 1 engine, GPUs: engine 0 shares bundle 0 with rank 0 and critic rank 0
    assert bundles(2, 1, gpu=True, critic=True) == [{"CPU": 3.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}]
    # 1 rank, 2 engines on CPU: the second engine gets a bundle of its own
    assert bundles(1, 2, gpu=False, critic=False) == [{"CPU": 2.0}, {"CPU": 1.0}]


def test_gpu_use_follows_the_setting_and_the_cluster():
    from reflow.infra.cluster.placement import gpus_on

    assert gpus_on("auto", sglang=False, cluster_gpus=2.0) and not gpus_on("auto", sglang=False, cluster_gpus=0.0)
    assert not gpus_on("off", sglang=False, cluster_gpus=8.0)  # CPU only, GPUs or not
    assert gpus_on("on", sglang=False, cluster_gpus=0.0)  # asked for: the room check then refuses it clearly
    assert gpus_on("off", sglang=True, cluster_gpus=0.0)  # SGLang engines run on GPUs whatever the setting


def test_a_layout_the_cluster_cannot_hold_is_refused_with_the_ways_out():
    from reflow.infra.cluster.placement import PlacementError, check_gpus

    check_gpus(2.0, 2.0, "the split layout")  # exactly enough
    with pytest.raises(PlacementError) as e:
        check_gpus(3.0, 2.0, "the split layout")
    assert "needs 3 GPU(s) but the Ray cluster has 2" in str(e.value)
    assert "cluster.colocate=true" in str(e.value) and "cluster.gpus=off" in str(e.value)


def test_split_gpu_layout_gives_each_rank_and_engine_a_whole_gpu():
    from reflow.infra.cluster.placement import ENGINE_GPU
    from reflow.infra.cluster.runtime import _engine_gpus, _rank_options
    from reflow.infra.config.schema import RunConfig

    cfg = RunConfig()
    assert _engine_gpus(cfg) == 1.0 and _rank_options(None, 2, 0.4, gpu=True) == {"num_gpus_per_rank": 1.0}
    assert _rank_options(None, 2, 0.4, gpu=False) == {}  # CPU: no GPU asked, so Ray hides every GPU
    colocated = RunConfig.model_validate({"cluster": {"colocate": True}})
    assert _engine_gpus(colocated) == ENGINE_GPU < 1  # a share of the bundle's GPU, next to the trainer rank's


def test_ranks_on_gpus_join_over_nccl():
    """Ranks that hold GPUs use nccl (each Ray actor sees its one GPU as cuda:0; with gloo, DeepSpeed took rank 1's
    LOCAL_RANK as cuda:1 and two ranks on two H200s failed at init); CPU ranks keep gloo."""
    from reflow.infra.config.schema import RunConfig
    from reflow.infra.config.settings import critic_rank_settings, policy_rank_settings

    cfg = RunConfig.model_validate({"trainer": {"num_ranks": 2, "precision": "fp32"}})  # auto on GPUs reads the policy
    assert policy_rank_settings(cfg, gpus=True).backend == critic_rank_settings(cfg, gpus=True).backend == "nccl"
    assert policy_rank_settings(cfg).backend == critic_rank_settings(cfg, gpus=False).backend == "gloo"


def test_colocated_without_hand_over_keeps_both_resident(ray_cluster, prefect_server, tiny_policy, tmp_path):
    """cluster.hand_over=false: placed together, but nothing is released or offloaded (a GPU that holds both)."""
    cfg = e2e_config(tiny_policy, tmp_path, "experiment=e2e-resident", "num_iterations=1", "eval.interval=null",
                     "eval.before_train=false", "trainer.num_ranks=1", "rollout.num_engines=1",
                     "cluster.colocate=true", "cluster.hand_over=false", "weight_sync.verify=full")
    summary, infos = _run(cfg)
    m = summary["history"][0]
    assert m["push_verified_tensors"] > 0 and math.isfinite(m["loss"])
    assert not {"time_engines_release", "time_engines_resume_weights", "trainer_state_moves"} & set(m), m
    assert infos[0]["memory_events"] == [] and infos[0]["weight_version"] == "1"
