"""What the terminal shows while the CLI runs a flow, and how the Prefect API is reached.

Quiet (the default): Prefect's logging settings of configs/prefect-logging.yml (its console handler
shows warnings and errors; every record still reaches the UI's Logs tab) and one progress bar over
iterations. `--verbose`: Prefect's own settings, every task's state line, no bar.

Without PREFECT_API_URL each process starts Prefect's temporary server; on a busy 2-core machine it
took longer than Prefect's default 20 s start-up timeout, so the timeout is raised (a setting the
user sets wins) and a start that still fails ends with one line saying what to do. The server begins to
start in the background as the command enters `terminal` (a thread waits for its health check), so its
15-20 s overlap the preflight and Ray's start; `terminal` waits for it before its body (the flow) runs.
A preflight that fails stops it again (a bad input still ends with its one line and leaves no server),
and so does SIGTERM: for the command's duration it raises SystemExit instead of ending the process at once.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

QUIET_LOGGING = Path(__file__).resolve().parents[2] / "configs" / "prefect-logging.yml"
STARTUP_TIMEOUT_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
STARTUP_TIMEOUT_S = 120
_STATE: dict = {"quiet": False, "bar": None}  # the CLI asks for quiet; a flow run opens the bar (tasks/progress.py)
SERVER_START_FAILED = "ephemeral Prefect API server"  # in the RuntimeError Prefect raises when its server does not answer


class ServerStartError(RuntimeError):
    """Prefect's temporary server did not answer in time."""


@contextmanager
def terminal(verbose: bool, preflight: Callable[[], object] | None = None,
             meanwhile: Callable[[], object] | None = None, abandon: Callable[[], object] | None = None):
    """Around one CLI command that runs a flow: Prefect's settings are chosen before Prefect is imported
    (it reads them once) and Prefect's temporary server (when the flows would use one) begins to start in
    the background. While it starts, `preflight` runs (a failure there ends the command before anything
    is printed, and stops the server), then a line says which Prefect server the flows use and `meanwhile`
    runs (Ray's start); the body runs once the server answers. Log records go above the bar, the bar closes
    however the run ends, and a temporary server that did not start becomes ServerStartError. The
    environment and this module's state are restored afterwards (tests call the CLI in-process). `abandon`
    runs when the body never ran (a failed preflight: what was started beside it is stopped)."""
    names = ("PREFECT_LOGGING_SETTINGS_PATH", STARTUP_TIMEOUT_ENV, "PREFECT_SERVER_ANALYTICS_ENABLED")
    saved = {k: os.environ.get(k) for k in names}
    line = _choose_settings(verbose)
    sigterm = _exit_on_sigterm()
    early = _EarlyServer.begin()  # None where a server is named (PREFECT_API_URL, a profile)
    began = False
    try:
        if preflight is not None:
            preflight()
        print(line, file=sys.stderr)
        _STATE["quiet"] = not verbose
        _quiet_ray(not verbose)
        with _logs_above_bar():
            if meanwhile is not None:
                meanwhile()
            if early is not None:
                early.wait()  # no Prefect client before this: Prefect marks its server running before it answers
            began = True
            yield
    except RuntimeError as e:
        if SERVER_START_FAILED not in str(e):  # deliberate: only Prefect's start-up failure
            raise
        raise ServerStartError(
            f"Prefect's temporary server did not answer within {os.environ.get(STARTUP_TIMEOUT_ENV)} s. "
            f"Raise {STARTUP_TIMEOUT_ENV} (e.g. to 300), or start a server once (`prefect server start "
            f"--host 127.0.0.1 --port 4200 &`) and export PREFECT_API_URL=http://127.0.0.1:4200/api") from None
    finally:
        if early is not None:
            early.cancel()  # stops the server if the body never ran (a failed preflight or Ray start)
        if abandon is not None and not began:
            abandon()
        if sigterm is not None and signal.getsignal(signal.SIGTERM) is _sigterm_exit:
            signal.signal(signal.SIGTERM, sigterm)
        close_bar()
        _STATE["quiet"] = False
        _quiet_ray(False)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _sigterm_exit(signum, frame) -> None:
    from reflow.rl.deadline import Terminated  # a SystemExit that user-code guards let through (rl/rewards.py)

    raise Terminated(128 + signum)


def _exit_on_sigterm():
    """SIGTERM (`kill PID`, a scheduler stopping the job) ends the command as an exception does, so
    `terminal`'s cleanup and the atexit hooks run: Python's default action ended the process at once and
    left Prefect's temporary server, a child that outlives it, running. Ray's `ray.init` and Prefect's
    flow engine install handlers of their own later, which end the same way (Ray's calls sys.exit; Prefect's
    re-sends the signal to the handler it found). Returns the handler to restore, or None where another
    handler was already set (an embedding program's) or this is not the main thread: then nothing changes."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return None
    return signal.signal(signal.SIGTERM, _sigterm_exit)


class _EarlyServer:
    """Prefect's temporary server, started by a thread while the command's preflight and Ray start run
    (Prefect's own client starts the same server, a per-process singleton, at the first flow otherwise).
    Prefect marks that server running before its health check passes, so no Prefect client may be made
    before `wait()` (terminal waits before its body runs)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cancelled = self.ready = False
        self.error: BaseException | None = None
        self.server = None  # set once the start is under way (under the lock)
        self.thread = threading.Thread(target=self._run, name="prefect-server-start", daemon=True)

    @classmethod
    def begin(cls) -> _EarlyServer | None:
        from prefect.settings import PREFECT_API_URL

        if PREFECT_API_URL.value():  # a profile or settings file names a server: Prefect starts none
            return None
        early = cls()
        early.thread.start()
        return early

    def _run(self) -> None:
        try:
            from prefect.server.api.server import SubprocessASGIServer  # ~4 s of imports, beside the preflight

            with self.lock:  # cancel() either comes first (no server at all) or waits for this start
                if self.cancelled:
                    return
                self.server = SubprocessASGIServer()
                self.server.start()
        except BaseException as e:  # noqa: BLE001 - raised in the main thread by wait()
            self.error = e

    def wait(self) -> None:
        """Wait for the server; a failure to start is raised here, as Prefect raises it at the first flow."""
        self.thread.join()
        self.ready = True
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        """After the command: a server no flow used (the preflight failed) is stopped; one the flows used
        stays until the process exits, as Prefect's own would (its atexit hook stops it)."""
        if self.ready:
            return
        with self.lock:
            self.cancelled = True
            if self.server is not None:
                self.server.stop()


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
        if quiet():
            root.handlers[-1].addFilter(_no_reward_failures)
        yield


def _no_reward_failures(record: logging.LogRecord) -> bool:
    """Quiet terminal: leave out the records of a reward that failed during the run (the iteration's flow run
    and the train flow run each log it with its traceback, ~80 lines each); the command ends with its one
    line (flows/cli.py), and the UI's logs keep the records."""
    from reflow.rl.rewards import reward_failure

    return not (record.exc_info and reward_failure(record.exc_info[1]) is not None)


def _quiet_ray(on: bool) -> None:
    # Imported here: Ray's import (~1 s) is not paid by `reflow --help` and the commands that never connect.
    from reflow.infra.cluster.ray_connect import quiet_ray

    quiet_ray(on)


def quiet() -> bool:
    """The CLI asked for a quiet terminal (never under a worker or in tests)."""
    return bool(_STATE["quiet"])


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
