"""Starting the experiment's actors: the only tasks that build a runtime (reflow.infra.cluster.runtime).

Every other task asks for the runtime these built and fails with a clear error when there is none.
"""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from reflow.infra.cluster.runtime import start_eval_runtime, start_runtime
from reflow.infra.config.schema import RunConfig


@task(name="start-cluster", cache_policy=NO_CACHE)
def start_cluster(config: RunConfig) -> dict[str, object]:
    """Engines, trainer ranks (and critic) of the experiment: attached, reused or created."""
    rt = start_runtime(config)
    return {"engines": rt.engine_urls, "trainer_ranks": config.trainer.num_ranks,
            "namespace": rt.namespace, "storage": rt.store.url(), "startup_s": rt.timings["startup"]}


@task(name="start-eval-engines", cache_policy=NO_CACHE)
def start_eval_engines(config: RunConfig) -> dict[str, object]:
    """Engines serving `config.model.path` (a checkpoint's model/ folder) for an eval-only run."""
    rt = start_eval_runtime(config)
    return {"engines": rt.engine_urls, "namespace": rt.namespace, "startup_s": rt.timings["startup"]}
