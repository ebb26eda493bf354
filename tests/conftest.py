"""Session-wide fixtures: one Ray cluster, one tiny HF policy, one Prefect server; the test tiers.

Ray is started once per test session in a fresh temp dir (a stale `ray_current_cluster` from an
earlier run breaks `ray.init`). It advertises more logical CPUs than the 2 cores so that two
trainer ranks and an engine can be scheduled together; threads are set per actor.

Tiers: a test that uses the Ray cluster or the Prefect server is `slow` automatically; others carry
the marker by hand. `make test-fast` (`-m "not slow"`) runs the rest with a guard: a test of that
tier that starts Ray, a torch.distributed group (DeepSpeed) or leaves a child process running (a
Prefect server, a Ray head) fails and names what it started, so the quick tier stays quick.

Isolation: named actors a test leaves on the shared Ray cluster are killed after it (and named in
the log), so no test sees a cluster with its CPUs or actor names taken by an earlier one.
"""
from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SERVICE_FIXTURES = {"ray_cluster", "prefect_server"}
log = logging.getLogger("tests")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SERVICE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def _fast_tier(config) -> bool:
    return (config.getoption("markexpr", "") or "").replace(" ", "") == "notslow"


@pytest.fixture(autouse=True)
def _fast_tier_guard(request):
    """In `-m "not slow"` runs: fail a test that started Ray, torch.distributed or a lasting child process."""
    if not _fast_tier(request.config):
        yield
        return
    import psutil

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    started = []
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        started.append("Ray (ray.init)")
        ray.shutdown()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        started.append("a torch.distributed process group (DeepSpeed)")
    lasting = []
    for p in me.children(recursive=True):
        try:  # torch_shm_manager: torch's own helper for shared-memory tensors, not a service
            if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE and p.name() != "torch_shm_manager":
                lasting.append(p)
        except psutil.NoSuchProcess:  # deliberate: it ended while we looked
            pass
    if lasting:
        started.append("child processes " + ", ".join(f"{p.pid} {p.name()}" for p in lasting))
    if started:
        pytest.fail(f"{request.node.nodeid} is in the fast tier but started {'; '.join(started)}: "
                    f"mark it @pytest.mark.slow (or use the ray_cluster / prefect_server fixtures)", pytrace=False)


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory) -> Path:
    """A ~20k-parameter random Llama with the demo's char tokenizer, saved as an HF folder."""
    from reflow.rl.demo_policy import build_model, build_tokenizer, save_policy

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


def _named_actors() -> set[tuple[str, str]]:
    import ray

    return {(a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)}


@pytest.fixture(autouse=True)
def _reap_named_actors():
    """Named actors a test leaves on the shared cluster are killed after it (and logged), so a later
    test never finds its CPUs taken or an actor name held by an earlier one. Actors of module- and
    session-scoped fixtures exist before this snapshot and are left alone. (Unnamed actors die with
    their last handle; named ones would live as long as the session.)"""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        yield
        return
    before = _named_actors()
    yield
    if not ray.is_initialized():
        return
    for namespace, name in sorted(_named_actors() - before):
        log.warning("a test left actor %s/%s running: killing it", namespace, name)
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        except ValueError:  # deliberate: it died between listing and killing
            pass


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """A real temporary Prefect server (sqlite in a temp PREFECT_HOME) for the session."""
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect_home"))
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield
