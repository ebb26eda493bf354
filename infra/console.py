"""What the terminal shows while the CLI runs a flow, and how the Prefect API is reached.

Quiet (the default): Prefect's logging settings of configs/prefect-logging.yml (its console handler
shows warnings and errors; every record still reaches the UI's Logs tab) and one progress bar over
iterations. `--verbose`: Prefect's own settings, every task's state line, no bar.

Without PREFECT_API_URL each process starts Prefect's temporary server; on a busy 2-core machine it
took longer than Prefect's default 20 s start-up timeout, so the timeout is raised (a setting the
user sets wins) and a start that still fails ends with one line saying what to do.
"""
from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path

QUIET_LOGGING = Path(__file__).resolve().parents[1] / "configs" / "prefect-logging.yml"
STARTUP_TIMEOUT_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
STARTUP_TIMEOUT_S = 120
_STATE: dict = {"quiet": False, "bar": None}  # the CLI asks for quiet; a flow run opens the bar (tasks/progress.py)


class ServerStartError(RuntimeError):
    """Prefect's temporary server did not answer in time."""


@contextmanager
def terminal(verbose: bool):
    """Around one CLI command that runs a flow: Prefect's settings are chosen before Prefect is imported
    (it reads them once), a line says which Prefect server the flows use, log records go above the bar,
    the bar closes however the run ends, and a temporary server that did not start becomes
    ServerStartError. The environment and this module's state are restored afterwards (tests call the
    CLI in-process)."""
    names = ("PREFECT_LOGGING_SETTINGS_PATH", STARTUP_TIMEOUT_ENV, "PREFECT_SERVER_ANALYTICS_ENABLED")
    saved = {k: os.environ.get(k) for k in names}
    print(_choose_settings(verbose), file=sys.stderr)
    _STATE["quiet"] = not verbose
    try:
        with _logs_above_bar():
            yield
    except RuntimeError as e:
        if "ephemeral Prefect API server" not in str(e):  # deliberate: only Prefect's start-up failure
            raise
        raise ServerStartError(
            f"Prefect's temporary server did not answer within {os.environ.get(STARTUP_TIMEOUT_ENV)} s. "
            f"Raise {STARTUP_TIMEOUT_ENV} (e.g. to 300), or start a server once (`prefect server start "
            f"--host 127.0.0.1 --port 4200 &`) and export PREFECT_API_URL=http://127.0.0.1:4200/api") from None
    finally:
        close_bar()
        _STATE["quiet"] = False
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _choose_settings(verbose: bool) -> str:
    """Prefect's settings for this process; returns a line saying which Prefect server the flows use."""
    if not verbose:
        os.environ.setdefault("PREFECT_LOGGING_SETTINGS_PATH", str(QUIET_LOGGING))
    os.environ.setdefault(STARTUP_TIMEOUT_ENV, str(STARTUP_TIMEOUT_S))
    url = os.environ.get("PREFECT_API_URL")
    if url:
        return f"reflow: using the running Prefect server at {url} (PREFECT_API_URL)"
    # The temporary server is this run's own: offline (most training machines) its telemetry call only
    # prints an ERROR line.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    return (f"reflow: starting Prefect's temporary server (start-up timeout {os.environ[STARTUP_TIMEOUT_ENV]} s; "
            f"set PREFECT_API_URL to use a running one)")


@contextmanager
def _logs_above_bar():
    """tqdm's redirect of the root logger's console handler, at that handler's level (tqdm's copy
    would print every level). Prefect's handlers must exist first: it sets them up on first use."""
    from prefect.logging.configuration import ensure_logging_setup
    from tqdm.contrib.logging import logging_redirect_tqdm

    ensure_logging_setup()

    root = logging.getLogger()
    consoles = [h for h in root.handlers if isinstance(h, logging.StreamHandler) and h.stream in (sys.stderr, sys.stdout)]
    with logging_redirect_tqdm(loggers=[root]):
        root.handlers[-1].setLevel(min((h.level for h in consoles), default=logging.WARNING))
        yield


def quiet() -> bool:
    """The CLI asked for a quiet terminal (never under a worker or in tests)."""
    return bool(_STATE["quiet"])


def ray_logging_level() -> int:
    """For ray.init: Ray's own INFO lines ("Started a local Ray instance") only when not quiet."""
    return logging.WARNING if quiet() else logging.INFO


def bar(total: int, done: int, desc: str):
    """A tqdm bar over iterations when the terminal is quiet, else None."""
    if not quiet():
        return None
    from tqdm import tqdm

    close_bar()
    _STATE["bar"] = tqdm(total=total, initial=done, desc=desc, unit="iter", dynamic_ncols=True)
    return _STATE["bar"]


def close_bar() -> None:
    if _STATE["bar"] is not None:
        _STATE["bar"].close()
        _STATE["bar"] = None
