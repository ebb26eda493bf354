"""Task retries are for transient faults only (tasks/faults.py)."""
from __future__ import annotations

import httpx
import pytest

from reflow.engines.rollout_client import EngineError
from reflow.infra.store.storage import StorageError
from reflow.tasks.faults import is_transient_fault


@pytest.mark.parametrize("exc,transient", [
    (EngineError("http://e:1", "/generate", None, "ConnectError: refused"), True),  # engine unreachable
    (EngineError("http://e:1", "/generate", 503, "no live engine behind the router"), True),
    (EngineError("http://e:1", "/generate", 400, "top_p must be in (0, 1]"), False),  # a bad request stays bad
    (httpx.ReadTimeout("timed out"), True),
    (ConnectionResetError("reset by peer"), True),  # storage I/O
    (FileNotFoundError("no such checkpoint"), False),
    (StorageError("bucket does not exist"), False),
    (KeyError("verifier has no answer key"), False),  # a raising reward function
    (FloatingPointError("loss is NaN"), False),
    (ValueError("prompt longer than max_prompt_len"), False),
])
def test_only_transient_faults_are_retried(exc, transient):
    assert is_transient_fault(exc) is transient


def test_ray_wrapped_errors_are_classified_by_their_cause(ray_cluster):
    import ray

    @ray.remote
    def unreachable():
        raise EngineError("http://e:1", "/generate", None, "ConnectError")

    @ray.remote
    def bad_request():
        raise EngineError("http://e:1", "/generate", 400, "bad")

    for fn, transient in ((unreachable, True), (bad_request, False)):
        with pytest.raises(ray.exceptions.RayTaskError) as e:
            ray.get(fn.remote())
        assert is_transient_fault(e.value) is transient
