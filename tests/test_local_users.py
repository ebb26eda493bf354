"""Another account on the same machine (uid 65534) cannot reach a run's Ray cluster or its weights
(issue 51, points 2 and 3).

Point 2: Ray makes its temp dir, session_*, sockets/ and logs/ mode 0777 (no sticky bit), so whatever
sits there (logs, the run's auth_token, the Unix sockets) was open to every local user. reflow puts
Ray's temp dir inside a fresh 0700 folder; each way reflow starts Ray is checked here as another uid.
Point 3: predictable /tmp paths (the default weight-push folder, the merged copy of a LoRA checkpoint)
that another user could create first are private folders now, and reflow's engine loads a disk push
only when its files match the digests the pusher computed.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

from reflow.infra.cluster import ray_head
from tests.other_user import as_other_user, attempts, needs_root
from tests.test_engine import fresh_engine as _fresh_engine_fixture

fresh_engine = _fresh_engine_fixture  # test_engine's engine whose weights a test may change, reached with its KEY

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unix_connect(path: str) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)


def _replace_with_own(path: str) -> None:
    """Put a file of one's own at `path` (what a user does to swap the run's auth token)."""
    mine = f"/tmp/reflow-test-other-user-{os.getpid()}"
    with open(mine, "w") as f:
        f.write("0" * 64)
    try:
        os.replace(mine, path)
    finally:
        if os.path.exists(mine):
            os.unlink(mine)


def _ray_tree_attempts(temp: str, session: str, token: str) -> dict[str, str]:
    """As another user: everything that must fail against a running cluster's temp tree (listed here as
    the run's user first, so the other user is told what to try)."""
    logs, sockets = Path(session) / "logs", Path(session) / "sockets"
    log_file = max((p for p in logs.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    socks = sorted(str(p) for p in sockets.iterdir() if p.is_socket())
    assert socks, f"no Unix sockets under {sockets}: the check would pass vacuously"
    tries = {"list Ray's temp dir": lambda: os.listdir(temp), "list the session folder": lambda: os.listdir(session),
             "list logs/": lambda: os.listdir(logs), f"read logs/{log_file.name}": lambda: log_file.read_bytes()[:32768],
             "replace auth_token": lambda: _replace_with_own(token), "delete auth_token": lambda: os.unlink(token)}
    tries.update({f"connect to sockets/{Path(s).name}": (lambda s=s: _unix_connect(s)) for s in socks})
    return as_other_user(attempts, {"sanity: list /tmp": lambda: os.listdir("/tmp"), **tries})


def _all_refused(found: dict[str, str]) -> None:
    assert found.pop("uid") == "65534" and found.pop("sanity: list /tmp") == "succeeded", found
    allowed = {k: v for k, v in found.items() if v != "PermissionError"}
    assert not allowed, f"another local user could: {allowed}"


def _refused(tries: dict) -> None:
    """Every attempt, made as another user, fails with PermissionError (and that user could act at all)."""
    _all_refused(as_other_user(attempts, {"sanity: list /tmp": lambda: os.listdir("/tmp"), **tries}))


@needs_root
@pytest.mark.slow  # a Ray cluster in a separate driver, ~10 s
def test_local_cluster_of_a_flow_is_closed_to_other_users(tmp_path):
    """No RAY_ADDRESS: the cluster `ray_connect.connect` starts inside the run's driver (a separate process)."""
    code = textwrap.dedent("""
        import json, os, sys, ray
        from reflow.infra.cluster.ray_connect import connect
        connect(None, 1, "reflow-local-users")
        assert ray.get(ray.remote(lambda: 42).remote()) == 42  # a worker has started and logged
        node = ray._private.worker._global_node
        print("PATHS", json.dumps({"temp": node.get_temp_dir_path(), "session": node.get_session_dir_path(),
                                   "token": os.environ["RAY_AUTH_TOKEN_PATH"]}), flush=True)
        sys.stdin.readline()
        ray.shutdown()
    """)
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    p = subprocess.Popen([sys.executable, "-c", code], env={**base, "HOME": str(tmp_path)}, cwd=REPO, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = next((x for x in p.stdout if x.startswith("PATHS ")), None)
        assert line, p.stderr.read()[-3000:] if p.poll() is not None else "the driver printed no paths"
        paths = json.loads(line.removeprefix("PATHS "))
        _all_refused(_ray_tree_attempts(paths["temp"], paths["session"], paths["token"]))
    finally:
        p.communicate("\n", timeout=60)


@needs_root
@pytest.mark.slow  # a `ray start` head, ~8 s
def test_cluster_up_head_is_closed_to_other_users(tmp_path):
    """`reflow cluster up`: the long-lived head's temp tree (its token lives in the state folder)."""
    info, started = ray_head.up(tmp_path / "cluster", port=_free_port(), num_cpus=1)
    assert started
    try:
        session = Path(info.temp_dir) / "session_latest"
        deadline = time.monotonic() + 90  # the port opens before the raylet has made its sockets
        while not any(p.is_socket() for p in (session / "sockets").iterdir()) and time.monotonic() < deadline:
            time.sleep(0.2)
        _all_refused(_ray_tree_attempts(info.temp_dir, str(session.resolve()), info.token_path))
    finally:
        ray_head.down(tmp_path / "cluster")


# ---------------------------------------------------------------- point 3: weights on disk


def _write(marker: str):
    def write(out: Path) -> None:
        (out / "model.safetensors").write_text(marker)

    return write


@needs_root
def test_default_push_folder_cannot_be_made_first_by_another_user():
    """weight_sync.disk_dir unset: the folder engines load from was /tmp/reflow-weight-push-<pid>, a name
    another user could create first (and own: then swap the weights the engines load)."""
    from reflow.engines.weights.push import publish_weights

    squat = Path(tempfile.gettempdir()) / f"reflow-weight-push-{os.getpid()}"

    def make_it_first() -> None:
        (squat / "reflow-weight-push").mkdir(parents=True)
        for d in (squat, squat / "reflow-weight-push"):
            d.chmod(0o777)

    as_other_user(make_it_first)
    try:
        pushed = Path(publish_weights(_write("the trainer's"), None, "1").path)
        weights = pushed / "model.safetensors"
        _refused({"list the push folder": lambda: os.listdir(pushed),
                  "read the pushed weights": weights.read_bytes,
                  "replace the pushed weights": lambda: _replace_with_own(str(weights)),
                  "move the push folder away": lambda: os.rename(pushed.parent, f"{pushed.parent}-moved"),
                  "move the version away": lambda: os.rename(pushed, f"{pushed}-moved")})
        assert weights.read_text() == "the trainer's"
    finally:
        shutil.rmtree(squat, ignore_errors=True)


@pytest.mark.slow  # ~2.3 s of CPU: make test-fast stays under a minute (a child process)
def test_default_push_folder_is_private_reused_and_removed_at_exit():
    """One private folder per process for all its pushes (older versions go as before); gone when it exits."""
    code = textwrap.dedent("""
        import json, os
        from pathlib import Path
        from reflow.engines.weights.push import publish_weights
        def write(out): (out / "model.safetensors").write_text("w")
        a, b = (Path(publish_weights(write, None, v).path) for v in ("1", "2"))
        roots = [p.parent.parent for p in (a, b)]
        print("RESULT", json.dumps({"roots": [str(r) for r in roots], "mode": oct(roots[0].stat().st_mode & 0o777),
                                    "a_gone": not a.exists(), "b": b.is_dir()}))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(line.removeprefix("RESULT "))
    assert res["roots"][0] == res["roots"][1] and res["mode"] == "0o700", res
    assert res["a_gone"] and res["b"], res
    assert not Path(res["roots"][0]).exists(), "the default push folder outlived its process"


def test_engine_loads_a_disk_push_only_as_the_pusher_wrote_it(fresh_engine, tiny_policy, tmp_path):
    """Whoever can write weight_sync.disk_dir (a shared folder) swaps the weights between the trainer's
    write and the engine's load: reflow's engine refuses them, at every push (not only at the pushes
    verify_every samples), and keeps serving the weights it had."""
    from reflow.engines.hf_io import load_tokenizer
    from reflow.engines.rollout_client import EngineClient, EngineError
    from reflow.engines.weights.push import publish_weights, push_weights
    from reflow.engines.weights.settings import PushSettings
    from reflow.rl.demo_policy import build_model, save_policy
    from tests.test_engine import KEY

    tok = load_tokenizer(str(tiny_policy))
    new, other = (build_model(tok, hidden=32, layers=2, heads=2, mlp=64, seed=s) for s in (5, 6))
    named = [(n, t.detach()) for n, t in new.state_dict().items()]
    c = EngineClient(fresh_engine.url(), api_key=KEY)
    before = c.get_weights_by_name("model.layers.0.self_attn.q_proj.weight", truncate_size=2)
    settings = PushSettings(mode="disk", verify="full", verify_every=10, disk_dir=str(tmp_path / "shared"))

    pushed = publish_weights(lambda out: save_policy(new, tok, out), settings.disk_dir, "1")
    save_policy(other, tok, tmp_path / "other")
    shutil.copy(tmp_path / "other" / "model.safetensors", Path(pushed.path) / "model.safetensors")
    with pytest.raises(EngineError, match="model.safetensors does not match"):
        push_weights([c], named, "1", settings, model_path=pushed.path, model_files=pushed.files)
    assert c.model_info()["weight_version"] != "1"
    assert c.get_weights_by_name("model.layers.0.self_attn.q_proj.weight", truncate_size=2) == before

    pushed = publish_weights(lambda out: save_policy(new, tok, out), settings.disk_dir, "2")
    (Path(pushed.path) / "extra.safetensors").write_bytes(b"")  # a file nobody recorded is refused too
    with pytest.raises(EngineError, match="holds extra.safetensors"):
        push_weights([c], named, "2", settings, model_path=pushed.path, model_files=pushed.files)
    (Path(pushed.path) / "extra.safetensors").unlink()

    stats = push_weights([c], named, "2", settings, model_path=pushed.path, model_files=pushed.files)
    assert stats["disk_files_checked"] == 1 and c.model_info()["weight_version"] == "2"
    got = c.get_weights_by_name("model.layers.0.self_attn.q_proj.weight", truncate_size=2)
    assert got == new.model.layers[0].self_attn.q_proj.weight[:2].tolist()


@needs_root
def test_merged_copy_of_a_lora_checkpoint_is_never_one_another_user_made(tiny_policy, tmp_path):
    """Evaluating a LoRA checkpoint merges it into a local folder; that folder was /tmp/reflow-merged-<digest>,
    reused when it existed: another user who made it first had their folder evaluated as the model."""
    from reflow.infra.config.schema import load_config
    from reflow.infra.store import checkpoint as ckpt
    from reflow.infra.store import lineage
    from reflow.tasks.checkpoint import resolve_checkpoint
    from tests.ckpt_fixtures import final_weights
    from tests.test_lora import lora_checkpoint

    model, store, url = lora_checkpoint(tiny_policy, tmp_path)
    cfg = load_config(None, ["experiment=lora", f"storage.root=file://{tmp_path}/runs"])

    squat = Path(tempfile.gettempdir()) / f"reflow-merged-{lineage.manifest_sha256(ckpt.from_url(url, store))[:24]}"

    def make_it_first() -> None:
        squat.mkdir()
        squat.chmod(0o777)

    as_other_user(make_it_first)
    try:
        shutil.copytree(tiny_policy, squat, dirs_exist_ok=True)  # stands for the other user's model: not the merge
        evaluated = Path(resolve_checkpoint.fn(cfg, url)["model"])
        assert squat not in (evaluated, *evaluated.parents), f"evaluated {evaluated}, the other user's folder"
        expected = model.merge_and_unload().state_dict()
        got = final_weights(evaluated)
        assert "model.layers.1.self_attn.q_proj.weight" in got and all(torch.equal(got[n], expected[n]) for n in got)
        assert Path(resolve_checkpoint.fn(cfg, "latest")["model"]) == evaluated  # merged once per checkpoint
        _refused({"list the merged model": lambda: os.listdir(evaluated),
                  "read its config": (evaluated / "config.json").read_bytes})
    finally:
        shutil.rmtree(squat, ignore_errors=True)
