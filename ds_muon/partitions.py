"""Partition layouts: which elements of each parameter each rank holds, and where in its flat shard (a base module: standard library only).

The owner plan (:mod:`ds_muon.sharded.ownership`), the block maps (:mod:`ds_muon.sharded.blocks`) and QK-clip's
ranges (:mod:`ds_muon.sharded.qk_clip`) take a parameter's :class:`Piece` on each rank as input, so one
implementation serves both layouts DeepSpeed uses:

* ZeRO-3 (:func:`chunked_pieces`): every parameter is cut into ``W`` chunks of ``ceil(numel / W)`` elements,
  zero padded; rank ``r`` holds chunk ``r``; a sub-group's shard concatenates its parameters' chunks in order.
* ZeRO-1/2 (:func:`flat_pieces`): a param group is one flat buffer (its parameters back to back, with
  DeepSpeed's alignment padding between them), cut into ``W`` partitions of equal size; a parameter lies in
  consecutive ranks' partitions, in pieces of unequal length.
* tensor parallelism (:class:`TensorParallelSplit`, :func:`tensor_parallel_pieces`): a matrix is cut into ``T``
  shards along one dim, and each shard is ZeRO-partitioned over its data-parallel group; its pieces over the
  ``T x D`` ranks are addressed in the matrix's *stacked* form (the flattened shards back to back, shard 0
  first), which is the row-major matrix itself for a column-parallel (dim 0) split.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["Piece", "TensorParallelSplit", "chunked_pieces", "flat_pieces", "tensor_parallel_pieces"]


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


@dataclass(frozen=True)
class TensorParallelSplit:
    """How a ``(rows, cols)`` matrix is cut across the ``T`` ranks of a tensor-parallel group.

    DeepSpeed's AutoTP (``deepspeed.module_inject.layers``): a column-parallel ``LinearLayer`` splits the weight's
    output dim (``dim=0``, rows), a row-parallel ``LinearAllreduce`` its input dim (``dim=1``, columns); tensor-parallel
    rank ``t`` holds the ``t``-th block of ``sizes[t]`` rows or columns.

    Attributes:
        shape: the full matrix ``(rows, cols)``.
        dim: 0 (rows split) or 1 (columns split).
        sizes: per tensor-parallel rank, its rows (``dim=0``) or columns (``dim=1``); they sum to ``shape[dim]``.

    Raises:
        ValueError: ``dim`` is not 0 or 1, or ``sizes`` do not sum to ``shape[dim]``.
    """

    shape: tuple[int, int]
    dim: int
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dim not in (0, 1) or len(self.shape) != 2 or sum(self.sizes) != self.shape[self.dim]:
            raise ValueError(f"tensor-parallel split of {self.shape} along dim {self.dim} into {self.sizes} does "
                             "not tile it")

    def shard_shape(self, t: int) -> tuple[int, int]:
        """Shape of tensor-parallel rank ``t``'s shard."""
        return (self.sizes[t], self.shape[1]) if self.dim == 0 else (self.shape[0], self.sizes[t])

    def stacked_offset(self, t: int) -> int:
        """Where shard ``t`` starts in the stacked form (elements)."""
        return sum(math.prod(self.shard_shape(k)) for k in range(t))


def tensor_parallel_pieces(split: TensorParallelSplit, shard_pieces: Sequence[Sequence[Piece]],
                           coords: Sequence[tuple[int, int]]) -> tuple[Piece, ...]:
    """The pieces of a tensor-parallel matrix over the whole ``T x D`` group, in its stacked form.

    Args:
        split: how the matrix is cut over the tensor-parallel group.
        shard_pieces: per tensor-parallel rank ``t``, the ``D`` pieces of its shard over its data-parallel group
            (:func:`flat_pieces` or :func:`chunked_pieces` of the shard), ``start`` counted in the flattened shard.
        coords: per rank ``g`` of the ``T x D`` group, its ``(tensor-parallel rank, data-parallel rank)``.

    Returns:
        One :class:`Piece` per rank ``g``: its data-parallel piece of its shard, ``start`` moved to the stacked form.

    Raises:
        ValueError: the shard pieces do not tile the shards.
    """
    out = []
    for t, pieces in enumerate(shard_pieces):
        if sum(p.length for p in pieces) != math.prod(split.shard_shape(t)):
            raise ValueError(f"tensor-parallel shard {t} of {split.shape}: pieces {tuple(pieces)} do not tile its "
                             f"{split.shard_shape(t)} elements")
    for t, d in coords:
        p = shard_pieces[t][d]
        out.append(Piece(p.start + split.stacked_offset(t) if p.length else 0, p.length, p.shard_offset, p.sent))
    return tuple(out)
