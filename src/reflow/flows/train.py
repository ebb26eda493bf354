"""The parent `train` flow: the miles/slime `train.py` loop as a Prefect flow.

    check storage -> find a checkpoint to resume from -> start cluster -> restore -> push weights
    -> eval (before training, fresh runs only)
    for each iteration: one `iteration` flow run (the next one's rollout launched as it ends); save at
    `checkpoint.save_interval`, every `checkpoint.save_every_minutes` (default 10), on the sentinel
    file and at the end; eval every `eval.interval` and at the end (eval.blocking=false: an eval
    overlaps the next iteration, its generation gating the next weight push; all are recorded, in
    order, before the flow returns; see tasks/evaluate.py)

`num_iterations` is the run's total: a run resumed after k iterations runs iterations k..n-1.
While it runs, `reflow ctl` reaches its control API (infra/ops/control.py: health, metrics, pause, resume,
save, stop); a trainer rank that dies mid-iteration is rebuilt from the latest checkpoint (flows/recovery.py).
The loop's steps and the clean-up after it are the run session's methods (flows/session.py).
"""
from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from reflow.flows.inputs import USER_ERRORS, checked_config, refused
from reflow.flows.session import RunSession
from reflow.infra.cluster import leases
from reflow.infra.config.flow_params import FlowConfig
from reflow.infra.config.schema import RunConfig
from reflow.tasks.checkpoint import check_storage, find_checkpoints


def _already_done(config: RunConfig, step: int, url: str) -> dict[str, object]:
    msg = (f"experiment {config.experiment!r} already completed {step} of num_iterations={config.num_iterations} "
           f"iterations (checkpoint {url}); nothing to do. num_iterations is the run's total: raise it to "
           f"train further, or use a new experiment name to start over.")
    get_run_logger().warning(msg)
    return {"iterations": 0, "start": step, "already_complete": True, "message": msg, "evals": {}, "history": []}


@flow(name="train", flow_run_name="{config.experiment}", log_prints=True)
def train(config: FlowConfig, release_cluster: bool | None = None) -> dict[str, object]:
    """Run iterations up to `config.num_iterations` in total (stopping early at `debug_exit_after`).

    config: the full run config, or {"file": "configs/X.yaml", "overrides": ["k=v", ...]}.
    release_cluster: kill the experiment's actors at the end (true), keep them for the next flow
    run (false), or (null) keep them only on a long-lived cluster (RAY_ADDRESS, `reflow cluster up`)."""
    try:
        config = checked_config(config)
    except USER_ERRORS as e:
        return refused(e)  # type: ignore[return-value]  # Prefect takes a returned State as the run's
    for line in leases.take(config.experiment, flow_run.id):  # a killed predecessor: its leftovers, its state
        get_run_logger().warning("previous run: %s", line)
    try:
        return _train(config, release_cluster)
    finally:
        leases.release(config.experiment)


def _train(config: RunConfig, release_cluster: bool | None) -> dict[str, object]:
    session = RunSession(config, release_cluster)  # the run's driver state and steps (flows/session.py)
    get_run_logger().info("storage: %s", check_storage(config))
    found = find_checkpoints(config)  # newest first
    if found and found[0][0].step >= config.num_iterations:
        return _already_done(config, found[0][0].step, found[0][0].url)
    with session:  # however the loop ends: batches in flight, records, checkpoint settled; actors released
        session.begin(found)  # cluster, restore, control API, first push, rollout source, eval before training
        for i in session.iterations():
            m = session.iterate(i)  # one iteration flow run; a dead trainer rank: rebuilt, re-run
            session.evaluate_if_due(i + 1)  # first: its records are written while the engines generate next
            session.save_if_due(i + 1)
            session.update_ahead(i + 1)  # the rollout source submits the next update in the background
            session.record(i, m)  # records, evals that finished, progress; a failed background save raises
            if session.ends_after(i + 1):  # the last, or stopped (a pause holds here)
                break
        return session.finish()  # every eval, record and checkpoint settled; the run's summary
