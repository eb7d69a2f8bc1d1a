"""The owner plan: which rank of a partition group orthogonalizes which Muon matrix (layer ``sharded``).

Pure and deterministic (docs/design.md, "One optimizer step"): built from shapes and the world size
alone, identically on every rank, so no collective is needed to agree on it. One plan per Muon sub-group.

Layout facts it relies on (DeepSpeed ZeRO-3): a parameter with ``numel`` elements is split into
``W`` chunks of ``chunk = ceil(numel / W)`` elements, zero padded past ``numel``; rank ``r`` holds
chunk ``r``; a sub-group's local fp32 shard concatenates its parameters' chunks in order.

Exchange layout (both directions use the same per-rank ordering):

* Every rank sends to owner ``d`` its chunks of the matrices ``d`` owns, in plan order:
  ``split_sizes[d] = sum(chunk for slots owned by d)`` elements.
* Owner ``d`` therefore receives a ``(W, split_sizes[d])`` block, row ``s`` from source ``s``; a
  matrix it owns occupies columns ``[owner_offset, owner_offset + chunk)`` of every row, so row-major
  over ``(W, chunk)`` it is the full padded flat matrix.
* The way back is the transpose: owner ``d`` sends row ``s`` to rank ``s``, which receives, per
  owner, its own chunks in the same order it sent them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from ..core.matrix import MatrixView, Split, matrix_view


@dataclass(frozen=True)
class MatrixSlot:
    """One Muon parameter in a sub-group's plan.

    Attributes:
        index: position of the parameter in the sub-group's parameter list.
        name: parameter name (for messages).
        shape: logical parameter shape.
        ns_shape: ``(batch, rows, cols)`` view Newton–Schulz runs on.
        numel: logical element count.
        chunk: elements each rank holds, ``ceil(numel / W)`` (padded).
        shard_offset: element offset of this parameter's chunk in the local flat shard.
        owner: rank that runs Newton–Schulz on it.
        owner_offset: column offset of its chunk inside the owner's ``(W, split_sizes[owner])`` block.
        cost: Newton–Schulz matmul FLOPs for it (summed over the blocks of its view).
        view: its :class:`~ds_muon.core.matrix.MatrixView` (the blocks Newton–Schulz orthogonalizes).
    """

    index: int
    name: str
    shape: tuple[int, ...]
    ns_shape: tuple[int, int, int]
    numel: int
    chunk: int
    shard_offset: int
    owner: int
    owner_offset: int
    cost: int
    view: Optional[MatrixView] = None


@dataclass(frozen=True)
class ShapeBatch:
    """Parameters with the same matrix view, which one owner orthogonalizes together: one batched
    Newton–Schulz call per block group of the view (:func:`ds_muon.core.matrix.orthogonalize_blocks_`).

    Their chunks are adjacent in the owner's block: columns ``[start, start + count * chunk)``.
    """

    ns_shape: tuple[int, int, int]
    numel: int
    chunk: int
    start: int
    count: int
    view: Optional[MatrixView] = None


@dataclass(frozen=True)
class ExchangePlan:
    """Owner plan for one Muon sub-group.

    Attributes:
        world_size: data-parallel size ``W``.
        slots: the Muon matrices, in exchange order (by owner, then by shape, then index).
        split_sizes: elements every rank sends to each owner (and gets back from it), length ``W``.
        batches: per rank, its :class:`ShapeBatch` list.
        shard_numel: elements of the local flat shard the plan covers.
    """

    world_size: int
    slots: tuple[MatrixSlot, ...]
    split_sizes: tuple[int, ...]
    batches: tuple[tuple[ShapeBatch, ...], ...]
    shard_numel: int

    def load(self) -> list[int]:
        """Newton–Schulz FLOPs per rank."""
        loads = [0] * self.world_size
        for s in self.slots:
            loads[s.owner] += s.cost
        return loads

    def imbalance(self) -> float:
        """max / mean Newton–Schulz FLOPs over ranks (1.0 = perfect; 1.0 when there is no work)."""
        return _imbalance(self.load())

    def sent_elements(self, rank: int) -> int:
        """Elements ``rank`` sends per step in both exchanges: its chunks of the matrices it does
        not own, plus ``W - 1`` chunks of each matrix it owns."""
        out = sum(self.split_sizes) - self.split_sizes[rank]
        return out + (self.world_size - 1) * self.split_sizes[rank]

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
    """What the plan needs to know about one parameter of a sub-group."""

    name: str
    shape: tuple[int, ...]
    numel: int
    split: Optional[Split] = None


def chunk_size(numel: int, world_size: int) -> int:
    """ZeRO-3's per-rank partition size: ``ceil(numel / world_size)``."""
    return math.ceil(numel / world_size)


def _assign_owners(infos: list, world_size: int, policy: str) -> dict[int, int]:
    if policy == "round_robin":
        return {t[0]: t[0] % world_size for t in infos}
    loads = [0] * world_size
    owners: dict[int, int] = {}
    for i, _, _, chunk, _, cost, _ in sorted(infos, key=lambda t: (-t[5], -t[3], t[0])):
        r = min(range(world_size), key=lambda k: (loads[k], k))
        owners[i] = r
        loads[r] += cost
    return owners


def _layout(infos: list, owners: dict[int, int], world_size: int, shard_numel: int) -> ExchangePlan:
    """Exchange layout of the given matrices: by owner, then shape, then index."""
    order = sorted(infos, key=lambda t: (owners[t[0]], t[6].sort_key(), t[0]))
    split = [0] * world_size
    slots = []
    for i, p, ns_shape, chunk, off, cost, view in order:
        r = owners[i]
        slots.append(MatrixSlot(i, p.name, tuple(p.shape), ns_shape, p.numel, chunk, off, r, split[r], cost, view))
        split[r] += chunk
    batches: list[list[ShapeBatch]] = [[] for _ in range(world_size)]
    for s in slots:
        rank_batches = batches[s.owner]
        last = rank_batches[-1] if rank_batches else None
        if last is not None and last.view.sort_key() == s.view.sort_key() and last.start + last.count * last.chunk == s.owner_offset:
            rank_batches[-1] = ShapeBatch(last.ns_shape, last.numel, last.chunk, last.start, last.count + 1, last.view)
        else:
            rank_batches.append(ShapeBatch(s.ns_shape, s.numel, s.chunk, s.owner_offset, 1, s.view))
    return ExchangePlan(world_size, tuple(slots), tuple(split), tuple(tuple(b) for b in batches), shard_numel)


def _infos(params: Sequence[ParamInfo], world_size: int, ns_steps: int, ns_method: str) -> tuple[list, int]:
    infos, offset = [], 0
    for i, p in enumerate(params):
        view = matrix_view(p.shape, p.split)
        chunk = chunk_size(p.numel, world_size)
        infos.append((i, p, view.ns_shape, chunk, offset, view.cost(ns_steps, ns_method), view))
        offset += chunk
    return infos, offset


def _check(world_size: int, policy: str) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if policy not in ("lpt", "round_robin"):
        raise ValueError(f"policy must be 'lpt' or 'round_robin', got {policy!r}")


def build_plan(params: Sequence[ParamInfo], world_size: int, ns_steps: int = 5, ns_method: str = "standard",
               policy: str = "lpt") -> ExchangePlan:
    """Assign each Muon matrix of a sub-group to an owner rank (one exchange for the whole sub-group).

    Args:
        params: the sub-group's parameters, in the sub-group's order (all of them Muon).
        world_size: data-parallel size.
        ns_steps, ns_method: used for the cost model (:func:`ds_muon.core.ns_cost.ns_flops`).
        policy: ``"lpt"`` (longest processing time first: largest cost to the least-loaded rank,
            ties to the lower rank) or ``"round_robin"`` (the baseline: matrix ``i`` to rank ``i % W``).

    Returns:
        The :class:`ExchangePlan`.

    Raises:
        ValueError: ``world_size < 1``, an unknown policy, or a parameter with fewer than 2 dims.
    """
    _check(world_size, policy)
    infos, shard_numel = _infos(params, world_size, ns_steps, ns_method)
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
            chunks of a bucket, and the ``W`` chunks of each matrix it owns there, each buffer
            sized for the largest bucket that cycles through its slot) and in the Newton–Schulz
            compute dtype (the largest same-shape batch of whole matrices it owns). Each is below
            ``depth * (1 + 1/W) * bucket_elements`` and ``bucket_elements`` plus padding, unless a
            single matrix is larger than a bucket.
        """
        W = self.world_size
        shard_side, owner_side = [0] * depth, [0] * depth
        compute = 0
        for k, b in enumerate(self.buckets):
            shard_side[k % depth] = max(shard_side[k % depth], sum(b.split_sizes))
            owner_side[k % depth] = max(owner_side[k % depth], W * b.split_sizes[rank])
            compute = max([compute] + [batch.count * W * batch.chunk for batch in b.batches[rank]])
        return sum(shard_side) + sum(owner_side), compute

    def describe(self) -> str:
        loads = ", ".join(f"{x / 1e9:.3g}" for x in self.load())
        return (f"{len(self.slots)} Muon matrices in {len(self.buckets)} exchange buckets over W={self.world_size}; "
                f"NS GFLOP per rank [{loads}]; imbalance max/mean {self.imbalance():.3f}")


def build_bucketed_plan(params: Sequence[ParamInfo], world_size: int, bucket_elements: int, ns_steps: int = 5,
                        ns_method: str = "standard", policy: str = "lpt") -> BucketedPlan:
    """:func:`build_plan`, then cut into exchange buckets of at most ``bucket_elements`` matrix elements.

    Raises:
        ValueError: as :func:`build_plan`, or ``bucket_elements < 1``.
    """
    _check(world_size, policy)
    if bucket_elements < 1:
        raise ValueError(f"bucket_elements must be >= 1, got {bucket_elements}")
    infos, shard_numel = _infos(params, world_size, ns_steps, ns_method)
    owners = _assign_owners(infos, world_size, policy)
    per_owner = [sorted((t for t in infos if owners[t[0]] == r), key=lambda t: (-t[5], t[0]))
                 for r in range(world_size)]
    interleaved = [q[k] for k in range(max((len(q) for q in per_owner), default=0)) for q in per_owner if k < len(q)]
    buckets, current, size = [], [], 0
    for t in interleaved:
        numel = t[1].numel
        if current and size + numel > bucket_elements:
            buckets.append(current)
            current, size = [], 0
        current.append(t)
        size += numel
    if current:
        buckets.append(current)
    return BucketedPlan(world_size, tuple(_layout(b, owners, world_size, shard_numel) for b in buckets), shard_numel)
