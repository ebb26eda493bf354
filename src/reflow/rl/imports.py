"""Imports that cost a process seconds of CPU for nothing."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def mlflow_hidden() -> Iterator[None]:
    """`import mlflow` raises ImportError inside, where MLflow is not imported already.

    `import deepspeed` tries `import mlflow` for its autotuner (unused here; it takes the ImportError as "no MLflow"):
    ~1.1 s of CPU where MLflow is installed (reflow's `tracking` extra). DeepSpeed is imported by a trainer rank, and
    by transformers' `save_pretrained` in any process (accelerate's unwrap_model looks for a DeepSpeedEngine)."""
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if hide and sys.modules.get("mlflow", ...) is None:
            del sys.modules["mlflow"]
