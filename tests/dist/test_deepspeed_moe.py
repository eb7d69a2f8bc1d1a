"""DeepSpeed's native MoE layers (``deepspeed.moe.layer.MoE``) under ds_muon.

DeepSpeed 0.19.8 itself refuses native MoE layers with ZeRO stage 3
(``DeepSpeedEngine._validate_zero3_moe_compatibility``), and ds_muon serves only stage 3, so ds_muon
refuses them first, with the reason and what to use instead. Both halves are asserted: if a future
DeepSpeed accepts native MoE under ZeRO-3, the first check fails and says to revisit this.
"""
from __future__ import annotations

import pytest

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
    assert "native MoE layers ('moe'" in msg and "ZeRO stage 3" in msg and "0.19.8" in msg, msg
    assert "stacked expert weights" in msg, msg


def test_autoep_layers_are_refused_naming_the_key():
    """AutoEP (DeepSpeed's ZeRO-3 expert parallelism) is refused until it is parity-tested."""
    from types import SimpleNamespace

    from torch import nn

    from ds_muon.config import ConfigError
    from ds_muon.integration.hooks import _check_moe_layers
    _check_moe_layers(SimpleNamespace(has_moe_layers=False, module=nn.Linear(2, 2)))  # no MoE: passes
    with pytest.raises(ConfigError, match=r'AutoEP MoE layers \("expert_parallel"\).*not parity-tested.*stacked'):
        _check_moe_layers(SimpleNamespace(has_moe_layers=True, module=nn.Linear(2, 2)))
