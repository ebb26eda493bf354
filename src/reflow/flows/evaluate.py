"""The `evaluate` flow: eval-only runs against a saved checkpoint (no training, no trainer ranks).

    resolve the checkpoint (`latest` or a URL) -> engines serving its model/ folder
    -> every eval set of `config.eval` -> evals/iter_<step>/<set>/{samples.parquet, summary.json}

The engines load the checkpoint's HF folder directly: it holds the weights the in-training eval of
that policy version generated with (checkpoint iter_<v> is saved after push v, before eval v), and
each set samples with the same per-sample seeds (infra/inputs/eval_sets.py), so an eval-only run of
checkpoint v reproduces the in-training eval at v (same eval sets, same number of engines).
Results go under evals/ so they never overwrite the in-training records under iterations/.
Before any engine starts, every file of the model/ folder is checked against the checkpoint's
manifest (sha256, not only sizes), and the engines check their copies the same way
(infra/runtime.model_source): a file changed after the save is refused, naming it and the checkpoint.
"""
from __future__ import annotations

from prefect import flow, get_run_logger

from reflow.flows.inputs import refused
from reflow.infra.cluster.runtime import shutdown_eval_runtime
from reflow.infra.config.flow_params import FlowConfig, resolve_config
from reflow.infra.config.schema import ConfigError
from reflow.infra.store import checkpoint as ckpt
from reflow.tasks.checkpoint import experiment_store, resolve_checkpoint
from reflow.tasks.cluster import start_eval_engines
from reflow.tasks.evaluate import launch_checkpoint_eval, record_eval


@flow(name="evaluate", flow_run_name="{config.experiment}-eval", log_prints=True)
def evaluate(config: FlowConfig, checkpoint: str = "latest", release_cluster: bool = True) -> dict[str, object]:
    """Evaluate `checkpoint` ("latest" or a checkpoint URL) on every eval set of `config.eval`."""
    log = get_run_logger()
    try:
        config = resolve_config(config)  # the full config, or {"file": ..., "overrides": [...]}
    except ConfigError as e:
        return refused(e)  # type: ignore[return-value]  # a returned State is the run's (flows/train.py)
    ck = resolve_checkpoint(config, checkpoint)
    cfg = config.model_copy(update={"model": config.model.model_copy(update={"path": ck["model"]})})
    try:
        log.info("checkpoint %s (policy version %d): %s", ck["url"], ck["step"], start_eval_engines(cfg))
        results = record_eval(cfg, launch_checkpoint_eval(cfg, ck["step"]), f" (checkpoint {ck['url']})")
    finally:
        if release_cluster:
            shutdown_eval_runtime(config.experiment)
    return {"checkpoint": ck["url"], "step": ck["step"], "evals": results,
            "records": experiment_store(config).url(f"evals/{ckpt.name_of(ck['step'])}")}
