"""Partition layouts: which elements of each parameter each rank holds, and where in its flat shard (a base module: standard library only).

The owner plan (:mod:`ds_muon.sharded.ownership`), the block maps (:mod:`ds_muon.sharded.blocks`) and QK-clip's
ranges (:mod:`ds_muon.sharded.qk_clip`) take a parameter's :class:`Piece` on each rank as input, so one
implementation serves both layouts DeepSpeed uses:

* ZeRO-3 (:func:`chunked_pieces`): every parameter is cut into ``W`` chunks of ``ceil(numel / W)`` elements,
  zero padded; rank ``r`` holds chunk ``r``; a sub-group's shard concatenates its parameters' chunks in order.
* ZeRO-1/2 (:func:`flat_pieces`): a param group is one flat buffer (its parameters back to back, with
  DeepSpeed's alignment padding between them), cut into ``W`` partitions of equal size; a parameter lies in
  consecutive ranks' partitions, in pieces of unequal length.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Piece", "chunked_pieces", "flat_pieces"]


@dataclass(frozen=True)
class Piece:
    """One rank's piece of one parameter.

    Attributes:
        start: first element of the flattened (row-major) parameter this rank holds.
        length: elements of the parameter this rank holds (0 when it holds none).
        shard_offset: where they start in this rank's flat shard (elements).
        sent: elements this rank exchanges for the parameter, from ``shard_offset``: ``length``, or, in
            ZeRO-3's chunked layout, the whole padded chunk (its tail past ``length`` is zero padding).
    """

    start: int
    length: int
    shard_offset: int
    sent: int


def chunked_pieces(numel: int, world_size: int, shard_offset: int) -> tuple[Piece, ...]:
    """ZeRO-3's pieces of a parameter of ``numel`` elements whose chunk starts at ``shard_offset`` of every
    rank's shard: rank ``r`` holds ``[r c, min((r+1) c, numel))`` with ``c = ceil(numel / W)`` and sends the
    whole padded chunk ``c``."""
    chunk = math.ceil(numel / world_size)
    return tuple(Piece(r * chunk, max(0, min(chunk, numel - r * chunk)), shard_offset, chunk)
                 for r in range(world_size))


def flat_pieces(offset: int, numel: int, partition_numel: int, world_size: int) -> tuple[Piece, ...]:
    """ZeRO-1/2's pieces of a parameter at elements ``[offset, offset + numel)`` of a flat buffer that is cut
    into ``world_size`` partitions of ``partition_numel`` elements (rank ``r`` holds
    ``[r * partition_numel, (r+1) * partition_numel)``); each rank sends exactly its piece.

    Raises:
        ValueError: the parameter runs past the last partition.
    """
    if offset < 0 or offset + numel > partition_numel * world_size:
        raise ValueError(f"a parameter at [{offset}, {offset + numel}) does not fit {world_size} partitions of "
                         f"{partition_numel} elements")
    pieces = []
    for r in range(world_size):
        lo, hi = max(offset, r * partition_numel), min(offset + numel, (r + 1) * partition_numel)
        length = max(0, hi - lo)
        pieces.append(Piece(lo - offset if length else 0, length, lo - r * partition_numel if length else 0, length))
    return tuple(pieces)
