"""What a Ray task worker imports: the module of the function it runs (cloudpickle sends a module-level function
by reference). Every task a run submits runs a function of a worker-side module that imports neither Prefect nor
the runtime (engine classes, transformers): those cost each task worker of each run ~2 s more CPU to start. Nor torch
(~1.7 s more) but in the critic's module, whose task only a run with a value model submits: the one worker that
runs the advantages task imports it when it unpickles the algorithm's config."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from ray.remote_function import RemoteFunction

SUBMITTING = ("reflow.tasks.rollout", "reflow.tasks.evaluate", "reflow.tasks.report", "reflow.tasks.train",
              "reflow.tasks.stage_cache", "reflow.infra.cluster.runtime")
HEAVY = ("prefect", "transformers", "deepspeed", "reflow.infra.cluster.runtime", "reflow.tasks.rollout")
WITH_TORCH = ("reflow.engines.train.critic",)  # attach_values: PPO's task (the warm-up imports it only then)


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
    light = [m for m in modules if m not in WITH_TORCH]
    code = (f"import importlib, sys\nfor m in {light!r}: importlib.import_module(m)\n"
            f"print(sorted(h for h in ('torch', 'pandas') if h in sys.modules))\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            f"print(sorted(h for h in {HEAVY!r} if h in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    *_, without_torch, without_heavy = out.stdout.strip().splitlines()
    assert without_torch == "[]", (light, out.stdout)
    assert without_heavy == "[]", (modules, out.stdout)
