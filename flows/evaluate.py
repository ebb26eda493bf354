"""The `evaluate` flow: eval-only runs against a saved checkpoint (no training, no trainer ranks).

    resolve the checkpoint (`latest` or a URL) -> engines serving its model/ folder
    -> every eval set of `config.eval` -> evals/iter_<step>/<set>/{samples.parquet, summary.json}

The engines load the checkpoint's HF folder directly: it holds the weights the in-training eval of
that policy version generated with (checkpoint iter_<v> is saved after push v, before eval v), and
each set samples with the same per-sample seeds (infra/eval_sets.py), so an eval-only run of
checkpoint v reproduces the in-training eval at v (same eval sets, same number of engines).
Results go under evals/ so they never overwrite the in-training records under iterations/.
"""
from __future__ import annotations

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from infra import checkpoint as ckpt
from infra.config import FlowConfig, RunConfig, resolve_config
from infra.runtime import get_eval_runtime, shutdown_eval_runtime
from tasks.checkpoint import experiment_store
from tasks.evaluate import launch_checkpoint_eval, record_eval


@task(name="resolve-checkpoint", cache_policy=NO_CACHE)
def resolve_checkpoint(config: RunConfig, checkpoint: str) -> dict[str, object]:
    """{url, step, model}: the newest valid committed checkpoint (`latest`) or the one at a URL."""
    store = experiment_store(config)
    if checkpoint == "latest":
        found = ckpt.valid_candidates(store)
        if not found:
            raise ckpt.CheckpointInvalid(f"no valid committed checkpoint under {store.url(ckpt.ROOT)}; "
                                         f"train first, or pass checkpoint=<URL of …/checkpoints/iter_NNNNNN>")
        ck = found[0][0]
    else:
        ck = ckpt.from_url(checkpoint, store)
        ckpt.check(ck)  # committed, and every file the manifest lists is there with its size
    return {"url": ck.url, "step": ck.step, "model": ck.store.url(ck.rel("model"))}


@task(name="start-eval-engines", cache_policy=NO_CACHE)
def start_engines(config: RunConfig) -> dict[str, object]:
    rt = get_eval_runtime(config)
    return {"engines": rt.engine_urls, "namespace": rt.namespace, "startup_s": rt.timings["startup"]}


@flow(name="evaluate", flow_run_name="{config.experiment}-eval", log_prints=True)
def evaluate(config: FlowConfig, checkpoint: str = "latest", release_cluster: bool = True) -> dict[str, object]:
    """Evaluate `checkpoint` ("latest" or a checkpoint URL) on every eval set of `config.eval`."""
    log = get_run_logger()
    config = resolve_config(config)  # the full config, or {"file": ..., "overrides": [...]}
    ck = resolve_checkpoint(config, checkpoint)
    cfg = config.model_copy(update={"model": config.model.model_copy(update={"path": ck["model"]})})
    try:
        log.info("checkpoint %s (policy version %d): %s", ck["url"], ck["step"], start_engines(cfg))
        results = record_eval(cfg, launch_checkpoint_eval(cfg, ck["step"]), f" (checkpoint {ck['url']})")
    finally:
        if release_cluster:
            shutdown_eval_runtime(config.experiment)
    return {"checkpoint": ck["url"], "step": ck["step"], "evals": results,
            "records": experiment_store(config).url(f"evals/{ckpt.name_of(ck['step'])}")}
