"""Helpers shared by the bench/ scripts: peak memory of processes, machine facts, tables, policies.

Peak memory is the kernel's high-water mark of resident memory (VmHWM in /proc/<pid>/status), read
for this process and every descendant (Ray's raylet, its workers and actors, Prefect's temporary
server), grouped by what the process is. It has to be read before those processes exit.
"""
from __future__ import annotations

import importlib.util
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where no reflow is installed (a bare GPU machine with the checkout only), the package is read from src/.
if importlib.util.find_spec("reflow") is None and str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

BENCH_ENV = {"TOKENIZERS_PARALLELISM": "false", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
             "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}


def set_bench_env() -> None:
    for k, v in BENCH_ENV.items():
        os.environ.setdefault(k, v)


def self_peak_mib() -> float:
    """Peak RSS of this process in MiB (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _vm_hwm_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):  # deliberate: the process exited
        return None
    return None


def _label(cmdline: list[str], name: str) -> str:
    """A short, stable name for a process: Ray sets titles like 'ray::EmbeddedEngine'."""
    head = " ".join(cmdline)[:200]
    if head.startswith("ray::"):
        return head.split()[0].split(".")[0]  # ray::EmbeddedEngine / ray::TrainerRank / ray::IDLE
    for key in ("raylet", "gcs_server", "dashboard", "log_monitor", "runtime_env", "prefect", "uvicorn"):
        if key in head:
            return key
    return name


def process_tree_peaks() -> list[tuple[str, int, float]]:
    """(label, count, largest peak RSS MiB) per kind of descendant process, largest first."""
    return [(k, n, m) for k, n, m, _ in process_tree_usage()]


def process_tree_usage() -> list[tuple[str, int, float, float]]:
    """(label, count, largest peak RSS MiB, CPU seconds used so far) per kind of descendant process."""
    import psutil

    groups: dict[str, list[tuple[float, float]]] = {}
    for p in psutil.Process().children(recursive=True):
        try:
            label = _label(p.cmdline(), p.name())
            t = p.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # deliberate: exited meanwhile
            continue
        hwm = _vm_hwm_mib(p.pid)
        if hwm is not None:
            groups.setdefault(label, []).append((hwm, t.user + t.system))
    rows = [(k, len(v), max(h for h, _ in v), sum(c for _, c in v)) for k, v in groups.items()]
    return sorted(rows, key=lambda r: -r[2])


def fmt_peaks(rows: list[tuple[str, int, float]], self_mib: float | None = None, top: int = 6) -> str:
    parts = [f"this process {self_mib:.0f}"] if self_mib is not None else []
    parts += [f"{k}{f' x{n}' if n > 1 else ''} {m:.0f}" for k, n, m in rows[:top]]
    return ", ".join(parts) + " MiB"


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):  # deliberate: no git (a tarball) is not an error
        return "unknown"


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:  # deliberate: not Linux
        pass
    gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{os.cpu_count()} CPUs ({cpu}){gpu}, Python {platform.python_version()}, torch {torch.__version__}"


def header(title: str) -> None:
    import time

    print(f"# {title}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} | {machine()} | commit {git_commit()}")
    print(f"# command: {' '.join([Path(sys.executable).name] + sys.argv)}")


def table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    """cols: (key, heading, format spec). Right-aligned, one line per row."""
    cells = [[h for _, h, _ in cols]]
    for r in rows:
        cells.append([format(r[k], f) if isinstance(r.get(k), (int, float)) else str(r.get(k, "")) for k, _, f in cols])
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = ["  ".join(c[i].rjust(widths[i]) if i else c[i].ljust(widths[i]) for i in range(len(cols))) for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def demo_policy(out: Path, hidden: int, layers: int, mlp: int | None = None, seed: int = 0) -> Path:
    """A randomly initialised demo-shaped policy (char tokenizer, Llama) saved as an HF folder."""
    from reflow.rl.demo_policy import build_model, build_tokenizer, save_policy

    if (out / "config.json").is_file():
        return out
    tok = build_tokenizer()
    model = build_model(tok, hidden=hidden, layers=layers, heads=max(1, hidden // 64) if hidden >= 256 else 4,
                        mlp=mlp or 4 * hidden, seed=seed)
    return save_policy(model, tok, out)


def n_params(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open has no __contains__ iteration)
                total += _numel(st.get_slice(k).get_shape())
    return total


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def child_row(cmd: list[str], name: str) -> dict:
    """One variant of a bench in a child process of its own (dynamo's recompile limit and the CUDA caching
    allocator are per process): run `cmd` to its end; its row is the JSON after the last `ROW ` line of its
    stdout, with the child's wall seconds as `process_s`. A child that fails gives {"variant": name, "error": ...}
    and its output's tail on stdout, and the caller goes on with the next variant."""
    import json
    import time

    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    found = [ln for ln in r.stdout.splitlines() if ln.startswith("ROW ")]
    if r.returncode or not found:
        print(f"  {name}: FAILED (exit {r.returncode})\n{(r.stdout + r.stderr)[-3000:]}", flush=True)
        return {"variant": name, "error": (r.stderr or r.stdout)[-800:]}
    return {**json.loads(found[-1][4:]), "process_s": time.perf_counter() - t0}
