"""The `retrain` flow: scheduled retraining with a promotion gate.

    new data? (files under `new_data` not in the ledger; none -> record "skipped" and stop)
    -> resume from the latest checkpoint and train `iterations` more (a `train` subflow: one flow
       run per iteration, eval at the end) -> compare `metric` with the champion's
    -> promote (champion.json points at the new checkpoint) only when it did not regress by more
       than `tolerance`; else keep the champion and say why. The decision is a markdown artifact
       and retrain/runs/<run>/decision.json in storage.

Without `new_data` the run continues on the configured data (the prompt cursor moves on).
With it, the new files' rows become this run's training prompts (kept in storage as
retrain/runs/<run>/prompts.jsonl) and the files go into retrain/ledger.json, so the next run
does not train on them again. The gate is only meaningful against a fixed eval set, so a run with
new data needs `data.eval_path` or eval sets with their own `source`.
"""
from __future__ import annotations

import time
import uuid

from prefect import flow, get_run_logger, runtime
from prefect.artifacts import create_markdown_artifact
from pydantic import Field

from reflow.flows.inputs import USER_ERRORS, refused
from reflow.flows.train import train
from reflow.infra.config.flow_params import FlowConfig, resolve_config
from reflow.infra.config.schema import Location, RunConfig
from reflow.infra.store import checkpoint as ckpt
from reflow.infra.store import promotion as pm
from reflow.tasks.checkpoint import experiment_store
from reflow.tasks.report import artifact_key
from reflow.tasks.retrain import check_fixed_eval, take_new_data


def _run_name() -> str:
    """A sortable, unique id of this retrain run: time + the flow run's name + its id. The id matters:
    two runs started within one second (a quick "no new data" run, then the next) would otherwise
    share a record folder."""
    name = runtime.flow_run.get_name() or "local"
    run_id = str(runtime.flow_run.get_id() or uuid.uuid4())
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{name}-{run_id[:8]}"


def _report(cfg: RunConfig, run: str, d: pm.Decision | None, lines: list[str]) -> None:
    head = "skipped" if d is None else ("PROMOTED" if d.promote else "not promoted")
    create_markdown_artifact(key=artifact_key(cfg.experiment, "retrain-decision"),
                             markdown="\n".join([f"# {cfg.experiment}: retrain {run}: {head}", "", *lines]),
                             description=f"{cfg.experiment}: promotion decision of retrain run {run}")


@flow(name="retrain", flow_run_name="{config.experiment}-retrain", log_prints=True)
def retrain(config: FlowConfig, iterations: int = Field(10, ge=1), new_data: Location | None = None,
            metric: str = "heldout/pass@1", tolerance: float = Field(0.0, ge=0.0),
            release_cluster: bool | None = None) -> dict[str, object]:
    """Train `iterations` more from the latest checkpoint (on new data when `new_data` names a folder
    or URL prefix of jsonl/parquet files) and promote the result to champion unless `metric`
    (`<eval set>/<key>`, higher is better) fell more than `tolerance` below the champion's."""
    log = get_run_logger()
    try:
        cfg = resolve_config(config)
        if new_data:
            check_fixed_eval(cfg)
    except USER_ERRORS as e:
        return refused(e)  # type: ignore[return-value]  # a returned State is the run's (flows/train.py)
    store = experiment_store(cfg)
    store.preflight()
    run = _run_name()
    files: list[dict] = []
    if new_data:
        new_cfg, files = take_new_data(cfg, new_data, run)
        if new_cfg is None:
            msg = f"no new data under {new_data} (every file is in {store.url(pm.LEDGER)}): nothing trained"
            log.info(msg)
            pm.record_decision(store, run, pm.Decision(False, msg, metric, None, None, tolerance), {"skipped": True})
            _report(cfg, run, None, [msg])
            return {"run": run, "skipped": True, "promoted": False, "reason": msg}
        cfg = new_cfg
    start = ckpt.latest_step(store) or 0
    cfg = cfg.model_copy(update={"num_iterations": start + iterations, "resume": "auto"})
    summary = train(cfg, release_cluster=release_cluster)
    step = start + int(summary["iterations"])
    champion = pm.read_champion(store)
    d = pm.against_champion(pm.metric_of(summary["evals"], step, metric), champion, tolerance, metric)
    url = ckpt.at_step(store, step).url
    if d.promote:
        pm.write_champion(store, url, step, d, run)
    if files:
        pm.append_ledger(store, files, run)
    rec = pm.record_decision(store, run, d, {"checkpoint": url, "step": step, "data_files": files,
                                             "previous_champion": champion})
    (log.info if d.promote else log.warning)("retrain %s: %s", run, d.reason)
    _report(cfg, run, d, [d.reason, "", f"- candidate: `{url}` (policy version {step})",
                          f"- champion before: `{champion['checkpoint'] if champion else None}`",
                          f"- trained on: {', '.join(f['url'] for f in files) or 'the configured data'}",
                          f"- record: `{rec}`"])
    return {"run": run, "skipped": False, "promoted": d.promote, "reason": d.reason, "step": step,
            "candidate": d.candidate, "champion": d.champion, "checkpoint": url}
