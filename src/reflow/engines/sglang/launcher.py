"""The SGLang rollout engine: a thin launcher over the real server, hostable as a Ray actor.

Same surface as `EmbeddedEngine` (url(), ready(), shutdown()); everything else goes over SGLang's
HTTP API through the one `EngineClient` and weight pusher CI exercises on the embedded engine.
The server runs as `python -m sglang.launch_server <ServerArgs flags>` in its own process group
(its scheduler/detokenizer children die with it). Flags are built from explicit arguments and
the field table SERVER_ARG_TYPES, which tests check against the installed wheel's ServerArgs.

Ports: several engines start on one node at once, and SGLang binds its ports only after seconds
of start-up, so "bind port 0, close, pass it on" can hand two engines the same port. Ports are
therefore allocated under a node-wide file lock and remembered for a while (`allocate_ports`).

Authentication: the server gets the runtime's key as SGLang's own `--api-key` (every endpoint but
/health*, /ready*, /metrics* then needs it as a bearer token) and binds 127.0.0.1 unless told
otherwise (a multi-node cluster sets cluster.bind_host=0.0.0.0). The key never goes on the command line
(any user of the node reads /proc/<pid>/cmdline): it is written to a YAML file of mode 0600 in a private
folder and handed over as SGLang's own `--config FILE`, which SGLang merges into its flags while parsing
them; the file is removed once the server answers (it was read at start-up).
On a GPU (bench/RESULTS.md 39, an H100): the real server start, generation and colocated CUDA IPC pushes ran with
SGLang 0.5.17; NCCL pushes, tensor parallelism and multi-node placement have not run on GPUs yet.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from reflow.engines.http_serve import advertised_url, check_api_key, new_api_key, node_ip
from reflow.engines.rollout_client import poll_health

INSTALL_HINT = ("rollout.backend=sglang needs SGLang on the engine nodes: pip install 'reflow[sglang]' "
                "(sglang==0.5.23 with its CUDA dependencies; 0.5.17, the newest for torch 2.11, is tested too: "
                "docs/ENGINE_CONTRACT.md; see https://docs.sglang.ai/get_started/install.html)")
# ServerArgs fields (sglang 0.5.23) this launcher sets, with their value types. The CLI flag of a
# field is `--` + name with `_` -> `-` (SGLang's arg_utils); booleans are store_true flags.
SERVER_ARG_TYPES: dict[str, type] = {
    "model_path": str, "tokenizer_path": str, "host": str, "port": int, "tp_size": int,
    "mem_fraction_static": float, "enable_memory_saver": bool, "nccl_port": int, "dist_init_addr": str,
    "base_gpu_id": int, "skip_server_warmup": bool, "dtype": str, "random_seed": int, "log_level": str,
    "trust_remote_code": bool, "api_key": str, "kv_cache_dtype": str,
    "enable_lora": bool, "max_lora_rank": int, "lora_target_modules": list, "max_loras_per_batch": int,
}
# With LoRA (trainer.lora.rank > 0) the server starts with no adapter (the first push loads one), so
# SGLang needs the rank and target modules up front; a batch may mix two versions' adapters while
# requests of the previous version finish (pause_mode retract/in_place; engines/weights/adapter_push.py).
LORAS_PER_BATCH = 2
_PORT_LEASE_S = 600.0  # a port handed out stays reserved this long (covers a slow server start)
# trainer.precision -> the --dtype the engine is pinned to. Never SGLang's "auto": it loads a float32
# checkpoint as float16 (bfloat16 for Gemma) while /server_info still says "auto", so nobody outside
# could tell what the engine holds; pinned, /server_info names the dtype the weight check casts to.
SGLANG_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
KV_CACHE_DTYPES = {"bf16": "bfloat16"}  # rollout.kv_cache_dtype -> --kv-cache-dtype (auto: the flag left out, SGLang's default)
PINNED_DTYPES = ("float32", "float", "bfloat16", "float16", "half")  # ServerArgs.dtype's choices but "auto"


class SGLangUnavailable(RuntimeError):
    """SGLang's server cannot be imported where the engine runs."""


class EngineStartError(RuntimeError):
    """The SGLang server exited or did not become healthy in time."""


def sglang_dtype(precision: str) -> str:
    """The SGLang --dtype that holds what a trainer of `precision` (trainer.precision) pushes, bit for bit."""
    if precision not in SGLANG_DTYPES:
        raise ValueError(f"trainer precision {precision!r} has no SGLang --dtype here; known: {sorted(SGLANG_DTYPES)}")
    return SGLANG_DTYPES[precision]


def server_args(model_path: str, *, host: str, port: int, nccl_port: int, tp_size: int = 1,
                mem_fraction_static: float = 0.8, enable_memory_saver: bool = False, base_gpu_id: int = 0,
                dist_init_addr: str | None = None, dtype: str = "float32", random_seed: int | None = None,
                skip_server_warmup: bool = True, log_level: str = "warning", api_key: str | None = None,
                lora_rank: int = 0, lora_target_modules: list[str] | tuple[str, ...] = (),
                kv_cache_dtype: str = "auto") -> dict:
    """ServerArgs field values for one engine (the builder passes explicit values; no config here).
    `dtype` is pinned (see SGLANG_DTYPES): "auto" is refused. `lora_rank` > 0 enables SGLang's LoRA
    serving for adapters of that rank on `lora_target_modules` (SGLang's own names, e.g. q_proj)."""
    if dtype not in PINNED_DTYPES:
        raise ValueError(f"SGLang engine dtype {dtype!r}: pin one of {list(PINNED_DTYPES)} (the runtime passes "
                         f"sglang_dtype(trainer.precision)); under 'auto' SGLang loads float32 checkpoints as float16 "
                         f"and still reports 'auto', so the pushed weights could not be checked")
    return {"model_path": model_path, "tokenizer_path": model_path, "host": host, "port": port, "api_key": api_key,
            "tp_size": tp_size, "mem_fraction_static": mem_fraction_static,
            "enable_memory_saver": enable_memory_saver, "nccl_port": nccl_port, "dist_init_addr": dist_init_addr,
            "base_gpu_id": base_gpu_id, "skip_server_warmup": skip_server_warmup, "dtype": dtype,
            "random_seed": random_seed, "log_level": log_level, "trust_remote_code": False, **_lora_args(
                lora_rank, lora_target_modules), **_kv_args(kv_cache_dtype)}


def _kv_args(kv_cache_dtype: str) -> dict:
    if kv_cache_dtype == "auto":
        return {}
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"rollout.kv_cache_dtype={kv_cache_dtype!r}: one of auto, {', '.join(KV_CACHE_DTYPES)}")
    return {"kv_cache_dtype": KV_CACHE_DTYPES[kv_cache_dtype]}


def _lora_args(rank: int, target_modules: list[str] | tuple[str, ...]) -> dict:
    if rank <= 0:
        return {}
    if not target_modules:
        raise ValueError("an SGLang engine serving LoRA adapters needs their target modules (trainer.lora.target_modules)")
    return {"enable_lora": True, "max_lora_rank": rank, "lora_target_modules": sorted(target_modules),
            "max_loras_per_batch": LORAS_PER_BATCH}


CONFIG_FILE = "server-config.yaml"
# rollout.sglang_server_args: more ServerArgs flags for a user's setup (an attention backend, CUDA graphs off, ...).
# Not the fields reflow sets from its own settings: each names the setting that owns it.
OWNED_SERVER_ARGS = {
    "model_path": "model.path", "tokenizer_path": "model.path", "host": "cluster.bind_host", "port": "(leased)",
    "api_key": "(the runtime's key)", "tp_size": "rollout.tp_size", "mem_fraction_static": "rollout.mem_fraction_static",
    "enable_memory_saver": "cluster.colocate", "nccl_port": "(leased)", "dist_init_addr": "(leased)",
    "base_gpu_id": "(Ray's placement)", "dtype": "trainer.precision", "random_seed": "seed",
    "enable_lora": "trainer.lora.rank", "max_lora_rank": "trainer.lora.rank",
    "lora_target_modules": "trainer.lora.target_modules", "max_loras_per_batch": "(reflow's LORAS_PER_BATCH)",
    "config": "(the key's file)", "kv_cache_dtype": "rollout.kv_cache_dtype",
}


def extra_flags(extra: dict) -> list[str]:
    """`--name value` for each of rollout.sglang_server_args (True: a bare store_true flag; False/None: left
    out; a list: its items after the flag). A field reflow sets itself is refused, naming the setting to use."""
    out: list[str] = []
    for name, value in extra.items():
        key = name.replace("-", "_")
        if not re.fullmatch(r"[a-z][a-z0-9_]*", key):
            raise ValueError(f"rollout.sglang_server_args: {name!r} is not a ServerArgs field name (e.g. "
                             f"attention_backend, disable_cuda_graph)")
        if key in OWNED_SERVER_ARGS:
            raise ValueError(f"rollout.sglang_server_args.{name}: reflow sets --{key.replace('_', '-')} itself "
                             f"from {OWNED_SERVER_ARGS[key]}; set that instead")
        if value is None or value is False:
            continue
        out += _flag_words(key, value)
    return out


def _flag_words(name: str, value) -> list[str]:
    """A ServerArgs field on SGLang's command line: True a bare store_true flag, a list its items after the flag."""
    flag = "--" + name.replace("_", "-")
    return [flag] if value is True else [flag, *map(str, value)] if isinstance(value, list) else [flag, str(value)]


def command_line(args: dict, python: str = sys.executable, secrets_dir: str | Path | None = None,
                 extra: dict | None = None) -> list[str]:
    """`python -m sglang.launch_server` with one flag per non-null field (checked against the table), except
    `api_key`, which goes into `secrets_dir/server-config.yaml` (mode 0600; `secrets_dir` must be a folder only
    this user can enter, e.g. a fresh mkdtemp) passed as `--config`; then the user's `extra` flags (extra_flags)."""
    cmd = [python, "-m", "sglang.launch_server"]
    if args.get("api_key") is not None:
        if secrets_dir is None:
            raise ValueError("an SGLang server with an API key needs a private folder (secrets_dir) for the file "
                             "that hands it the key: on the command line any local user could read it")
        config = Path(secrets_dir) / CONFIG_FILE
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"api-key": check_api_key(args["api_key"])}, f)  # JSON is YAML; the key spelled as the flag
        cmd += ["--config", str(config)]
        args = {k: v for k, v in args.items() if k != "api_key"}
    for name, value in args.items():
        kind = SERVER_ARG_TYPES.get(name)
        if kind is None:
            raise ValueError(f"{name!r} is not a ServerArgs field this launcher knows; add it to SERVER_ARG_TYPES "
                             f"after checking sglang's arg_groups/fields")
        if value is None or (kind is bool and not value):
            continue
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            if not (kind is float and isinstance(value, int)):
                raise TypeError(f"ServerArgs.{name} must be {kind.__name__}, got {value!r}")
        cmd += _flag_words(name, value)
    return cmd + extra_flags(extra or {})


def allocate_ports(count: int, host: str = "", registry: Path | None = None) -> list[int]:
    """`count` free TCP ports no other caller on this node got in the last _PORT_LEASE_S seconds."""
    registry = registry or Path(tempfile.gettempdir()) / "reflow-ports.json"
    with open(f"{registry}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        now = time.time()
        leased = {int(p): t for p, t in _read_json(registry).items() if t > now}
        ports: list[int] = []
        while len(ports) < count:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in leased and port not in ports:
                ports.append(port)
        leased.update({p: now + _PORT_LEASE_S for p in ports})
        registry.write_text(json.dumps(leased))
    return ports


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def require_sglang(python: str = sys.executable, env: dict | None = None, timeout: float = 300.0) -> None:
    """Import SGLang's HTTP server in a child interpreter (the one that will run it): the real import
    needs CUDA-side packages that a bare `find_spec` would not notice. `python` is a path or a command
    on PATH (rollout.sglang_python)."""
    exe = shutil.which(python, path=(env or os.environ).get("PATH"))
    if exe is None:
        raise SGLangUnavailable(f"the interpreter for SGLang's server, {python!r}, is not an executable file nor a "
                                f"command on PATH: set rollout.sglang_python to one that imports sglang (or leave it "
                                f"null to use the engine's own)")
    probe = subprocess.run([exe, "-c", "import sglang.srt.entrypoints.http_server"], capture_output=True,
                           text=True, timeout=timeout, env=env)
    if probe.returncode != 0:
        tail = (probe.stderr or probe.stdout).strip().splitlines()[-3:]
        where = "" if python == sys.executable else f" (under {python})"
        raise SGLangUnavailable(f"{INSTALL_HINT}. Importing sglang.srt.entrypoints.http_server failed{where}: "
                                f"{' | '.join(tail)}")


class SGLangEngine:
    """Launches one SGLang server; the Ray actor around it is what the runtime keeps."""

    def __init__(self, model_path: str, engine_id: str, *, host: str = "127.0.0.1", tp_size: int = 1,
                 mem_fraction_static: float = 0.8, enable_memory_saver: bool = False, base_gpu_id: int = 0,
                 multi_node: bool = False, dtype: str = "float32", seed: int | None = None,
                 startup_timeout_s: float = 900.0, python: str = sys.executable, env: dict | None = None,
                 api_key: str | None = None, lora_rank: int = 0, lora_target_modules: list[str] | tuple[str, ...] = (),
                 server_args_extra: dict | None = None, kv_cache_dtype: str = "auto"):
        self.engine_id, self.startup_timeout_s = engine_id, startup_timeout_s
        extra_flags(server_args_extra or {})  # refused before anything starts
        self._api_key = check_api_key(new_api_key() if api_key is None else api_key)
        self.env = {**os.environ, **(env or {})}
        require_sglang(python, self.env)
        port, nccl_port, dist_port = allocate_ports(3)
        self.host = host
        dist_addr = f"{node_ip()}:{dist_port}" if multi_node else None  # TP across nodes only
        self.args = server_args(model_path, host=host, port=port, nccl_port=nccl_port, tp_size=tp_size,
                                mem_fraction_static=mem_fraction_static, enable_memory_saver=enable_memory_saver,
                                base_gpu_id=base_gpu_id, dist_init_addr=dist_addr, dtype=dtype, random_seed=seed,
                                api_key=self._api_key, lora_rank=lora_rank, lora_target_modules=lora_target_modules,
                                kv_cache_dtype=kv_cache_dtype)
        self._secrets = tempfile.mkdtemp(prefix="reflow-sglang-")  # 0700: the key's file (command_line)
        self.cmd = command_line(self.args, python, self._secrets, server_args_extra)
        self.log_path = Path(tempfile.gettempdir()) / f"reflow-sglang-{engine_id}-{port}.log"
        with open(self.log_path, "w") as log:  # the child keeps its own handle
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)

    def url(self) -> str:
        return advertised_url(self.host, self.args["port"])

    def api_key(self) -> str:
        """The server's --api-key (asked over Ray by a later flow run)."""
        return self._api_key

    def _check_process(self) -> None:
        if self.proc.poll() is not None:
            raise EngineStartError(f"SGLang engine {self.engine_id} exited with code {self.proc.returncode} "
                                   f"during start-up; last log lines:\n{self.log_tail()}")

    def ready(self, timeout: float | None = None) -> bool:
        """Block until /health_generate answers 200 (a real one-token generate)."""
        timeout = self.startup_timeout_s if timeout is None else timeout
        last = poll_health(self.url(), timeout, 1.0, self._check_process)
        if last is None:
            shutil.rmtree(self._secrets, ignore_errors=True)  # SGLang read its --config file while starting
            return True
        raise EngineStartError(f"SGLang engine {self.engine_id} at {self.url()} not healthy after {timeout:.0f}s "
                               f"({last}); command: {' '.join(self.cmd)}; last log lines:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def shutdown(self, grace_s: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after `grace_s`."""
        shutil.rmtree(self._secrets, ignore_errors=True)
        if self.proc.poll() is not None:
            return
        _signal_group(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        _signal_group(self.proc.pid, signal.SIGKILL)  # children that outlived their parent


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # start_new_session=True made the server its group's leader
    except ProcessLookupError:
        pass  # already gone: nothing to stop

