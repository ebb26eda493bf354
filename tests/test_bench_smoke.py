"""The GPU benchmarks' own code paths on CPU with tiny models: `bench/gpu.py --device cpu --tiny` (the
trainer, the plain loop, the engine and the push as bench/gpu.py drives them) and bench/rollout_generate.py
against a tree, bench/gc_pauses.py. CI has no GPU, so without this a refactor can break a script unnoticed until a paid device
run (it did once: `train_iteration`'s keywords changed under it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # ~15 s: DeepSpeed (gloo), an engine, a push

REPO = Path(__file__).resolve().parents[1]


def test_gpu_benchmark_runs_on_cpu_tiny(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    # two of the tiny default's three variants: each runs in a child process of its own (~5 s of start-up on CPU),
    # and old-pass differs from default by a trainer setting tested in tests/test_trainer_compile.py
    p = subprocess.run([sys.executable, str(REPO / "bench" / "gpu.py"), "--device", "cpu", "--tiny", "--variants",
                        "default,plain"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "gpu: trainer MFU" in out and "engine/generate" in out and "push" in out, out[-2000:]
    assert (tmp_path / "gpu.json").is_file()


def test_rollout_generate_benchmark_runs_on_cpu_against_a_tree(tmp_path):
    """bench/rollout_generate.py with a baseline tree (here: this one), as the GPU call runs it."""
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "rollout_generate.py"), "--baseline", str(REPO), "--cpu",
                        "--prompts", "4", "--n", "2", "--repeat", "1", "--rounds", "1", "--json", str(out)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "rollout_generate: this_samples_per_s=" in p.stdout and "speedup=" in p.stdout, p.stdout[-2000:]
    res = json.loads(out.read_text())
    assert res["shape"]["prompts"] == 4 and res["this"]["samples_per_s"] > 0 and res["baseline"]["samples_per_s"] > 0


def test_gc_pauses_benchmark_runs_on_cpu(tmp_path):
    """bench/gc_pauses.py as the GPU call runs it: a plain and a frozen child; the frozen one holds its set-up frozen."""
    out = tmp_path / "g.json"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "gc_pauses.py"), "--cpu", "--prompts", "4", "--n", "2",
                        "--rollouts", "2", "--rounds", "1", "--json", str(out)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "gc_pauses: full collections" in p.stdout, p.stdout[-2000:]
    runs = json.loads(out.read_text())["runs"]
    assert runs["plain"][0]["frozen_objects"] < 10_000 < runs["frozen"][0]["frozen_objects"], runs


def test_partial_rollout_benchmark_runs_on_cpu(tmp_path):
    """bench/partial_rollout.py (issue 55's partial_speedup) as the GPU call runs it, at a toy size."""
    out = tmp_path / "p.json"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "partial_rollout.py"), "--prompts", "2", "--n", "2",
                        "--max-new", "24", "--median", "6", "--chunk", "4", "--iterations", "2", "--json", str(out)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "partial_rollout: partial_speedup=" in p.stdout, p.stdout[-2000:]
    res = json.loads(out.read_text())
    assert res["partial_speedup"] > 0 and 0 <= res["idle_fraction_carry"] <= 1 and 0 <= res["idle_fraction_off"] <= 1
    assert all(len(m["seconds"]) == 2 for m in res["modes"].values())
    # steady: the second iteration alone (--warmup-iterations 1, the default)
    for k, m in res["modes"].items():
        assert res["seconds_per_iteration_steady"][k] == m["seconds"][1]
    assert res["partial_speedup_steady"] > 0 and res["shape"]["warmup_iterations"] == 1
