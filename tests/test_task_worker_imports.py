"""What a Ray task worker imports: the module of the function it runs (cloudpickle sends a module-level function
by reference). Every task a run submits runs a function of a worker-side module that imports neither Prefect nor
the runtime (engine classes, transformers): those cost each task worker of each run ~2 s more CPU to start."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from ray.remote_function import RemoteFunction

SUBMITTING = ("reflow.tasks.rollout", "reflow.tasks.evaluate", "reflow.tasks.report", "reflow.tasks.train",
              "reflow.tasks.stage_cache", "reflow.infra.cluster.runtime")
HEAVY = ("prefect", "transformers", "deepspeed", "reflow.infra.cluster.runtime", "reflow.tasks.rollout")


def _task_modules() -> dict[str, str]:
    found = {}
    for name in SUBMITTING:
        for attr, value in vars(importlib.import_module(name)).items():
            if isinstance(value, RemoteFunction):
                found[f"{name}.{attr}"] = value._function.__module__
    return found


@pytest.mark.slow  # a fresh interpreter importing torch: ~2 s of CPU, a guard of the slow tier's cost
def test_task_functions_live_in_modules_a_worker_imports_cheaply():
    found = _task_modules()
    assert len(found) >= 10, found  # generate, score, advantages, dynamic fill, tables, samples, eval, stages, warm-up
    modules = sorted(set(found.values()))
    assert not any(m.startswith("reflow.tasks.") and m != "reflow.tasks.stage_cache" for m in modules), found
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            f"print(sorted(h for h in {HEAVY!r} if h in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", (modules, out.stdout)
