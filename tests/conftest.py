"""Session-wide fixtures: one Ray cluster, one tiny HF policy, isolated Prefect home.

Ray is started once per test session in a fresh temp dir (a stale `ray_current_cluster` from an
earlier run breaks `ray.init`). It advertises more logical CPUs than the 2 cores so that two
trainer ranks and an engine can be scheduled together; threads are set per actor.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory) -> Path:
    """A ~20k-parameter random Llama with the demo's char tokenizer, saved as an HF folder."""
    from rl.demo_policy import build_model, build_tokenizer, save_policy

    tok = build_tokenizer()
    model = build_model(tok, hidden=32, layers=2, heads=2, mlp=64, seed=0)
    return save_policy(model, tok, tmp_path_factory.mktemp("tiny_policy"))


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster shared by the whole test session."""
    import ray

    tmp = tempfile.mkdtemp(prefix="ray_", dir="/tmp")
    ctx = ray.init(num_cpus=8, include_dashboard=False, _temp_dir=tmp, log_to_driver=True,
                   runtime_env={"env_vars": {"TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"],
                                             "TOKENIZERS_PARALLELISM": "false"}})
    yield ctx
    ray.shutdown()


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """A real temporary Prefect server (sqlite in a temp PREFECT_HOME) for the session."""
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect_home"))
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield
