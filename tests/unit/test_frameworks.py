"""ds_muon/frameworks.py: which framework is building the engine, and the fix named for it."""
from __future__ import annotations

import pytest

from ds_muon.config import ConfigError
from ds_muon.integration.frameworks import ACCELERATE, DIRECT, TRAINER, ZERO_STAGE_FIX, detect_framework, for_framework


def _call_chain(*modules: str):
    """Call detect_framework() through functions defined in modules named ``modules`` (outermost first)."""
    def innermost():
        return detect_framework()
    fn = innermost
    for name in reversed(modules):
        scope = {"__name__": name, "inner": fn}
        exec("def call():\n    return inner()\n", scope)
        fn = scope["call"]
    return fn()


@pytest.mark.parametrize("chain, expected", [
    ((), DIRECT),
    (("deepspeed",), DIRECT),
    (("accelerate.accelerator", "deepspeed"), ACCELERATE),
    (("transformers.trainer", "accelerate.accelerator", "deepspeed"), TRAINER),
    (("trl.trainer.sft_trainer", "transformers.trainer", "accelerate.accelerator"), TRAINER),
    (("accelerate.commands.launch", "transformers.trainer", "accelerate.accelerator"), TRAINER),
])
def test_detect_framework(chain, expected) -> None:
    assert _call_chain(*chain) == expected


def test_for_framework_picks_and_falls_back() -> None:
    assert "TrainingArguments(deepspeed=...)" in for_framework(ZERO_STAGE_FIX, TRAINER)
    assert "DeepSpeedPlugin" in for_framework(ZERO_STAGE_FIX, ACCELERATE)
    assert for_framework(ZERO_STAGE_FIX, DIRECT).startswith("set \"zero_optimization\"")
    assert for_framework({DIRECT: "d"}, TRAINER) == "d"


@pytest.mark.parametrize("module, expected", [("transformers.trainer", "TrainingArguments(deepspeed=...)"),
                                              ("accelerate.accelerator", "DeepSpeedPlugin(...)"),
                                              ("train_script", "in the DeepSpeed config")])
def test_stage_error_names_the_fix_for_the_framework(module, expected) -> None:
    """The engine-side check (integration._set_optimizer_flags) appends the detected framework's fix."""
    from ds_muon.integration import hooks as integration

    class Cfg:  # what DeepSpeed passes: its config object with the raw dict
        _param_dict = {"optimizer": {"type": "Muon", "params": {"lr": 0.02}}, "zero_optimization": {"stage": 0}}

    scope = {"__name__": module, "flags": integration._set_optimizer_flags, "Cfg": Cfg}
    exec("def build():\n    flags(Cfg(), None)\n", scope)
    with pytest.raises(ConfigError) as err:
        scope["build"]()
    text = str(err.value)
    assert "zero_optimization.stage: 0 is invalid" in text
    framework = {"transformers.trainer": TRAINER, "accelerate.accelerator": ACCELERATE}.get(module, DIRECT)
    assert f"for this {framework} setup: " in text and expected in text
    assert "DS_MUON=0" not in text  # ds_muon was not enabled by the start-up hook here
