"""ds_muon.config and ds_muon.config.schema: messages, defaults, and the committed JSON Schema files."""
from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import warnings

import pydantic
import pytest

from tests.support.tools import REPO  # noqa: E402

from ds_muon.config import ConfigError, MuonOptimizerParams, load_ds_config, parse_muon_params  # noqa: E402
from ds_muon.config.sections import deepspeed_version  # noqa: E402
from ds_muon.config.schema import (DS_CONFIG_SCHEMA_FILE, PARAMS_SCHEMA_FILE, check_schemas, ds_config_schema,  # noqa: E402
                                   main as schema_main, muon_params_schema, render, write_schemas)
from ds_muon.integration.validation import validate as validate_ds_config  # noqa: E402

SCHEMA_DIR = REPO / "ds_config_schemas"
#: the installed DeepSpeed's version as a regex: messages about DeepSpeed's behaviour name the release they describe
DS_VERSION = re.escape(deepspeed_version())
EXAMPLES = sorted((REPO / "examples").glob("ds_config_*.json"))


def muon_config(params=None, **top):
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Muon", "params": dict(params or {})},
        "zero_optimization": {"stage": 3},
    }
    cfg.update(top)
    return cfg


def params_error(params) -> str:
    with pytest.raises(ConfigError) as info:
        parse_muon_params(params)
    return str(info.value)


# ------------------------------------------------------------------------------------------------
# optimizer.params messages
# ------------------------------------------------------------------------------------------------
def test_typo_gets_did_you_mean():
    msg = params_error({"momentun": 0.9})
    assert "optimizer.params.momentun" in msg
    assert "did you mean 'momentum'" in msg
    assert "0.9" in msg


def test_typo_is_reported_by_validate_ds_config_too():
    with pytest.raises(ConfigError, match=r"optimizer\.params\.momentun.*did you mean 'momentum'"):
        validate_ds_config(muon_config({"momentun": 0.9}))


def test_momentum_out_of_range_names_key_value_and_range():
    msg = params_error({"momentum": 1.5})
    assert "optimizer.params.momentum" in msg
    assert "1.5" in msg
    assert "[0, 1)" in msg


@pytest.mark.parametrize("lr", [0, -1, 0.0, float("inf"), float("nan")])
def test_lr_must_be_positive_and_finite(lr):
    msg = params_error({"lr": lr})
    assert "optimizer.params.lr" in msg
    assert repr(lr) in msg
    assert "a number > 0" in msg


def test_overriding_lrs_are_checked_too():
    msg = params_error({"muon_lr": 0, "adam_lr": -3e-4})
    assert "optimizer.params.muon_lr: 0 is invalid" in msg
    assert "optimizer.params.adam_lr: -0.0003 is invalid" in msg
    assert "2 problems" in msg


def test_ns_steps_zero():
    msg = params_error({"ns_steps": 0})
    assert "optimizer.params.ns_steps" in msg
    assert "0 is invalid" in msg
    assert "an integer in [1, 100]" in msg


def test_ns_method_lists_the_allowed_values():
    msg = params_error({"ns_method": "foo"})
    assert "optimizer.params.ns_method: 'foo' is invalid" in msg
    for allowed in ("'standard'", "'gram'", "'polar_express'"):
        assert allowed in msg


@pytest.mark.parametrize("value", ["yes please", "true", 1])
def test_wrong_type_is_not_coerced(value):
    msg = params_error({"nesterov": value})
    assert "optimizer.params.nesterov" in msg
    assert repr(value) in msg
    assert "true or false" in msg


def test_number_given_as_string_is_rejected():
    msg = params_error({"lr": "0.02"})
    assert "optimizer.params.lr: '0.02' is invalid" in msg


def test_hf_auto_placeholder_gets_a_hint():
    msg = params_error({"lr": "auto"})
    assert "Hugging Face" in msg


@pytest.mark.parametrize("key", ["update_scale", "adjust_lr_fn"])
@pytest.mark.parametrize("value,meaning", [("shape", "shape"), ("rms_match", "rms_match"), ("original", "shape"),
                                           ("match_rms_adamw", "rms_match")])
def test_update_scale_takes_torchs_adjust_lr_fn_names(key, value, meaning):
    """torch.optim.Muon's and torchtitan's adjust_lr_fn ("original", "match_rms_adamw") are aliases of update_scale
    ("shape", "rms_match"), key and values, read as ds_muon's names; in the committed JSON Schema too."""
    assert parse_muon_params({key: value}).update_scale == meaning
    assert parse_muon_params({key: value}).muon_group_defaults()["update_scale"] == meaning
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate({key: value}, json.loads((SCHEMA_DIR / PARAMS_SCHEMA_FILE).read_text(encoding="utf-8")))


def test_update_scale_and_adjust_lr_fn_together_or_unknown_value_is_an_error():
    msg = params_error({"update_scale": "shape", "adjust_lr_fn": "original"})
    assert "optimizer.params.adjust_lr_fn" in msg and "both 'update_scale' and its alias 'adjust_lr_fn'" in msg
    msg = params_error({"adjust_lr_fn": "match_rms"})
    assert "optimizer.params.adjust_lr_fn: 'match_rms' is invalid" in msg
    assert "'shape', 'rms_match', 'original', 'match_rms_adamw'" in msg, msg
    schema = json.loads((SCHEMA_DIR / PARAMS_SCHEMA_FILE).read_text(encoding="utf-8"))
    jsonschema = pytest.importorskip("jsonschema")
    for bad in ({"update_scale": "shape", "adjust_lr_fn": "original"}, {"adjust_lr_fn": "match_rms"}):
        assert list(jsonschema.Draft202012Validator(schema).iter_errors(bad)), bad


def test_exchange_bucket_mb_says_mib_not_elements():
    """exchange_bucket_mb is MiB, where DeepSpeed's *_bucket_size keys count elements: a value copied from
    reduce_bucket_size (5e8 elements) is refused with a message that says so; the description says it too."""
    msg = params_error({"exchange_bucket_mb": 5e8})
    assert "optimizer.params.exchange_bucket_mb: 500000000.0 is invalid" in msg
    assert "MiB, not elements" in msg and "*_bucket_size keys count elements" in msg, msg
    description = MuonOptimizerParams.model_fields["exchange_bucket_mb"].description
    assert "MiB" in description and "not elements" in description and "reduce_bucket_size" in description


def test_betas_and_alias_together_is_an_error():
    msg = params_error({"betas": [0.9, 0.99], "adam_betas": [0.9, 0.95]})
    assert "optimizer.params.adam_betas" in msg
    assert "both 'betas' and its alias 'adam_betas'" in msg
    msg = params_error({"eps": 1e-8, "adam_eps": 1e-6})
    assert "both 'eps' and its alias 'adam_eps'" in msg


def test_bad_beta_names_the_element():
    msg = params_error({"adam_betas": [0.9, 1.0]})
    assert "optimizer.params.adam_betas[1]: 1.0 is invalid" in msg
    assert "each in [0, 1)" in msg


def test_adam_w_mode_false_is_explained():
    msg = params_error({"adam_w_mode": False})
    assert "optimizer.params.adam_w_mode" in msg
    assert "decoupled weight decay" in msg
    assert "not supported" in msg
    assert parse_muon_params({"adam_w_mode": True}).adam_w_mode is True


def test_per_head_muon_is_accepted_and_strict():
    assert parse_muon_params({"per_head_muon": True}).per_head_muon is True
    assert parse_muon_params({}).per_head_muon is False
    msg = params_error({"per_head_muon": 1})
    assert "optimizer.params.per_head_muon" in msg and "true or false" in msg


def test_max_grad_norm_points_to_gradient_clipping():
    assert "gradient_clipping" in params_error({"max_grad_norm": 1.0})


def test_params_must_be_a_dict_and_custom_path_is_used():
    assert "optimizer.params: [1] is invalid" in params_error([1])
    with pytest.raises(ConfigError, match=r"^x\.y\.lr: 0 is invalid"):
        parse_muon_params({"lr": 0}, path="x.y")


def test_pattern_in_both_lists_is_an_error():
    msg = params_error({"muon_params": ["*.mlp.*"], "adamw_params": ["*.mlp.*"]})
    assert "optimizer.params.adamw_params" in msg and "both" in msg


def test_direct_construction_is_validated_too():
    with pytest.raises(pydantic.ValidationError, match=r"momentum\n  Input should be less than 1"):
        MuonOptimizerParams(momentum=2.0)
    with pytest.raises(pydantic.ValidationError, match=r"momentun\n  Extra inputs are not permitted"):
        MuonOptimizerParams(momentun=0.9)


def test_every_field_is_documented():
    for name, field in MuonOptimizerParams.model_fields.items():
        assert field.description and "Source:" in field.description, name


# ------------------------------------------------------------------------------------------------
# Resolved defaults
# ------------------------------------------------------------------------------------------------
def test_defaults_resolved():
    p = parse_muon_params(None)
    assert p == parse_muon_params({})
    assert p.muon_group_defaults() == {
        "lr": 0.02, "momentum": 0.95, "momentum_dtype": "float32", "nesterov": True, "ns_method": "standard",
        "ns_steps": 5,
        "ns_dtype": "auto", "update_scale": "shape", "weight_decay": 0.0, "exchange_dtype": "auto",
    }
    assert p.adamw_group_defaults() == {"lr": 0.02, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


def test_overrides_resolved():
    p = parse_muon_params({"lr": 0.01, "muon_lr": 0.05, "adam_lr": 3e-4, "weight_decay": 0.1,
                           "adam_weight_decay": 0.01, "adam_betas": [0.9, 0.95], "adam_eps": 1e-6,
                           "ns_method": "gram", "update_scale": "rms_match"})
    muon, adamw = p.muon_group_defaults(), p.adamw_group_defaults()
    assert (muon["lr"], muon["weight_decay"], muon["ns_method"], muon["update_scale"]) == (0.05, 0.1, "gram",
                                                                                              "rms_match")
    assert adamw == {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.01}
    assert isinstance(adamw["betas"], tuple)


def test_shared_lr_and_weight_decay_reach_both_halves():
    p = parse_muon_params({"lr": 0.01, "weight_decay": 0.1, "betas": [0.8, 0.9], "eps": 1e-7})
    assert p.muon_group_defaults()["lr"] == p.adamw_group_defaults()["lr"] == 0.01
    assert p.muon_group_defaults()["weight_decay"] == p.adamw_group_defaults()["weight_decay"] == 0.1
    assert p.adamw_group_defaults()["betas"] == (0.8, 0.9)


def test_frozen():
    p = parse_muon_params({})
    with pytest.raises(pydantic.ValidationError, match=r"lr\n  Instance is frozen"):
        p.lr = 1.0


# ------------------------------------------------------------------------------------------------
# validate_ds_config
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opt", [None, {"type": "AdamW", "params": {"lr": 1e-3, "momentun": 1}},
                                 {"type": "Adam"}, {"params": {}}])
def test_non_muon_config_passes_through(opt):
    cfg = {"zero_optimization": {"stage": 2}}
    if opt is not None:
        cfg["optimizer"] = opt
    before = copy.deepcopy(cfg)
    assert validate_ds_config(cfg) is None
    assert cfg == before


@pytest.mark.parametrize("name", ["Muon", "muon", "MUON"])
def test_muon_type_is_case_insensitive(name):
    cfg = muon_config({"lr": 0.01})
    cfg["optimizer"]["type"] = name
    assert validate_ds_config(cfg).params.lr == 0.01


@pytest.mark.parametrize("zero", [{"stage": 0}, {}, None])
def test_stage_0_is_refused_naming_the_served_stages(zero):
    cfg = muon_config()
    if zero is None:
        del cfg["zero_optimization"]
    else:
        cfg["zero_optimization"] = zero
    with pytest.raises(ConfigError) as info:
        validate_ds_config(cfg)
    msg = str(info.value)
    assert "zero_optimization.stage" in msg
    assert "ds_muon serves ZeRO stages 1, 2 and 3 (which run on one GPU too)" in msg
    assert "Set zero_optimization.stage to 1, 2 or 3" in msg
    assert "DeepSpeed's built-in Muon" in msg


def test_all_problems_are_reported_together():
    cfg = muon_config({"momentum": 1.5}, gradient_clipping=-1.0)
    cfg["zero_optimization"] = {"stage": 0}
    with pytest.raises(ConfigError) as info:
        validate_ds_config(cfg)
    assert len(info.value.problems) == 3
    msg = str(info.value)
    assert "optimizer.params.momentum" in msg and "zero_optimization.stage" in msg and "gradient_clipping" in msg


def test_save_momentum_in_memory_without_offload_warns():
    cfg = muon_config()
    cfg["zero_optimization"]["save_muon_momentum_buffer_in_memory"] = True
    with pytest.warns(UserWarning, match=r"save_muon_momentum_buffer_in_memory.*no effect"):
        assert validate_ds_config(cfg) is not None
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "none"}
    with pytest.warns(UserWarning, match="no effect"):
        validate_ds_config(cfg)


@pytest.mark.parametrize("device", ["cpu"])
def test_save_momentum_in_memory_with_offload_is_quiet(device):
    cfg = muon_config()
    cfg["zero_optimization"]["save_muon_momentum_buffer_in_memory"] = True
    cfg["zero_optimization"]["offload_optimizer"] = {"device": device}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_ds_config(cfg)


@pytest.mark.parametrize("offload", [{"device": "nvme"}, {"device": "nvme", "nvme_path": None},
                                     {"device": "nvme", "nvme_path": ""}])
def test_nvme_needs_nvme_path(offload):
    cfg = muon_config()
    cfg["zero_optimization"]["offload_optimizer"] = offload
    with pytest.raises(ConfigError, match=r"zero_optimization\.offload_optimizer\.nvme_path.*set nvme_path"):
        validate_ds_config(cfg)


@pytest.mark.parametrize("clip", [-1.0, -0.5, "1.0", True])
def test_bad_gradient_clipping(clip):
    with pytest.raises(ConfigError, match=r"gradient_clipping: .* is invalid.*>= 0"):
        validate_ds_config(muon_config(gradient_clipping=clip))


def test_gradient_clipping_zero_is_fine():
    assert validate_ds_config(muon_config(gradient_clipping=0)) is not None


def test_validate_needs_a_dict():
    with pytest.raises(ConfigError, match="load_ds_config"):
        validate_ds_config("ds_config.json")


def test_load_ds_config(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(muon_config({"lr": 0.03})))
    assert validate_ds_config(load_ds_config(path)).params.lr == 0.03
    assert load_ds_config(str(path)) == muon_config({"lr": 0.03})
    d = muon_config()
    copied = load_ds_config(d)
    assert copied == d and copied is not d
    path.write_text('{"a": 1, "a": 2}')
    with pytest.raises(ConfigError, match="duplicate key 'a'"):
        load_ds_config(path)
    path.write_text('{"a": 1,}')
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_ds_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_ds_config(tmp_path / "missing.json")


# ------------------------------------------------------------------------------------------------
# JSON Schema files and examples
# ------------------------------------------------------------------------------------------------
def test_committed_schemas_match_the_models():
    """Drift test: fails whenever a field of MuonOptimizerParams changes without regenerating."""
    regen = "python -m ds_muon.config.schema"
    for name, schema in ((PARAMS_SCHEMA_FILE, muon_params_schema()), (DS_CONFIG_SCHEMA_FILE, ds_config_schema())):
        committed = (SCHEMA_DIR / name).read_text(encoding="utf-8")
        assert committed == render(schema), f"ds_config_schemas/{name} is out of date; run `{regen}`"
    assert check_schemas(SCHEMA_DIR) == []


def test_schema_covers_every_field_and_alias():
    props = muon_params_schema()["properties"]
    assert set(MuonOptimizerParams.model_fields) | {"adam_betas", "adam_eps", "adjust_lr_fn"} == set(props)
    assert ds_config_schema()["$defs"]["MuonOptimizerParams"]["properties"] == props


def test_check_reports_drift(tmp_path, capsys):
    write_schemas(tmp_path)
    assert schema_main(["--check", "--out", str(tmp_path)]) == 0
    path = tmp_path / PARAMS_SCHEMA_FILE
    path.write_text(path.read_text().replace('"default": 0.95', '"default": 0.9'))
    assert schema_main(["--check", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert PARAMS_SCHEMA_FILE in err and "python -m ds_muon.config.schema" in err


def _validator():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((SCHEMA_DIR / DS_CONFIG_SCHEMA_FILE).read_text(encoding="utf-8"))
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def test_params_schema_file_is_a_valid_schema():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((SCHEMA_DIR / PARAMS_SCHEMA_FILE).read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate({"adam_betas": [0.9, 0.95], "lr": 0.02}, schema)


@pytest.mark.parametrize("stage,ok", [(0, False), (1, True), (2, True), (3, True), (4, False)])
def test_schema_admits_the_served_stages(stage, ok):
    cfg = {"optimizer": {"type": "Muon", "params": {"lr": 0.02}}, "zero_optimization": {"stage": stage}}
    errors = [e.message for e in _validator().iter_errors(cfg)]
    assert (errors == []) is ok, errors


def test_there_are_examples():
    assert {p.name for p in EXAMPLES} >= {"ds_config_cpu.json", "ds_config_gpu_bf16.json"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_validates(path):
    cfg = load_ds_config(path)
    errors = sorted(str(e.message) for e in _validator().iter_errors(cfg))
    assert errors == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(validate_ds_config(cfg).params, MuonOptimizerParams)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_zero_section_is_accepted_by_deepspeed(path):
    zero_config = pytest.importorskip("deepspeed.runtime.zero.config")
    zero_config.DeepSpeedZeroConfig(**load_ds_config(path)["zero_optimization"])


def test_example_values():
    cpu = load_ds_config(REPO / "examples" / "ds_config_cpu.json")
    assert cpu["zero_optimization"]["stage"] == 3 and cpu["gradient_clipping"] == 1.0
    assert cpu["train_micro_batch_size_per_gpu"] == 8 and cpu["gradient_accumulation_steps"] == 1
    p = validate_ds_config(cpu).params
    assert (p.lr, p.adam_lr, p.weight_decay) == (0.02, 3e-3, 0.0)


@pytest.mark.parametrize("mutate", [
    lambda c: c["optimizer"]["params"].update(momentun=0.9),
    lambda c: c["optimizer"]["params"].update(momentum=1.5),
    lambda c: c["optimizer"]["params"].update(ns_method="foo"),
    lambda c: c["optimizer"]["params"].update(nesterov="yes please"),
    lambda c: c["optimizer"]["params"].update(betas=[0.9, 0.95], adam_betas=[0.9, 0.95]),
    lambda c: c["optimizer"]["params"].update(adam_w_mode=False),
    lambda c: c["optimizer"].update(type="Moun"),
    lambda c: c["zero_optimization"].update(stage=0),
    lambda c: c["zero_optimization"].update(offload_optimizer={"device": "nvme"}),
    lambda c: c.update(gradient_clipping=-1),
], ids=["typo", "momentum", "ns_method", "type", "alias", "adam_w_mode", "opt_type", "stage", "nvme", "clip"])
def test_bad_config_fails_jsonschema(mutate):
    cfg = load_ds_config(REPO / "examples" / "ds_config_cpu.json")
    mutate(cfg)
    assert list(_validator().iter_errors(cfg)), "jsonschema accepted a bad config"


def test_schema_cli_check_exits_0():
    result = subprocess.run([sys.executable, "-m", "ds_muon.config.schema", "--check"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_nvme_offload_with_a_writable_path_is_accepted(tmp_path):
    cfg = nvme_config(tmp_path)
    cfg["zero_optimization"]["save_muon_momentum_buffer_in_memory"] = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert validate_ds_config(cfg) is not None


def test_nvme_path_missing_names_key_and_fix(tmp_path):
    cfg = muon_config()
    missing = tmp_path / "local_nvm"  # a mistyped mount point
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(missing)}
    with pytest.raises(ConfigError, match=rf"zero_optimization\.offload_optimizer\.nvme_path: '{missing}' does not "
                                          rf"exist.*mkdir -p {missing}"):
        validate_ds_config(cfg)


def nvme_config(path) -> dict:
    """A Muon config with the optimizer offloaded to NVMe at ``path``."""
    cfg = muon_config()
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(path)}
    return cfg


def test_nvme_parameter_offload_is_refused(tmp_path):
    cfg = muon_config()
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    with pytest.raises(ConfigError, match=r"zero_optimization\.offload_param\.device: 'nvme' \(parameter offload "
                                          r"to NVMe\) is not supported by ds_muon yet; use offload_param device 'cpu'"):
        validate_ds_config(cfg)


@pytest.mark.parametrize("mutate, match", [
    (lambda c: c["zero_optimization"].update(offload_optimizer={"device": "cpu", "ratio": 0.5}),
     rf"offload_optimizer\.ratio: 0\.5 is invalid: DeepSpeed {DS_VERSION}'s ZeRO-3 partial optimizer offload runs only "
     r"with DeepSpeedCPUAdam.*remove ratio"),
    (lambda c: c.update(tensor_parallel={"autotp_size": 2}),
     r"tensor_parallel\.autotp_size: 2 with ZeRO stage 3 is not served by ds_muon yet.*stages 1 and 2.*set "
     r"zero_optimization\.stage to 1 or 2, or autotp_size to 1"),
    (lambda c: c["zero_optimization"].update(zenflow={"topk_ratio": 0.1}), r"zero_optimization\.zenflow"),
    (lambda c: c["zero_optimization"].update(offload_optimizer={"device": "cpu", "super_offload": True}),
     rf"offload_optimizer\.super_offload: true is invalid: DeepSpeed {DS_VERSION}'s SuperOffload.*no Muon step"),
], ids=["partial-offload", "autotp", "zenflow", "super-offload"])
def test_unsupported_combinations_are_named(mutate, match):
    cfg = muon_config()
    mutate(cfg)
    with pytest.raises(ConfigError, match=match):
        validate_ds_config(cfg)


def test_autotp_is_served_at_stages_1_and_2_with_its_limits_named():
    """AutoTP: served at ZeRO-1/2 with ``tp_mode`` 'full' (default) or 'shard'; QK-clip, and a declared split in
    shard mode, are refused naming the key and the fix."""
    for stage in (1, 2):
        for mode in ("full", "shard"):
            cfg = muon_config()
            cfg["zero_optimization"]["stage"] = stage
            cfg["tensor_parallel"] = {"autotp_size": 2}
            cfg["optimizer"]["params"]["tp_mode"] = mode
            assert validate_ds_config(cfg).params.tp_mode == mode
    cfg["optimizer"]["params"]["tp_mode"] = "blockwise"
    with pytest.raises(ConfigError, match=r"optimizer\.params\.tp_mode: 'blockwise' is invalid.*'full', 'shard'"):
        validate_ds_config(cfg)
    cfg["optimizer"]["params"].update(tp_mode="shard", per_head_muon=True)
    with pytest.raises(ConfigError, match=r"optimizer\.params\.per_head_muon: with tp_mode 'shard' is not served.*"
                                          r"use tp_mode 'full'"):
        validate_ds_config(cfg)
    cfg["optimizer"]["params"].update(tp_mode="full", qk_clip={"enabled": True})
    with pytest.raises(ConfigError, match=r"optimizer\.params\.qk_clip: enabled with tensor_parallel\.autotp_size 2 "
                                          r"is not served.*disable qk_clip or set autotp_size to 1"):
        validate_ds_config(cfg)


def test_every_deepspeed_scheduler_is_accepted_and_classified():
    from ds_muon.integration.schedulers import broadcasts_one_lr
    cfg = muon_config()
    cfg["optimizer"]["params"].update(lr=0.02, adam_lr=3e-4)
    cases = [({"type": "WarmupLR", "params": {"warmup_max_lr": 0.02, "warmup_num_steps": 10}}, True),
             ({"type": "WarmupLR", "params": {"warmup_num_steps": 10}}, False),      # each group's own lr
             ({"type": "WarmupLR", "params": {"warmup_max_lr": [0.02, 3e-4]}}, False),  # the user's per-group lrs
             ({"type": "WarmupDecayLR", "params": {"total_num_steps": 100}}, True),   # DeepSpeed's default 0.001
             ({"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_max_lr": None}}, False),
             ({"type": "WarmupCosineLR", "params": {"total_num_steps": 100}}, False),  # ratios already
             ({"type": "OneCycle", "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.02}}, True),
             ({"type": "LRRangeTest", "params": {}}, True),
             ({"type": "StepLR", "params": {"step_size": 10}}, False)]
    for sched, scaled in cases:
        cfg["scheduler"] = sched
        assert validate_ds_config(cfg) is not None, sched
        assert broadcasts_one_lr(sched["type"], sched["params"]) is scaled, sched


def test_bf16_momentum_with_nvme_needs_momentum_in_memory(tmp_path):
    from ds_muon.config import ConfigError
    from ds_muon.integration.validation import validate as validate_ds_config
    from ds_muon.integration.probes import _async_io_available
    cfg = {"optimizer": {"type": "Muon", "params": {"momentum_dtype": "bfloat16"}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    with pytest.raises(ConfigError, match="momentum_dtype: 'bfloat16' with NVMe optimizer offload needs "
                                          "zero_optimization.save_muon_momentum_buffer_in_memory"):
        validate_ds_config(cfg)
    cfg["zero_optimization"]["save_muon_momentum_buffer_in_memory"] = True
    if _async_io_available():
        try:
            validate_ds_config(cfg)
        except ConfigError as err:  # only tmpfs without O_DIRECT may still object, never momentum_dtype
            assert "momentum_dtype" not in str(err)
    with pytest.raises(ConfigError, match="momentum_dtype"):
        validate_ds_config({"optimizer": {"type": "Muon", "params": {"momentum_dtype": "float16"}},
                            "zero_optimization": {"stage": 3}})


def test_builtin_optimizer_keys_keep_their_meaning():
    # fp32_optimizer_states: true is what ds_muon does; false is refused with the reason
    assert parse_muon_params({"fp32_optimizer_states": True}).fp32_optimizer_states is True
    with pytest.raises(ConfigError, match=r"optimizer\.params\.fp32_optimizer_states: False is invalid: ds_muon "
                                          r"keeps the Adam moments in fp32.*momentum_dtype 'bfloat16'.*allowed: true"):
        parse_muon_params({"fp32_optimizer_states": False})
    # torch_adam / foreach pick torch.optim.AdamW through DeepSpeed's get_optimizer_configuration
    p = parse_muon_params({"torch_adam": True, "foreach": False})
    assert p.adamw_implementation() == {"torch_adam": True, "foreach": False}
    assert parse_muon_params({}).adamw_implementation() == {"torch_adam": False, "foreach": None}
    cfg = muon_config({"foreach": True})
    with pytest.warns(UserWarning, match=r"foreach has no effect without optimizer\.params\.torch_adam"):
        validate_ds_config(cfg)
    with pytest.raises(ConfigError, match=r"torch_adam: 'yes' is invalid"):
        parse_muon_params({"torch_adam": "yes"})
    # torch_autocast is accepted (parity: tests/dist/test_dropin.py)
    assert validate_ds_config(muon_config(torch_autocast={"enabled": True, "dtype": "bfloat16"})) is not None


@pytest.mark.parametrize("bf16_key", ["bf16", "bfloat16"])
@pytest.mark.parametrize("accum", ["fp32", "float32", "torch.float32", "FP32"])
def test_stage1_bf16_fp32_accumulation_is_unserved_in_every_spelling(bf16_key, accum):
    """DeepSpeed runs BF16_Optimizer (not a ZeRO optimizer) for stage 1 + bf16 + fp32 accumulation; every spelling
    DeepSpeed accepts must be recognised, or zero-code activation would build ds_muon's inner optimizer there."""
    from ds_muon.config import unserved_modes
    cfg = {"optimizer": {"type": "Muon", "params": {"lr": 0.02}}, "zero_optimization": {"stage": 1},
           bf16_key: {"enabled": True}, "data_types": {"grad_accum_dtype": accum}}
    assert any("grad_accum_dtype" in line for line in unserved_modes(cfg)), unserved_modes(cfg)
    assert not unserved_modes(dict(cfg, zero_optimization={"stage": 2}))


def test_elastic_checkpoint_at_stage_1_2_is_unserved():
    from ds_muon.config import unserved_modes
    cfg = {"optimizer": {"type": "Muon", "params": {"lr": 0.02}},
           "zero_optimization": {"stage": 2, "elastic_checkpoint": True}}
    assert any("elastic_checkpoint" in line for line in unserved_modes(cfg)), unserved_modes(cfg)
    assert not unserved_modes(dict(cfg, zero_optimization={"stage": 2, "elastic_checkpoint": False}))


@pytest.mark.parametrize("value", ["auto", True, False])
def test_overlap_backward_values(value):
    assert parse_muon_params({"overlap_backward": value}).overlap_backward == value


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_overlap_backward_rejects_others(value):
    with pytest.raises(ConfigError, match="overlap_backward"):
        parse_muon_params({"overlap_backward": value})
