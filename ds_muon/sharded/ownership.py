"""The owner plan: which rank of a partition group orthogonalizes which Muon matrix (layer ``sharded``).

Pure and deterministic (docs/design.md, "One optimizer step"): built from shapes and a partition layout
alone, identically on every rank, so no collective is needed to agree on it (one checks it once, when the
optimizer is built: :func:`ds_muon.sharded.plan_check.check_plans_agree`). One plan per Muon sub-group
(ZeRO-3) or per Muon param group (ZeRO-1/2).

The layout is an input (:class:`~ds_muon.partitions.Piece`: which elements of each parameter each rank
holds, and where in its flat shard). Two layouts occur:

* ZeRO-3 (*chunked*, :func:`~ds_muon.partitions.chunked_pieces`): a parameter of ``numel`` elements is cut into ``W`` chunks of ``chunk = ceil(numel / W)``
  elements, zero padded past ``numel``; rank ``r`` holds chunk ``r``; a sub-group's local shard concatenates
  its parameters' chunks in order, so every rank's shard has the same structure. Each rank sends its whole
  padded chunk (``Piece.sent == chunk``).
* ZeRO-1/2 (*flat*, :func:`~ds_muon.partitions.flat_pieces`): a param group is one flat buffer cut into ``W`` equal partitions, so a parameter lies in
  one or several consecutive ranks' partitions in pieces of unequal length; each rank sends exactly its piece.

Exchange layout (both directions use the same per-rank ordering):

* Every rank ``s`` sends to owner ``d`` its pieces of the matrices ``d`` owns, in plan order:
  ``sends[s][d] = sum(piece.sent for the slots owned by d)`` elements.
* Owner ``d`` receives the blocks of ``sends[s][d]`` elements from every ``s``, in rank order; a matrix it owns
  occupies ``[owner_offsets[s], owner_offsets[s] + pieces[s].sent)`` of source ``s``'s block. In the chunked
  layout every row has the same length (``split_sizes[d]``), so the owner's buffer is a ``(W, split_sizes[d])``
  block and, row-major over ``(W, chunk)``, a matrix is its full padded flat form.
* The way back is the transpose: owner ``d`` sends source ``s`` its block back, holding its own pieces of the
  orthogonalized matrices in the order it sent them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from ..core.matrix import MatrixView, Split, matrix_view
from ..partitions import Piece, TensorParallelSplit, chunked_pieces


@dataclass(frozen=True)
class MatrixSlot:
    """One Muon parameter in a plan.

    Attributes:
        index: position of the parameter in the sub-group's parameter list.
        name: parameter name (for messages).
        shape: logical parameter shape.
        ns_shape: ``(batch, rows, cols)`` view Newton–Schulz runs on.
        numel: logical element count.
        pieces: one :class:`Piece` per rank of the partition group.
        owner: rank that runs Newton–Schulz on it.
        owner_offsets: per source rank, where this parameter's piece starts in the block the owner receives
            from that rank.
        cost: Newton–Schulz matmul FLOPs for it (summed over the blocks of its view).
        view: its :class:`~ds_muon.core.matrix.MatrixView` (the blocks Newton–Schulz orthogonalizes).
        tp: its tensor-parallel split (``shape`` is then the full matrix and ``pieces`` address its stacked
            form, :func:`ds_muon.partitions.tensor_parallel_pieces`), or None.
    """

    index: int
    name: str
    shape: tuple[int, ...]
    ns_shape: tuple[int, int, int]
    numel: int
    pieces: tuple[Piece, ...]
    owner: int
    owner_offsets: tuple[int, ...]
    cost: int
    view: Optional[MatrixView] = None
    tp: Optional[TensorParallelSplit] = None

    @property
    def chunked(self) -> bool:
        """ZeRO-3's layout: every rank ``r`` exchanges the same number of elements ``c``, elements ``[r c, (r+1) c)``
        of the (padded) parameter, at the same shard offset."""
        first = self.pieces[0]
        return all(p.sent == first.sent and p.shard_offset == first.shard_offset and p.start == r * first.sent
                   for r, p in enumerate(self.pieces))

    @property
    def chunk(self) -> int:
        """Elements each rank exchanges, ``ceil(numel / W)`` (chunked layout only)."""
        return self._uniform("sent", self.pieces)

    @property
    def shard_offset(self) -> int:
        """Where the parameter's chunk starts in every rank's flat shard (chunked layout only)."""
        return self._uniform("shard_offset", self.pieces)

    @property
    def owner_offset(self) -> int:
        """Where its chunk starts in every row of the owner's ``(W, split_sizes[owner])`` block (chunked only)."""
        if len(set(self.owner_offsets)) != 1:
            raise ValueError(f"{self.name}: owner offsets differ between source ranks (not a chunked layout)")
        return self.owner_offsets[0]

    def _uniform(self, attr: str, pieces) -> int:
        values = {getattr(p, attr) for p in pieces}
        if len(values) != 1:
            raise ValueError(f"{self.name}: {attr} differs between ranks (not a chunked layout)")
        return values.pop()


@dataclass(frozen=True)
class ShapeBatch:
    """Parameters with the same matrix view, which one owner orthogonalizes together: one batched
    Newton–Schulz call per block group of the view (:func:`ds_muon.core.matrix.view_blocks`).

    Attributes:
        members: the slots, in exchange order; in the chunked layout their chunks are adjacent in the owner's
            block: columns ``[start, start + count * chunk)``.
    """

    ns_shape: tuple[int, int, int]
    numel: int
    members: tuple[MatrixSlot, ...]
    view: Optional[MatrixView] = None
    tp: Optional[TensorParallelSplit] = None

    @property
    def count(self) -> int:
        return len(self.members)

    @property
    def chunk(self) -> int:
        return self.members[0].chunk

    @property
    def start(self) -> int:
        return self.members[0].owner_offset


@dataclass(frozen=True)
class ExchangePlan:
    """Owner plan for one Muon sub-group (or one exchange bucket of it).

    Attributes:
        world_size: partition-group size ``W``.
        slots: the Muon matrices, in exchange order (by owner, then by shape, then index).
        sends: ``sends[s][d]``: elements rank ``s`` sends to owner ``d`` (and gets back from it).
        batches: per rank, its :class:`ShapeBatch` list.
        shard_numel: elements of the local flat shard the plan covers.
    """

    world_size: int
    slots: tuple[MatrixSlot, ...]
    sends: tuple[tuple[int, ...], ...]
    batches: tuple[tuple[ShapeBatch, ...], ...]
    shard_numel: int

    @property
    def chunked(self) -> bool:
        """Every slot is in ZeRO-3's chunked layout (:attr:`MatrixSlot.chunked`), so every rank sends each owner
        the same amount."""
        return all(s.chunked for s in self.slots)

    @property
    def split_sizes(self) -> tuple[int, ...]:
        """Elements every rank sends to each owner, length ``W`` (chunked layout).

        Raises:
            ValueError: the ranks send different amounts (a flat ZeRO-1/2 layout: use :attr:`sends`).
        """
        if any(row != self.sends[0] for row in self.sends):
            raise ValueError("split_sizes: the ranks send different amounts to the owners; use sends[s][d]")
        return self.sends[0]

    def load(self) -> list[int]:
        """Newton–Schulz FLOPs per rank."""
        loads = [0] * self.world_size
        for s in self.slots:
            loads[s.owner] += s.cost
        return loads

    def imbalance(self) -> float:
        """max / mean Newton–Schulz FLOPs over ranks (1.0 = perfect; 1.0 when there is no work)."""
        return _imbalance(self.load())

    def received(self, rank: int) -> int:
        """Elements owner ``rank`` receives from all ranks (itself included) per exchange-in."""
        return sum(row[rank] for row in self.sends)

    def sent_elements(self, rank: int) -> int:
        """Elements ``rank`` sends per step in both exchanges: its pieces of the matrices it does not own, plus
        every other rank's pieces of each matrix it owns (chunked: ``W - 1`` chunks of it)."""
        out = sum(self.sends[rank]) - self.sends[rank][rank]
        return out + self.received(rank) - self.sends[rank][rank]

    def describe(self) -> str:
        """A short printable summary: matrices, FLOPs per rank, imbalance."""
        loads = ", ".join(f"{x / 1e9:.3g}" for x in self.load())
        return (f"{len(self.slots)} Muon matrices over W={self.world_size}; NS GFLOP per rank [{loads}]; "
                f"imbalance max/mean {self.imbalance():.3f}")


def _imbalance(loads: list[int]) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0


@dataclass(frozen=True)
class ParamInfo:
    """What the plan needs to know about one parameter.

    Attributes:
        name, shape, numel, split: the parameter and its declared or detected :class:`~ds_muon.core.matrix.Split`.
        pieces: its :class:`Piece` on every rank; None: ZeRO-3's chunked layout (:func:`chunk_size`), the
            parameters' chunks back to back in the shard in list order.
        tp: a tensor-parallel matrix's split over the tensor-parallel group: ``shape``/``numel`` are then the full
            matrix's and ``pieces`` address its stacked form (:func:`ds_muon.partitions.tensor_parallel_pieces`);
            the owner orthogonalizes the full matrix. None: not split.
    """

    name: str
    shape: tuple[int, ...]
    numel: int
    split: Optional[Split] = None
    pieces: Optional[tuple[Piece, ...]] = None
    tp: Optional[TensorParallelSplit] = None


def chunk_size(numel: int, world_size: int) -> int:
    """ZeRO-3's per-rank partition size: ``ceil(numel / world_size)``."""
    return math.ceil(numel / world_size)


@dataclass(frozen=True)
class _Info:
    index: int
    param: ParamInfo
    pieces: tuple[Piece, ...]
    cost: int
    view: MatrixView

    @property
    def largest(self) -> int:
        return max(p.sent for p in self.pieces)


#: How far above the mean Newton–Schulz load a rank may go to own a matrix it holds more of (flat layouts).
HOME_SLACK = 0.10


def _moved(t: _Info, r: int) -> int:
    """Elements that cross the wire (both ways) if rank ``r`` owns the matrix: every other rank's piece, twice."""
    return 2 * sum(p.sent for k, p in enumerate(t.pieces) if k != r)


def _assign_owners(infos: list[_Info], world_size: int, policy: str) -> dict[int, int]:
    """Owner rank per matrix index. ``"lpt"``: largest Newton–Schulz cost first, each to the least-loaded rank
    (ties to the lower rank), except where the layout makes some owners cheaper than others (ZeRO-1/2's flat
    layout, where a rank may hold a matrix whole or most of it): there the matrix goes to the rank that moves
    the fewest elements among those whose load stays within ``1 + HOME_SLACK`` of the mean, and to the
    least-loaded rank only when none does. In ZeRO-3's chunked layout every owner moves the same, so this is
    plain LPT."""
    if policy == "round_robin":
        return {t.index: t.index % world_size for t in infos}
    loads = [0] * world_size
    cap = (1 + HOME_SLACK) * sum(t.cost for t in infos) / world_size
    owners: dict[int, int] = {}
    for t in sorted(infos, key=lambda t: (-t.cost, -t.largest, t.index)):
        moved = [_moved(t, r) for r in range(world_size)]
        fits = [r for r in range(world_size) if loads[r] + t.cost <= cap and moved[r] < max(moved)]
        if fits:
            r = min(fits, key=lambda k: (moved[k], loads[k], k))
        else:
            r = min(range(world_size), key=lambda k: (loads[k], k))
        owners[t.index] = r
        loads[r] += t.cost
    return owners


def _layout(infos: list[_Info], owners: dict[int, int], world_size: int, shard_numel: int) -> ExchangePlan:
    """Exchange layout of the given matrices: by owner, then view, then index."""
    order = sorted(infos, key=lambda t: (owners[t.index], t.view.sort_key(), _tp_key(t.param.tp), t.index))
    sends = [[0] * world_size for _ in range(world_size)]
    slots = []
    for t in order:
        d = owners[t.index]
        offsets = tuple(sends[s][d] for s in range(world_size))
        p = t.param
        slots.append(MatrixSlot(t.index, p.name, tuple(p.shape), t.view.ns_shape, p.numel, t.pieces, d, offsets,
                                t.cost, t.view, p.tp))
        for s in range(world_size):
            sends[s][d] += t.pieces[s].sent
    batches: list[list[ShapeBatch]] = [[] for _ in range(world_size)]
    for s in slots:
        rank_batches = batches[s.owner]
        last = rank_batches[-1] if rank_batches else None
        if last is not None and last.view.sort_key() == s.view.sort_key() and last.tp == s.tp:
            rank_batches[-1] = ShapeBatch(last.ns_shape, last.numel, last.members + (s,), last.view, last.tp)
        else:
            rank_batches.append(ShapeBatch(s.ns_shape, s.numel, (s,), s.view, s.tp))
    return ExchangePlan(world_size, tuple(slots), tuple(tuple(row) for row in sends),
                        tuple(tuple(b) for b in batches), shard_numel)


def _tp_key(tp: Optional[TensorParallelSplit]) -> tuple:
    """Orders matrices of one view so that those with the same tensor-parallel split are adjacent (one batch)."""
    return () if tp is None else (tp.dim, tp.sizes)


def _infos(params: Sequence[ParamInfo], world_size: int, ns_steps: int, ns_method: str,
           shard_numel: Optional[int]) -> tuple[list[_Info], int]:
    infos, offset = [], 0
    for i, p in enumerate(params):
        view = matrix_view(p.shape, p.split)
        if p.pieces is None:
            pieces = chunked_pieces(p.numel, world_size, offset)
            offset += pieces[0].sent
        else:
            pieces = p.pieces
            if len(pieces) != world_size or sum(q.length for q in pieces) != p.numel:
                raise ValueError(f"parameter {p.name!r}: pieces {pieces} do not tile its {p.numel} elements over "
                                 f"{world_size} ranks")
        infos.append(_Info(i, p, pieces, view.cost(ns_steps, ns_method), view))
    return infos, (offset if shard_numel is None else shard_numel)


def _check(world_size: int, policy: str) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if policy not in ("lpt", "round_robin"):
        raise ValueError(f"policy must be 'lpt' or 'round_robin', got {policy!r}")


def build_plan(params: Sequence[ParamInfo], world_size: int, ns_steps: int = 5, ns_method: str = "standard",
               policy: str = "lpt", shard_numel: Optional[int] = None) -> ExchangePlan:
    """Assign each Muon matrix of a sub-group to an owner rank (one exchange for the whole sub-group).

    Args:
        params: the sub-group's parameters, in the sub-group's order (all of them Muon).
        world_size: partition-group size.
        ns_steps, ns_method: used for the cost model (:func:`ds_muon.core.ns_cost.ns_flops`).
        policy: ``"lpt"`` (longest processing time first: largest cost to the least-loaded rank,
            ties to the lower rank; in a flat layout a matrix that one rank holds whole stays there within
            :data:`HOME_SLACK` of the mean load) or ``"round_robin"`` (the baseline: matrix ``i`` to rank ``i % W``).
        shard_numel: elements of each rank's flat shard when the parameters carry their pieces (a flat layout);
            default: the chunks back to back.

    Returns:
        The :class:`ExchangePlan`.

    Raises:
        ValueError: ``world_size < 1``, an unknown policy, a parameter with fewer than 2 dims, or pieces that do
            not tile a parameter.
    """
    _check(world_size, policy)
    infos, shard_numel = _infos(params, world_size, ns_steps, ns_method, shard_numel)
    return _layout(infos, _assign_owners(infos, world_size, policy), world_size, shard_numel)


@dataclass(frozen=True)
class BucketedPlan:
    """A sub-group's owner plan cut into exchange buckets that are pipelined one after another.

    Owners are assigned over the whole sub-group (LPT); the buckets then interleave the owners'
    matrices (each owner's largest first, round robin over owners), so a bucket that holds at least
    W matrices gives every rank Newton–Schulz work (a bucket of fewer, larger matrices leaves some
    ranks idle for it), and each bucket holds at most ``bucket_elements`` matrix elements (or one
    matrix, if a single matrix is larger).

    Attributes:
        buckets: one :class:`ExchangePlan` per bucket, in exchange order; each covers only its slots
            (``shard_numel`` is the whole shard's).
    """

    world_size: int
    buckets: tuple[ExchangePlan, ...]
    shard_numel: int

    @property
    def slots(self) -> tuple[MatrixSlot, ...]:
        return tuple(s for b in self.buckets for s in b.slots)

    def load(self) -> list[int]:
        """Newton–Schulz FLOPs per rank over all buckets."""
        return [sum(col) for col in zip(*(b.load() for b in self.buckets))] or [0] * self.world_size

    def imbalance(self) -> float:
        """max / mean Newton–Schulz FLOPs over ranks for the whole sub-group."""
        return _imbalance(self.load())

    def ns_call_shapes(self, rank: int) -> set[tuple[int, ...]]:
        """The input shapes ``(k, *batch, rows, cols)`` of the Newton–Schulz calls ``rank`` makes per step
        (one per block group of each same-view batch it owns, in every bucket): with static-shape
        compilation (``ns_autotune``) each distinct one is a graph."""
        out = set()
        for bucket in self.buckets:
            for b in bucket.batches[rank]:
                view = b.view if b.view is not None else matrix_view(b.ns_shape)
                out.update((b.count, *g.sizes) for g in view.groups)
        return out

    def sent_elements(self, rank: int) -> int:
        """Elements ``rank`` sends per step in all buckets' exchanges (see ExchangePlan.sent_elements)."""
        return sum(b.sent_elements(rank) for b in self.buckets)

    def buffer_elements(self, rank: int, depth: int) -> tuple[int, int]:
        """Exchange-buffer elements ``rank`` holds at most while this plan runs with ``depth`` buckets
        in flight (:data:`ds_muon.sharded.exchange.PIPELINE_DEPTH`): the bound on the exchange's accelerator
        memory, also under optimizer offload, where the shard stays in CPU memory.

        Returns:
            ``(wire, compute)``: elements in the exchange dtype (per pipeline slot, this rank's
            pieces of a bucket, and every rank's pieces of each matrix it owns there, each buffer
            sized for the largest bucket that cycles through its slot) and in the Newton–Schulz
            compute dtype (the largest same-view batch of whole matrices it owns). Each is below
            ``depth * (1 + 1/W) * bucket_elements`` and ``bucket_elements`` plus padding, unless a
            single matrix is larger than a bucket.
        """
        shard_side, owner_side = [0] * depth, [0] * depth
        compute = 0
        for k, b in enumerate(self.buckets):
            shard_side[k % depth] = max(shard_side[k % depth], sum(b.sends[rank]))
            owner_side[k % depth] = max(owner_side[k % depth], b.received(rank))
            compute = max([compute] + [sum(sum(p.sent for p in s.pieces) for s in batch.members)
                                       for batch in b.batches[rank]])
        return sum(shard_side) + sum(owner_side), compute

    def describe(self) -> str:
        loads = ", ".join(f"{x / 1e9:.3g}" for x in self.load())
        return (f"{len(self.slots)} Muon matrices in {len(self.buckets)} exchange buckets over W={self.world_size}; "
                f"NS GFLOP per rank [{loads}]; imbalance max/mean {self.imbalance():.3f}")


def build_bucketed_plan(params: Sequence[ParamInfo], world_size: int, bucket_elements: int, ns_steps: int = 5,
                        ns_method: str = "standard", policy: str = "lpt",
                        shard_numel: Optional[int] = None, order: str = "cost") -> BucketedPlan:
    """:func:`build_plan`, then cut into exchange buckets of at most ``bucket_elements`` matrix elements.

    Args:
        order: which matrices share a bucket. ``"cost"``: the owners' matrices, largest Newton–Schulz cost first,
            interleaved over the owners (every bucket has work for every owner; the step after backward).
        ``"reverse"``: the parameters in reverse order, the order ZeRO-3 finalizes their gradients in backward, so
            that a bucket is complete as soon as its layers are reduced (the overlapped step,
            :mod:`ds_muon.sharded.overlap`). The owners (LPT) and the bytes sent are the same either way.

    Raises:
        ValueError: as :func:`build_plan`, ``bucket_elements < 1`` or an unknown ``order``.
    """
    _check(world_size, policy)
    if bucket_elements < 1:
        raise ValueError(f"bucket_elements must be >= 1, got {bucket_elements}")
    if order not in ("cost", "reverse"):
        raise ValueError(f"order must be 'cost' or 'reverse', got {order!r}")
    infos, shard_numel = _infos(params, world_size, ns_steps, ns_method, shard_numel)
    owners = _assign_owners(infos, world_size, policy)
    if order == "reverse":
        interleaved = sorted(infos, key=lambda t: -t.index)
    else:
        per_owner = [sorted((t for t in infos if owners[t.index] == r), key=lambda t: (-t.cost, t.index))
                     for r in range(world_size)]
        interleaved = [q[k] for k in range(max((len(q) for q in per_owner), default=0)) for q in per_owner
                       if k < len(q)]
    buckets, current, size = [], [], 0
    for t in interleaved:
        numel = t.param.numel
        if current and size + numel > bucket_elements:
            buckets.append(current)
            current, size = [], 0
        current.append(t)
        size += numel
    if current:
        buckets.append(current)
    return BucketedPlan(world_size, tuple(_layout(b, owners, world_size, shard_numel) for b in buckets), shard_numel)
