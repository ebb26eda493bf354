"""User errors end the CLI with one `reflow: ...` line naming the field or file and the fix, exit
code 2, no traceback; `reflow config --check` finds each of them with the preflight (infra/ops/preflight.py),
before Ray or Prefect start. The CLI runs in-process here (its real parser, config loader and
preflight: no Ray, no Prefect, so these are fast); tests/test_preflight_cli.py runs it as a
subprocess, where `train` shows that it checks the same before starting anything."""
from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest

from reflow.flows.cli import main
from tests.ckpt_fixtures import free_port, s3_with_bucket, write_config
from tests.streams import without_ray_lines


def check(capsys, cfg: Path, *overrides: str) -> tuple[int, str, str]:
    """`reflow config -c cfg --check overrides...`: (exit code, stdout, stderr)."""
    try:
        main(["config", "-c", str(cfg), "--check", *overrides])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, without_ray_lines(err)


def assert_one_line(code: int, out: str, err: str, line: str) -> None:
    """Exit 2, nothing on stdout, exactly `line` on stderr (so no traceback and no repeats)."""
    assert (code, out) == (2, ""), (code, out, err)
    assert err == line + "\n", err


@pytest.fixture
def good(tmp_path, tiny_policy) -> Path:
    """A config that passes every check: the tiny policy, prompts from a jsonl, a tests reward."""
    rows = [{"q": f"{i}+1=", "a": str(i + 1)} for i in range(12)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return write_config(tmp_path / "good.yaml", tiny_policy, f"file://{tmp_path}/runs", "pre",
                        **{"data.task": "file", "data.path": str(tmp_path / "p.jsonl"), "data.prompt_key": "q",
                           "data.label_key": "a", "data.num_eval": 4})


def test_a_good_config_passes_and_leaves_nothing_in_storage(capsys, good, tmp_path):
    code, out, err = check(capsys, good)
    assert code == 0, err
    assert out.startswith("experiment: pre\n")  # the resolved config, as without --check
    assert err.startswith("reflow: preflight passed in "), err
    for part in ("model.path: ", "(8 train / 4 held-out rows; first rows valid)", "eval set heldout",
                 f"storage: file://{tmp_path}/runs/pre (writable)"):
        assert part in err, err
    assert not (tmp_path / "runs").exists()  # the probe's folders are removed again


def test_missing_config_file(capsys, tmp_path):
    code, out, err = check(capsys, tmp_path / "nope.yaml")
    assert_one_line(code, out, err, f"reflow: config file '{tmp_path}/nope.yaml' does not exist (see configs/ for examples)")


def test_invalid_value_names_the_field(capsys, good):
    code, out, err = check(capsys, good, "rollout.top_p=0")
    assert (code, out) == (2, "")
    # One `reflow:` line; pydantic may find several fields at once, one indented line each.
    assert err == (f"reflow: invalid configuration ({good} + overrides):\n"
                   f"  rollout.top_p: Input should be greater than 0 (got 0)\n"), err


def test_missing_model_folder(capsys, good, tmp_path):
    code, out, err = check(capsys, good, f"model.path={tmp_path}/no-model")
    assert_one_line(code, out, err,
                    f"reflow: model.path: checkpoint folder '{tmp_path}/no-model' does not exist. Point model.path "
                    f"at an HF checkpoint folder (config.json + *.safetensors + tokenizer files), or run `reflow "
                    f"bootstrap` to build the demo policy.")


def test_model_folder_without_tokenizer(capsys, good, tmp_path, tiny_policy):
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for f in tiny_policy.iterdir():
        if f.name == "config.json" or f.suffix == ".safetensors":
            shutil.copy(f, folder / f.name)
    code, out, err = check(capsys, good, f"model.path={folder}")
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert err.startswith(f"reflow: model.path='{folder}': its tokenizer does not load ("), err
    assert err.endswith("save it into the folder with tokenizer.save_pretrained\n"), err


@pytest.mark.parametrize("field,override", [("data.path", "data.path={}"),
                                            ("eval.sets.0.source", "eval.sets=[{{name: extra, source: {}}}]")])
def test_missing_data_or_eval_file(capsys, good, tmp_path, field, override):
    code, out, err = check(capsys, good, override.format(tmp_path / "gone.parquet"))
    assert_one_line(code, out, err,
                    f"reflow: {field}='{tmp_path}/gone.parquet': no such file; point {field} at an existing "
                    f"jsonl or parquet file (a local path or a URL)")


def test_data_without_the_named_column(capsys, good, tmp_path):
    code, out, err = check(capsys, good, "data.prompt_key=question")
    assert_one_line(code, out, err,
                    f"reflow: '{tmp_path}/p.jsonl' has no column 'question' (data.prompt_key); its columns are "
                    f"['q', 'a']: set data.prompt_key to the one holding the prompt text")


def test_reward_module_not_found(capsys, good):
    code, out, err = check(capsys, good, "data.reward_fn=no_such_verifiers:score")
    assert_one_line(code, out, err,
                    "reflow: data.reward_fn='no_such_verifiers:score': module 'no_such_verifiers' not found (No "
                    "module named 'no_such_verifiers'); is it on PYTHONPATH of every process that scores rollouts?")


def _module(tmp_path: Path, monkeypatch, name: str, source: str) -> None:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))


def test_reward_module_whose_import_fails(capsys, good, tmp_path, monkeypatch):
    """A dependency missing inside the module is named as such, not as the module being absent."""
    _module(tmp_path, monkeypatch, "needs_dep", "import no_such_dependency\ndef score(p, r, l):\n    return 0.0\n")
    code, out, err = check(capsys, good, "data.reward_fn=needs_dep:score")
    assert_one_line(code, out, err,
                    "reflow: data.reward_fn='needs_dep:score': module 'needs_dep' imports 'no_such_dependency', "
                    "which is not installed; install it where rollouts are scored")
    _module(tmp_path, monkeypatch, "broken", "def score(p, r, l)\n    return 0.0\n")
    code, out, err = check(capsys, good, "data.reward_fn=broken:score")
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert err.startswith("reflow: data.reward_fn='broken:score': importing module 'broken' raised SyntaxError: "), err
    _module(tmp_path, monkeypatch, "script", "import sys\nsys.exit('usage: script.py FILE')\n")  # a script's exit
    code, out, err = check(capsys, good, "data.reward_fn=script:score")
    assert_one_line(code, out, err, "reflow: data.reward_fn='script:score': importing module 'script' raised SystemExit: "
                                    "usage: script.py FILE; fix that module (run `python -c 'import script'` to see where)")


def test_reward_function_that_fails_on_a_row(capsys, good, tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, "strict_reward", "def score(p, r, l):\n    return float(r)\n")
    code, out, err = check(capsys, good, "data.reward_fn=strict_reward:score")
    assert_one_line(code, out, err,
                    f"reflow: data.reward_fn='strict_reward:score' fails on the first row of data.path="
                    f"'{tmp_path}/p.jsonl' with an empty response: reward function strict_reward:score raised "
                    f"ValueError: could not convert string to float: '' on sample 0 (prompt='0+1=', response=''). "
                    f"Make it return a float for any response")


@pytest.mark.parametrize("body, what", [
    ("return 10**400", f"returned int 1{'0' * 59}...(+341 chars), too large for a float"),
    ("raise SystemExit(0)", "raised SystemExit: 0"),
    ("while True:\n        pass", "did not return within 0.3 s"),
])
def test_reward_function_that_overflows_exits_or_hangs(capsys, good, tmp_path, monkeypatch, body, what):
    """Each is a failure of the reward function: one line, exit 2 (SystemExit(0) ended `--check` with exit 0 and
    no output, 10**400 with an OverflowError traceback, and a hang hung it)."""
    name = f"odd_reward_{body.split()[0]}"  # one module per case: an imported module stays imported
    _module(tmp_path, monkeypatch, name, f"def score(p, r, l):\n    {body}\n")
    code, out, err = check(capsys, good, f"data.reward_fn={name}:score", "reward.fn_timeout_s=0.3")
    assert (code, out) == (2, "") and err.count("\n") == 1, (code, out, err)
    assert err.startswith(f"reflow: data.reward_fn='{name}:score' fails on the first row of data.path="), err
    assert f"reward function {name}:score {what}" in err and "sample 0 (prompt='0+1=', response='')" in err, err


def test_nan_labels_are_refused_naming_the_line(capsys, good, tmp_path):
    """A NaN (or Infinity) label is not JSON and no ground truth; a missing one (null) stays allowed."""
    rows = [{"q": f"{i}+1=", "a": str(i + 1)} for i in range(12)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "p.jsonl").write_text(text + '{"q": "x", "a": NaN}\n{"q": "y", "a": null}\n')
    code, out, err = check(capsys, good)
    assert_one_line(code, out, err, f"reflow: '{tmp_path}/p.jsonl' line 13: the label (column 'a', data.label_key) "
                                    f"is NaN, not a value; write null for a row without a label")


def test_eval_source_without_the_named_column(capsys, good, tmp_path):
    code, out, err = check(capsys, good, f"eval.sets=[{{name: extra, source: {tmp_path}/p.jsonl, label_key: answer}}]")
    assert_one_line(code, out, err,
                    f"reflow: eval.sets.0.source: '{tmp_path}/p.jsonl' has no column 'answer' (eval.sets.0.label_key); "
                    f"its columns are ['q', 'a']: set eval.sets.0.label_key to the one holding the ground truth")


def test_builtin_and_http_rewards_are_checked_instead_of_reward_fn(capsys, good):
    """With reward.type builtin or http, data.reward_fn does not score (here it names no module): the
    verifier scores a row, and the reward server is asked once (no retries) for the data and each set."""
    from tests.test_reward_sources import _Server

    code, out, err = check(capsys, good, "data.reward_fn=no_such_verifiers:score", "reward.type=builtin")
    assert code == 0, err
    assert "first rows valid); reward.builtin: reflow.rl.verifiers:exact_match (scores a row)" in err, err
    server = _Server()
    try:
        code, out, err = check(capsys, good, "data.reward_fn=no_such_verifiers:score", "reward.type=http",
                               f"reward.url={server.url('/score')}")
        assert code == 0, err
        assert f"reward.url: {server.url('/score')} (scores a row)" in err, err
        assert [r[:2] for r in server.requests] == [("/score", 1)] * 2  # data + the held-out eval set
        server.fail, server.fail_with = {"/down": 1}, {"/down": 503}
        code, out, err = check(capsys, good, "reward.type=http", f"reward.url={server.url('/down')}")
        assert (code, out) == (2, "") and err.count("\n") == 1, err
        assert err.startswith(f"reflow: reward.url='{server.url('/down')}' did not score the first row of data.path="), err
        assert "(samples 0..0) failed 1 times; last: " in err, err
        assert [r[0] for r in server.requests].count("/down") == 1  # not retried
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()


def test_storage_that_cannot_be_written(capsys, good, tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    code, out, err = check(capsys, good, f"storage.root={tmp_path}/a-file/runs")
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert err.startswith(f"reflow: storage preflight failed: cannot write a probe object under "
                          f"file://{tmp_path}/a-file/runs/pre: "), err
    assert "point storage.root elsewhere" in err, err
    assert (tmp_path / "a-file").is_file()  # nothing was made in its place


def test_storage_endpoint_that_does_not_answer(capsys, good, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code, out, err = check(capsys, good, "storage.root=s3://reflow-test/runs", f"storage.endpoint_url={url}")
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert err.startswith(f"reflow: storage preflight failed: cannot write a probe object under s3://reflow-test/runs/pre "
                          f"(endpoint {url}): EndpointConnectionError: "), err
    assert err.endswith(f"the endpoint is reachable and the AWS credentials (env, ~/.aws, role) may write there. (set "
                        f"by storage.root='s3://reflow-test/runs', storage.endpoint_url='{url}')\n"), err


def test_data_missing_in_object_storage(capsys, good):
    """On a real S3 server (moto on loopback): the data URL is read through the run's storage access."""
    with s3_with_bucket("reflow-preflight") as s3:
        code, out, err = check(capsys, good, "data.path=s3://reflow-preflight/none.jsonl",
                               f"storage.endpoint_url={s3.url}")
    assert_one_line(code, out, err, "reflow: data.path='s3://reflow-preflight/none.jsonl': no such file; point "
                                    "data.path at an existing jsonl or parquet file (a local path or a URL)")


def test_resume_that_the_run_would_refuse(capsys, good, tmp_path):
    from reflow.infra.store import checkpoint as ckpt
    from reflow.infra.store.storage import ExperimentStore

    gone = f"file://{tmp_path}/runs/pre/checkpoints/iter_000003"
    code, out, err = check(capsys, good, f"resume={gone}")
    assert_one_line(code, out, err, f"reflow: resume: {gone}: no COMMITTED marker (the save did not finish); give "
                                    f"the URL of a committed checkpoint (…/checkpoints/iter_NNNNNN) or resume=auto")
    store = ExperimentStore.open(f"file://{tmp_path}/runs", "pre")
    store.write_text(ckpt.at_step(store, 1).rel(ckpt.MARKER), "0" * 64)  # a committed checkpoint, as far as `never` looks
    code, out, err = check(capsys, good, "resume=never")
    assert_one_line(code, out, err, f"reflow: resume=never but file://{tmp_path}/runs/pre/checkpoints already holds "
                                    f"committed checkpoints; use resume=auto to continue, or a new experiment name "
                                    f"to start over")


def test_debug_raises_with_the_traceback(good, tmp_path):
    from reflow.infra.ops.preflight import PreflightError

    with pytest.raises(PreflightError, match="data.path="):
        main(["config", "-c", str(good), "--check", "--debug", f"data.path={tmp_path}/missing.jsonl"])


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs of this test's own (root, as CI runs): the tiny policy's checkpoints (~0.4 MB each) fit 4 times."""
    import subprocess

    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mnt)], capture_output=True,
                       text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip() or r.returncode}): needs root")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_checkpoints_that_cannot_fit_the_disk_stop_the_run(capsys, good, small_disk):
    from reflow.infra.config.schema import load_config
    from reflow.infra.ops.preflight import checkpoint_bytes, model_bytes

    code, out, err = check(capsys, good, f"storage.root=file://{small_disk}", "checkpoint.keep_last=3")
    assert code == 0, err
    assert "disk: 2.0 MiB free for ~" in err and "(3 kept + 1)" in err, err
    code, out, err = check(capsys, good, f"storage.root=file://{small_disk}", "checkpoint.keep_last=9")
    assert (code, out) == (2, "")
    line = err.strip()
    assert "\n" not in line and line.startswith(f"reflow: storage.root='file://{small_disk}' has 2.0 MiB free, "), err
    assert "checkpoint.keep_last=9 checkpoints and the one being written need ~" in line, line
    assert "lower checkpoint.keep_last, or point storage.root at a larger disk or a bucket" in line, line
    assert list(small_disk.iterdir()) == []  # nothing written
    # The estimate against a real checkpoint of the tiny policy (weights 90 kB, optimizer state 292 kB: 382 kB):
    cfg = load_config(str(good), [])
    params, _ = model_bytes(cfg.model.path)
    assert 0.9 * 382_000 < checkpoint_bytes(cfg, params) < 1.1 * 382_000, (params, checkpoint_bytes(cfg, params))


def test_a_run_that_saves_nothing_is_not_refused_for_the_disk(capsys, good, small_disk):
    """checkpoint.save_last=false without save_interval, save_every_minutes or a sentinel: no checkpoint is
    scheduled, so checkpoints that could not fit are no reason to stop (a 7B throughput run on a 64 GB disk)."""
    code, out, err = check(capsys, good, f"storage.root=file://{small_disk}", "checkpoint.keep_last=9",
                           "checkpoint.save_last=false", "checkpoint.save_every_minutes=null",
                           "checkpoint.save_interval=null")
    assert code == 0, err
    assert "disk: no checkpoint scheduled (checkpoint.save_last=false" in err, err


def test_a_trainer_rank_that_cannot_fit_the_configured_gpu_stops_the_run(capsys, good):
    """cluster.gpu_memory_gib against the estimate (engines/train/memory.py) of the tiny policy's rank."""
    code, out, err = check(capsys, good, "cluster.gpu_memory_gib=80")
    assert code == 0, err
    assert "gpu memory: a trainer rank ~" in err and "of 80.00 GiB (weights " in err, err
    code, out, err = check(capsys, good, "cluster.gpu_memory_gib=0.0001", "trainer.micro_batch_size=64",
                           "trainer.activation_checkpointing=off", "data.max_prompt_len=60", "rollout.max_new_tokens=4")
    assert (code, out) == (2, "")
    line = err.strip()
    assert "\n" not in line and line.startswith("reflow: a trainer rank needs ~"), err
    for part in ("of a 0.1 MiB GPU (weights 0.1 MiB, gradients 0.1 MiB, optimizer state 0.2 MiB, activations of a "
                 "4096-token micro-batch ", "lower trainer.micro_batch_size (or set trainer.max_tokens_per_micro_batch), "
                 "set trainer.activation_checkpointing=on, raise trainer.zero_stage, or add trainer.num_ranks"):
        assert part in line, line
    # auto: the rank would checkpoint at this size (the estimate is over half the GPU), so the preflight counts it so
    code, out, err = check(capsys, good, "cluster.gpu_memory_gib=0.0001")
    assert code == 2 and "(checkpointed)" in err and "activation_checkpointing=on" not in err, err
    # Checkpointing and ZeRO-3 are already what it would advise: only the micro-batch and the ranks are named.
    code, out, err = check(capsys, good, "cluster.gpu_memory_gib=0.0001", "trainer.activation_checkpointing=on",
                           "trainer.zero_stage=3", "trainer.max_tokens_per_micro_batch=200")
    assert "(checkpointed)" in err and err.strip().endswith(
        "lower trainer.max_tokens_per_micro_batch, or add trainer.num_ranks"), err
    code, out, err = check(capsys, good, "cluster.gpu_memory_gib=0.0001", "cluster.gpus=off")
    assert code == 0 and "gpu memory" not in err, err  # a CPU run has no GPU to fit
    # Colocated without hand-overs, the engine keeps its share beside the rank: the embedded engine's KV budget
    # (rollout.kv_mem_fraction) as SGLang's mem_fraction_static, else its weights alone
    beside = ("cluster.gpu_memory_gib=80", "cluster.colocate=true", "cluster.hand_over=false")
    code, out, err = check(capsys, good, *beside, "rollout.kv_mem_fraction=0.5")
    assert code == 0 and ", a colocated engine 40.00 GiB)" in err, err
    code, out, err = check(capsys, good, *beside)
    assert code == 0 and ", a colocated engine 40.00 GiB)" not in err and ", a colocated engine " in err, err
