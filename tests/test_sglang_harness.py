"""The harness that starts SGLang's real app servers for tests/test_sglang_real_app.py (tests/sglang_backends.py)."""
from __future__ import annotations

import pytest

from tests import sglang_backends


def test_a_second_start_hands_back_the_log_its_servers_write(tmp_path, monkeypatch):
    """A first start that does not come up is dumped into its log and started again with a log of its
    own; the tests that read the servers' log must get that second log, not the first one with the
    stack dump (CI of stop 62: two tests searched the first log for lines the running servers wrote
    into the second)."""
    starts = []

    def start(model_dirs, log):
        starts.append(log)
        log.write_text(f"attempt {len(starts)}\n")
        if len(starts) == 1:
            raise AssertionError("not healthy 240 s after the start")
        return "proc", {"llama": ["http://127.0.0.1:1"]}

    monkeypatch.setattr(sglang_backends, "_start_sglang_apps", start)
    with pytest.warns(UserWarning, match="starting them again"):
        proc, urls, log = sglang_backends.start_sglang_apps({}, tmp_path / "servers.log")
    assert (proc, urls) == ("proc", {"llama": ["http://127.0.0.1:1"]})
    assert log == starts[1] != starts[0] and log.read_text() == "attempt 2\n"
    assert starts[0].read_text() == "attempt 1\n"  # the first attempt's log (its stacks) is kept
