"""Retraining's data step: which new files a retrain run trains on (flows/retrain.py)."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from reflow.infra.config.schema import ConfigError, RunConfig
from reflow.infra.config.settings import storage_access
from reflow.infra.store import promotion as pm
from reflow.tasks.checkpoint import experiment_store


def check_fixed_eval(cfg: RunConfig) -> None:
    """New data replaces the training file, and with it a held-out split carved from that file: the
    champion and the candidate would be scored on different prompts. Refused before anything runs."""
    if not cfg.data.eval_path and any(s.source == "heldout" for s in cfg.eval.sets):
        heldout = [s.name for s in cfg.eval.sets if s.source == "heldout"]
        raise ConfigError(f"retrain with new_data needs a fixed eval set to compare against the champion, but "
                          f"eval set(s) {heldout} use source: heldout without data.eval_path: set data.eval_path "
                          f"to a held-out file, or give every eval set its own `source` file "
                          f"(configs/demo-retrain.yaml does)")


@task(name="take-new-data", cache_policy=NO_CACHE)
def take_new_data(cfg: RunConfig, location: str, run: str) -> tuple[RunConfig | None, list[dict]]:
    """(config training on the new rows, the new files), or (None, []) when nothing is new."""
    check_fixed_eval(cfg)
    store = experiment_store(cfg)
    files = pm.new_files(store, pm.list_data_files(location, storage_access(cfg)))
    if not files:
        return None, []
    url = store.write_bytes(f"retrain/runs/{run}/prompts.jsonl", pm.merge_rows(files, storage_access(cfg)))
    data = cfg.data.model_copy(update={"task": "file", "path": url})
    return cfg.model_copy(update={"data": data}), files
