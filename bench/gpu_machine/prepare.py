"""Wheels to carry to a GPU machine that has torch but no network, for running the real `train` flow there.

    .venv/bin/python bench/gpu_machine/prepare.py                 # -> .gpuwheels/ (git-ignored), parts of <= 60 MiB
    .venv/bin/python bench/gpu_machine/prepare.py --have have.txt # names the target already has, one a line

What it does: walks the requirements of reflow (and `--extras`) as installed in this venv, drops what the
target already has (a `pip list`-style file; by default the package list of the lent H200 image, recorded
in HAVE below) and what must never travel (torch and CUDA libraries: the target's own builds), and
downloads each remaining package at this venv's version as a wheel for the target's Python and platform
(`--python 3.12`, manylinux x86_64; pure-Python wheels as they are). A wheel larger than `--part-mb` is
split into numbered parts (`NAME.whl.part00`, ...), since one transfer to that machine carries at most
64 MiB; bench/gpu_machine/install.sh joins and installs them there. Carrying takes several calls when the
set is larger than one transfer: put a subset in each call's carried folder, and keep the machine warm
between calls (it keeps ignored files), as bench/RESULTS.md section 4 describes.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

# Never carried: the target's own torch/CUDA stack and what the project does not run there.
NEVER = {"torch", "triton", "nvidia-.*", "cuda-.*", "sglang", "sglang-router", "playwright", "mypy", "ruff", "pytest.*",
         "setuptools", "pip", "wheel"}
# The lent H200 image's packages (the device tool's KINDS.md, 2026-11-17): present there, not carried.
HAVE = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi
charset-normalizer click cloudpickle colorama contourpy cycler filelock fonttools frozenlist fsspec h11 h5py
hf-xet httpcore httpx huggingface-hub idna jinja2 joblib kiwisolver markdown markdown-it-py markupsafe
matplotlib mdurl msgpack multidict networkx numpy packaging pandas pillow prometheus-client propcache protobuf
psutil pyarrow pygments pyparsing python-dateutil pyyaml regex requests rich safetensors scipy sentencepiece
shellingham six sympy tabulate tensorboard tensorboard-data-server tokenizers torch tqdm transformers triton
typer typing-extensions urllib3 uvloop werkzeug wrapt yarl zipp""".split()


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(root: str, extras: list[str]) -> dict[str, str]:
    """{normalized name: installed version} of everything `root` needs here (markers evaluated here)."""
    from packaging.requirements import Requirement

    seen: dict[str, str] = {}
    todo = [(root, set(extras))]
    while todo:
        name, want = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional dependency not installed here: the target cannot need it from us
        key = norm(dist.metadata["Name"])
        if key in seen and not want:
            continue
        seen[key] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            env = [{"extra": e} for e in (want or {""})]
            if req.marker is None or any(req.marker.evaluate(e) for e in env):
                todo.append((req.name, set(req.extras)))
    return seen


def skipped(name: str, have: set[str]) -> bool:
    return name in have or any(re.fullmatch(p, name) for p in NEVER)


def download(pins: dict[str, str], out: Path, python: str) -> list[str]:
    """One `pip download --no-deps` per package (so one missing wheel is named, not fatal), a local build
    where none is published; returns what neither gave."""
    missing = []
    for name, version in sorted(pins.items()):
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(out),
               "--python-version", python, "--implementation", "cp", "--platform", "manylinux2014_x86_64",
               "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux_2_28_x86_64", f"{name}=={version}"]
        if subprocess.run(cmd, capture_output=True, text=True).returncode == 0:
            continue
        # no wheel published (deepspeed ships an sdist): build one here; pure Python builds anywhere
        build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                 f"{name}=={version}"]
        if subprocess.run(build, capture_output=True, text=True).returncode != 0:
            missing.append(f"{name}=={version}")
    return missing


def split(out: Path, part_mb: int) -> list[Path]:
    """Wheels over part_mb become NAME.part00, NAME.part01, ... (install.sh joins them back)."""
    parts = []
    for whl in sorted(out.glob("*.whl")):
        size, step = whl.stat().st_size, part_mb << 20
        if size <= step:
            continue
        data = whl.read_bytes()
        for i in range(0, size, step):
            p = whl.with_name(f"{whl.name}.part{i // step:02d}")
            p.write_bytes(data[i:i + step])
            parts.append(p)
        whl.unlink()
    return parts


def bins(out: Path, limit_mb: int) -> list[Path]:
    """Move the files into numbered subfolders out/1, out/2, ... of at most `limit_mb` each (largest first,
    first fit): carry one subfolder per call, each a separate `carry` path, so earlier ones stay on the warm
    machine while the next travels."""
    loads: list[int] = []
    for f in sorted((f for f in out.iterdir() if f.is_file()), key=lambda f: -f.stat().st_size):
        size = f.stat().st_size
        k = next((i for i, used in enumerate(loads) if used + size <= limit_mb << 20), len(loads))
        if k == len(loads):
            loads.append(0)
        loads[k] += size
        (out / str(k + 1)).mkdir(exist_ok=True)
        f.rename(out / str(k + 1) / f.name)
    return [out / str(k + 1) for k in range(len(loads))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".gpuwheels", help="folder for the wheels (git-ignored)")
    p.add_argument("--python", default="3.12", help="the target's Python version")
    p.add_argument("--extras", default="", help="reflow extras to include too, comma-separated (e.g. tracking)")
    p.add_argument("--have", default=None, help="file listing the target's installed packages (default: HAVE)")
    p.add_argument("--part-mb", type=int, default=60, help="largest file carried whole (one transfer is 64 MiB)")
    p.add_argument("--bin-mb", type=int, default=60, help="size of each numbered subfolder (one call's carry)")
    args = p.parse_args()
    have = {norm(x.split("==")[0].split()[0]) for x in Path(args.have).read_text().split("\n") if x.strip()} \
        if args.have else {norm(x) for x in HAVE}
    pins = {k: v for k, v in requirements("reflow", [e for e in args.extras.split(",") if e]).items()
            if k != "reflow" and not skipped(k, have)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    missing = download(pins, out, args.python)
    parts = split(out, args.part_mb)
    total = sum(f.stat().st_size for f in out.iterdir() if f.is_file()) / 2**20
    folders = bins(out, args.bin_mb)
    print(f"{len(pins) - len(missing)} wheels in {out} ({total:.0f} MiB, {len(parts)} parts of split wheels), "
          f"in {len(folders)} folders to carry one per call: {', '.join(str(f) for f in folders)}")
    if missing:
        print("no wheel for the target (carry another way or drop): " + ", ".join(missing))


if __name__ == "__main__":
    main()
