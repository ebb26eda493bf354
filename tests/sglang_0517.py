"""SGLang 0.5.17 (the GPU machine's: the newest that pins its torch 2.11) beside the venv's 0.5.23, for
tests/test_sglang_0517.py.

Its wheel is installed --no-deps into TARGET (git-ignored), as the Makefile installs 0.5.23 into the venv:
`pip install --no-deps --target .cache/sglang-0.5.17 sglang==0.5.17` (22 MB, a few seconds). A process that
puts TARGET first on its path imports 0.5.17's `sglang` and reads its version from its dist-info there.
`target()` installs it on first use when it is missing, and gives None with the reason when it cannot be had
(no index reachable): the tests then skip, naming it.
"""
from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

VERSION = "0.5.17"
REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / ".cache" / f"sglang-{VERSION}"
_WHY: list[str] = []


def target() -> Path | None:
    """The folder holding sglang 0.5.17, installed now if missing; None when pip cannot get it (`why_missing`)."""
    if (TARGET / f"sglang-{VERSION}.dist-info").is_dir():
        return TARGET
    if _WHY:
        return None
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(TARGET),
           f"sglang=={VERSION}"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        _WHY.append(f"`{' '.join(cmd[2:])}` failed: {(run.stderr or run.stdout).strip()[-300:]}")
        return None
    return TARGET


def why_missing() -> str:
    return _WHY[0] if _WHY else f"sglang=={VERSION} is not in {TARGET}"


@contextlib.contextmanager
def imported_first(folder: Path):
    """This process sees `folder`'s sglang instead of the venv's for the block: the sglang modules loaded
    before are set aside and put back after, and every sglang module loaded inside is dropped."""
    saved = {n: m for n, m in sys.modules.items() if n == "sglang" or n.startswith("sglang.")}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path.remove(str(folder))
        for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def start_apps(model_dir: Path, receivers: int, log: Path) -> tuple[subprocess.Popen, list[str]]:
    """`receivers` SGLang 0.5.17 app servers of the model in `model_dir` (tests/sglang_app_0517.py, launched
    with reflow's launcher flags), in one child process with 0.5.17 first on its path; waits until healthy."""
    import json
    import os

    from reflow.engines.rollout_client import poll_health
    from reflow.engines.sglang.launcher import command_line, server_args
    from tests.sglang_backends import KEY, free_port, stop

    ports = [free_port() for _ in range(receivers)]
    serve = [arg for p in ports for arg in ("--serve", json.dumps(command_line(server_args(
        str(model_dir), host="127.0.0.1", port=p, nccl_port=free_port(), api_key=KEY, dtype="float32"),
        secrets_dir=log.parent)[3:]))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TARGET), str(REPO)]), "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tests.sglang_app_0517", *serve], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT)

    def alive():
        if proc.poll() is not None:
            raise RuntimeError(f"tests.sglang_app_0517 exited with {proc.returncode}:\n{log.read_text()[-3000:]}")

    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for url in urls:  # 240 s: the import takes ~20 s of CPU, and the suite runs other work beside it
            if (last := poll_health(url, 240.0, 0.2, alive)) is not None:
                raise AssertionError(f"SGLang {VERSION} app {url} not healthy: {last}\n{log.read_text()[-6000:]}")
    except BaseException:
        stop(proc)
        raise
    return proc, urls
