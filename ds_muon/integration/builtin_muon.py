"""ds_muon's switch for DeepSpeed's own ZeRO-1/2 Muon path (layer ``integration``).

DeepSpeed 0.19.8's ``DeepSpeedZeroOptimizer`` decides by the inner optimizer's class name whether it runs its built-in
Muon update inside gradient reduction (Newton–Schulz on each gradient partition it builds, per gradient-accumulation
boundary): ``_is_muon_group`` (``use_muon`` on the group's first parameter and ``'muon' in
type(self.optimizer).__name__.lower()``) picks the group's momentum buffer and staging, and ``get_flat_partition`` /
``_get_flat_partition_unpadded`` test the same two things inline for every parameter before calling
``muon_update``. ds_muon steps its Muon groups itself (the owner exchange), so that path must stay off whatever the
inner optimizer is called: :class:`BuiltinMuonSwitch` makes it depend on :attr:`BuiltinMuonSwitch.builtin_muon`
(False for ds_muon's optimizer) instead of on a class name, so the inner optimizer keeps its honest name
(:class:`~ds_muon.integration.inner.ZeroMuonInner`, "muon" in it, as DeepSpeed's own tests expect).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch

from ..names import USE_MUON_ATTR

__all__ = ["BuiltinMuonSwitch", "use_muon_hidden"]


@contextlib.contextmanager
def use_muon_hidden(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """For the block, ``use_muon`` reads False on each of ``params`` that carries it; restored afterwards (also on an
    exception). The selection tags themselves are ds_muon's (``param.use_muon``): only DeepSpeed's reduction code
    runs while they are hidden."""
    tagged = [(p, getattr(p, USE_MUON_ATTR)) for p in params if getattr(p, USE_MUON_ATTR, False)]
    for p, _ in tagged:
        setattr(p, USE_MUON_ATTR, False)
    try:
        yield
    finally:
        for p, value in tagged:
            setattr(p, USE_MUON_ATTR, value)


class BuiltinMuonSwitch:
    """Mixin for a ``DeepSpeedZeroOptimizer`` subclass (before it in the bases): DeepSpeed's built-in ZeRO-1/2 Muon
    path runs only when :attr:`builtin_muon` is True, whatever the inner optimizer's class name."""

    #: Whether DeepSpeed's own per-boundary Muon update runs (ds_muon's ZeRO-1/2 optimizer: False, it steps Muon).
    builtin_muon = False

    def _is_muon_group(self, tensor_list: Sequence[torch.Tensor]) -> bool:
        """DeepSpeed's test of a group for its Muon path (by the inner optimizer's class name), gated by
        :attr:`builtin_muon`."""
        return self.builtin_muon and super()._is_muon_group(tensor_list)

    def get_flat_partition(self, tensor_list: Sequence[torch.Tensor], *args: Any, **kwargs: Any):
        """DeepSpeed's flat gradient partition of ``tensor_list``; unless :attr:`builtin_muon`, with the parameters'
        ``use_muon`` hidden for the call (:func:`use_muon_hidden`), which its per-parameter Muon test reads beside the
        class name, so the partition holds the reduced gradients as DeepSpeed's AdamW path builds it."""
        if self.builtin_muon:
            return super().get_flat_partition(tensor_list, *args, **kwargs)
        with use_muon_hidden(tensor_list):
            return super().get_flat_partition(tensor_list, *args, **kwargs)
