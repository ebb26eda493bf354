"""Helpers shared by the checkpoint/resume tests: a reward with signal for a random tiny policy,
a loopback S3 server, and running `reflow train` as a subprocess."""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
REFLOW = str(Path(sys.executable).parent / "reflow")


def digit_reward(prompt: str, response: str, label) -> float:
    """Fraction of digits in the response: a random tiny policy gets graded, non-zero rewards, so
    GRPO advantages and weight updates are non-trivial (the demo's exact-match reward is 0 here)."""
    return sum(c.isdigit() for c in response) / max(1, len(response))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackS3:
    """moto's S3 server on 127.0.0.1. Its buckets live in this process's memory, so stop() and a
    later start() on the same port keep the data: the server goes away, the bytes do not."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = None

    def start(self) -> LoopbackS3:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


@contextmanager
def s3_with_bucket(bucket: str = "reflow-test") -> Iterator[LoopbackS3]:
    """A started LoopbackS3 holding `bucket`, with moto's dummy AWS credentials in the environment
    (restored afterwards). moto keeps its buckets in process memory, shared by every server of the
    test session: an earlier module's objects may still be there, so tests use their own prefixes."""
    server = LoopbackS3().start()
    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in creds}
    os.environ.update(creds)
    try:
        import s3fs

        try:
            s3fs.S3FileSystem(endpoint_url=server.url, skip_instance_cache=True).mkdir(bucket)
        except FileExistsError:  # moto's buckets live in this process: an earlier server made it
            pass
        yield server
    finally:
        server.stop()
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@contextmanager
def captured(logger_name: str, level: int = logging.WARNING) -> Iterator[list[str]]:
    """Records of `level` and above (default: warnings) logged to `logger_name` (a handler on the logger itself:
    Prefect's logging setup, once imported, keeps caplog's root handler from seeing these)."""
    messages: list[str] = []
    handler = logging.Handler(level)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    saved, disabled = logger.level, logger.disabled
    if logger.getEffectiveLevel() > level:
        logger.setLevel(level)
    # a logging setup run earlier in the session (dictConfig's disable_existing_loggers, as a library's may run) leaves
    # the logger disabled, and a disabled logger calls no handler: in random order this read no warning at all
    logger.disabled = False
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)
        logger.disabled = disabled


def write_config(path: Path, policy: Path, storage_root: str, experiment: str, **extra) -> Path:
    cfg = {
        "experiment": experiment, "seed": 0, "num_iterations": 6, "eval": {"before_train": False},
        "model": {"path": str(policy)},
        "data": {"num_train": 64, "num_eval": 8, "reward_fn": "tests.ckpt_fixtures:digit_reward"},
        "rollout": {"prompts_per_iteration": 4, "n_samples_per_prompt": 4, "max_new_tokens": 4},
        "trainer": {"num_ranks": 1, "micro_batch_size": 16, "lr": 1.0e-2},
        "checkpoint": {"save_interval": 1, "keep_last": 2},
        "storage": {"root": storage_root},
    }
    for key, value in extra.items():
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_train(config: Path, env_extra: dict[str, str] | None = None, timeout: float = 300,
              background: bool = False, leave_leftovers: bool = False):
    """`reflow train -c config` in its own session, output to `<config>.log` (a pipe would stay open
    while Ray helpers of a SIGKILLed run live on). Returns (returncode, output), or the Popen with
    `background`; call `reap` on it afterwards. `leave_leftovers`: do not reap the process group,
    leaving what a killed run leaves behind for the next run to find."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("REFLOW_FAULT_")}
    env.update({"PYTHONPATH": str(REPO), **(env_extra or {})})
    log = config.with_suffix(".log")
    with open(log, "w") as out:
        # --verbose: the tests read the run's INFO lines (resume, retries), which the quiet terminal hides
        proc = subprocess.Popen([REFLOW, "train", "--verbose", "-c", str(config)], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    proc.log_path = log
    if background:
        return proc
    try:
        proc.wait(timeout=timeout)
    finally:
        if not leave_leftovers or proc.returncode is None:
            reap(proc)
    return proc.returncode, log.read_text()


def reap(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of the run's process group (Ray's helpers after a SIGKILLed driver)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is already gone
        pass
    proc.wait()


def iteration_rewards(read_json, n: int) -> list[float]:
    return [read_json(f"iterations/{i:06d}/metrics.json")["reward_mean"] for i in range(n)]


def final_weights(local_model_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(local_model_dir / "model.safetensors"))


def assert_bit_identical(a: dict, b: dict) -> None:
    """Every tensor equal bit for bit (dtype, shape, values): resume is exact, not approximately so."""
    import torch

    assert a.keys() == b.keys()
    differ = {k: float((a[k].double() - b[k].double()).abs().max()) for k in a
              if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])}
    assert not differ, f"resumed weights differ from the uninterrupted run (max abs diff per tensor): {differ}"


def dump(obj) -> str:
    return json.dumps(obj, indent=1, default=str)
