"""ds_muon/frameworks.py: which framework is building the engine, and the fix named for it."""
from __future__ import annotations

import pytest

from ds_muon.config import ConfigError
from ds_muon.frameworks import ACCELERATE, DIRECT, SCHEDULER_FIX, TRAINER, detect_framework, for_framework


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
    assert for_framework(SCHEDULER_FIX, TRAINER).startswith("remove the \"scheduler\" block")
    assert "DummyScheduler" in for_framework(SCHEDULER_FIX, ACCELERATE)
    assert "ds_muon.initialize" in for_framework(SCHEDULER_FIX, DIRECT)
    assert for_framework({DIRECT: "d"}, TRAINER) == "d"


def test_scheduler_error_names_the_trainer_fix() -> None:
    """The engine-side check (integration._set_optimizer_flags) appends the detected framework's fix."""
    from ds_muon import integration

    class Cfg:  # what DeepSpeed passes: its config object with the raw dict
        _param_dict = {"optimizer": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 3e-4}},
                       "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.02}},
                       "zero_optimization": {"stage": 3}}

    scope = {"__name__": "transformers.trainer", "flags": integration._set_optimizer_flags, "Cfg": Cfg}
    exec("def train():\n    flags(Cfg(), None)\n", scope)
    with pytest.raises(ConfigError) as err:
        scope["train"]()
    text = str(err.value)
    assert "scheduler.params.warmup_max_lr" in text
    assert "for this trainer setup: remove the \"scheduler\" block" in text and "lr_scheduler_type" in text
    assert "DS_MUON=0" not in text  # ds_muon was not enabled by the start-up hook here
