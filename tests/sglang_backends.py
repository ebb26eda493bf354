"""The two backends of tests/test_sglang_real_app.py: tiny models, SGLang's real app servers
(tests/sglang_app.py) and the embedded engine, and the trainer-side logprob probe of a model."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from reflow.engines.http_serve import new_api_key
from reflow.engines.rollout_client import EngineClient, poll_health
from reflow.engines.weights.verify import LogprobProbe, probe_prompts

KEY = new_api_key()
REPO = Path(__file__).resolve().parents[1]
ARCHS = ("llama", "qwen2")
RECEIVERS = 4  # engines per backend and model: pushes go to 1, 2 and 4 of them
AUTO = "llama-auto"  # a Llama server under SGLang's default --dtype auto (reflow's launcher pins it)
LORA = "llama-lora"  # a Llama server with the LoRA flags of a trainer.lora.rank=4 run on q_proj, v_proj
LORA_TARGETS = ("q_proj", "v_proj")


def build(arch: str, out: Path | None, seed: int = 0):
    """A tiny random model of `arch` with the demo's char tokenizer (hidden 32, 2 layers)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from reflow.rl.demo_policy import build_tokenizer, save_policy

    tok = build_tokenizer()
    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    cfg = cfg_cls(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                  pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    if out is not None:
        save_policy(model, tok, out)
    return model, tok


def pushed(arch: str, seed: int):
    """A fresh model of the same shape (the 'trainer' after a step) and its HF-named tensors."""
    model, tok = build(arch, None, seed=seed)
    return model, tok, [(n, t.detach().clone()) for n, t in model.state_dict().items()]


@torch.no_grad()
def probe_of(model) -> LogprobProbe:
    """The trainer's side of the logprob check for `model` (what TrainerRank._logprob_probe computes)."""
    prompts = probe_prompts(model.config.vocab_size)
    ids = torch.tensor(prompts)  # [P, T]
    logits = model(input_ids=ids).logits[:, :-1].float()  # [P, T-1, V]
    ref = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]  # [P, T-1]
    return LogprobProbe(prompts, list(ref), torch.float32)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Backend:
    """One backend's engines serving one model."""

    name: str  # "sglang" (its real app) or "embedded"
    arch: str
    urls: list[str] = field(default_factory=list)

    def clients(self, k: int | None = None) -> list[EngineClient]:
        return [EngineClient(u, timeout=60, api_key=KEY) for u in self.urls[:k]]


def sglang_launches(model_dirs: dict[str, Path], secrets_dir: Path) -> tuple[dict[str, list[int]], list[str]]:
    """Ports per server group and tests.sglang_app's arguments: RECEIVERS servers per model with the
    flags reflow's launcher gives sglang.launch_server (parsed by the wheel), plus one Llama server
    under SGLang's default --dtype auto and one serving LoRA adapters."""
    from reflow.engines.sglang.launcher import command_line, server_args

    def flags(path: Path, port: int, **kw) -> list[str]:
        return command_line(server_args(str(path), host="127.0.0.1", port=port, nccl_port=free_port(), api_key=KEY,
                                        **kw), secrets_dir=secrets_dir)[3:]  # the key in a --config file

    ports = {a: [free_port() for _ in range(RECEIVERS)] for a in model_dirs}
    serve = [arg for a, ps in ports.items() for p in ps
             for arg in ("--serve", json.dumps(flags(model_dirs[a], p, dtype="float32")))]
    ports[AUTO] = [free_port()]
    auto = flags(model_dirs["llama"], ports[AUTO][0])
    i = auto.index("--dtype")
    ports[LORA] = [free_port()]
    lora = flags(model_dirs["llama"], ports[LORA][0], dtype="float32", lora_rank=4, lora_target_modules=LORA_TARGETS)
    return ports, serve + ["--serve", json.dumps(auto[:i] + auto[i + 2:]), "--serve", json.dumps(lora)]


def start_sglang_apps(model_dirs: dict[str, Path],
                      log: Path) -> tuple[subprocess.Popen, dict[str, list[str]], Path]:
    """Start tests.sglang_app (one forked process per server) and wait until every server is healthy;
    returns the process, the servers' URLs and the log the running servers write to.

    A start that does not come up is stopped after every server's threads were dumped into `log`
    (tests.sglang_app forwards SIGUSR1 to faulthandler), and tried once more with a log of its own
    (`log` keeps the stacks); the first attempt's log tail is reported as a warning, so a rare hang
    shows in the suite's summary, stacks included.
    """
    try:
        return (*_start_sglang_apps(model_dirs, log), log)
    except AssertionError as first:
        warnings.warn(f"SGLang app servers did not come up; starting them again. First attempt: {first}",
                      stacklevel=2)
        again = log.with_name(log.stem + "-again.log")
        return (*_start_sglang_apps(model_dirs, again), again)


def _start_sglang_apps(model_dirs: dict[str, Path], log: Path) -> tuple[subprocess.Popen, dict[str, list[str]]]:
    ports, serve = sglang_launches(model_dirs, log.parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    with log.open("w") as out:  # the child holds its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, "-m", "tests.sglang_app", *serve], cwd=REPO,
                                env=env, stdout=out, stderr=subprocess.STDOUT)

    def alive():
        if proc.poll() is not None:
            raise RuntimeError(f"tests.sglang_app exited with {proc.returncode}:\n{log.read_text()[-3000:]}")

    urls = {a: [f"http://127.0.0.1:{p}" for p in ps] for a, ps in ports.items()}
    t0 = time.monotonic()
    try:  # 240 s: tests/suite.sh runs test_resume.py's Ray clusters beside this (load 17 seen on 2 cores)
        for url in (u for us in urls.values() for u in us):
            last = poll_health(url, 240.0, 0.2, alive)
            if last is not None:
                proc.send_signal(signal.SIGUSR1)  # every server dumps its threads' stacks into the log
                time.sleep(3.0)
                raise AssertionError(f"SGLang app {url} not healthy {time.monotonic() - t0:.0f} s after the start: "
                                     f"{last}\n{log.read_text()[-12000:]}")
    except BaseException:
        stop(proc)
        raise
    return proc, urls


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()  # it stops its forked servers
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
