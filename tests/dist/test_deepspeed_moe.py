"""DeepSpeed's native MoE layers (``deepspeed.moe.layer.MoE``) under ds_muon.

DeepSpeed 0.19.8 itself refuses native MoE layers with ZeRO stage 3
(``DeepSpeedEngine._validate_zero3_moe_compatibility``), so ds_muon refuses them there first, with the reason
and what to use instead. Both halves are asserted: if a future DeepSpeed accepts native MoE under ZeRO-3, the
first check fails and says to revisit this. At stages 1/2 DeepSpeed runs them; ds_muon does not serve their
expert-parallel partitions yet, so the zero-code path hands them to the built-in and ds_muon.initialize
refuses them naming why. AutoEP (``expert_parallel``) is served; the combinations it is not are refused, naming why.
"""
from __future__ import annotations

from ds_muon.config.sections import deepspeed_version  # the installed release, which the message names
from tests.support.spawn import run_distributed


def _moe_model():
    import torch
    from deepspeed.moe.layer import MoE
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.moe = MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=2, ep_size=2, k=1)
            self.head = nn.Linear(8, 16)

        def forward(self, x):
            h, _, _ = self.moe(self.embed(x))
            return self.head(h)

    torch.manual_seed(0)
    return Net()


def _config(optimizer: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": optimizer, "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3}, "steps_per_print": 10_000}


def _initialize_both(rank: int, world_size: int) -> dict:
    import deepspeed
    import ds_muon
    from ds_muon.config import ConfigError
    out = {}
    try:  # DeepSpeed alone, with its AdamW: its own refusal
        model = _moe_model()
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config("AdamW"))
        out["deepspeed"] = "accepted"
    except AssertionError as exc:
        out["deepspeed"] = str(exc)
    try:
        model = _moe_model()
        ds_muon.initialize(model=model, model_parameters=model.parameters(), config=_config("Muon"))
        out["ds_muon"] = "accepted"
    except ConfigError as exc:
        out["ds_muon"] = str(exc)
    return out


def test_native_moe_is_refused_by_deepspeed_and_by_ds_muon_with_the_reason():
    res = run_distributed(_initialize_both, 2)[0]
    assert "Native DeepSpeed MoE is not supported with ZeRO Stage 3" in res["deepspeed"], res
    msg = res["ds_muon"]
    assert "native MoE layers ('moe'" in msg and "ZeRO stage 3" in msg and f"DeepSpeed {deepspeed_version()}" in msg, msg
    assert "stacked expert weights" in msg, msg


def test_autoep_is_served_and_what_is_not_is_refused_naming_why():
    """AutoEP (DeepSpeed's expert parallelism) is served (parity with the oracle: tests/dist/test_autoep.py). Refused,
    each naming the key and why: AutoEP with sequence parallelism (an engine check; a hand-over to the built-in on the
    zero-code path: ``builtin could``); with Adam-mini, AutoTP or ``load_universal`` (the config); and with a
    transformers whose output-capture registry DeepSpeed 0.19.8's AutoEP cannot use (transformers >= 5.23, CI's 5.25.0:
    a ``ConfigError`` before the engine, naming DeepSpeed's TypeError and the releases that work), but only for a
    model DeepSpeed would fail on: not with the test-only shim, not for a preset that does not retarget the
    router-logit recorders (DeepSeek-V3), not with AutoEP off."""
    from types import SimpleNamespace

    from torch import nn

    from ds_muon.config import unserved_modes
    from ds_muon.integration.autoep import engine_problem, transformers_problem
    from ds_muon.integration.hooks import _engine_problem
    from tests.support.autoep import AUTOEP, qwen3_moe, registry_shim
    from tests.support.qk_models import deepseek_v3

    def engine(moe: bool):
        return SimpleNamespace(mpu=None, has_moe_layers=moe, module=nn.Linear(2, 2), zero_optimization_stage=lambda: 3)

    assert _engine_problem(engine(False)) == (None, False)  # no MoE: served
    assert _engine_problem(engine(True)) == (None, False)  # AutoEP layers (no native MoE, no SP): served
    problem = engine_problem(2)
    assert "AutoEP (expert_parallel) with sequence parallelism" in problem and "not parity-tested" in problem, problem
    assert engine_problem(1) is None

    def config(optimizer: str = "Muon", **extra) -> dict:
        return {"optimizer": {"type": optimizer}, "zero_optimization": {"stage": 3}, "expert_parallel": dict(AUTOEP),
                **extra}

    assert unserved_modes(config()) == [] and unserved_modes(config(zero_optimization={"stage": 2})) == []
    (adam_mini,) = unserved_modes(config("AdamMini"), "AdamMini")
    assert adam_mini.startswith("expert_parallel: AutoEP is not served by ds_muon's AdamMini") and "w1, w3" in adam_mini
    (tp,) = unserved_modes(config(zero_optimization={"stage": 2}, tensor_parallel={"autotp_size": 2}))
    assert tp.startswith("expert_parallel: AutoEP with tensor_parallel.autotp_size 2"), tp
    (universal,) = unserved_modes(config(checkpoint={"load_universal": True}))
    assert universal.startswith("checkpoint.load_universal: true with AutoEP"), universal

    def config_class(enabled: bool = True):
        return SimpleNamespace(expert_parallel_config=SimpleNamespace(enabled=enabled, preset_model=None))

    from transformers.utils import output_capturing
    affected = type(output_capturing._CAN_RECORD_REGISTRY) is not dict  # transformers >= 5.23
    msg = transformers_problem(config_class(), qwen3_moe())
    if affected:
        assert "_CanRecordRegistry.get() takes 2 positional arguments but 3 were given" in msg, msg
        assert "'qwen3_moe' preset" in msg and "transformers>=5.2,<5.23" in msg and "expert_parallel" in msg, msg
    else:
        assert msg is None, msg
    assert transformers_problem(config_class(enabled=False), qwen3_moe()) is None
    assert transformers_problem(config_class(), deepseek_v3()) is None  # its preset keeps the recorders
    with registry_shim():
        assert transformers_problem(config_class(), qwen3_moe()) is None


def _native_moe_at_stage_2(rank: int, world_size: int) -> dict:
    """ZeRO stage 2 (where DeepSpeed runs native MoE): ds_muon.initialize refuses it naming the reason; the
    zero-code path hands it to the built-in, which builds its ZeRO-1/2 optimizer and trains."""
    import deepspeed
    import torch

    import ds_muon
    from ds_muon.config import ConfigError
    from ds_muon.integration import hooks
    cfg = dict(_config("Muon"), zero_optimization={"stage": 2})
    out = {}
    try:
        model = _moe_model()
        ds_muon.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        out["explicit"] = "accepted"
    except ConfigError as exc:
        out["explicit"] = str(exc)
    hooks.auto_enable()
    try:
        model = _moe_model()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        out["auto"] = type(engine.optimizer).__name__
        loss = engine(torch.randint(0, 16, (1, 4))).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        out["trained"] = bool(torch.isfinite(loss))
        engine.destroy()
    finally:
        hooks.disable()
        hooks._auto = False
    return out


def test_native_moe_at_stage_2_is_handed_to_the_builtin():
    res = run_distributed(_native_moe_at_stage_2, 2)[0]
    assert "native MoE layers ('moe'" in res["explicit"] and "not serve yet" in res["explicit"], res
    assert res["auto"] == "DeepSpeedZeroOptimizer" and res["trained"], res
