"""Reads of the session's shared Prefect server, filtered on the server.

One Prefect server serves the whole test session, and the API answers an unfiltered read with its
default page (PREFECT_API_DEFAULT_LIMIT, 200 rows): once earlier tests have written more artifacts
or flow runs than that, an unfiltered read misses some of a test's own. Ask for them by key or name.
"""

from __future__ import annotations


def artifacts(*keys: str, flow_run_id: str | None = None) -> list:
    """Every artifact version with one of these keys (of one flow run, when given), oldest first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    run = None if flow_run_id is None else ArtifactFilterFlowRunId(any_=[flow_run_id])
    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=list(keys)), flow_run_id=run),
                                     sort=ArtifactSort.CREATED_DESC)[::-1]


def flow_runs(*names: str) -> dict:
    """The flow runs with these names, by name (the newest where a name repeats)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=list(names))),
                                     sort=FlowRunSort.START_TIME_DESC)
    return {r.name: r for r in reversed(runs)}
