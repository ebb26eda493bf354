"""Secrets where they should not be (issue 51, point 7): a secret under a wrong key is not echoed by the config's
error, a URL that carries a token in its fragment or path is refused before it is saved (config.yaml, Prefect
parameters), and the checkpoint-signing key stays in the driver's memory: Ray's processes never get it.
Fast tier, except the one test that starts a run's own local Ray cluster (slow)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from reflow.infra.config.schema import ConfigError, load_config
from reflow.infra.store import signing
from reflow.infra.store.storage import ExperimentStore, StorageError

REPO = Path(__file__).resolve().parents[1]
SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYzEXAMPLEKEY"

# ---------------------------------------------------------------- a secret under a wrong key


@pytest.mark.parametrize("override", [f"storage.aws_secret_access_key={SECRET}", f"reward.token={SECRET}",
                                      f"reward.api_key={SECRET}", f"storage.password={SECRET}",
                                      f"tracking.wandb_api_key={SECRET}", f"auth={SECRET}",
                                      f"trainer.lrr={SECRET}"])
def test_a_value_under_an_unknown_key_is_not_echoed(override):
    """A secret put under a key reflow does not have (a typo, or a guess that the config takes credentials) is
    refused naming the key, never showing the value: the error goes to terminals, logs and flow-run states."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert SECRET not in msg and SECRET[:12] not in msg, msg
    assert override.split("=")[0] in msg, msg


def test_a_secret_under_a_wrong_key_in_a_file_is_not_echoed(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(f"storage:\n  aws_secret_access_key: {SECRET}\nreward:\n  token: {SECRET}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert SECRET not in msg and "storage.aws_secret_access_key" in msg and "reward.token" in msg, msg


@pytest.mark.parametrize("override", [f"reward.token_env={{a: {SECRET}}}", "reward.token_env=12"])
def test_a_wrongly_typed_value_of_a_credential_named_key_is_redacted(override):
    """reward.token_env is a real key (the *name* of a variable); a wrong value there may be the token itself."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert SECRET not in msg and "12" not in msg.split("reward.token_env", 1)[1], msg
    assert "reward.token_env" in msg, msg


def test_ordinary_wrong_values_are_still_echoed():
    """The echo stays where it helps: a value of a known, non-credential field."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.lr=fast"])
    assert "(got 'fast')" in str(e.value), str(e.value)


# ---------------------------------------------------------------- tokens in fragments and paths of URLs

LEAKY = [
    f"https://host/data.jsonl#token={SECRET}",
    f"s3://bucket/data.jsonl#access_token={SECRET}&token_type=bearer",
    f"https://host/x.parquet?v=1#sig={SECRET}",
    f"https://host/api/token/{SECRET}/data.jsonl",
    f"s3://bucket/token={SECRET}/data.jsonl",
    f"https://host/v1/apikey/{SECRET}",
]
FIELDS = ["model.path", "data.path", "weight_sync.disk_dir", "storage.root", "resume"]


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("url", LEAKY, ids=range(len(LEAKY)))
def test_tokens_in_fragments_and_paths_are_refused(field, url):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{field}={url}"])
    msg = str(e.value)
    assert SECRET not in msg and SECRET[:12] not in msg, msg
    assert field in msg and "credentials" in msg, msg


@pytest.mark.parametrize("url", LEAKY, ids=range(len(LEAKY)))
def test_eval_set_source_and_store_root_share_the_rule(url):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"eval.sets=[{{name: gsm, source: '{url}', temperature: 0}}]"])
    assert SECRET not in str(e.value) and "eval.sets.0.source" in str(e.value), str(e.value)
    with pytest.raises(StorageError, match="embeds credentials") as e2:
        ExperimentStore.open(url, "exp")
    assert SECRET not in str(e2.value)


@pytest.mark.parametrize("url", [f"https://rm.example/score#token={SECRET}", "https://rm.example/score#v2",
                                 f"https://rm.example/score?access_token={SECRET}",
                                 f"https://rm.example/token/{SECRET}"])
def test_reward_url_refuses_fragments_and_tokens(url):
    """A fragment never reaches the server, so on reward.url it can only be a token pasted in the wrong place:
    any fragment is refused, and the error points at reward.token_env."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["reward.type=http", f"reward.url={url}"])
    msg = str(e.value)
    assert SECRET not in msg and "reward.url" in msg and "reward.token_env" in msg, msg


def test_a_reward_url_of_the_wrong_scheme_is_not_echoed_with_its_password():
    """reward.type=http refuses a URL that is not http(s) quoting it; never with its user:password."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["reward.type=http", f"reward.url=ftp://me:{SECRET}@rm.example/score"])
    assert SECRET not in str(e.value) and "http:// or https://" in str(e.value), str(e.value)


@pytest.mark.parametrize("url", ["s3://bucket/tokenizers/x.jsonl", "s3://bucket/token/short/x.jsonl",
                                 "https://host/models/tokenizer.json", "s3://bucket/date=2024-01-01/x.parquet",
                                 "file:///data/run#1/x.jsonl", "/data/run#1/x.jsonl",
                                 "s3://bucket/runs/3f2a9c1b7d4e5f60718293a4b5c6d7e8/x.jsonl"])
def test_ordinary_urls_still_validate(url):
    cfg = load_config(None, [f"data.path={url}", "reward.type=http", "reward.url=https://rm.example/v1/score"])
    assert cfg.data.path == url


def test_text_fields_with_a_hash_still_validate():
    """Every string of the config is checked for credentials, prompts included: a '#' in prose is no URL."""
    prompt = "Answer after '####'. See https://docs.python.org/3/library/re.html#re.sub for the rules."
    assert load_config(None, [f"data.system_prompt={prompt}"]).data.system_prompt == prompt


# ---------------------------------------------------------------- the signing key stays on the driver

KEY = "k" * 16 + "0123456789abcdef0123"


@pytest.mark.slow
def test_ray_processes_of_a_run_never_get_the_signing_key(tmp_path):
    """A run's own local cluster (infra/ray_connect.connect, as a flow starts it) in a fresh process whose
    environment holds REFLOW_CHECKPOINT_KEY: no Ray task or actor sees the key, while the driver's keyring
    still signs and verifies with it. Its workers get the run's worker environment (ray_connect.worker_env) by
    inheritance, with no job runtime_env (which would start every worker through Ray's setup_worker.py), and
    the driver's own environment is left as it was."""
    code = textwrap.dedent("""
        import hashlib, hmac, json, os, sys, ray
        from reflow.infra.store import signing
        from reflow.infra.cluster.ray_connect import connect
        KEY = sys.argv[1]  # to look for the key's value under any name
        connect(None, 1, "reflow-keys")

        @ray.remote
        class Probe:
            def env(self):
                return {k: v for k, v in os.environ.items() if v == KEY or k == signing.KEY_ENV}

            def worker_env(self):
                return ({k: os.environ.get(k) for k in ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS")},
                        ray.get_runtime_context().runtime_env)

        probe = Probe.remote()
        task = ray.get(ray.remote(lambda: {k: v for k, v in os.environ.items() if k == signing.KEY_ENV}).remote())
        keys = signing.keyring("exp")
        kid, key = keys.signing_key()
        mac = hmac.new(key, b"manifest", hashlib.sha256).hexdigest()
        found = keys.find(kid)
        print("RESULT", json.dumps({"actor": ray.get(probe.env.remote()), "task": task,
                                    "driver_env": signing.KEY_ENV in os.environ, "kid": kid,
                                    "verified": found is not None and hmac.compare_digest(
                                        hmac.new(found[0], b"manifest", hashlib.sha256).hexdigest(), mac),
                                    "source": keys.source, "worker_env": ray.get(probe.worker_env.remote()),
                                    "driver_verbosity": os.environ.get("TRANSFORMERS_VERBOSITY")}))
        ray.shutdown()
    """)
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("RAY_") and k not in ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS")}
    env = {**base, "HOME": str(tmp_path), signing.KEY_ENV: KEY, signing.KEYS_DIR_ENV: str(tmp_path / "keys")}
    p = subprocess.run([sys.executable, "-c", code, KEY], env=env, capture_output=True, text=True, timeout=180, cwd=REPO)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(line.removeprefix("RESULT "))
    assert res["actor"] == {} and res["task"] == {}, res
    assert not res["driver_env"], "the driver kept the key in its environment, where its children inherit it"
    assert res["kid"] == signing.key_id(KEY.encode()) and res["verified"], res
    assert signing.KEY_ENV in res["source"], res
    seen, runtime_env = res["worker_env"]
    assert seen == {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}, res
    assert runtime_env == {}, res
    assert res["driver_verbosity"] is None, res


def test_the_driver_holds_the_key_after_taking_it_from_the_environment(monkeypatch, tmp_path):
    """`reflow train` resuming with the key from the environment: once taken out of os.environ (before Ray or
    Prefect's server start), the keyring still finds it."""
    monkeypatch.setenv(signing.KEYS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(signing.KEY_ENV, KEY)
    monkeypatch.setattr(signing, "_HELD", [])  # this process's memory of a taken key, fresh for the test
    signing.hold_env_key()
    assert signing.KEY_ENV not in os.environ
    keys = signing.keyring("exp")
    assert keys.signing_key() == (signing.key_id(KEY.encode()), KEY.encode())
    assert keys.find(signing.key_id(KEY.encode())) == (KEY.encode(), f"${signing.KEY_ENV}")
    assert signing.key_location("exp") == f"${signing.KEY_ENV}"  # what the CLI's summary names (no key material)
    monkeypatch.setenv(signing.KEY_ENV, "n" * 40)  # set again later (a test, a notebook): the environment wins
    assert signing.keyring("exp").signing_key()[1] == b"n" * 40


def test_the_cli_takes_the_key_out_of_the_environment(monkeypatch, tmp_path, capsys):
    """Before any command runs (the flow commands start Prefect's temporary server and Ray, both children of
    this process), the CLI moves the key from os.environ into the signing module's memory."""
    from reflow.flows.cli import main

    monkeypatch.setenv(signing.KEY_ENV, KEY)
    monkeypatch.setattr(signing, "_HELD", [])
    main(["config", "experiment=keys"])
    assert "experiment: keys" in capsys.readouterr().out
    assert signing.KEY_ENV not in os.environ
    assert signing.keyring("exp").configured == KEY.encode()
