"""An embedded engine served on loopback for a test module's fixtures."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from reflow.engines.embedded.engine import EmbeddedEngine


@contextmanager
def served(policy: str | Path, engine_id: str, api_key: str) -> Iterator[EmbeddedEngine]:
    """One CPU thread, ready (a real one-token generate answered) before the test, shut down after."""
    e = EmbeddedEngine(str(policy), engine_id, threads=1, api_key=api_key)
    assert e.ready()
    try:
        yield e
    finally:
        e.shutdown()
