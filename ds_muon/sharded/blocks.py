"""Block maps: which flat ranges of one rank's shard belong to which Newton–Schulz (or Adam-mini) block.

Layer ``sharded``, pure and deterministic, built once per Muon sub-group from the owner
plan's slots (shapes and each rank's piece, :mod:`ds_muon.partitions`) and the rank, with no process group. A *block* is
one matrix of a parameter's Newton–Schulz view (:func:`ds_muon.core.matrix.ns_view_shape`): the single
matrix of a 2-D or conv weight, or one expert of a stacked ``(E, m, n)`` parameter. Its elements
are contiguous in the flattened parameter, so on a rank's shard a block is at most one contiguous
range per parameter piece.

Used to find the blocks that got no gradient in a step (:mod:`ds_muon.sharded.no_grad`; docs/how-it-works.md,
"Steps with no gradient") and by Adam-mini's block sums (:mod:`ds_muon.sharded.adam_mini_step`):
``segment_reduce`` over the shard gives per-segment values (the largest and smallest gradient element; Adam-mini's
sums of squares), and the segments map to blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from ..core.matrix import ns_view_shape

PADDING = -1  # block id of a segment that is ZeRO-3 padding


@dataclass(frozen=True)
class BlockMap:
    """The blocks of one Muon sub-group, as seen from one rank's flat shard.

    Attributes:
        n_blocks: blocks in the sub-group (all ranks agree on their numbering: the slots' order,
            then the batch index of each parameter's view).
        lengths: element counts of consecutive segments that tile the local shard
            ``[0, shard_numel)`` exactly (a segment never spans two blocks).
        block_of_segment: block id of each segment, or :data:`PADDING`.
        block_names: ``"<parameter name>[k]"`` per block (``k`` the batch index), for messages.
    """

    n_blocks: int
    lengths: tuple[int, ...]
    block_of_segment: tuple[int, ...]
    block_names: tuple[str, ...]

    def local_ranges(self, blocks: Sequence[int]) -> list[tuple[int, int]]:
        """``(offset, length)`` in the local shard of every segment of the given block ids (elements)."""
        wanted = set(blocks)
        out, offset = [], 0
        for length, block in zip(self.lengths, self.block_of_segment):
            if block in wanted and length:
                out.append((offset, length))
            offset += length
        return out


def _order(slot) -> tuple[int, int]:
    """A global order of a sub-group's parameters, the same on every rank: the first rank that holds a piece of
    the parameter, and where it starts in that rank's shard (ZeRO-3: the shard order; ZeRO-1/2: the flat order)."""
    r = next((r for r, p in enumerate(slot.pieces) if p.length), 0)
    return r, slot.pieces[r].shard_offset


def build_block_map(slots: Sequence, rank: int, shard_numel: int,
                    block_numel: Optional[Callable[[object], int]] = None) -> BlockMap:
    """The :class:`BlockMap` of ``rank`` for a sub-group whose Muon (or Adam-mini) parameters are ``slots``.

    Args:
        slots: objects with ``name``, ``shape`` (logical parameter shape), ``numel`` and ``pieces`` (one
            :class:`~ds_muon.partitions.Piece` per rank: which elements of the parameter each rank holds, where
            in its shard, and how many shard elements belong to it, padding included), e.g.
            :class:`ds_muon.sharded.ownership.MatrixSlot`; any order. Blocks are numbered in a global parameter
            order (the same on every rank, also for parameters this rank holds no piece of).
        rank: this rank's index in the partition group, ``0 <= rank < W``.
        shard_numel: elements of the local flat shard.
        block_numel: ``slot -> elements per block`` (dividing ``slot.numel``; an Adam-mini block, see
            :mod:`ds_muon.model.adam_mini_blocks`); default: one block per matrix of the slot's Newton–Schulz view.

    Returns:
        The map. Shard elements not covered by a slot's piece are :data:`PADDING` segments.

    Raises:
        ValueError: pieces overlap or run past ``shard_numel``.
    """
    lengths: list[int] = []
    blocks: list[int] = []
    names: list[str] = []
    offset = 0
    local = []  # (slot, block size, first block id) of the slots this rank holds a piece of
    for slot in sorted(slots, key=_order):  # block ids: the global order
        if block_numel is not None:
            size = block_numel(slot)
        else:  # one block per matrix of the Newton–Schulz view (the slot's own: it knows conv weights)
            size = slot.numel // (getattr(slot, "ns_shape", None) or ns_view_shape(slot.shape))[0]
        if slot.pieces[rank].sent:
            local.append((slot, size, len(names)))
        names.extend(f"{slot.name}[{k}]" for k in range(slot.numel // size))
    # segments: this rank's shard order (the global order too, except where slots are held by disjoint rank sets:
    # the replicated Muon matrices under AutoTP, ds_muon.integration.tensor_parallel)
    for slot, size, base in sorted(local, key=lambda x: x[0].pieces[rank].shard_offset):
        piece = slot.pieces[rank]
        if piece.shard_offset < offset or piece.shard_offset + piece.sent > shard_numel:
            raise ValueError(f"block map: parameter {slot.name!r} at shard offset {piece.shard_offset} "
                             f"(+{piece.sent}) overlaps another or runs past the shard ({shard_numel} elements)")
        if piece.shard_offset > offset:
            lengths.append(piece.shard_offset - offset)
            blocks.append(PADDING)
        pos, end = piece.start, piece.start + piece.length  # in the flat parameter
        while pos < end:
            k = pos // size
            stop = min(end, (k + 1) * size)
            lengths.append(stop - pos)
            blocks.append(base + k)
            pos = stop
        if piece.sent > piece.length:
            lengths.append(piece.sent - piece.length)
            blocks.append(PADDING)
        offset = piece.shard_offset + piece.sent
    if offset < shard_numel:
        lengths.append(shard_numel - offset)
        blocks.append(PADDING)
    return BlockMap(len(names), tuple(lengths), tuple(blocks), tuple(names))
