"""QK-clip on ZeRO partitions: which flat ranges of a rank's shard hold which head (layer ``sharded``).

The spans come from :func:`ds_muon.model.attention.factor_spans` (a head's rows are one contiguous
range of its flattened parameter); here they are intersected with this rank's piece of each
parameter (:mod:`ds_muon.partitions`), once at start-up, and scaled element-wise on the local fp32 partition after the
optimizer update (no gather). The rule is :mod:`ds_muon.core.qk_clip`.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from ..core.qk_clip import scale_rows_
from ..errors import ConfigError
from ..partitions import Piece

__all__ = ["local_span", "shard_ranges", "scale_shard_"]

#: ``param -> (key, this rank's Piece of it)``, or None: not stepped here.
Locate = Callable[[Any], Optional[tuple[Any, Piece]]]


def local_span(lo: int, hi: int, piece: Piece) -> Optional[tuple[int, int]]:
    """The part of the flat element range ``[lo, hi)`` of a parameter that this rank's ``piece`` holds.

    Returns:
        ``(offset in the rank's shard, length)`` (elements), or None when the piece holds none of it.
    """
    a, b = max(lo, piece.start), min(hi, piece.start + piece.length)
    return (piece.shard_offset + a - piece.start, b - a) if a < b else None


def shard_ranges(spans: Sequence[tuple[Any, int, int, int, bool]], names: dict[int, str],
                 locate: Locate) -> dict[Any, list[tuple[int, int, int, bool]]]:
    """Per partition (a ZeRO sub-group), the flat ranges of its local shard to scale and their factor index.

    Args:
        spans: ``[(param, lo, hi, k, plus_one)]`` from :func:`ds_muon.model.attention.factor_spans`.
        names: ``{id(param): name}`` for messages.
        locate: where each parameter's chunk lies (see :data:`Locate`).

    Returns:
        ``{key: [(offset in the local shard, length, index into the factor vector, plus_one)]}``.

    Raises:
        ConfigError: a query/key parameter is not trainable (``locate`` returned None).
    """
    out: dict[Any, list[tuple[int, int, int, bool]]] = {}
    for param, lo, hi, k, plus_one in spans:
        where = locate(param)
        if where is None:
            raise ConfigError(f"optimizer.params.qk_clip: {names.get(id(param), '?')!r} is not trained by this "
                              "optimizer (frozen?); QK-clip scales the query and key weights after each step, so "
                              "they must be trainable (or disable qk_clip)")
        key, piece = where
        part = local_span(lo, hi, piece)
        if part is not None:
            out.setdefault(key, []).append((part[0], part[1], k, plus_one))
    return out


def scale_shard_(flat: torch.Tensor, ranges: Sequence[tuple[int, int, int, bool]], factors: Sequence[float]) -> None:
    """In place on a local partition ``(n,)``: every range times its factor (``factors`` as Python floats;
    ranges whose factor is 1 are not touched; a ``plus_one`` gain ``w``, applied as ``1 + w``, becomes
    ``f * w + (f - 1)``)."""
    for offset, n, k, plus_one in ranges:
        if factors[k] != 1.0:
            scale_rows_(flat.narrow(0, offset, n), factors[k], plus_one)
