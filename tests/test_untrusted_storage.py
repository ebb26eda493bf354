"""Nothing reflow reads back from storage can run code (issue 13, point 4): a bucket writer can
replace any file, and the sha256 records sit in the same bucket, so a pickle there would be code
execution in the Ray workers. Stage results are JSON; RNG states load with torch's weights-only
unpickler. DeepSpeed's pickled optimizer states are guarded by signed manifests instead:
tests/test_signed_checkpoints.py."""
from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from reflow.engines.train.checkpoint import load_rng_state, rng_state
from reflow.infra.store.storage import ExperimentStore
from reflow.rl.types import RolloutBatch
from reflow.tasks import stage_cache

PWNED = "/tmp/reflow-pwned-marker"


class Exploit:
    """Unpickling this runs `touch PWNED`: what a bucket writer would plant."""

    def __reduce__(self):
        return (os.system, (f"touch {PWNED}",))


@pytest.fixture()
def no_marker():
    Path(PWNED).unlink(missing_ok=True)
    yield
    assert not Path(PWNED).exists(), "a file read from storage ran code"


def _batch() -> RolloutBatch:
    return RolloutBatch(group_index=[0, 0], prompt_text=["1+1=", "1+1="], prompt_ids=[[5, 6], [5, 6]],
                        response_text=["2", "3"], response_ids=[[7], [8, 9]],
                        rollout_logprobs=[[-0.25], [-1e-7, -3.5]], finish_reason=["stop", "length"],
                        label=[2, 2], policy_version=3, rewards=[1.0, float("nan")], extra={"k": [1, "a"]})


def test_stage_results_round_trip_exactly_without_pickle(tmp_path):
    store = ExperimentStore.open(f"file://{tmp_path}", "exp")
    key = "k" * 16
    stage_cache.save_stage_local(_batch(), store, 4, "scored", key, {"reward_mean": 0.5})
    meta = stage_cache.find(store, 4, "scored", key)
    assert meta is not None and meta["stats"] == {"reward_mean": 0.5}
    back = stage_cache.load_stage_local(store, 4, "scored", meta["sha256"])
    a, b = _batch(), back
    assert (a.prompt_ids, a.response_ids, a.rollout_logprobs, a.label, a.policy_version, a.extra) == \
        (b.prompt_ids, b.response_ids, b.rollout_logprobs, b.label, b.policy_version, b.extra)
    assert b.rewards[0] == 1.0 and np.isnan(b.rewards[1])
    raw = store.read_bytes(f"{store.iteration_dir(4)}/stages/scored.batch.json")
    json.loads(raw)  # plain JSON, no pickle anywhere
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads(raw)


def test_a_planted_stage_pickle_is_never_loaded(tmp_path, no_marker):
    """An old-style `<stage>.pkl` plus a record naming its sha256 (both writable by a bucket writer):
    the record is not of the JSON format, so the stage is generated again, never unpickled."""
    store = ExperimentStore.open(f"file://{tmp_path}", "exp")
    data = pickle.dumps(Exploit())
    rel = f"{store.iteration_dir(0)}/stages/generated"
    store.write_bytes(f"{rel}.pkl", data)
    import hashlib

    store.write_json(f"{rel}.json", {"key": "k", "sha256": hashlib.sha256(data).hexdigest(), "samples": 2,
                                     "stats": {}})
    assert stage_cache.find(store, 0, "generated", "k") is None


def test_stage_file_with_unknown_fields_is_refused(tmp_path):
    store = ExperimentStore.open(f"file://{tmp_path}", "exp")
    meta_sha = stage_cache.save_stage_local(_batch(), store, 1, "generated", "k", {})
    rel = f"{store.iteration_dir(1)}/stages/generated.batch.json"
    doc = json.loads(store.read_bytes(rel))
    doc["fields"]["__class__"] = "os.system"
    data = json.dumps(doc).encode()
    store.write_bytes(rel, data)
    import hashlib

    with pytest.raises(ValueError, match="unknown fields"):
        stage_cache.load_stage_local(store, 1, "generated", hashlib.sha256(data).hexdigest())
    assert meta_sha


def test_rng_state_round_trips_and_a_planted_pickle_does_not_run(tmp_path, no_marker):
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    torch.save(rng_state(), tmp_path / "rank_00000.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    load_rng_state(tmp_path / "rank_00000.pt")
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    torch.save({"python": Exploit()}, tmp_path / "evil.pt")
    with pytest.raises(Exception, match="(?i)weights.only|unsupported global"):
        load_rng_state(tmp_path / "evil.pt")
