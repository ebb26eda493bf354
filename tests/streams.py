"""What a CLI printed, without what Ray's log monitor printed into the same stream.

A test that runs `reflow ...` in-process shares the pytest process with the suite's Ray driver, whose log
monitor thread copies worker output (an actor of an earlier test warning late) into this process's stderr:
`\\x1b[36m(TrainerRank pid=10572)\\x1b[0m /.../c10d_logger.py:83: FutureWarning: ...` (a CI run, stop 59).
Those lines are not the CLI's; a test of "exactly one line" compares the rest.
"""
from __future__ import annotations

import re

RAY_FORWARDED = re.compile(r"^(\x1b\[[0-9;]*m)?\(\S+ pid=\d+[^)]*\)(\x1b\[0m)? ")


def without_ray_lines(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if not RAY_FORWARDED.match(line))
