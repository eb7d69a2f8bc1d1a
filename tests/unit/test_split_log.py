"""The start-up parameter split users read: trainable parameters only, a frozen line, the rule per side,
shown whenever DeepSpeed's logger is at INFO (its handler stays at WARNING; Trainer lowers the logger only)."""
from __future__ import annotations

import io
import logging

import torch
from torch import nn

CONFIG = {"optimizer": {"type": "Muon", "params": {"lr": 0.02}}, "zero_optimization": {"stage": 3}}


class Cfg:  # what DeepSpeed hands to set_optimizer_flags: its config object with the raw dict
    _param_dict = CONFIG


def _lora_like() -> nn.Module:
    """Two frozen base linears with trainable low-rank A/B adapters, a trainable norm and head."""
    torch.manual_seed(0)
    m = nn.ModuleDict({"embed": nn.Embedding(16, 8), "base0": nn.Linear(8, 8), "a0": nn.Linear(8, 2, bias=False),
                       "b0": nn.Linear(2, 8, bias=False), "base1": nn.Linear(8, 8), "norm": nn.LayerNorm(8),
                       "head": nn.Linear(8, 16, bias=False)})
    for name in ("embed", "base0", "base1"):
        m[name].requires_grad_(False)
    return m


def _split_output(level: int) -> str:
    """What DeepSpeed's own handler prints while its logger is at ``level`` (the handler is untouched)."""
    from deepspeed.utils import logger as ds_logger
    from ds_muon.integration import hooks as integration
    old_level, buffer = ds_logger.level, io.StringIO()
    # DeepSpeed's own stdout handler only (pytest may have added capture handlers at level 0)
    handlers = [h for h in ds_logger.handlers if type(h) is logging.StreamHandler]
    old_streams = [h.setStream(buffer) for h in handlers]
    ds_logger.setLevel(level)  # what Trainer(log_level=...) does: the logger only, not its handler
    try:
        integration._set_optimizer_flags(Cfg(), _lora_like())
        return buffer.getvalue()
    finally:
        ds_logger.setLevel(old_level)
        for h, stream in zip(handlers, old_streams):
            h.setStream(stream)


def test_split_shows_at_info_and_counts_trainable_only() -> None:
    out = _split_output(logging.INFO)
    assert "ds_muon parameter split (trainable parameters only)" in out
    lines = out.splitlines()
    muon = next(line for line in lines if line.strip().startswith("Muon "))
    adamw = next(line for line in lines if line.strip().startswith("AdamW "))
    frozen = next(line for line in lines if line.strip().startswith("frozen"))
    assert muon.split()[1:3] == ["2", "params"]  # a0, b0: the adapters, not the frozen base weights
    assert adamw.split()[1:3] == ["3", "params"]  # norm weight+bias, head; not the frozen embedding
    assert frozen.split()[1:3] == ["5", "params"] and "requires_grad=False" in frozen
    assert "embed.weight" in frozen and "base0.weight" in frozen
    assert 'rule "hidden linear/conv weight": 2 params' in out
    assert 'rule "output head": 1 params' in out and 'rule "0-D/1-D (norm, bias, scalar)": 2 params' in out
    assert "embedding" not in out.split("frozen")[0]  # the frozen embedding is on no side


def test_split_hidden_at_warning() -> None:
    assert "parameter split" not in _split_output(logging.WARNING)
