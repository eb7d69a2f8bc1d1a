"""The "basic" optimizers DeepSpeed's ZeRO wraps when the config says ``"Muon"`` or ``"AdamMini"`` (layer ``integration``).

DeepSpeed builds the inner optimizer from the config (``DeepSpeedEngine._configure_basic_optimizer``) and the
ZeRO optimizer around it. ds_muon's inner optimizers hold every param group (each with its
``"algorithm"``, :data:`ds_muon.names.ALGORITHM_KEY`) and one ``state`` dict; the element-wise AdamW groups
are stepped by DeepSpeed's own AdamW class (FusedAdam, DeepSpeedCPUAdam under optimizer offload, or
``torch.optim.AdamW`` with ``torch_adam``), which shares these group dicts and this state, so checkpoints see
a single optimizer. Muon and Adam-mini groups are stepped by the ZeRO optimizer subclass
(:class:`ds_muon.integration.zero3.MuonZeroOptimizer` at stage 3, :class:`ds_muon.integration.zero12.MuonZero12Optimizer`
at stages 1 and 2), which needs the owner exchange.

They are deliberately not DeepSpeed's ``MuonWithAuxAdam``: that class switches on the built-in ZeRO-3 Muon
path, which must never run alongside ds_muon's.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..names import ADAMW, ALGORITHM_KEY, MOMENTUM_KEY, MUON, algorithm_of

__all__ = ["DsMuonInner", "ZeroMuonInner", "ZeroAdamMiniInner", "cast_momentum_"]

AdamWFactory = Callable[[list[dict]], torch.optim.Optimizer]


def cast_momentum_(state: dict, group: dict) -> None:
    """Store ``state``'s Muon momentum (if any) in the group's ``momentum_dtype`` (loads give fp32)."""
    momentum = state.get(MOMENTUM_KEY)
    dtype = getattr(torch, group.get("momentum_dtype", "float32"))
    if momentum is not None and momentum.dtype != dtype:
        state[MOMENTUM_KEY] = momentum.to(dtype)


class DsMuonInner(torch.optim.Optimizer):
    """What ds_muon's inner optimizers share: the param groups, the element-wise AdamW, and loading.

    Args:
        param_groups: groups with ``"algorithm"`` (``"muon"``, ``"adam_mini"`` or ``"adamw"``; default: what
            ``"use_muon"`` implies, :func:`ds_muon.names.algorithm_of`) and ``"use_muon"``.
        adamw_factory: ``groups -> torch.optim.Optimizer`` for the ``"adamw"`` groups, or None.
        config: the validated optimizer params (:class:`ds_muon.config.MuonOptimizerParams` or
            :class:`~ds_muon.config.AdamMiniOptimizerParams`).
    """

    #: the ``optimizer.type`` this inner optimizer serves ("Muon", "AdamMini")
    optimizer_type = ""

    def __init__(self, param_groups: list[dict], adamw_factory: Optional[AdamWFactory], config) -> None:
        # a group without "algorithm" (built by hand with DeepSpeed's "use_muon" only) gets the one it implies
        super().__init__([dict(g, **{ALGORITHM_KEY: algorithm_of(g)}) for g in param_groups], {})
        self.config = config
        self.adamw = None
        adam_groups = self._elementwise_groups()
        if adam_groups and adamw_factory is not None:
            self.adamw = adamw_factory(adam_groups)
        self._share_with_adamw()

    def _elementwise_groups(self) -> list[dict]:
        return [g for g in self.param_groups if g[ALGORITHM_KEY] == ADAMW]

    def _share_with_adamw(self) -> None:
        if self.adamw is None:
            return
        adam_groups = self._elementwise_groups()
        for group in adam_groups:
            for key, value in self.adamw.defaults.items():
                group.setdefault(key, value)
        self.adamw.param_groups = adam_groups
        self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        """Load as ``torch.optim.Optimizer`` does (which casts state to the fp32 partitions' dtype and takes the
        saved groups' hyperparameters), keep this run's ``algorithm`` (groups of checkpoint format 1 as first written
        have none; the fit checks compared them) and ``momentum_dtype`` (the config's, not the checkpoint's: a
        bf16 momentum must not reach an NVMe swapper the config checks assumed fp32 for), put each Muon
        momentum in it, then re-share groups and state with the AdamW."""
        live = [(algorithm_of(g), g.get("momentum_dtype")) for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, (algorithm, dtype) in zip(self.param_groups, live):
            group[ALGORITHM_KEY] = algorithm
            group.pop("adam_mini", None)  # the flag of older checkpoints; "algorithm" says it now
            if dtype is not None:
                group["momentum_dtype"] = dtype
            if algorithm == MUON:
                for p in group["params"]:
                    cast_momentum_(self.state.get(p, {}), group)
        self._share_with_adamw()

    @torch.no_grad()
    def step(self, closure=None):
        """Step the element-wise AdamW groups in ``self.param_groups`` that hold parameters.

        ZeRO-3 leaves ``params`` empty except in the sub-group it steps; ZeRO-1/2 replace ``self.param_groups`` by
        ``[the group]`` while they step it. Either way only the groups listed now are stepped.

        Raises:
            RuntimeError: a Muon or Adam-mini group holds parameters (those are stepped by the ZeRO optimizer
                subclass, :class:`~ds_muon.integration.zero3.MuonZeroOptimizer` or
                :class:`~ds_muon.integration.zero12.MuonZero12Optimizer`).
        """
        for group in self.param_groups:
            if group[ALGORITHM_KEY] != ADAMW and group["params"]:
                raise RuntimeError("Muon and Adam-mini param groups are stepped by ds_muon's ZeRO optimizer "
                                   "(MuonZeroOptimizer, MuonZero12Optimizer), not by the inner optimizer; was the "
                                   "engine built with a ZeRO stage ds_muon serves (1, 2 or 3)?")
        if self.adamw is None:
            return closure() if closure is not None else None
        current = self._elementwise_groups()
        everything = self.adamw.param_groups
        if len(current) == len(everything):
            return self.adamw.step(closure)
        self.adamw.param_groups = current
        try:
            return self.adamw.step(closure)
        finally:
            self.adamw.param_groups = everything


class ZeroMuonInner(DsMuonInner):
    """The inner optimizer for ``"type": "Muon"`` at every ZeRO stage: Muon groups (from
    :func:`ds_muon.model.param_groups.split_param_groups`) and the AdamW groups; ``config`` is the validated
    :class:`ds_muon.config.MuonOptimizerParams`. (At stages 1/2 DeepSpeed's own Muon path, which it switches on by
    this class's name, is kept off by :class:`~ds_muon.integration.builtin_muon.BuiltinMuonSwitch`.)"""

    optimizer_type = "Muon"




class ZeroAdamMiniInner(DsMuonInner):
    """The inner optimizer for ``"type": "AdamMini"``: groups from
    :func:`ds_muon.model.adam_mini_blocks.adam_mini_param_groups` (``"adam_mini"`` groups, parameters tagged with
    their block size, and per-element ``"adamw"`` groups: Adam-mini with one-element blocks); ``config`` is the
    validated :class:`ds_muon.config.AdamMiniOptimizerParams`."""

    optimizer_type = "AdamMini"


def __getattr__(name: str):
    # FlatPartitionInner: the ZeRO-1/2 inner optimizer's name before the explicit switch (a name without "muon", to keep
    # DeepSpeed's own ZeRO-1/2 Muon path off); now ZeroMuonInner serves every stage.
    if name == "FlatPartitionInner":
        import warnings
        warnings.warn("ds_muon.integration.inner.FlatPartitionInner is deprecated: ZeroMuonInner is the inner "
                      "optimizer at every ZeRO stage", DeprecationWarning, stacklevel=2)
        return ZeroMuonInner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
