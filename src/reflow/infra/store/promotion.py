"""Scheduled retraining's bookkeeping: which data each run consumed, and the champion gate.

Storage layout under the experiment:
    champion.json                     the promoted checkpoint and its eval metric
    retrain/ledger.json               every data file consumed so far (url, size, run)
    retrain/runs/<run>/decision.json  what one retrain run did and why
    retrain/runs/<run>/prompts.jsonl  the new rows that run trained on (when new data was given)
"""
from __future__ import annotations

import io
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass

import pandas as pd

from reflow.infra.store.storage import ExperimentStore, StorageAccess

log = logging.getLogger("reflow.promotion")
CHAMPION, LEDGER = "champion.json", "retrain/ledger.json"
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass
class Decision:
    promote: bool
    reason: str
    metric: str
    candidate: float | None
    champion: float | None
    tolerance: float


def decide(candidate: float | None, champion: float | None, tolerance: float, metric: str,
           champion_metric: str | None = None) -> Decision:
    """Promote unless the candidate's metric falls more than `tolerance` below the champion's.
    Higher is better (accuracy, pass@k, mean reward). `champion_metric`: the metric the champion was
    chosen on, when there is one (default: `metric`); `champion` None with no `champion_metric` means
    there is no champion yet. Every comparison with NaN is False, so without the finiteness checks a
    NaN on either side would pass the regression test and promote."""
    def refuse(reason: str) -> Decision:
        log.warning("promotion refused: %s", reason)
        return Decision(False, reason, metric, candidate, champion, tolerance)

    if candidate is None:
        return Decision(False, f"the candidate has no {metric!r} (no eval recorded it)", metric, None, champion, tolerance)
    if not math.isfinite(candidate):
        return refuse(f"the candidate's {metric} is {candidate} (not finite): the eval failed or scored nothing; "
                      f"nothing is promoted")
    if champion is None and champion_metric is None:
        return Decision(True, "no champion yet: the first evaluated checkpoint becomes champion", metric,
                        candidate, None, tolerance)
    if champion_metric is not None and champion_metric != metric:
        return refuse(f"the champion was chosen on {champion_metric!r}, this gate compares {metric!r}: the values "
                      f"are not comparable, so nothing is promoted. Keep the gate with metric={champion_metric!r}, "
                      f"or accept {metric!r} by deleting the experiment's {CHAMPION} (the next evaluated "
                      f"checkpoint then becomes champion)")
    if champion is None or not math.isfinite(champion):
        return refuse(f"the champion's recorded {metric} is {champion} (missing or not finite): it cannot be compared, so "
                      f"nothing is promoted; delete the experiment's {CHAMPION} to choose a champion afresh")
    drop = champion - candidate
    if drop > tolerance:
        return Decision(False, f"{metric} regressed by {drop:.4f} ({champion:.4f} -> {candidate:.4f}), more than the "
                               f"tolerance {tolerance:.4f}: the champion stays", metric, candidate, champion, tolerance)
    return Decision(True, f"{metric} {candidate:.4f} vs champion {champion:.4f} (change {-drop:+.4f}, tolerance "
                          f"{tolerance:.4f}): promoted", metric, candidate, champion, tolerance)


def against_champion(candidate: float | None, record: dict | None, tolerance: float, metric: str) -> Decision:
    """`decide` against a champion.json record (None: no champion yet). A record names the metric it was
    chosen on; one without a name or value cannot be compared, and so blocks promotion."""
    if record is None:
        return decide(candidate, None, tolerance, metric)
    value = record.get("value")
    return decide(candidate, None if value is None else float(value), tolerance, metric,
                  champion_metric=str(record.get("metric") or "<unrecorded>"))


def metric_of(evals: dict[int, dict[str, dict]], version: int, metric: str) -> float | None:
    """`metric` is `<eval set>/<key>`, e.g. `heldout/pass@1`, read from the eval at `version`."""
    name, _, key = metric.partition("/")
    value = evals.get(version, {}).get(name, {}).get(key)
    return None if value is None else float(value)


def read_champion(store: ExperimentStore) -> dict | None:
    return store.read_json(CHAMPION) if store.exists(CHAMPION) else None


def write_champion(store: ExperimentStore, checkpoint_url: str, step: int, decision: Decision, run: str) -> str:
    return store.write_json(CHAMPION, {"checkpoint": checkpoint_url, "step": step, "metric": decision.metric,
                                       "value": decision.candidate, "promoted_by": run, "promoted_at": time.time()})


def record_decision(store: ExperimentStore, run: str, decision: Decision, extra: dict) -> str:
    return store.write_json(f"retrain/runs/{run}/decision.json", {**asdict(decision), **extra})


# ---------------------------------------------------------------- data ledger


def list_data_files(location: str, storage: StorageAccess) -> list[dict]:
    """Data files (jsonl/json/parquet) directly under a folder or URL prefix, with their sizes.
    A relative folder is made absolute, so the ledger names each file the same from any directory."""
    location = location.rstrip("/") if "://" in location else os.path.abspath(location)
    if not storage.exists(location):
        raise FileNotFoundError(f"retrain data location {location!r} does not exist")
    return [{"url": f"{location}/{name}", "size": int(info.get("size") or 0)}
            for name, info in storage.files(location, maxdepth=1).items() if name.endswith(DATA_SUFFIXES)]


def read_ledger(store: ExperimentStore) -> list[dict]:
    return store.read_json(LEDGER) if store.exists(LEDGER) else []


def new_files(store: ExperimentStore, files: list[dict]) -> list[dict]:
    """Files not consumed by an earlier run (a file is identified by its URL and size: one that
    grew or was replaced counts as new)."""
    seen = {(f["url"], f["size"]) for f in read_ledger(store)}
    return [f for f in files if (f["url"], f["size"]) not in seen]


def merge_rows(files: list[dict], storage: StorageAccess) -> bytes:
    """The new files' rows as one jsonl (the run's training prompts, kept as its record)."""
    frames = []
    for f in files:
        data = storage.read_bytes(f["url"])
        if f["url"].endswith(".parquet"):
            frames.append(pd.read_parquet(io.BytesIO(data)))
        else:
            frames.append(pd.read_json(io.BytesIO(data), lines=f["url"].endswith(".jsonl")))
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    return "".join(json.dumps(r, default=str) + "\n" for r in rows.to_dict(orient="records")).encode()


def append_ledger(store: ExperimentStore, files: list[dict], run: str) -> str:
    return store.write_json(LEDGER, read_ledger(store) + [{**f, "run": run, "at": time.time()} for f in files])
