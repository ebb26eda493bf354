"""The installed distribution is one package, `reflow`: its layers are reflow.flows, reflow.tasks, ...
and nothing named flows/tasks/engines/infra/rl lands at the top level of site-packages (where it
would clash with any other package of that name)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("flows", "tasks", "engines", "infra", "rl")


@pytest.mark.slow
def test_wheel_installs_one_reflow_namespace(tmp_path):
    src = tmp_path / "src"  # a copy: setuptools leaves build/ and *.egg-info in the tree it builds
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "src"):
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(
            REPO / name,
            src / name,
            **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}),
        )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    wheel = next((tmp_path / "dist").glob("reflow-*.whl"))
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"reflow", wheel.name.split("-py")[0] + ".dist-info"}, tops
    members = set(zipfile.ZipFile(wheel).namelist())
    assert {f"reflow/{layer}/__init__.py" for layer in LAYERS} <= members
    assert {
        "reflow/engines/train/group.py",
        "reflow/engines/embedded/engine.py",
        "reflow/rl/algorithms/grpo.py",
        "reflow/configs/demo.yaml",  # `reflow demo` reads it beside its package (flows/cli.py DEMO_CONFIG)
        "reflow/configs/gpu-demo.yaml",
    } <= members

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        text=True,
    )
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # The dependencies come from this venv's site-packages as a plain path entry: its .pth files (the
    # editable install of this checkout among them) are not processed, so only the wheel provides reflow.
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    code = (
        "import importlib.util, reflow, reflow.flows.train, reflow.engines.train.group, reflow.flows.cli as cli; "
        "assert cli.DEMO_CONFIG.is_file() and cli.GPU_DEMO_CONFIG.is_file(), cli.DEMO_CONFIG; "
        "print(reflow.__file__); "
        f"print([m for m in {LAYERS!r} if importlib.util.find_spec(m) is not None])"
    )
    out = subprocess.run([str(py), "-c", code], cwd=tmp_path, check=True, capture_output=True, text=True).stdout
    where, top_level = out.strip().splitlines()[-2:]
    assert where.startswith(str(site)), where
    assert top_level == "[]", f"importable at the top level in the fresh venv: {top_level}"
