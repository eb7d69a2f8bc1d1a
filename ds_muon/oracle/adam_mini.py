"""The single-device Adam-mini (layer ``oracle``): the reference the sharded Adam-mini step is compared with.

Zhang et al., "Adam-mini: Use Fewer Learning Rates To Gain More", arXiv:2406.16793.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import parse_adam_mini_params
from ..core.adam_update import adam_mini_update_, adamw_update_
from ..model.adam_mini_blocks import adam_mini_param_groups
from ..names import ADAM_MINI, ALGORITHM_KEY, BLOCK_ATTR, BLOCK_STATE_KEY, algorithm_of


class AdamMini(torch.optim.Optimizer):
    r"""Adam-mini on one device (the oracle of the ZeRO-3 Adam-mini step).

    The math is :mod:`ds_muon.core.adam_update`'s, the block rules :mod:`ds_muon.model.adam_mini_blocks`'s.
    State per parameter: ``step`` (int), ``exp_avg`` (fp32, the parameter's shape) and either ``exp_avg_sq`` (fp32, the
    parameter's shape; per-element parameters) or ``block_exp_avg_sq`` (fp32, ``(numel / block,)``).
    A parameter whose ``.grad`` is None is skipped, as in ``torch.optim``.

    Args:
        params: an ``nn.Module`` (blocks from :func:`ds_muon.model.adam_mini_blocks.adam_mini_plan`), or the groups
            of :func:`ds_muon.model.adam_mini_blocks.adam_mini_param_groups` (parameters tagged with their block).
        **hyperparameters: the keys of ``"optimizer": {"type": "AdamMini", "params": {...}}``
            (:class:`ds_muon.config.AdamMiniOptimizerParams`): ``lr``, ``betas``, ``eps``,
            ``weight_decay``, ``block_rule``, ``decay_norms_and_biases``.

    Raises:
        ds_muon.errors.ConfigError: a bad hyperparameter (names the key and the allowed values).
        ValueError: a parameter's block does not divide its numel.
    """

    def __init__(self, params: Any, **hyperparameters: Any) -> None:
        cfg = parse_adam_mini_params(hyperparameters, path="AdamMini")
        groups = (adam_mini_param_groups(params, cfg.group_defaults(), cfg.block_rule, cfg.decay_norms_and_biases)
                  if isinstance(params, nn.Module) else [dict(g, **{ALGORITHM_KEY: algorithm_of(g)}) for g in params])
        for group in groups:
            for p in group["params"]:
                block = getattr(p, BLOCK_ATTR, None)
                if group[ALGORITHM_KEY] == ADAM_MINI and (not block or p.numel() % block):
                    raise ValueError(f"a parameter of shape {tuple(p.shape)} has Adam-mini block {block}, which does "
                                     "not divide its numel")
        super().__init__(groups, {})
        self.config = cfg

    @torch.no_grad()
    def step(self, closure=None):
        """Apply one update to every parameter that has a gradient. Returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                block = getattr(p, BLOCK_ATTR, None) if algorithm_of(group) == ADAM_MINI else None
                if "step" not in state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    if block is None:
                        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                    else:
                        state[BLOCK_STATE_KEY] = torch.zeros(p.numel() // block, dtype=torch.float32, device=p.device)
                state["step"] += 1
                hyper = (state["step"], group["lr"], tuple(group["betas"]), group["eps"], group["weight_decay"])
                if block is None:
                    adamw_update_(p, p.grad.float(), state["exp_avg"], state["exp_avg_sq"], *hyper)
                else:
                    adam_mini_update_(p, p.grad.float(), state["exp_avg"], state[BLOCK_STATE_KEY], block, *hyper)
        return loss

