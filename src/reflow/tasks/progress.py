"""The parent `train` run's progress, updated after every iteration: a progress artifact, a one-line
summary in the run's log, the terminal bar (only when the CLI asked for one: infra/ops/console.py), the
experiment trackers of `tracking:` (infra/store/tracking.py) and the curves artifact. The curves artifact
carries its image inside the markdown (a data: URI), so the Prefect UI shows it whatever the storage
(a browser cannot load file:// or s3:// images from a page);
it is redrawn when an eval lands and every CURVES_EVERY iterations, but not within CURVES_MIN_SECONDS of
the last redraw (it then waits for the next iteration past that), and at the end; updated in place (one
artifact per run, not one per redraw). Every update during the run, the redraw included, is made by the
records writer (tasks/report.py), in order and after the metrics.json files it reads: off the loop, as
plain calls (no task run)."""
from __future__ import annotations

import time
from uuid import UUID

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.runtime import flow_run

from reflow.infra.cluster.runtime import get_runtime
from reflow.infra.config.schema import RunConfig
from reflow.infra.ops import console
from reflow.infra.store import metric_views as views
from reflow.infra.store.plots import curves_png, data_uri
from reflow.infra.store.records import eval_points, iteration_table
from reflow.infra.store.storage import ExperimentStore
from reflow.infra.store.tracking import Trackers
from reflow.tasks.report import RECORDS, api_call, artifact_key, create_artifact

CURVES_EVERY = 10  # iterations between redraws when no eval lands (each reads every metrics.json)
# At most one redraw in this many seconds while the run goes: with an eval after every 6 s iteration (25M,
# bench/iteration_overhead.py large) a redraw each time cost ~0.1 s of CPU (matplotlib, every
# metrics.json read, the artifact's ~20 kB) of a machine the engine and trainer already fill.
CURVES_MIN_SECONDS = 15.0


def plot_curves(cfg: RunConfig, run_id: UUID | None, artifact_id: UUID | None = None) -> tuple[str, UUID]:
    """Reward + eval curves (one per eval set) of the whole experiment (resumed runs included), drawn
    from the records in storage: plots/curves.png, and the curves artifact of the flow run `run_id`
    (created, or updated when `artifact_id` names it). Returns the PNG's URL and the artifact's id."""
    rt = get_runtime(cfg)
    table, evals = iteration_table(rt.store), eval_points(rt.store)
    curves = {name: [(v, float(s["pass@1"])) for v, s in points] for name, points in evals.items()}
    png = curves_png(table, curves, cfg.experiment)
    url = rt.store.write_bytes("plots/curves.png", png)
    markdown = views.curves_markdown(cfg.experiment, data_uri(png), url, table, curves)
    description = f"{cfg.experiment}: reward and eval curves, key metrics per policy version"
    if artifact_id is None:
        return url, create_artifact("markdown", artifact_key(cfg.experiment, "curves"), markdown, description, run_id)
    _update_artifact(artifact_id, markdown, description)
    return url, artifact_id


def _update_artifact(artifact_id: UUID, data: str, description: str) -> None:

    # also updates the key's "latest" when this is it
    api_call(lambda client: client.update_artifact(artifact_id, ArtifactUpdate(data=data, description=description)))


class Progress:
    """What the parent run shows while it goes (see the module docstring)."""

    def __init__(self, cfg: RunConfig, done: int, total: int) -> None:
        self.cfg, self.total = cfg, total
        run_id = flow_run.get_id()  # the train run: its records are written from another thread
        self.run_id = UUID(str(run_id)) if run_id else None
        self.curves_id: UUID | None = None
        self.evals_seen = 0
        self.stale = False  # something to redraw that the last redraw did not show
        self.drawn_at = float("-inf")  # time.monotonic() of the last redraw
        self.artifact = create_progress_artifact(
            progress=100.0 * done / max(total, 1), key=artifact_key(cfg.experiment, "progress"),
            description=f"{cfg.experiment}: iterations done of num_iterations={total}")
        self.bar = console.bar(total, done, "train")
        self.log = get_run_logger()  # the train run's: lines written later by the records writer land on it
        self.trackers = Trackers(cfg, ExperimentStore.from_config(cfg.storage, cfg.experiment),
                                 flow_run.get_name() or cfg.experiment)

    def update(self, done: int, metrics: dict[str, float], evals: dict[int, dict[str, dict]]) -> None:
        """After iteration `done - 1` (its metrics) and the evals recorded so far. Written by the records
        writer, in order, after that iteration's records: the loop only queues it (the progress artifact's
        API call, the trackers and the log line took ~35 ms of the loop's own thread per iteration)."""
        RECORDS.submit(self._update, done, dict(metrics), dict(evals))

    def _update(self, done: int, metrics: dict[str, float], evals: dict[int, dict[str, dict]]) -> None:

        progress = 100.0 * done / max(self.total, 1)
        RECORDS.api_turn()
        api_call(lambda client: client.update_artifact(self.artifact, ArtifactUpdate(data=progress)))
        self.trackers.iteration(done - 1, metrics)
        self.trackers.evals(evals)
        new_eval = len(evals) > self.evals_seen
        self.evals_seen = len(evals)
        line = f"[{done}/{self.total}] {views.summary_line(done - 1, metrics)}"
        self.log.info(line + (f" | eval {views.last_eval(evals)}" if new_eval else ""))
        if self.bar is not None:
            shown = f"reward {metrics.get('reward_mean', float('nan')):.3f}"
            self.bar.set_postfix_str(shown + (f" | eval {views.last_eval(evals)}" if evals else ""), refresh=False)
            self.bar.update(1)
        self.stale |= new_eval or done % CURVES_EVERY == 0
        if self.stale and time.monotonic() - self.drawn_at >= CURVES_MIN_SECONDS:
            self._draw()  # after this iteration's metrics.json (written before, by this same writer)
            self.stale, self.drawn_at = False, time.monotonic()
            self.trackers.flush()  # as often as the curves: uploads TensorBoard's files to remote storage

    def _draw(self) -> str:
        url, self.curves_id = plot_curves(self.cfg, self.run_id, self.curves_id)
        return url

    def curves(self) -> str:
        """Redraw now (the records writer has nothing queued: the run waits for it first)."""
        url = self._draw()
        self.trackers.flush()
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
        """A run that failed: its trackers close marked failed (nothing when finish() ran), after the
        updates queued before."""
        RECORDS.wait(raise_errors=False)
        self.trackers.close(ok=False)
