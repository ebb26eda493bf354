"""The parent `train` run's progress, updated after every iteration: a progress artifact, a one-line
summary in the run's log, the terminal bar (only when the CLI asked for one: infra/console.py), the
experiment trackers of `tracking:` (infra/tracking.py) and the curves artifact. The curves artifact
carries its image inside the markdown (a data: URI), so the Prefect UI shows it whatever the storage
(a browser cannot load file:// or s3:// images from a page);
it is redrawn when an eval lands, every CURVES_EVERY iterations and at the end, and updated in place
(one artifact per run, not one per redraw)."""
from __future__ import annotations

from uuid import UUID

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from reflow.infra import console
from reflow.infra import metric_views as views
from reflow.infra.config import RunConfig
from reflow.infra.plots import curves_png, data_uri
from reflow.infra.records import eval_points, iteration_table
from reflow.infra.runtime import get_runtime
from reflow.infra.storage import ExperimentStore
from reflow.infra.tracking import Trackers
from reflow.tasks.report import artifact_key

CURVES_EVERY = 10  # iterations between redraws when no eval lands (each reads every metrics.json)


@task(name="plot-curves", cache_policy=NO_CACHE)
def plot_curves(cfg: RunConfig, artifact_id: UUID | None = None) -> tuple[str, UUID]:
    """Reward + eval curves (one per eval set) of the whole experiment (resumed runs included), drawn
    from the records in storage: plots/curves.png, and the curves artifact (created, or updated when
    `artifact_id` names it). Returns the PNG's URL and the artifact's id."""
    rt = get_runtime(cfg)
    table, evals = iteration_table(rt.store), eval_points(rt.store)
    curves = {name: [(v, float(s["pass@1"])) for v, s in points] for name, points in evals.items()}
    png = curves_png(table, curves, cfg.experiment)
    url = rt.store.write_bytes("plots/curves.png", png)
    markdown = views.curves_markdown(cfg.experiment, data_uri(png), url, table, curves)
    description = f"{cfg.experiment}: reward and eval curves, key metrics per policy version"
    if artifact_id is None:
        return url, create_markdown_artifact(key=artifact_key(cfg.experiment, "curves"), markdown=markdown,
                                             description=description)
    _update_artifact(artifact_id, markdown, description)
    return url, artifact_id


def _update_artifact(artifact_id: UUID, data: str, description: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactUpdate

    with get_client(sync_client=True) as client:  # also updates the key's "latest" when this is it
        client.update_artifact(artifact_id, ArtifactUpdate(data=data, description=description))


class Progress:
    """What the parent run shows while it goes (see the module docstring)."""

    def __init__(self, cfg: RunConfig, done: int, total: int) -> None:
        self.cfg, self.total = cfg, total
        self.curves_id: UUID | None = None
        self.evals_seen = 0
        self.artifact = create_progress_artifact(
            progress=100.0 * done / max(total, 1), key=artifact_key(cfg.experiment, "progress"),
            description=f"{cfg.experiment}: iterations done of num_iterations={total}")
        self.bar = console.bar(total, done, "train")
        self.trackers = Trackers(cfg, ExperimentStore.from_config(cfg.storage, cfg.experiment),
                                 flow_run.get_name() or cfg.experiment)

    def update(self, done: int, metrics: dict[str, float], evals: dict[int, dict[str, dict]]) -> None:
        """After iteration `done - 1` (its metrics) and the evals recorded so far."""
        update_progress_artifact(artifact_id=self.artifact, progress=100.0 * done / max(self.total, 1))
        self.trackers.iteration(done - 1, metrics)
        self.trackers.evals(evals)
        new_eval = len(evals) > self.evals_seen
        self.evals_seen = len(evals)
        line = f"[{done}/{self.total}] {views.summary_line(done - 1, metrics)}"
        get_run_logger().info(line + (f" | eval {views.last_eval(evals)}" if new_eval else ""))
        if self.bar is not None:
            shown = f"reward {metrics.get('reward_mean', float('nan')):.3f}"
            self.bar.set_postfix_str(shown + (f" | eval {views.last_eval(evals)}" if evals else ""), refresh=False)
            self.bar.update(1)
        if new_eval or done % CURVES_EVERY == 0:
            self.curves()

    def curves(self) -> str:
        url, self.curves_id = plot_curves(self.cfg, self.curves_id)
        self.trackers.flush()  # as often as the curves: uploads TensorBoard's files to remote storage
        return url

    def finish(self, evals: dict[int, dict[str, dict]]) -> str:
        """The final curves, the evals recorded after the last update; the trackers and the bar close.
        Returns the PNG's URL."""
        self.trackers.evals(evals)
        url = self.curves()
        self.trackers.close(ok=True)
        console.close_bar()
        return url

    def abort(self) -> None:
        """A run that failed: its trackers close marked failed (nothing when finish() ran)."""
        self.trackers.close(ok=False)
