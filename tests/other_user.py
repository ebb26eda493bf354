"""Acting as another local user (uid 65534, `nobody`) in tests of what such a user must not reach.

`as_other_user(fn, *args)` runs `fn` in a forked child that has dropped to uid/gid 65534 with no
supplementary groups, and returns what it returned (JSON-able). Forked, not exec'd: the test's own
interpreter and venv may sit where that user cannot read (/root), and the check needs no imports.
`attempts` runs named attempts there and says how each ended, so one child reports them all.
CI runs as root; elsewhere the tests skip (`needs_root`).
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest

NOBODY = 65534
needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="acts as another local user (uid 65534): needs root (CI runs as root)")


def as_other_user(fn: Callable, *args, timeout_s: float = 30.0):
    """fn(*args) as uid/gid 65534 in a forked child; its return value, or RuntimeError with what it raised."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out = {"result": fn(*args)}
        except BaseException as e:  # deliberate: reported to the parent, which raises it there
            out = {"error": f"{type(e).__name__}: {e}"}
        try:
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    with os.fdopen(r, "rb") as f:
        while chunk := f.read(65536):
            chunks.append(chunk)
    os.waitpid(pid, 0)
    out = json.loads(b"".join(chunks) or b'{"error": "the child wrote nothing"}')
    if "error" in out:
        raise RuntimeError(f"as uid {NOBODY}: {out['error']}")
    return out["result"]


def outcome(action: Callable[[], object]) -> str:
    """How one attempt ended: "PermissionError", another exception's name, or "succeeded"."""
    try:
        action()
    except PermissionError:
        return "PermissionError"
    except OSError as e:
        return f"{type(e).__name__} ({e})"
    return "succeeded"


def attempts(named: dict[str, Callable[[], object]]) -> dict[str, str]:
    """Run every attempt (in the child), each one's outcome by name; plus who the child was."""
    return {"uid": str(os.getuid()), **{name: outcome(a) for name, a in named.items()}}
