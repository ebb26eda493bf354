"""The parent `train` flow: the miles/slime `train.py` loop as a Prefect flow.

    check storage -> find a checkpoint to resume from -> start cluster -> restore -> push weights
    -> eval (before training, fresh runs only)
    for each iteration: one `iteration` flow run; save at `checkpoint.save_interval`, on the
    sentinel file and at the end; eval every `eval_interval` and at the end

`num_iterations` is the run's total: a run resumed after k iterations runs iterations k..n-1.
"""
from __future__ import annotations

import time

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows.iteration import iteration
from infra import checkpoint as ckpt
from infra.config import RunConfig
from infra.runtime import get_runtime, shutdown_runtime
from tasks.checkpoint import check_storage, find_checkpoints, restore, save_checkpoint
from tasks.report import plot_curves
from tasks.rollout import evaluate
from tasks.train import push_weights


@task(name="start-cluster", cache_policy=NO_CACHE)
def start_cluster(config: RunConfig) -> dict[str, object]:
    rt = get_runtime(config)
    return {"engines": rt.engine_urls, "trainer_ranks": config.trainer.num_ranks,
            "namespace": rt.namespace, "storage": rt.store.url(), "startup_s": rt.timings["startup"]}


def _eval_due(config: RunConfig, done: int, last: int) -> bool:
    every = config.eval_interval
    return done == last or (every is not None and done % every == 0)


def _save_due(config: RunConfig, done: int, last: int) -> bool:
    every = config.checkpoint.save_interval
    return done == last or (every is not None and done % every == 0) or ckpt.sentinel_present(config.checkpoint.sentinel)


def _already_done(config: RunConfig, step: int, url: str) -> dict[str, object]:
    msg = (f"experiment {config.experiment!r} already completed {step} of num_iterations={config.num_iterations} "
           f"iterations (checkpoint {url}); nothing to do. num_iterations is the run's total: raise it to "
           f"train further, or use a new experiment name to start over.")
    get_run_logger().warning(msg)
    return {"iterations": 0, "start": step, "already_complete": True, "message": msg, "evals": {}, "history": []}


def _progress(done: int, total: int, m: dict[str, float], acc: float | None) -> str:
    stages = " ".join(f"{k[5:]} {v:.1f}s" for k, v in m.items() if k.startswith("time_") and k != "time_iteration")
    acc_s = f" eval_acc {acc:.3f}" if acc is not None else ""
    return (f"iter {done}/{total} reward {m.get('reward_mean', float('nan')):.3f}{acc_s} "
            f"loss {m.get('loss', float('nan')):.4f} kl {m.get('kl', float('nan')):.4f} | {stages} "
            f"| total {m['time_iteration']:.1f}s")


@flow(name="train", flow_run_name="{config.experiment}", log_prints=True)
def train(config: RunConfig, release_cluster: bool = True) -> dict[str, object]:
    """Run iterations up to `config.num_iterations` in total (stopping early at `debug_exit_after`)."""
    log = get_run_logger()
    t0 = time.perf_counter()
    log.info("storage: %s", check_storage(config))
    found = find_checkpoints(config)
    if found and found[0][0].step >= config.num_iterations:
        return _already_done(config, found[0][0].step, found[0][0].url)
    try:
        log.info("cluster: %s", start_cluster(config))
        start = restore(config, found) if found else 0
        push_weights(config, start)
        evals: dict[int, float] = {}
        if config.eval_before_train and start == 0:
            evals[0] = evaluate(config, 0)["eval_accuracy"]
            log.info("eval before training: held-out accuracy %.3f", evals[0])
        last = config.num_iterations
        if config.debug_exit_after is not None:
            last = min(last, start + config.debug_exit_after)
        history: list[dict[str, float]] = []
        for i in range(start, last):
            m = iteration(config, i)
            if _save_due(config, i + 1, last):
                log.info("checkpoint: %s", save_checkpoint(config, i + 1))
                if ckpt.sentinel_present(config.checkpoint.sentinel):
                    ckpt.remove_sentinel(config.checkpoint.sentinel)
            if _eval_due(config, i + 1, last):
                evals[i + 1] = evaluate(config, i + 1)["eval_accuracy"]
            history.append(m)
            log.info(_progress(i + 1, last, m, evals.get(i + 1)))
        log.info("curves: %s", plot_curves(config))
        if last < config.num_iterations:
            log.warning("debug_exit_after=%d: stopping after %d of %d iterations",
                        config.debug_exit_after, last, config.num_iterations)
        return {"iterations": last - start, "start": start, "evals": evals, "history": history,
                "seconds": time.perf_counter() - t0}
    finally:
        if release_cluster:
            shutdown_runtime(config.experiment)
