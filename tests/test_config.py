"""Config: every shipped experiment file validates; bad values fail early and name the field."""
import re
from pathlib import Path

import pytest

from reflow.infra.config.schema import ConfigError, RunConfig, apply_overrides, dump_config, load_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    # round trip: the dumped config is itself a valid config file
    assert RunConfig.model_validate(__import__("yaml").safe_load(dump_config(cfg))) == cfg


def test_overrides_are_typed_and_nested():
    cfg = load_config(None, ["trainer.lr=3e-4", "rollout.n_samples_per_prompt=4", "eval.interval=null",
                             "algorithm.normalize_std=false", "experiment=x1"])
    assert cfg.trainer.lr == pytest.approx(3e-4)
    assert cfg.rollout.n_samples_per_prompt == 4
    assert cfg.eval.interval is None and cfg.algorithm.normalize_std is False and cfg.experiment == "x1"


@pytest.mark.parametrize("override, field", [
    ("trainer.lr=-1", "trainer.lr"),
    ("trainer.zero_stage=4", "trainer.zero_stage"),
    ("rollout.top_p=0", "rollout.top_p"),
    ("rollout.max_new_tokens=five", "rollout.max_new_tokens"),
    ("algorithm.kl_estimator=k9", "algorithm.kl_estimator"),
    ("trainer.typo_field=1", "trainer.typo_field"),
    ("experiment=has space", "experiment"),
])
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert field in str(e.value)


@pytest.mark.parametrize("override, field, message", [
    ("trainer.lr=1e999", "trainer.lr", "Input should be a finite number"),
    ("trainer.lr=.nan", "trainer.lr", "Input should be a finite number"),
    ("rollout.temperature=.inf", "rollout.temperature", "Input should be a finite number"),
    ("algorithm.tis_cap=inf", "algorithm.tis_cap", "Input should be a finite number"),
    (f"num_iterations={10**29}", "num_iterations", "Input should be less than or equal to 10000000"),
    ("rollout.max_new_tokens=1.0e+13", "rollout.max_new_tokens", "Input should be less than or equal to 1048576"),
    ("eval.sets=[{name: a, max_new_tokens: 10000000000000}]", "eval.sets.0.max_new_tokens",
     "Input should be less than or equal to 1048576"),
])
def test_non_finite_numbers_and_absurd_counts_are_refused(override, field, message):
    """lr=inf passed and failed in training with three tracebacks; 1e29 iterations and 1e13 tokens passed too."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert f"  {field}: {message}" in str(e.value), str(e.value)


def test_a_config_file_that_is_not_utf8_is_named(tmp_path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("experiment: d\u00e9mo\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"^config file '{bad}' is not UTF-8 text \(invalid continuation byte at "
                                          rf"byte 13\); save it as UTF-8$"):
        load_config(bad)


def test_bare_on_off_mean_the_words():
    """YAML reads `on`/`off` as booleans: `trainer.compile=on` was refused ("got True") before; `true`/`false`
    mean on/off too."""
    cfg = load_config(None, ["trainer.compile=on", "trainer.activation_checkpointing=false", "cluster.gpus=off"])
    assert (cfg.trainer.compile, cfg.trainer.activation_checkpointing, cfg.cluster.gpus) == ("on", "off", "off")
    cfg = load_config(None, ["trainer.compile=off", "trainer.activation_checkpointing=true"])
    assert (cfg.trainer.compile, cfg.trainer.activation_checkpointing) == ("off", "on")
    assert load_config(None, ["trainer.compile=auto"]).trainer.compile == "auto"
    assert load_config(None, []).cluster.gc_freeze and not load_config(None, ["cluster.gc_freeze=off"]).cluster.gc_freeze
    with pytest.raises(ConfigError, match="trainer.activation_checkpointing"):
        load_config(None, ["trainer.activation_checkpointing=sometimes"])


def test_auto_precision_follows_the_gpus_and_the_policys_size(tiny_policy, monkeypatch):
    """trainer.precision=auto (the default): fp32 without GPUs, whatever the policy; on GPUs bf16 from
    AUTO_BF16_PARAMS parameters (bf16-mixed at ZeRO-0, which has no fp32 master weights), fp32 with TF32 products
    below; a precision that is set is kept, and the policy is then never read."""
    from reflow.infra.cluster import runtime
    from reflow.infra.config import settings
    from reflow.infra.config.settings import AUTO_BF16_PARAMS, policy_rank_settings, resolve_precision

    def unread():
        raise AssertionError("the policy's size was asked for")

    auto = load_config(None, [f"model.path={tiny_policy}"])
    assert auto.trainer.precision == "auto"
    t1 = auto.trainer.model_copy(update={"zero_stage": 1})
    assert resolve_precision(auto.trainer, False, unread) == ("fp32", False)
    assert policy_rank_settings(auto).precision == "fp32"  # a CPU run needs no parameter count
    assert resolve_precision(t1, True, lambda: AUTO_BF16_PARAMS) == ("bf16", False)
    assert resolve_precision(auto.trainer, True, lambda: AUTO_BF16_PARAMS) == ("bf16-mixed", False)
    assert resolve_precision(t1, True, lambda: AUTO_BF16_PARAMS - 1) == ("fp32", True)
    for p in ("fp32", "bf16", "bf16-mixed"):
        assert resolve_precision(t1.model_copy(update={"precision": p}), True, unread) == (p, False)
    with pytest.raises(ValueError, match="parameter count"):
        policy_rank_settings(auto, gpus=True)  # on GPUs the caller must have counted
    # The run counts the policy's parameters from its safetensors headers (the tiny one: ~22.5k)
    assert runtime.run_precision(auto, True) == ("fp32", True)
    assert runtime.engine_dtype(auto, True) == "fp32" and runtime.engine_dtype(auto, False) == "fp32"
    monkeypatch.setattr(settings, "AUTO_BF16_PARAMS", 20_000)
    big = auto.model_copy(update={"trainer": t1})
    assert runtime.run_precision(big, True) == ("bf16", False) and runtime.engine_dtype(big, True) == "bf16"
    rank = policy_rank_settings(big, True, runtime.run_precision(big, True))
    assert (rank.precision, rank.backend) == ("bf16", "nccl")


def test_bf16_mixed_keeps_fp32_weights_in_the_trainer_and_the_engines():
    """trainer.precision=bf16-mixed reaches the ranks as is (their forward runs under autocast: tests/test_trainer.py),
    while everything that holds weights (the ranks' model, checkpoints, engines on a GPU, SGLang's --dtype) is fp32."""
    from reflow.engines.sglang.launcher import sglang_dtype
    from reflow.engines.train.settings import weights_precision
    from reflow.infra.cluster.runtime import engine_dtype
    from reflow.infra.config.settings import critic_rank_settings, policy_rank_settings

    cfg = load_config(None, ["trainer.precision=bf16-mixed", "trainer.zero_stage=1"])
    assert policy_rank_settings(cfg).precision == "bf16-mixed"
    assert (engine_dtype(cfg, True), engine_dtype(cfg, False), sglang_dtype(engine_dtype(cfg, True))) == \
        ("fp32", "fp32", "float32")
    bf16 = load_config(None, ["trainer.precision=bf16", "trainer.zero_stage=1"])
    assert (engine_dtype(bf16, True), engine_dtype(bf16, False)) == ("bf16", "fp32")
    assert [weights_precision(p) for p in ("fp32", "bf16", "bf16-mixed")] == ["fp32", "bf16", "fp32"]
    with pytest.raises(ConfigError, match="trainer.precision"):
        load_config(None, ["trainer.precision=fp16"])
    assert policy_rank_settings(load_config(None, ["trainer.fp32_lm_head=true"])).fp32_lm_head
    assert not policy_rank_settings(cfg).fp32_lm_head
    tf32 = load_config(None, ["trainer.tf32=true"])
    assert policy_rank_settings(tf32).tf32 and critic_rank_settings(tf32).tf32 and not policy_rank_settings(cfg).tf32
    with pytest.raises(ConfigError, match="trainer.fp32_lm_head=false"):
        load_config(None, ["trainer.fp32_lm_head=true", "rollout.backend=sglang", "trainer.zero_stage=1"])


def test_eval_k_must_fit_the_samples_per_prompt():
    with pytest.raises(ConfigError, match="k=4 needs at least k samples"):
        load_config(None, ["eval.sets=[{name: a, temperature: 0, k: [1, 4]}]"])
    with pytest.raises(ConfigError, match="unique"):
        load_config(None, ["eval.sets=[{name: a}, {name: a}]"])
    cfg = load_config(None, ["eval.sets=[{name: a, k: [1, 4]}]", "rollout.n_samples_per_prompt=4"])
    assert cfg.eval.sets[0].sampling(cfg.rollout) == {"n": 4, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                                       "max_new_tokens": 8}


def test_batch_must_split_over_ranks():
    with pytest.raises(ConfigError, match="trainer.num_ranks"):
        load_config(None, ["rollout.prompts_per_iteration=3", "rollout.n_samples_per_prompt=1",
                           "trainer.num_ranks=2"])


def test_malformed_files_and_overrides(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)
    with pytest.raises(ConfigError, match="key.sub=value"):
        apply_overrides({}, ["trainer.lr"])


def test_cli_reports_config_errors(capsys):
    from reflow.flows.cli import main

    with pytest.raises(SystemExit) as e:
        main(["config", "trainer.lr=abc"])
    assert e.value.code == 2 and "trainer.lr" in capsys.readouterr().err


def test_colocated_sglang_needs_a_zero_stage_that_can_offload():
    with pytest.raises(ConfigError, match="needs trainer.zero_stage 1, 2 or 3"):
        load_config(None, ["cluster.colocate=true", "rollout.backend=sglang", "trainer.zero_stage=0"])
    assert load_config(None, ["cluster.colocate=true", "rollout.backend=sglang", "trainer.zero_stage=3"])
    assert load_config(None, ["cluster.colocate=true"])  # the embedded engine on CPU: nothing to offload


def test_example_configs_load_and_name_no_hub_model():
    from pathlib import Path

    for f in sorted(Path(__file__).resolve().parents[1].glob("configs/*.yaml")):
        path = load_config(f).model.path
        assert path.startswith((".", "/", "s3://", "file://", "models/")), f"{f.name}: model.path {path!r} looks like a hub id"


def test_sglang_disk_mode_refuses_a_storage_url_and_names_the_fix():
    sglang_disk = ["rollout.backend=sglang", "weight_sync.mode=disk"]
    with pytest.raises(ConfigError, match=r"weight_sync.disk_dir='s3://bucket/push'(.|\n)*reads only local "
                                          r"folders(.|\n)*a shared filesystem mount(.|\n)*mode=tensor or distributed"):
        load_config(None, [*sglang_disk, "weight_sync.disk_dir=s3://bucket/push"])
    for ok in ("/mnt/shared/weights", "file:///mnt/shared/weights"):
        assert load_config(None, [*sglang_disk, f"weight_sync.disk_dir={ok}"]).weight_sync.disk_dir == ok
    assert load_config(None, sglang_disk).weight_sync.disk_dir is None  # the default local temp folder
    # the embedded engine downloads a pushed folder from storage itself
    assert load_config(None, ["weight_sync.mode=disk", "weight_sync.disk_dir=s3://bucket/push"])


def _field_descriptions(model: type, where: str = "") -> dict[str, str | None]:
    """{dotted field: description} over a config class and its nested sections (every algorithm type's fields)."""
    import typing

    from pydantic import BaseModel

    from reflow.rl.algorithms import SPECS

    out: dict[str, str | None] = {}
    for name, field in model.model_fields.items():
        key = f"{where}{name}"
        inner = [field.annotation, *typing.get_args(field.annotation)]
        if name == "algorithm":
            inner = [s.config for s in SPECS.values()]
        sections = [t for t in (typing.get_args(t)[0] if typing.get_origin(t) is list else t for t in inner)
                    if isinstance(t, type) and issubclass(t, BaseModel)]
        for t in sections:  # a section's docstring describes it; its fields are listed instead
            out |= _field_descriptions(t, f"{key}.")
        if not sections or name == "sets":
            out[key] = field.description
    return out


def test_every_field_says_what_it_does_without_measurements():
    """Each field has a description saying what it does and when to change it; measured figures live in
    bench/RESULTS.md, not in the description (where they go stale)."""
    fields = _field_descriptions(RunConfig)
    assert len(fields) > 150 and "trainer.lora.rank" in fields and "algorithm.lam" in fields, sorted(fields)[:20]
    # algorithm.type: the union's tag, which RunConfig.algorithm's description lists
    assert [k for k, d in fields.items() if not d] == ["algorithm.type"]
    cites = [k for k, d in fields.items() if re.search(r"RESULTS|\d\s?ms\b|\d\.\d+x\b", d or "")]
    assert cites == [], cites
