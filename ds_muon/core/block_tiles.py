r"""A flat shard's blocks as fixed-size tiles: per-block reductions and per-block values in one pass each.

Layer ``core`` (torch only). A rank's flat fp32 shard ``(n,)`` is tiled by its segments (consecutive element
ranges, each inside one block or padding: :class:`ds_muon.sharded.blocks.BlockMap`'s ``lengths`` and
``block_of_segment``). The Adam-mini step (:mod:`ds_muon.core.adam_update`; Zhang et al., arXiv:2406.16793)
needs two things per step: the sum of ``g**2`` over every block's elements, and an element-wise update in
which every element reads its block's denominator. Done per segment, both are slow on an accelerator when
blocks are large (a few segments of millions of elements: ``torch.segment_reduce`` and
``torch.repeat_interleave`` give each segment one thread block or warp) and slow in Python when blocks are
many (``block_rule: "neuron"``: one block per row).

:class:`BlockTiles` views the shard as ``(n_full, T)`` tiles of ``T`` elements (a power of two, chosen once,
:func:`choose_tile`) plus a tail of ``n - n_full*T``:

* a *clean* tile lies inside one segment, so one value per tile covers it: the per-tile sum of squares
  is one row reduction of the ``(n_full, T)`` view (no temporary of the shard's size), the per-tile
  value a ``(n_full, 1)`` column the element-wise update broadcasts;
* a *mixed* tile holds a segment boundary. The mixed tiles and the tail (the *mixed region*, at most
  ``T`` elements per segment boundary) are gathered into one short 1-D copy, reduced and updated element
  by element there, and written back.

The work per step is a fixed number of tensor operations, whatever the number of blocks or segments:
no Python loop over blocks, segments or tiles. Built once per sub-group (a Python loop over the
segments, O(segments)); cached on the device: ``int64`` tensors of ``O(runs + blocks + mixed tiles)``
elements (a *run* is a stretch of consecutive tiles with one block, or of mixed/padding tiles), nothing
of the shard's length. Per step it allocates ``O(n / T)`` per-tile temporaries (``4 n / T`` bytes of fp32
values plus torch's ``8 n / T`` byte index inside ``repeat_interleave``) and a few copies of the mixed
region.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

#: Tile sizes :func:`choose_tile` considers (elements; powers of two).
TILE_CANDIDATES = tuple(1 << k for k in range(6, 17))
#: What :func:`choose_tile` minimizes: ``MIXED_COST * mixed-region elements + full tiles`` (a mixed element is
#: gathered, updated on its own and written back, ~4x the traffic of a tile's entries in the per-tile vectors).
MIXED_COST = 4


def _merged(lengths: Sequence[int], block: Sequence[int], sentinel: int) -> tuple[list[int], list[int]]:
    """Segments with padding (id < 0) as ``sentinel`` and neighbours of one id merged; empty ones dropped."""
    out_len: list[int] = []
    out_id: list[int] = []
    for n, b in zip(lengths, block):
        if n <= 0:
            continue
        b = sentinel if b < 0 else int(b)
        if out_id and out_id[-1] == b:
            out_len[-1] += int(n)
        else:
            out_len.append(int(n))
            out_id.append(b)
    return out_len, out_id


def choose_tile(lengths: Sequence[int], candidates: Sequence[int] = TILE_CANDIDATES) -> int:
    """The tile size (elements) for a window whose segments have ``lengths``: the candidate that minimizes
    ``MIXED_COST * (elements in mixed tiles and the tail) + (full tiles)``; the largest among equals.

    Args:
        lengths: ``(k,)`` element counts of consecutive segments (already merged where neighbours share a block).
        candidates: tile sizes to consider (default :data:`TILE_CANDIDATES`).
    """
    n = int(sum(lengths))
    if n == 0:
        return int(max(candidates))
    ends = torch.tensor(list(lengths), dtype=torch.int64).cumsum(0)
    starts = ends - torch.tensor(list(lengths), dtype=torch.int64)
    best = None
    for tile in sorted(candidates, reverse=True):
        n_full = n // tile
        clean = ((ends // tile).clamp(max=n_full) - (starts + tile - 1) // tile).clamp(min=0).sum()
        cost = MIXED_COST * (n - tile * int(clean)) + n_full
        if best is None or cost < best[0]:
            best = (cost, tile)
    return best[1]


@dataclass(frozen=True)
class BlockTiles:
    """One window ``[start, start + numel)`` of a rank's flat shard as tiles (see the module docstring).

    Block ids are ``0 .. n_blocks - 1``; ``n_blocks`` itself is the *sentinel*: padding, and mixed tiles in the
    per-tile vectors. Every tensor is ``int64`` on the shard's device, built once by :func:`block_tiles`.

    Attributes:
        start, numel: where the window lies in the shard (elements).
        tile: ``T``, elements per tile. n_full: full tiles (``numel // T``); the tail is ``numel - n_full*T``.
        n_blocks: blocks in the sub-group (global numbering).
        run_lengths, run_block: ``(r,)``: the full tiles as runs of consecutive tiles with one id (a block, or
            the sentinel for mixed and padding tiles).
        clean_run: ``(n_blocks,)``: the run of each block's clean tiles, or ``r`` (none in this window).
        mixed_rows: ``(m,)``: the mixed tiles, ascending (the mixed region is these tiles, then the tail).
        mixed_lengths, mixed_block: ``(q,)``: the mixed region as runs of consecutive elements with one id.
        mixed_run: ``(n_blocks,)``: each block's run in the mixed region, or ``q`` (none).
        mixed_numel: elements in the mixed region (``m*T`` plus the tail).
    """

    start: int
    numel: int
    tile: int
    n_full: int
    n_blocks: int
    run_lengths: torch.Tensor
    run_block: torch.Tensor
    clean_run: torch.Tensor
    mixed_rows: torch.Tensor
    mixed_lengths: torch.Tensor
    mixed_block: torch.Tensor
    mixed_run: torch.Tensor
    mixed_numel: int

    def nbytes(self) -> int:
        """Bytes of the cached index tensors."""
        return sum(t.numel() * t.element_size() for t in (self.run_lengths, self.run_block, self.clean_run,
                                                          self.mixed_rows, self.mixed_lengths, self.mixed_block,
                                                          self.mixed_run))

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """``(n_full, T)`` view of the window's full tiles (``x``: the window, ``(numel,)``)."""
        return x.narrow(0, 0, self.n_full * self.tile).view(self.n_full, self.tile)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``(mixed_numel,)`` copy of the mixed region of the window ``x`` (``(numel,)``, any dtype)."""
        tail = x.narrow(0, self.n_full * self.tile, self.numel - self.n_full * self.tile)
        if not self.mixed_rows.numel():
            return tail.clone()
        return torch.cat([self._rows(x).index_select(0, self.mixed_rows).view(-1), tail])

    def scatter_(self, x: torch.Tensor, mixed: torch.Tensor) -> None:
        """Write ``mixed`` (``(mixed_numel,)``, from :meth:`gather`) back into the window ``x``'s mixed region."""
        rows = self.mixed_rows.numel() * self.tile
        if rows:
            self._rows(x).index_copy_(0, self.mixed_rows, mixed.narrow(0, 0, rows).view(-1, self.tile))
        x.narrow(0, self.n_full * self.tile, self.numel - self.n_full * self.tile).copy_(mixed.narrow(0, rows,
                                                                                                      mixed.numel() - rows))

    def sums_of_squares(self, x: torch.Tensor) -> torch.Tensor:
        """``(n_blocks,)`` float32: the sum of ``x**2`` over each block's elements in the window ``x``
        (``(numel,)`` float32), 0 for blocks with none. Deterministic: no atomics; the order of the sums
        depends on the layout only (per tile, then per run; the mixed region per run)."""
        out = torch.zeros(self.n_blocks, dtype=torch.float32, device=x.device)
        if self.n_full:  # per tile: one row reduction of the (n_full, T) view, no temporary of the window's size
            per_tile = torch.linalg.vector_norm(self._rows(x), dim=1).square_()
            runs = torch.segment_reduce(per_tile, "sum", lengths=self.run_lengths, unsafe=True)
            out += torch.cat([runs, runs.new_zeros(1)]).index_select(0, self.clean_run)
        if self.mixed_numel:
            mixed = self.gather(x)
            runs = torch.segment_reduce(mixed.mul_(mixed), "sum", lengths=self.mixed_lengths, unsafe=True)
            out += torch.cat([runs, runs.new_zeros(1)]).index_select(0, self.mixed_run)
        return out

    def apply_(self, fn: Callable[..., None], tensors: Sequence[torch.Tensor], block_values: torch.Tensor,
               mutated: Sequence[int], args: tuple = (), mixed_fn: Optional[Callable[..., None]] = None) -> None:
        """``fn(*tensors, d, *args)`` on every element of the window, in place, ``d`` each element's block value.

        Args:
            fn: an element-wise in-place function; called once on the ``(n_full, T)`` views of ``tensors`` with
                ``d`` a ``(n_full, 1)`` column (broadcast over each tile), and ``mixed_fn`` (default ``fn``)
                once on 1-D copies of their mixed region with ``d`` per element. Mixed tiles get the sentinel's
                value in the first call; their results there are overwritten by the second.
            args: more arguments of ``fn`` (e.g. scalars).
            tensors: ``(numel,)`` windows of the shard's tensors (float32), all the same length.
            block_values: ``(n_blocks + 1,)`` float32, one value per block, then the sentinel's (padding: e.g. 1).
            mutated: indices into ``tensors`` of those ``fn`` writes (their mixed region is written back).
            mixed_fn: the function of the mixed region (e.g. the eager form of a compiled ``fn``).
        """
        mixed = [self.gather(t) for t in tensors] if self.mixed_numel else None
        if self.n_full:
            d = torch.repeat_interleave(block_values.index_select(0, self.run_block), self.run_lengths,
                                        output_size=self.n_full)
            fn(*(self._rows(t) for t in tensors), d.view(-1, 1), *args)
        if mixed is not None:
            d = torch.repeat_interleave(block_values.index_select(0, self.mixed_block), self.mixed_lengths,
                                        output_size=self.mixed_numel)
            (mixed_fn or fn)(*mixed, d, *args)
            for k in mutated:
                self.scatter_(tensors[k], mixed[k])


def block_tiles(lengths: Sequence[int], block_of_segment: Sequence[int], n_blocks: int, device: torch.device,
                start: int = 0, tile: Optional[int] = None) -> BlockTiles:
    """The :class:`BlockTiles` of one window of a shard, built once (O(segments) Python, then to ``device``).

    Args:
        lengths: element counts of the consecutive segments that tile the window exactly.
        block_of_segment: each segment's block id in ``[0, n_blocks)``, or negative for padding. A block's
            elements in the window must be one contiguous range (:func:`ds_muon.sharded.blocks.build_block_map`
            gives each block at most one segment per rank).
        n_blocks: blocks in the sub-group. device: where the index tensors live (the shard's device).
        start: the window's first element in the shard (recorded only).
        tile: elements per tile; default :func:`choose_tile`.

    Raises:
        ValueError: a block has two separate ranges in the window.
    """
    seg_len, seg_id = _merged(lengths, block_of_segment, n_blocks)
    numel = sum(seg_len)
    tile = int(tile or choose_tile(seg_len))
    n_full = numel // tile
    runs: list[list[int]] = []  # [id, tiles]
    mixed_rows: list[int] = []
    mixed: list[list[int]] = []  # [id, elements]
    seen: set[int] = set()
    pos = nxt = 0  # pos: the segment's first element; nxt: the first full tile not yet in a run

    def add(out: list, ident: int, count: int) -> None:
        if count <= 0:
            return
        if out and out[-1][0] == ident:
            out[-1][1] += count
        else:
            out.append([ident, count])

    for n, ident in zip(seg_len, seg_id):
        if ident != n_blocks:
            if ident in seen:
                raise ValueError(f"block tiles: block {ident} has two separate ranges in one window")
            seen.add(ident)
        first, end = -(-pos // tile), min((pos + n) // tile, n_full)  # its clean tiles: [first, end)
        clean = max(0, end - first)
        if clean:
            add(runs, n_blocks, first - nxt)  # the tiles before it hold a boundary: mixed
            mixed_rows.extend(range(nxt, first))
            add(runs, ident, clean)
            nxt = end
        add(mixed, ident, n - clean * tile)  # its elements outside clean tiles, contiguous in the mixed region
        pos += n
    add(runs, n_blocks, n_full - nxt)
    mixed_rows.extend(range(nxt, n_full))

    def index(out: list) -> torch.Tensor:  # (n_blocks,): each block's run in ``out``, or len(out) for none
        where = torch.full((n_blocks,), len(out), dtype=torch.int64)
        ids = [k for k, (ident, _) in enumerate(out) if ident != n_blocks]
        if ids:
            where[torch.tensor([out[k][0] for k in ids], dtype=torch.int64)] = torch.tensor(ids, dtype=torch.int64)
        return where.to(device)

    def column(out: list, k: int) -> torch.Tensor:
        return torch.tensor([r[k] for r in out], dtype=torch.int64, device=device)

    return BlockTiles(start=start, numel=numel, tile=tile, n_full=n_full, n_blocks=n_blocks,
                      run_lengths=column(runs, 1), run_block=column(runs, 0), clean_run=index(runs),
                      mixed_rows=torch.tensor(mixed_rows, dtype=torch.int64, device=device),
                      mixed_lengths=column(mixed, 1), mixed_block=column(mixed, 0), mixed_run=index(mixed),
                      mixed_numel=len(mixed_rows) * tile + numel - n_full * tile)
