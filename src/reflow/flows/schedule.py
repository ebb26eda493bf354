"""When the parent `train` flow (flows/train.py) checkpoints and evaluates, after `done` iterations of a
run whose last iteration is `last`, and when its time budget ends it."""
from __future__ import annotations

import time

from reflow.infra.config.schema import RunConfig
from reflow.infra.store import checkpoint as ckpt


def eval_due(config: RunConfig, done: int, last: int) -> bool:
    """After the last iteration and every `eval.interval` iterations."""
    every = config.eval.interval
    return done == last or (every is not None and done % every == 0)


def save_due(config: RunConfig, done: int, last: int, minutes_since_save: float) -> bool:
    """After the last iteration (unless `save_last` is off), every `save_interval` iterations, once
    `save_every_minutes` have passed since the run's start or its last save, or when the sentinel file appears."""
    c = config.checkpoint
    return ((done == last and c.save_last) or (c.save_interval is not None and done % c.save_interval == 0)
            or (c.save_every_minutes is not None and minutes_since_save >= c.save_every_minutes)
            or ckpt.sentinel_present(c.sentinel))


def over_budget(config: RunConfig, started: float, now: float | None = None) -> bool:
    """`max_train_minutes` have passed since `started` (a time.monotonic() reading; `now` defaults to the
    current one): the iteration just finished is the run's last. Never without a budget."""
    budget = config.max_train_minutes
    return budget is not None and ((time.monotonic() if now is None else now) - started) / 60 >= budget
