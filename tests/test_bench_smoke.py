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


def test_partial_rollout_anatomy_times_and_profiles_a_full_batch_step(tiny_policy):
    """bench/partial_rollout.py --anatomy's step of the whole batch (on a GPU its CUDA graph replayed), here the
    graph-free static step of a CPU generator: timed, profiled, and refused where the rows cannot fit the pool."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import partial_rollout
    finally:
        sys.path.remove(str(REPO / "bench"))
    from reflow.engines.embedded.generator import Generator
    from reflow.engines.hf_io import load_causal_lm, load_tokenizer

    tok = load_tokenizer(str(tiny_policy))
    gen = Generator(load_causal_lm(str(tiny_policy)).eval(), tok, max_batch_size=4, decoder="static", kv_tokens=256)
    gen.generate([tok.encode("1+2=")], {"max_new_tokens": 2})  # the pool is sized by the first call
    res = partial_rollout.anatomy(gen, 40, replays=2)
    assert (res["rows"], res["ctx"], res["keys_bucket"], res["graphs"]) == (4, 40, 64, False), res  # decode()'s shape
    assert res["device_step_ms"] > 0 and "Self CPU" in res["top"]
    assert "do not fit" in partial_rollout.anatomy(gen, 100)["skipped"]  # 4 rows x 101 positions > 256


def test_decode_host_benchmark_runs_on_cpu(tmp_path):
    """bench/decode_host.py (the static decode loop's host work a step), one tree at a toy size (its --baseline
    takes another tree through bench/_trees.importable, as rollout_generate.py's above)."""
    out = tmp_path / "d.json"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "decode_host.py"), "--rows", "8", "--prompts", "2",
                        "--scale", "0.05", "--json", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "decode_host: this " in p.stdout, p.stdout[-2000:]
    res = json.loads(out.read_text())
    (run,) = res["trees"]["this"]["runs"]
    assert run["steps"] > 0 and run["tokens"] >= run["steps"] and 0 < run["host_s"] < run["loop_s"]
    assert res["shape"]["samples"] == 16 and "host_ratio" not in res


def test_scratchpad_breakdown_tallies_sizes_pass_at_k_and_mixed_groups(tmp_path, monkeypatch):
    """bench/scratchpad_breakdown.py (issue 56: where a warm policy can still gain) over a real HF folder and the
    task's reward, with the decoder replaced by one whose answers are known: greedy solves the 1-digit-operand
    problems only; sampled, every other continuation is the worked trace. So each table's figures are known."""
    sys.path.insert(0, str(REPO / "bench"))
    import scratchpad_breakdown as sb

    from reflow.rl import scratchpad_task
    from reflow.rl.demo_policy import build_model, build_tokenizer
    from reflow.rl.scratchpad_demo import write_scratchpad_data

    tok = build_tokenizer()
    build_model(tok, hidden=32, layers=2, heads=2, mlp=64, max_positions=256, seed=0).save_pretrained(tmp_path / "p")
    tok.save_pretrained(tmp_path / "p")
    data = write_scratchpad_data(tmp_path / "d", seed=0, size="tiny", num_eval=24)
    rows = [json.loads(x) for x in Path(data["heldout"]).read_text().splitlines()]
    calls = {"n": 0}

    def decoder(model, prompt_ids, max_new_tokens, eos_id, pad_id=0, temperature=0.0, generator=None):
        out = []
        for ids in prompt_ids:
            prompt = tok.decode(ids, skip_special_tokens=True)
            a, b = scratchpad_task.operands(prompt)
            calls["n"] += 1
            right = max(a, b) < 10 if temperature == 0 else calls["n"] % 2 == 0
            text = scratchpad_task.trace(a, b) if right else "(1*1+0=01 =1)=1" + "0" * 9
            out.append(tok(text, add_special_tokens=False)["input_ids"] + [eos_id])
        return out

    monkeypatch.setattr(sb, "_greedy", decoder)
    r = sb.breakdown(str(tmp_path / "p"), data["heldout"], k=4, batch=7, device="cpu")
    one_digit = [r_ for r_ in rows if max(scratchpad_task.operands(r_["prompt"])) < 10]
    assert r["rows"] == 24 and r["greedy_accuracy"] == round(len(one_digit) / 24, 4)
    table = r["by_larger_operand_digits"]
    assert table["2"]["greedy"] == 0.0 and sum(v["rows"] for v in table.values()) == 24
    assert "1" not in table or table["1"]["greedy"] == 1.0
    # every other sample right: each group of 4 holds 2, so every group is mixed and solved at least once
    assert r["sampled_accuracy"] == 0.5 and r["pass_at_4"] == 1.0 and r["mixed_groups"] == 1.0
    assert all(v["sampled"] == 0.5 and v["pass_at_4"] == 1.0 for v in table.values())


def test_response_codec_benchmark_runs_on_cpu(tmp_path):
    """bench/response_codec.py (the /generate answer's json vs orjson), at a toy size: both ways round-trip the
    engine's answer and the ratios are printed."""
    out = tmp_path / "codec.json"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "response_codec.py"), "--samples", "8", "--tokens", "10",
                        "--rounds", "2", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "response_codec: encode_ratio=" in p.stdout, p.stdout
    res = json.loads(out.read_text())
    assert res["encode_ratio"] > 0 and res["decode_ratio"] > 0 and res["shape"]["bytes"] > 0
