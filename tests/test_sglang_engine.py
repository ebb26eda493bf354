"""The SGLang launcher: its ServerArgs/command line against the installed sglang 0.5.23 wheel, port
allocation, the missing-install error, and the process lifecycle against a stand-in server.

SGLang's full ServerArgs does not import without triton, so the command line is checked twice:
every flag against the wheel's ServerArgs field table (read from its source with `ast`, a drift
test), and parsed by SGLang's own argparse builder for the field groups that do import on CPU.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import stat
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from reflow.engines.sglang import contract as sglang_contract
from reflow.engines.sglang.launcher import (
    INSTALL_HINT,
    SERVER_ARG_TYPES,
    EngineStartError,
    SGLangEngine,
    SGLangUnavailable,
    allocate_ports,
    command_line,
    require_sglang,
    server_args,
)

CONTRACT = sglang_contract.load()
needs_wheel = pytest.mark.skipif(CONTRACT is None, reason="sglang==0.5.23 is not installed")


def _args(**kw):
    base = dict(host="0.0.0.0", port=31000, nccl_port=31001, tp_size=2, mem_fraction_static=0.7,
                enable_memory_saver=True, base_gpu_id=1, dist_init_addr="10.0.0.2:31002", random_seed=3,
                api_key="runtime-key")
    return server_args("/models/policy", **{**base, **kw})


def wheel_fields(root: Path | None = None) -> dict[str, str]:
    """ServerArgs field name -> annotated value type, from an sglang folder's sources (default: the venv's): its
    arg_groups/fields (0.5.23), or server_args.py itself (0.5.17 declares them there)."""
    srt = Path(root or sglang_contract.installed_root()) / "srt"
    out = {}
    for path in [*(srt / "arg_groups" / "fields").glob("*.py"), srt / "server_args.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                ann = node.annotation
                if isinstance(ann, ast.Subscript) and getattr(ann.value, "id", "") == "A":
                    first = ann.slice.elts[0] if isinstance(ann.slice, ast.Tuple) else ann.slice
                    out[node.target.id] = ast.unparse(first)
    return out


def check_field_table(fields: dict[str, str], version: str) -> None:
    """Every flag the launcher passes is a ServerArgs field of `fields` (wheel_fields), of the type it passes."""
    assert len(fields) > 200  # the whole ServerArgs surface was read
    for name, kind in SERVER_ARG_TYPES.items():
        assert name in fields, f"ServerArgs has no field {name!r} in sglang {version}"
        if kind is list:  # a nargs flag (lora_target_modules: Union[set[str], List[str]])
            assert "List[str]" in fields[name], (name, fields[name])
            continue
        assert fields[name].removeprefix("Optional[").removesuffix("]") == kind.__name__, (name, fields[name])


@needs_wheel
def test_field_table_matches_the_wheel():
    check_field_table(wheel_fields(), CONTRACT.version)


def _sglang_parser() -> tuple[argparse.ArgumentParser, set[str]]:
    """SGLang's own CLI builder over every field group that imports on this machine."""
    import msgspec
    from sglang.srt.arg_groups.arg_utils import add_cli_args_from_dataclass

    parser, covered = argparse.ArgumentParser(exit_on_error=False), set()
    try:  # the real thing where the runtime is installed
        from sglang.srt.server_args import ServerArgs

        ServerArgs.add_cli_args(parser)
        return parser, set(SERVER_ARG_TYPES)
    except ImportError:
        pass
    for group in ("model", "parallel", "schedule", "serving", "exec_", "device", "memory", "observability"):
        try:
            mod = importlib.import_module(f"sglang.srt.arg_groups.fields.{group}")
        except ImportError:  # needs triton or pybase64: covered by the field-table drift test only
            continue
        for cls in vars(mod).values():
            if isinstance(cls, type) and issubclass(cls, msgspec.Struct) and getattr(cls, "_NS_PATH", None):
                add_cli_args_from_dataclass(parser, cls)
                covered |= set(cls.__struct_fields__)
    return parser, covered


def _merged(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`argv` with its `--config` file's options merged in, by SGLang's own merger (what prepare_server_args runs)."""
    import importlib.util

    path = Path(sglang_contract.installed_root()) / "srt" / "utils" / "server_args_config_parser.py"
    spec = importlib.util.spec_from_file_location("sglang_server_args_config_parser", path)  # its package needs pybase64
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ConfigArgumentMerger(parser).merge_config_with_args(argv)


@needs_wheel
def test_command_line_parses_with_sglangs_own_argument_builder(tmp_path):
    args = _args()
    cmd = command_line(args, python="python3", secrets_dir=tmp_path)
    assert cmd[:3] == ["python3", "-m", "sglang.launch_server"]
    parser, covered = _sglang_parser()
    ours = covered & set(args)
    assert {"tp_size", "nccl_port", "dist_init_addr", "base_gpu_id"} <= ours  # Parallel + Device import on CPU
    parsed, _ = parser.parse_known_args(_merged(parser, cmd[3:]))
    for name in ours:
        assert getattr(parsed, name) == args[name], name


def test_kv_cache_dtype_reaches_sglang_as_its_own_flag(tmp_path):
    """rollout.kv_cache_dtype=bf16 is SGLang's --kv-cache-dtype bfloat16 (auto: the flag left out, SGLang's
    default); set through sglang_server_args instead it is refused, naming the setting; SGLang's parser (where its
    memory group imports) reads back what was passed."""
    from reflow.infra.config.schema import ConfigError, load_config

    args = _args(kv_cache_dtype="bf16")
    cmd = command_line(args, python="py", secrets_dir=tmp_path)
    assert args["kv_cache_dtype"] == "bfloat16" and cmd[cmd.index("--kv-cache-dtype") + 1] == "bfloat16"
    assert "--kv-cache-dtype" not in command_line(_args(), python="py", secrets_dir=tmp_path)
    with pytest.raises(ValueError, match="rollout.kv_cache_dtype='fp8'"):
        _args(kv_cache_dtype="fp8")
    with pytest.raises(ConfigError, match=r"sets --kv-cache-dtype itself from rollout.kv_cache_dtype"):
        load_config(None, ["rollout.backend=sglang", "rollout.sglang_server_args.kv_cache_dtype=bfloat16"])
    assert load_config(None, ["rollout.backend=sglang", "rollout.kv_cache_dtype=bf16"]).rollout.kv_cache_dtype == "bf16"
    if CONTRACT is not None:
        parser, covered = _sglang_parser()
        if "kv_cache_dtype" in covered:
            parsed, _ = parser.parse_known_args(_merged(parser, cmd[3:]))
            assert parsed.kv_cache_dtype == "bfloat16"


def test_command_line_flags(tmp_path):
    cmd = command_line(_args(enable_memory_saver=False, dist_init_addr=None), python="py", secrets_dir=tmp_path)
    assert "--enable-memory-saver" not in cmd and "--dist-init-addr" not in cmd
    assert "--skip-server-warmup" in cmd and cmd[cmd.index("--tp-size") + 1] == "2"
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.7"


@needs_wheel
def test_the_api_key_reaches_sglang_by_its_config_file_not_the_command_line(tmp_path):
    """Any local user reads /proc/<pid>/cmdline (issue 51): the key goes into SGLang's own `--config` YAML file,
    mode 0600, which SGLang's argument merger (the code `prepare_server_args` runs) turns into --api-key."""
    cmd = command_line(_args(), python="python3", secrets_dir=tmp_path)
    assert not any("runtime-key" in a for a in cmd) and "--api-key" not in cmd, cmd
    config = Path(cmd[cmd.index("--config") + 1])
    assert config.parent == tmp_path and stat.S_IMODE(config.stat().st_mode) == 0o600
    parser, covered = _sglang_parser()
    merged = _merged(parser, cmd[3:])
    assert merged[merged.index("--api-key") + 1] == "runtime-key" and "--config" not in merged
    if "api_key" in covered:  # the serving group imports here: SGLang's parser takes it too
        assert parser.parse_known_args(merged)[0].api_key == "runtime-key"
    with pytest.raises(ValueError, match="private folder"):
        command_line(_args(), python="python3")  # a key and nowhere safe to put it
    with pytest.raises(ValueError, match="not a ServerArgs field"):
        command_line({"made_up": 1})
    with pytest.raises(TypeError, match="tp_size must be int"):
        command_line({"tp_size": "2"})


def test_lora_flags_only_with_a_rank(tmp_path):
    assert "--enable-lora" not in command_line(_args(), python="py", secrets_dir=tmp_path)
    cmd = command_line(_args(lora_rank=8, lora_target_modules=("v_proj", "q_proj")), python="py", secrets_dir=tmp_path)
    i = cmd.index("--lora-target-modules")
    assert "--enable-lora" in cmd and cmd[cmd.index("--max-lora-rank") + 1] == "8"
    assert cmd[i + 1:i + 3] == ["q_proj", "v_proj"] and cmd[cmd.index("--max-loras-per-batch") + 1] == "2"
    with pytest.raises(ValueError, match="target modules"):
        _args(lora_rank=8)


def test_ports_are_unique_across_concurrent_engines(tmp_path):
    got: list[int] = []
    threads = [threading.Thread(target=lambda: got.extend(allocate_ports(3, registry=tmp_path / "p.json")))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 24 and len(set(got)) == 24


def test_missing_runtime_says_how_to_install():
    try:
        require_sglang()
    except SGLangUnavailable as e:
        assert INSTALL_HINT in str(e) and "pip install 'reflow[sglang]'" in str(e)
    else:
        pytest.skip("the full sglang runtime imports here")


_STUB = '''
import argparse, http.server, subprocess, sys, time
p = argparse.ArgumentParser()
p.add_argument("--port", type=int); p.add_argument("--host")
a, _ = p.parse_known_args()
if "--exit-early" in sys.argv or {exit_early}:
    print("CUDA error: no device"); sys.exit(3)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open({pidfile!r}, "w").write(str(child.pid))
calls = []
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        calls.append(1)
        self.send_response(200 if len(calls) > 2 else 503); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer((a.host, a.port), H).serve_forever()
'''


def _stub_sglang(tmp_path: Path, exit_early: bool) -> dict:
    """A stand-in `sglang` package: the launcher's only call-out is `python -m sglang.launch_server`."""
    pkg = tmp_path / "stub" / "sglang"
    (pkg / "srt" / "entrypoints").mkdir(parents=True)
    for f in ("__init__.py", "srt/__init__.py", "srt/entrypoints/__init__.py", "srt/entrypoints/http_server.py"):
        (pkg / f).write_text("")
    (pkg / "launch_server.py").write_text(textwrap.dedent(_STUB.format(exit_early=exit_early,
                                                                         pidfile=str(tmp_path / "child.pid"))))
    return {"PYTHONPATH": str(tmp_path / "stub")}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_lifecycle_waits_for_health_and_stops_the_process_group(tmp_path):
    e = SGLangEngine("/models/x", "stub-0", host="127.0.0.1", env=_stub_sglang(tmp_path, False),
                     startup_timeout_s=60)
    assert e.ready() and e.url().startswith("http://127.0.0.1:")
    child = int((tmp_path / "child.pid").read_text())
    assert _alive(child)
    e.shutdown()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert e.proc.poll() is not None and not _alive(child)


def test_early_exit_is_reported_with_the_log(tmp_path):
    e = SGLangEngine("/models/x", "stub-1", host="127.0.0.1", env=_stub_sglang(tmp_path, True), startup_timeout_s=60)
    with pytest.raises(EngineStartError, match=r"exited with code 3(.|\n)*CUDA error: no device"):
        e.ready()
    e.shutdown()


def test_health_timeout_is_a_clear_error(tmp_path):
    e = SGLangEngine("/models/x", "stub-2", host="127.0.0.1", env=_stub_sglang(tmp_path, False), startup_timeout_s=60)
    try:
        with pytest.raises(EngineStartError, match=r"not healthy after 1s .*HTTP 503|not healthy after 1s"):
            e.ready(timeout=1.0)
    finally:
        e.shutdown()
    assert sys.executable in e.cmd[0]


def test_server_runs_under_its_own_interpreter(tmp_path):
    """rollout.sglang_python: SGLang installed where only its own interpreter sees it (a venv whose pins
    clash with the trainer's): the probe and the server run under that interpreter, the engine's
    environment is left as it was."""
    stub = _stub_sglang(tmp_path, False)["PYTHONPATH"]
    venv_python = tmp_path / "sglang-venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text(f"#!/bin/sh\nPYTHONPATH={stub} exec {sys.executable} \"$@\"\n")
    venv_python.chmod(0o755)
    e = SGLangEngine("/models/x", "venv-0", host="127.0.0.1", python=str(venv_python), startup_timeout_s=60,
                     env={"PYTHONPATH": ""})
    try:
        assert e.cmd[0] == str(venv_python) and e.ready()
    finally:
        e.shutdown()
    with pytest.raises(SGLangUnavailable, match=r"'/no/such/python'.*rollout.sglang_python"):
        SGLangEngine("/models/x", "venv-1", host="127.0.0.1", python="/no/such/python")


@needs_wheel
def test_server_args_extra_are_flags_and_owned_ones_are_refused(tmp_path):
    """rollout.sglang_server_args, as the H100 run needed them (grammar_backend none: that machine has no
    xgrammar): each a ServerArgs field of the wheel, spelled as its declared type wants (their arg groups do not
    import on CPU, so SGLang's parser cannot read them here); a flag reflow sets itself is refused by the config."""
    from reflow.engines.sglang.launcher import OWNED_SERVER_ARGS
    from reflow.infra.config.schema import ConfigError, load_config

    extra = {"grammar_backend": "none", "attention_backend": "triton", "disable_cuda_graph": True,
             "enable_torch_compile": False}
    cfg = load_config(None, ["rollout.backend=sglang"] + [f"rollout.sglang_server_args.{k}={str(v).lower()}"
                                                          for k, v in extra.items()])
    assert cfg.rollout.sglang_server_args == extra
    cmd = command_line(_args(), python="py", secrets_dir=tmp_path, extra=cfg.rollout.sglang_server_args)
    assert cmd[-5:] == ["--grammar-backend", "none", "--attention-backend", "triton", "--disable-cuda-graph"]
    fields = wheel_fields()
    assert set(extra) <= set(fields) and set(OWNED_SERVER_ARGS) - {"config"} <= set(fields)
    for name, value in extra.items():  # each as SGLang declares it: a bool field is a bare store_true flag
        flag = "--" + name.replace("_", "-")
        assert (fields[name] == "bool") == isinstance(value, bool), (name, fields[name])
        if value is True:
            assert flag in cmd and (cmd.index(flag) == len(cmd) - 1 or cmd[cmd.index(flag) + 1].startswith("--"))
        elif value is False:
            assert flag not in cmd
        else:
            assert cmd[cmd.index(flag) + 1] == value
    with pytest.raises(ConfigError, match=r"sets --mem-fraction-static itself from rollout.mem_fraction_static"):
        load_config(None, ["rollout.sglang_server_args.mem_fraction_static=0.5"])
    with pytest.raises(ValueError, match=r"'--port' is not a ServerArgs field name"):
        SGLangEngine("/m", "x", server_args_extra={"--port": 1})
    assert "admin_api_key" in fields  # a credential flag SGLang has: never on its command line, never echoed
    with pytest.raises(ConfigError, match=r"admin_api_key would put a credential on SGLang's command line") as e:
        load_config(None, ["rollout.sglang_server_args.admin_api_key=hunter2-secret"])
    assert "hunter2" not in str(e.value)


def test_runtime_hands_sglang_python_to_the_engine(monkeypatch):
    from reflow.infra.cluster import runtime
    from reflow.infra.config.schema import load_config

    seen = {}

    class Options:
        def __init__(self, **opts):
            seen["options"] = opts

        def remote(self, **kwargs):
            seen["kwargs"] = kwargs

    class Remote:
        options = Options

    monkeypatch.setattr(runtime.ray, "remote", lambda cls: Remote)
    for value in (None, "/opt/sglang-venv/bin/python"):
        over = ["rollout.backend=sglang", "cluster.gpus=off", "trainer.precision=fp32"] + (  # auto would read the policy
            [f"rollout.sglang_python={value}"] if value else [])
        cfg = load_config(None, over)
        runtime._engine_actor(cfg, "ns", 0, False, "k" * 32)
        assert seen["kwargs"].get("python") == value


# ---------------------------------------------------------------- the engine dtype: pinned, and checked in


def _sglang_dtype_resolver():
    """SGLang's own `_get_and_verify_dtype` (configs/model_config.py, which does not import on CPU),
    compiled alone from the wheel's source: what dtype a server started with `--dtype X` holds."""
    import logging
    from typing import Union

    import torch
    from transformers import PretrainedConfig

    path = Path(sglang_contract.installed_root()) / "srt" / "configs" / "model_config.py"
    tree = ast.parse(path.read_text())
    keep = [n for n in tree.body if (isinstance(n, ast.FunctionDef) and n.name == "_get_and_verify_dtype")
            or (isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "_STR_DTYPE_TO_TORCH_DTYPE")]
    assert len(keep) == 2, "sglang moved _get_and_verify_dtype or its dtype table"
    scope = {"torch": torch, "Union": Union, "PretrainedConfig": PretrainedConfig,
             "logger": logging.getLogger("sglang-dtype")}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), scope)
    return scope["_get_and_verify_dtype"]


def _wheel_dtype_choices() -> list[str]:
    src = (Path(sglang_contract.installed_root()) / "srt" / "arg_groups" / "fields" / "model.py").read_text()
    field = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.AnnAssign)
                 and getattr(n.target, "id", "") == "dtype")
    call = next(n for n in ast.walk(field) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Arg")
    return ast.literal_eval(next(k.value for k in call.keywords if k.arg == "choices"))


@needs_wheel
def test_engine_dtype_is_pinned_from_the_trainer_precision(tmp_path):
    import torch

    from reflow.engines.sglang.launcher import PINNED_DTYPES, sglang_dtype

    resolve = _sglang_dtype_resolver()
    fp32_llama = {"model_type": "llama", "torch_dtype": "float32"}
    assert resolve(fp32_llama, "auto") == torch.float16  # the defect: a float32 checkpoint held as float16
    assert set(PINNED_DTYPES) == set(_wheel_dtype_choices()) - {"auto"}
    for precision, want in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        cmd = command_line(_args(dtype=sglang_dtype(precision)), python="py", secrets_dir=tmp_path)
        assert resolve(fp32_llama, cmd[cmd.index("--dtype") + 1]) == want  # what SGLang then holds
    assert "--dtype" in command_line(server_args("/m", host="h", port=1, nccl_port=2))  # never left to auto
    with pytest.raises(ValueError, match=r"dtype 'auto': pin one of .*float32 checkpoints as float16"):
        server_args("/m", host="h", port=1, nccl_port=2, dtype="auto")
    with pytest.raises(ValueError, match="trainer precision 'fp16'"):
        sglang_dtype("fp16")


DTYPE_KEY = "dtype-test-key-" + "k" * 32


@pytest.fixture(scope="module")
def fp16_engine(tiny_policy):
    """An engine that holds float16, as SGLang does for a float32 checkpoint under --dtype auto."""
    from reflow.engines.embedded.engine import EmbeddedEngine

    e = EmbeddedEngine(str(tiny_policy), "dtype-fp16", threads=1, dtype="fp16", api_key=DTYPE_KEY)
    e.ready()
    yield e
    e.shutdown()


def _pushed_fp32(engine, version: str) -> list:
    """float32 weights pushed (tensor mode, unchecked) to `engine`, which casts them to what it holds."""
    from reflow.engines.rollout_client import EngineClient
    from reflow.engines.weights.push import push_weights
    from reflow.engines.weights.settings import PushSettings
    from reflow.rl.demo_policy import build_model, build_tokenizer

    named = list(build_model(build_tokenizer(), hidden=32, layers=2, heads=2, mlp=64, seed=41).state_dict().items())
    assert {t.dtype for _, t in named} == {__import__("torch").float32}
    push_weights([EngineClient(engine.url(), timeout=60, api_key=DTYPE_KEY)], named, version,
                 PushSettings(verify="off", bucket_bytes=1 << 20))
    return named


def _auto_client(url: str):
    """A client of an engine that answers as SGLang does under --dtype auto: /server_info says "auto",
    whatever it loaded (the only part faked: the engine really holds float16)."""
    from reflow.engines.rollout_client import EngineClient

    class AutoClient(EngineClient):
        def server_info(self) -> dict:
            return {**super().server_info(), "dtype": "auto"}

    return AutoClient(url, timeout=60, api_key=DTYPE_KEY)


def _tampered(named: list, name: str) -> list:
    return [(n, t + 0.01 if n == name else t) for n, t in named]


def test_verify_compares_in_the_dtype_the_engine_reports(fp16_engine):
    from reflow.engines.rollout_client import EngineClient
    from reflow.engines.weights.push import WeightSyncError, verify_weights

    named = _pushed_fp32(fp16_engine, "pinned-v1")
    c = EngineClient(fp16_engine.url(), timeout=60, api_key=DTYPE_KEY)
    assert c.server_info()["dtype"] == "float16"  # pinned: it says what it holds
    assert verify_weights([c], named, "pinned-v1", "full") == len(named)
    name = "model.norm.weight"
    with pytest.raises(WeightSyncError, match=rf"{name}.*cast to the engine dtype: float16: max abs diff"):
        verify_weights([c], _tampered(named, name), "pinned-v1", "full")


def test_verify_against_an_engine_reporting_auto_accepts_what_auto_can_load(fp16_engine):
    """Before: an "auto" engine was compared in the pushed float32 and failed on every push."""
    from reflow.engines.weights.push import WeightSyncError, verify_weights

    named = _pushed_fp32(fp16_engine, "auto-v1")
    c = _auto_client(fp16_engine.url())
    assert verify_weights([c], named, "auto-v1", "full") == len(named)
    name = "model.norm.weight"
    with pytest.raises(WeightSyncError, match=rf"{name}.*engine dtype 'auto', so any of these: float32: .*; "
                                              r"float16: .*; bfloat16: max abs diff"):
        verify_weights([c], _tampered(named, name), "auto-v1", "full")
