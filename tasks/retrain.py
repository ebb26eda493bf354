"""Retraining's data step: which new files a retrain run trains on (flows/retrain.py)."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from reflow.infra import promotion as pm
from reflow.infra.config import RunConfig
from reflow.infra.settings import storage_access
from reflow.tasks.checkpoint import experiment_store


@task(name="take-new-data", cache_policy=NO_CACHE)
def take_new_data(cfg: RunConfig, location: str, run: str) -> tuple[RunConfig | None, list[dict]]:
    """(config training on the new rows, the new files), or (None, []) when nothing is new."""
    if not cfg.data.eval_path and any(s.source == "heldout" for s in cfg.eval.sets):
        raise ValueError("retrain with new_data needs a fixed eval set to compare against the champion: set "
                         "data.eval_path, or give every eval set in eval.sets its own `source`")
    store = experiment_store(cfg)
    files = pm.new_files(store, pm.list_data_files(location, storage_access(cfg)))
    if not files:
        return None, []
    url = store.write_bytes(f"retrain/runs/{run}/prompts.jsonl", pm.merge_rows(files, storage_access(cfg)))
    data = cfg.data.model_copy(update={"task": "file", "path": url})
    return cfg.model_copy(update={"data": data}), files
