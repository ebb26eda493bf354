"""Periodic stack dumps of every reflow process of a run (`debug.stack_dump_interval_s`), for hangs.

Every interval a daemon thread of the flow's process runs `py-spy dump` on the driver (this process),
each trainer and critic rank, each engine (with its subprocesses: a SGLang engine's scheduler is
one) and the router, and writes one text file per round to the run's storage:
`<experiment>/debug/stacks/<UTC time>-iter<NNNNNN>.txt`. The pids come from Ray's record of each
actor (infra/control.ray_record), so a rank stuck in a collective is dumped without being called.

py-spy reads another process's memory through ptrace: it works as root, or for the user's own
processes where the kernel allows it (Yama ptrace_scope 0; with 1, only descendants: the actors of a
cluster this run started are, those of a long-lived `reflow cluster up` head are not). Where it
cannot, the file holds py-spy's own error for that process, and the driver's section falls back to
Python's view of its own threads (sys._current_frames), which needs no privilege. Actors on other
nodes are listed, not dumped (py-spy reads local processes only).
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from reflow.infra.config.schema import RunConfig

log = logging.getLogger("reflow.stack_dumps")
FOLDER = "debug/stacks"
PYSPY_TIMEOUT_S = 30.0


def py_spy() -> str | None:
    """The py-spy executable: next to this Python (a venv's bin/), else on PATH."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.is_file() else shutil.which("py-spy")


def own_threads() -> str:
    """This process's Python stacks, thread by thread, from the interpreter itself."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f"Thread {ident} ({names.get(ident, '?')}):\n{''.join(traceback.format_stack(frame))}")
    return "\n".join(out)


# A flag whose value is a credential, as it would appear in a command line py-spy prints at the head of a dump.
_SECRET_FLAG = re.compile(r"(--[\w-]*(?:api[-_]key|token|secret|password)[\w-]*)(=|\s+)(\S+)", re.IGNORECASE)


def scrub(text: str, secrets: tuple[str, ...] = ()) -> str:
    """`text` with every value of a credential flag (`--api-key X`, `--token=X`, ...) and every string of
    `secrets` (the run's keys) replaced by `<redacted>`: dumps are stored where readers of the bucket see them."""
    text = _SECRET_FLAG.sub(lambda m: f"{m.group(1)}{m.group(2)}<redacted>", text)
    for secret in secrets:
        if secret:
            text = text.replace(secret, "<redacted>")
    return text


def dump_pid(pid: int, subprocesses: bool = False, exe: str | None = None) -> str:
    """py-spy's dump of `pid` (its error text when it could not), scrubbed of credentials (`scrub`)."""
    exe = exe or py_spy()
    if exe is None:
        return "py-spy not found: `pip install py-spy` (reflow's `debug` extra) to dump other processes"
    cmd = [exe, "dump", "--pid", str(pid)] + (["--subprocesses"] if subprocesses else [])
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PYSPY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"py-spy gave no dump of pid {pid} within {PYSPY_TIMEOUT_S:.0f} s"
    if done.returncode != 0:
        return scrub(f"py-spy failed on pid {pid} (exit {done.returncode}): {(done.stderr or done.stdout).strip()}")
    return scrub(done.stdout)


def run_processes(cfg: RunConfig) -> list[dict[str, object]]:
    """The run's actors as Ray records them (name, kind, state, pid, node): infra/control.actor_rows
    without asking engines for their weight version."""
    from reflow.infra.cluster.runtime import get_runtime
    from reflow.infra.ops.control import ray_record

    rt = get_runtime(cfg)
    handles = [(f"engine-{i}", "engine", e) for i, e in enumerate(rt.engines)]
    for group in [rt.trainers] + ([rt.critic] if rt.critic is not None else []):
        handles += [(f"{group.name_prefix}-trainer-{r}", "trainer", a) for r, a in enumerate(group.actors)]
    if rt.router is not None:
        handles.append(("router", "router", rt.router))
    return [{"name": name, "kind": kind, **ray_record(h)} for name, kind, h in handles]


def dump_round(cfg: RunConfig, secrets: tuple[str, ...] = ()) -> str:
    """One round's text: the driver, then every actor of the run; scrubbed of credential flags, the runtime's
    API key and `secrets` (the control API's token)."""
    import ray

    from reflow.infra.cluster.runtime import get_runtime

    here = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    exe = py_spy()
    sections = [f"==== driver (pid {os.getpid()}) ====\n"
                + (dump_pid(os.getpid(), exe=exe) if exe else "py-spy not found; Python's own view:\n" + own_threads())]
    for p in run_processes(cfg):
        head = f"==== {p['name']} (pid {p['pid']}, {p['state']}) ===="
        if p["state"] != "ALIVE" or not p["pid"]:
            sections.append(f"{head}\nnot running: nothing to dump")
        elif here is not None and p["node"] != here:
            sections.append(f"{head}\non node {p['node']}, not this one: py-spy reads local processes only")
        else:
            sections.append(f"{head}\n{dump_pid(int(p['pid']), subprocesses=p['kind'] == 'engine', exe=exe)}")
    return scrub("\n\n".join(sections) + "\n", (get_runtime(cfg).api_key, *secrets))


class StackDumper:
    """A daemon thread writing `dump_round` to the run's storage every `interval_s` seconds."""

    def __init__(self, cfg: RunConfig, interval_s: float, control=None):
        self.cfg, self.interval_s, self.control = cfg, float(interval_s), control  # control: infra/control.RunControl
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="reflow-stack-dumps", daemon=True)

    def start(self) -> StackDumper:
        if py_spy() is None:
            log.warning("debug.stack_dump_interval_s: py-spy not found, so only the driver's own threads are "
                        "dumped; `pip install py-spy` to dump trainers and engines too")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=PYSPY_TIMEOUT_S + 5)

    def _loop(self) -> None:
        from reflow.infra.store.storage import ExperimentStore

        store = ExperimentStore.from_config(self.cfg.storage, self.cfg.experiment)
        while not self._stop.wait(self.interval_s):
            it = self.control.iteration if self.control is not None else 0
            now = time.time()
            rel = f"{FOLDER}/{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now))}.{int(now % 1 * 1000):03d}Z-iter{it:06d}.txt"
            try:
                store.write_text(rel, dump_round(self.cfg, (self.control.token,) if self.control is not None else ()))
            except Exception as e:  # deliberate: a failed dump must never take the run down; say it and go on
                log.warning("stack dump %s failed: %s: %s", rel, type(e).__name__, e)
                continue
            if self.control is not None:
                self.control.counters["stack_dumps"] += 1
