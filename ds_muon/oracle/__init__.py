"""The single-device optimizers every distributed path is compared with (layer ``oracle``).

:class:`~ds_muon.oracle.muon_adamw.MuonAdamW` (Muon with an auxiliary AdamW) and
:class:`~ds_muon.oracle.adam_mini.AdamMini`, built from the same config models and the same ``core`` math.
"""
from __future__ import annotations

from .adam_mini import AdamMini
from .muon_adamw import MuonAdamW

__all__ = ["MuonAdamW", "AdamMini"]
