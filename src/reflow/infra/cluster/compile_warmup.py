"""The trainer's compiled graphs made ahead, in a process of their own, while a run starts (`trainer.compile_warmup`).

Why: with compiled decoder layers the run's first train step compiles them (and the log-prob chunks) for its shapes:
8.8-14 s of iteration 0 on an H200 (bench/RESULTS.md 26), against ~2 s when inductor's on-disk caches already hold
those graphs (section 16). The layers of a model share one graph, so a *one-layer* model of the same config, random
weights, run through the trainer's own code on the first iteration's shapes, fills the caches the trainer's compile
then reads (bench/compile_cache_probe.py: 14.5 s -> 2.0 s for the whole model after a one-layer warm-up in another
process, CPU). The CLI starts this process before its preflight, beside Ray's and the actors' start.

How the trainer waits: the CLI holds an exclusive lock on a file and hands it to the process, which keeps it until
it has compiled (or failed); a trainer rank whose environment names that file takes a shared lock before its first
step (engines/train/compiled.wait_for_warmup, bounded), so it never compiles the same graphs alongside it (a second compile of the same graphs is
never faster than waiting for the first). Everything here is best effort: a wrong guess of the first shapes (the
responses' lengths are guessed: max_new_tokens each) or a failure only costs the background work.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from reflow.engines.train.compiled import WARMUP_LOCK_ENV as LOCK_ENV
from reflow.infra.config.schema import RunConfig, dump_config


def wanted(cfg: RunConfig) -> bool:
    """trainer.compile_warmup, where the trainer will compile its layers (compile on, or auto with GPUs: on CUDA and
    not under ZeRO-3, as engines/train/compiled.use_compile decides). auto: on a local machine with an NVIDIA GPU
    that the run uses; on: also with compile forced on without one (CPU)."""
    from reflow.infra.cluster.ray_connect import has_nvidia_gpu

    t = cfg.trainer
    if t.compile_warmup == "off" or t.compile == "off" or t.zero_stage == 3:
        return False
    return (cfg.cluster.gpus != "off" and has_nvidia_gpu()) or (t.compile == "on" and t.compile_warmup == "on")


class Warmup:
    """The running warm-up process (`start`); `stop` ends it if it still runs and restores the environment."""

    def __init__(self, proc: subprocess.Popen, folder: Path) -> None:
        self.proc, self.folder = proc, folder

    @classmethod
    def start(cls, cfg: RunConfig) -> Warmup:
        folder = Path(tempfile.mkdtemp(prefix="reflow-compile-warmup-"))
        (folder / "config.yaml").write_text(dump_config(cfg))
        lock = folder / "lock"
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held by the child's copy of this descriptor until it exits
            cmd = [sys.executable, "-m", "reflow.infra.cluster.compile_warmup", str(folder / "config.yaml")]
            with open(folder / "log.txt", "w") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, pass_fds=(fd,),
                                        env={**os.environ, LOCK_ENV: ""})
        finally:
            os.close(fd)
        os.environ[LOCK_ENV] = str(lock)
        return cls(proc, folder)

    def stop(self) -> None:
        """End the process if it still runs; remove its folder (its one-layer model always; its config and log
        unless it failed, when the log says why)."""
        os.environ.pop(LOCK_ENV, None)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.folder / "model", ignore_errors=True)
        if self.proc.returncode == 0:
            shutil.rmtree(self.folder, ignore_errors=True)


def _one_layer_model(local: str, out: Path, dtype) -> Path:
    """A random-weight copy of the model's config with one decoder layer, saved as an HF folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(local)
    config.num_hidden_layers = 1
    for key in ("layer_types", "sliding_window_pattern"):  # per-layer lists some configs carry
        if isinstance(getattr(config, key, None), list):
            setattr(config, key, getattr(config, key)[:1])
    AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(out)
    return out


def _first_batch(cfg: RunConfig, tokenizer):
    """The first iteration's prompts x n samples, each answered by max_new_tokens tokens (its longest possible
    length: the batch's padded length is the longest row's bucket), with advantages of both signs."""
    from reflow.infra.inputs.prompts import load_prompts
    from reflow.rl.data import prompts_for_iteration
    from reflow.rl.types import RolloutBatch

    train, _ = load_prompts(cfg, tokenizer)
    r = cfg.rollout
    prompts = prompts_for_iteration(train, cfg.data.seed, 0, r.prompts_per_iteration)
    n, m = r.n_samples_per_prompt, r.max_new_tokens
    special = set(tokenizer.all_special_ids)
    token = next(t for t in range(tokenizer.vocab_size) if t not in special)
    rows = [(g, p) for g, p in enumerate(prompts) for _ in range(n)]
    return RolloutBatch(group_index=[g for g, _ in rows], prompt_text=[p.text for _, p in rows],
                        prompt_ids=[list(p.input_ids) for _, p in rows], response_text=[""] * len(rows),
                        response_ids=[[token] * m for _ in rows], rollout_logprobs=[[-1.0] * m for _ in rows],
                        finish_reason=["length"] * len(rows), label=[p.label for _, p in rows],
                        advantages=[1.0 if i % 2 else -1.0 for i in range(len(rows))])


def main(argv: list[str]) -> int:
    """The child: build a one-layer trainer rank with the run's settings and take one step on the first batch."""
    import dataclasses
    import socket

    from reflow.engines.hf_io import load_tokenizer, resolve_checkpoint, torch_dtype
    from reflow.engines.train.settings import weights_precision
    from reflow.engines.train.trainer import TrainerRank
    from reflow.infra.config.schema import load_config
    from reflow.infra.config.settings import loss_settings, policy_rank_settings, storage_access

    t0 = time.perf_counter()
    cfg = load_config(argv[0], [])
    settings = policy_rank_settings(cfg)
    local = str(resolve_checkpoint(cfg.model.path, storage_access(cfg), None))
    tokenizer = load_tokenizer(local)
    batch = _first_batch(cfg, tokenizer)
    dtype = torch_dtype(weights_precision(cfg.trainer.precision))
    folder = _one_layer_model(local, Path(argv[0]).parent / "model", dtype)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # policy_rank_settings without `gpus`: a group of one over gloo (what the run's ranks use between them, nccl on
    # GPUs, does not change a one-rank step's compiled graphs)
    settings = dataclasses.replace(settings, storage=None, lora=None)
    rank = TrainerRank(0, 1, "127.0.0.1", port, str(folder), settings)
    t1 = time.perf_counter()
    rank.train_iteration(batch, minibatches=cfg.trainer.minibatches_per_iteration, pad_id=tokenizer.pad_token_id,
                         loss=dataclasses.replace(loss_settings(cfg), kl_coef=0.0))
    print(f"compile warm-up: set up in {t1 - t0:.1f} s, one step (compiling) in {time.perf_counter() - t1:.1f} s, "
          f"{len(batch)} samples", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
