"""The runtime is explicit: only the start steps build one; any other task without it fails clearly
(instead of silently starting a second cluster, e.g. when a task runs in another process)."""

from __future__ import annotations

import pytest

from reflow.infra.cluster.runtime import RuntimeNotStarted
from reflow.infra.config.schema import load_config


@pytest.mark.parametrize("task_path", ["reflow.tasks.rollout:generate", "reflow.tasks.train:push_weights"])
def test_a_task_without_a_started_runtime_names_the_start_step(task_path, tmp_path):
    import importlib

    module, name = task_path.split(":")
    task = getattr(importlib.import_module(module), name)
    cfg = load_config(None, ["experiment=never-started", f"storage.root=file://{tmp_path}/runs"])
    with pytest.raises(RuntimeNotStarted, match=r"experiment 'never-started'.*'start-cluster' task"):
        task.fn(cfg, 1)
    assert not (tmp_path / "runs").exists(), "nothing may be started or written"


def test_eval_tasks_need_the_eval_start_step(tmp_path):
    from reflow.tasks.evaluate import launch_checkpoint_eval

    cfg = load_config(None, ["experiment=never-started", f"storage.root=file://{tmp_path}/runs"])
    with pytest.raises(RuntimeNotStarted, match="'start-eval-engines' task"):
        launch_checkpoint_eval.fn(cfg, 1)
