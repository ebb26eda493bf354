"""Wheels to carry SGLang 0.5.17 to the lent GPU machine (issue 57), for `python -m sglang.launch_server`.

    nice -n 15 .venv/bin/python bench/gpu_machine/sglang_prepare.py      # -> .gpuwheels/sglang/1, 2, ... (git-ignored)

Why 0.5.17: the newest SGLang whose pins match the machine's torch 2.11.0 (bench/RESULTS.md, "SGLang on the GPU
machine"). Its wheel is a platform wheel (cp312, manylinux_2_34: three optional Rust `_core` modules), so the
download asks for the manylinux_2_34 tag too.

What travels is the set the server needs on the path reflow uses (HTTP server, one scheduler, an HF Llama/Qwen2
checkpoint, `--grammar-backend none`, the weight-update and memory endpoints), not SGLang's whole Requires-Dist
(815 MiB). Each of sglang's own requirements is classified below (ROOTS: carried; LEFT_OUT: not carried, with the
reason read from sglang 0.5.17's source: the import is inside a function or a try/except off that path, or only
behind a flag reflow does not pass). The requirements of what is carried are then walked recursively from each
downloaded wheel's METADATA (markers for CPython 3.12 on Linux x86_64), dropping what the GPU image has (IMAGE:
the device docs' package list of 2026-11-17), what reflow's own carried set brings (.gpuwheels/1-3, or
prepare.py's walk), and torch/triton/nvidia-*/cuda-* (the image's own builds). A requirement whose version the
image or reflow's set does not satisfy is printed. transformers travels at sglang's pin, 5.12.1 (with a tokenizers it
accepts), in the engine's folder only: the image's 5.17.0 already registers "qwen3_asr", which sglang 0.5.17's
configs/qwen3_asr.py registers again without exist_ok, so `import sglang.srt.entrypoints.http_server` raises
ValueError under it (seen on CPU under transformers 5.25, tests/sglang_app_0517.py; 5.17.0's auto_mappings.py has the
entry). reflow's trainer keeps the image's.

Stand-ins (bench/gpu_machine/sglang_stubs/, put LAST on PYTHONPATH by sglang_start.sh, so a real package wins):
  - IPython: only `from IPython.display import HTML, display` at the top of sglang/utils.py (notebook helpers,
    never called by the server). The stub has no `get_ipython`, so tqdm.autonotebook's probe fails as without it.
  - xgrammar: only sglang/srt/function_call/kimik3_structural_tag.py imports it at module level (Kimi-K3 tool-call
    structural tags; the names are used inside functions only). The grammar backend, the other user, is off
    (`--grammar-backend none`). 42.6 MiB and its requirements saved.
Left out without a stand-in: llguidance (absent from this index; imported only by the llguidance grammar backend,
constructed only when `--grammar-backend llguidance`), the others in LEFT_OUT.

Output: .gpuwheels/sglang/N/ of <= --bin-mb each (wheels over --part-mb split into NAME.whl.part00, ...;
bench/gpu_machine/install.sh joins them), a table of wheels and sizes, and the number of transfers.
sglang_carry.md says how to carry them and sglang_start.sh what runs there.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prepare import HAVE, bins, norm, requirements, split  # noqa: E402

SGLANG = "0.5.17"
PLATFORMS = ["manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
       "platform_python_implementation": "CPython"}

# The GPU image's packages (device docs, KINDS.md "Python packages already there", 2026-11-17); prepare.py's HAVE
# is the part of it that reflow's walk meets. Versions where the docs' pip list row gives them.
IMAGE = set(HAVE) | set("""botorch build chex cmake coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit
cupy-cuda13x cython diffrax e3nn einops equinox etils execnet flatbuffers flax formulaic gpytorch grpcio humanize
hypothesis imageio iniconfig interface-meta jax jaxlib jaxtyping lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml meson ml-dtypes mpi4py mpmath multipledispatch mypy-extensions nanobind
narwhals ninja numba numba-cuda nvidia-ml-py onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
opt-einsum opt-einsum-fx optimistix orbax-checkpoint pathspec patsy peft pip pluggy portalocker pybind11 py-cpuinfo
pyproject-hooks pyre-extensions pytest sacrebleu scikit-build-core scikit-image scikit-learn seaborn setuptools
simplejson sortedcontainers statsmodels tensorstore threadpoolctl tifffile tiktoken timm toolz torchaudio
torchdiffeq torch-geometric torchmetrics torchvision treescope typing-inspect wadler-lindig wheel xarray xxhash
""".split())
IMAGE_VERSIONS = {"torch": "2.11.0", "torchaudio": "2.11.0", "torchvision": "0.26.0", "transformers": "5.17.0",
                  "triton": "3.6.0", "numpy": "2.5.2", "tiktoken": "0.14.0", "tokenizers": "0.23.2",
                  "safetensors": "0.8.0", "sentencepiece": "0.2.2", "huggingface-hub": "1.33.0"}
NEVER = [r"torch", r"triton", r"nvidia-(?!cutlass|mathdx).*", r"cuda-(bindings|core|pathfinder|toolkit)"]

# sglang's requirements that travel only as another carried wheel's requirement (found by the walk).
VIA_WALK = {"distro": "openai's"}
# sglang's own requirements that travel (pins as sglang 0.5.17 gives them), and where the server imports them.
ROOTS = {
    "sglang": (SGLANG, "the server"),
    "tokenizers": ("0.22.2", "transformers 5.12.1 wants >=0.22.0,<=0.23.0 (the image has 0.23.2; no 0.23.0 wheel here)"),
    "transformers": ("5.12.1", "sglang's pin: the image's 5.17.0 fails sglang's import (module docstring)"),
    "sglang-kernel": ("0.4.5", "sgl_kernel: flashattention_backend (fa3, Hopper's default), sampler, layernorm, rotary"),
    "flashinfer-python": ("0.6.15.post1", "layers/sampler.py: `if is_cuda(): from flashinfer.sampling import ...`"),
    "apache-tvm-ffi": ("0.1.11", "flashinfer's and sgl_kernel's FFI (flashinfer imports tvm_ffi at import)"),
    "torch-memory-saver": ("", "--enable-memory-saver (reflow's colocated release/resume): utils/torch_memory_saver_adapter"),
    "pyzmq": ("", "zmq: utils/network.py, tokenizer<->scheduler<->detokenizer transport"),
    "msgspec": ("", "sampling/sampling_params.py, lora_registry, io structs"),
    "pybase64": ("", "utils/common.py (module level)"),
    "setproctitle": ("", "managers/detokenizer_manager.py (module level)"),
    "python-multipart": ("", "FastAPI checks it for http_server's Form/File route (/v1/audio/transcriptions) at import"),
    "partial-json-parser": ("", "function_call/utils.py (module level, via the OpenAI serving modules)"),
    "openai": ("2.6.1", "entrypoints/openai/protocol.py (module level; http_server imports it)"),
    "compressed-tensors": ("", "layers/quantization/compressed_tensors/utils.py (module level, quantization registry)"),
    "gguf": ("", "layers/quantization/gguf.py (module level, quantization registry)"),
    "soundfile": ("0.13.1", "entrypoints/openai/streaming_asr.py (module level, via http_server)"),
    "dill": ("", "sampling/custom_logit_processor.py (module level); not in sglang's Requires-Dist (datasets brings it)"),
}
# sglang's requirements that do not travel, and why (read from sglang 0.5.17's source).
LEFT_OUT = {
    "llguidance": "absent from the package index here; only sglang/srt/constrained/llguidance_backend.py, built for "
                  "--grammar-backend llguidance (we pass none)",
    "xgrammar": "stand-in (sglang_stubs/xgrammar): module-level import only in function_call/kimik3_structural_tag.py; "
                "the grammar backend is off",
    "ipython": "stand-in (sglang_stubs/IPython): only sglang/utils.py's `from IPython.display import HTML, display`",
    "outlines": "grammar backend / jump-forward only (constrained/outlines_*.py, imported when that backend is chosen)",
    "interegular": "outlines jump-forward only",
    "anthropic": "/v1/messages serving module, imported inside its route handler's setup only",
    "openai-harmony": "gpt-oss reasoning/tool parsers, imported inside functions",
    "mistral-common": "Mistral tokenizers (utils/hf_transformers/mistral_utils.py), inside functions",
    "modelscope": "only with SGLANG_USE_MODELSCOPE (hf_transformers/common.py, server_args.py)",
    "blobfile": "tiktoken/harmony file loading, inside functions",
    "datasets": "bench scripts only",
    "torchao": "--torchao-config quantization only, inside functions",
    "tilelang": "DeepSeek sparse-attention kernels only",
    "nvidia-cutlass-dsl": "CuTe-DSL kernels (flash-attn-4, quack, MLA/MoE paths), inside functions; 168 MiB",
    "nvidia-mathdx": "cutlass-dsl's; not on a Llama/Qwen2 path",
    "quack-kernels": "CuTe-DSL kernels for Blackwell/MoE paths, inside functions",
    "flash-attn-4": "--attention-backend fa4 (Blackwell) only",
    "helion": "MoE triton/helion runner only (layers/moe/moe_runner/triton_utils/helion_utils.py)",
    "humming-kernels": "humming quantization/MoE only",
    "tokenspeed-mla": "MLA backend (DeepSeek) only",
    "sgl-deep-gemm": "try/except import (layers/deep_gemm_wrapper/configurer.py): FP8 block GEMM, off without it",
    "kernels": "HF kernels hub, inside functions; reflow's set carries kernels 0.19.1 (sglang wants <0.15: unused here)",
    "torchcodec": "video decoding, try/except import",
    "av": "arm64 only", "decord2": "arm64 only",
    "smg-grpc-servicer": "--smg-grpc-mode only",
    "cuda-python": "meta-package for cuda-bindings, which the image has (utils/common.py imports cuda.bindings)",
    "py-spy": "in reflow's carried set already (.gpuwheels/3)",
    "watchfiles": "uvicorn reload only",
    "zstandard": "only with SGLANG_ENABLE_REQUEST_DECOMPRESSION",
    "easydict": "multimodal model configs only",
}


def wheel_name(filename: str) -> str:
    return norm(filename.split("-")[0])


def carried_by_reflow(root: Path) -> dict[str, str]:
    """{name: version} of reflow's own carried set: the wheels in .gpuwheels/1-3, else prepare.py's walk."""
    found = {}
    for sub in ("1", "2", "3"):
        for f in (root / sub).glob("*.whl*"):
            found[wheel_name(f.name)] = f.name.split("-")[1]
    return found or {k: v for k, v in requirements("reflow", []).items() if k != "reflow"}


def never(name: str) -> bool:
    return any(re.fullmatch(p, name) for p in NEVER)


def download(spec: str, dest: Path) -> Path | None:
    """One wheel, for CPython 3.12 manylinux x86_64 (pure Python as it is); the file, or None when the index has none."""
    before = set(dest.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(dest),
           "--python-version", "3.12", "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)],
           spec]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"  no wheel for {spec}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
        return None
    new = set(dest.glob("*.whl")) - before
    if new:
        return new.pop()
    name = norm(re.split(r"[<>=!~\[ ;]", spec)[0])  # already there from an earlier run
    return next((f for f in dest.glob("*.whl") if wheel_name(f.name) == name), None)


def requires(whl: Path, extras: set[str]) -> list:
    from packaging.requirements import Requirement

    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            envs = [{**ENV, "extra": e} for e in (extras or {""})]
            if req.marker is None or any(req.marker.evaluate(e) for e in envs):
                out.append(req)
    return out


def satisfied(req, version: str | None) -> str:
    if version is None or not str(req.specifier):
        return ""
    return "" if req.specifier.contains(version, prereleases=True) else f"  (wants {req.specifier}, has {version})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".gpuwheels/sglang")
    p.add_argument("--cache", default=".gpuwheels/sglang-cache", help="downloads land here first (kept for reruns)")
    p.add_argument("--part-mb", type=int, default=60)
    p.add_argument("--bin-mb", type=int, default=60)
    args = p.parse_args()
    repo = Path(__file__).resolve().parents[2]
    out, cache = repo / args.out, repo / args.cache
    cache.mkdir(parents=True, exist_ok=True)
    reflow = carried_by_reflow(repo / ".gpuwheels")

    # sglang's own requirements: each must be a root or have a recorded reason.
    sg = download(f"sglang=={SGLANG}", cache)
    if sg is None:
        sys.exit("sglang wheel not found")
    notes, conflicts = [], []
    for req in requires(sg, set()):
        n = norm(req.name)
        if n in ROOTS or n in VIA_WALK:
            continue
        if n in LEFT_OUT:
            notes.append(f"left out {n}{req.specifier}: {LEFT_OUT[n]}")
        elif n in IMAGE or never(n):
            msg = satisfied(req, IMAGE_VERSIONS.get(n))
            notes.append(f"image has {n}{msg}")
            if msg:
                conflicts.append(f"{n}{msg}")
        elif n in reflow:
            msg = satisfied(req, reflow[n])
            notes.append(f"reflow's set carries {n} {reflow[n]}{msg}")
        else:
            sys.exit(f"sglang requirement {req} is not classified: add it to ROOTS or LEFT_OUT")

    # Walk what travels: roots, then their requirements (recursively), minus what is there already.
    chosen: dict[str, Path] = {"sglang": sg}
    todo = [(n, f"{n}=={v}" if v else n, set(), "sglang 0.5.17 (root): " + why)
            for n, (v, why) in ROOTS.items() if n != "sglang"]
    reasons = {"sglang": "the server"}
    while todo:
        name, spec, extras, why = todo.pop(0)
        if name in chosen:
            continue
        whl = download(spec, cache)
        if whl is None:
            conflicts.append(f"{spec}: no wheel for the target in this index")
            continue
        chosen[name], reasons[name] = whl, why
        for req in requires(whl, extras):
            n = norm(req.name)
            if n in chosen or n == name:
                continue
            if never(n) or n in IMAGE:
                msg = satisfied(req, IMAGE_VERSIONS.get(n))
                if msg:
                    conflicts.append(f"{name} -> {n}{msg}")
                continue
            if n in reflow:
                msg = satisfied(req, reflow[n])
                if msg:
                    conflicts.append(f"{name} -> {n}{msg} (reflow's set)")
                continue
            if n in LEFT_OUT:
                notes.append(f"{name} wants {n}{req.specifier}: left out ({LEFT_OUT[n]})")
                continue
            todo.append((n, f"{req.name}{req.specifier}", set(req.extras), f"required by {name}"))

    # Lay out: copy the chosen wheels, split the big ones, bin into numbered folders of one transfer each.
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for whl in chosen.values():
        shutil.copy2(whl, out / whl.name)
    rows = sorted(((w.name, w.stat().st_size / 2**20, reasons[n]) for n, w in chosen.items()), key=lambda r: -r[1])
    parts = split(out, args.part_mb)
    total = sum(f.stat().st_size for f in out.iterdir() if f.is_file()) / 2**20
    folders = bins(out, args.bin_mb)

    print("\n| wheel | MiB | why |\n|---|---|---|")
    for fname, mib, why in rows:
        print(f"| {fname} | {mib:.1f} | {why} |")
    print(f"| **{len(rows)} wheels** | **{total:.1f}** | |")
    print(f"\n{len(parts)} parts of split wheels; {len(folders)} transfers (one numbered folder per call):")
    for f in folders:
        size = sum(x.stat().st_size for x in f.iterdir()) / 2**20
        print(f"  {f.relative_to(repo)}: {size:.1f} MiB, {len(list(f.iterdir()))} files")
    print("\nsglang's other requirements:")
    for line in notes:
        print("  " + line)
    if conflicts:
        print("\nversion conflicts / gaps (the image's or reflow's version is used):")
        for line in conflicts:
            print("  " + line)


if __name__ == "__main__":
    main()
