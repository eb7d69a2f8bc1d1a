"""Every rank has the same owner plans: checked once, when the optimizer is built (layer ``sharded``).

The owner plan (:mod:`ds_muon.sharded.ownership`) is built on every rank from the rank's own parameters and
never exchanged, so the exchange trusts it to be identical on every rank of a sub-group's partition group. A
plan that differs on one rank (a model built differently there, a nondeterministic parameter order) would send
wrong split sizes to the all_to_all (a hang or an error deep in the backend) or orthogonalize the wrong elements
(silently corrupt updates). :func:`check_plans_agree` compares a digest of every plan over all ranks with one
``all_gather_object``, and on a difference raises on every rank, naming the first differing matrix.
"""
from __future__ import annotations

import hashlib
from typing import Any, Optional, Sequence

import torch.distributed as dist

from .collectives import named_collective
from .ownership import BucketedPlan

__all__ = ["plan_rows", "plan_digest", "plan_difference", "check_plans_agree", "LIKELY_CAUSES"]

LIKELY_CAUSES = ("Every rank must build the same model: the same parameters, in the same order, with the same names, "
                 "shapes and Muon selection. Likely causes: the model was built differently on one rank (an argument, "
                 "config or file that depends on the rank; a module created on some ranks only), or a nondeterministic "
                 "parameter order (modules or parameters created by iterating over a set, or in an order that "
                 "depends on the process); or different ds_muon/torch versions on the ranks")


def plan_rows(plan: BucketedPlan) -> tuple[tuple, tuple]:
    """What every rank of the partition group must agree on, as plain values.

    Returns:
        ``(matrices, layout)``: ``matrices``, one row per Muon matrix in parameter order (its ``index``):
        ``(index, name, shape, owner, bucket, ns_shape, pieces, owner_offsets)``, ``pieces`` as
        ``(start, length, shard_offset, sent)`` per rank; ``layout``: ``(world_size, shard_numel, sends)`` with
        ``sends[k][s][d]`` the elements rank ``s`` sends owner ``d`` in bucket ``k`` (the all_to_all's split sizes).
    """
    matrices = sorted((s.index, s.name, tuple(s.shape), s.owner, k, tuple(s.ns_shape),
                       tuple((p.start, p.length, p.shard_offset, p.sent) for p in s.pieces), tuple(s.owner_offsets))
                      for k, bucket in enumerate(plan.buckets) for s in bucket.slots)
    return tuple(matrices), (plan.world_size, plan.shard_numel, tuple(b.sends for b in plan.buckets))


def plan_digest(plan: BucketedPlan) -> str:
    """SHA-256 (hex) of :func:`plan_rows`: equal on two ranks exactly when their rows are."""
    return hashlib.sha256(repr(plan_rows(plan)).encode()).hexdigest()


def _matrix(row: Optional[tuple]) -> str:
    if row is None:
        return "no such matrix"
    index, name, shape, owner, bucket = row[:5]
    return f"{name!r} shape {shape} owner rank {owner} (bucket {bucket})"


def _by_value(values: dict[int, Any], describe) -> str:
    """``"ranks 0, 2: <value>; rank 1: <value>"``, ranks grouped by equal value, in rank order."""
    groups: dict[Any, list[int]] = {}
    for rank in sorted(values):
        groups.setdefault(values[rank], []).append(rank)
    return "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {describe(value)}"
                     for value, ranks in groups.items())


def plan_difference(name: str, rows: dict[int, Optional[tuple[tuple, tuple]]]) -> Optional[str]:
    """The first difference between ranks' :func:`plan_rows` of one sub-group, as a sentence, or None.

    Args:
        name: how messages name the sub-group (``"ZeRO sub-group 3"``).
        rows: per rank (of its partition group, by global rank), its rows, or None where it has no such plan.

    Returns:
        Names the sub-group and the first parameter (by position in the sub-group) whose name or shape differs,
        else whose owner or bucket, else whose pieces, with each rank's name, shape and owner; else the first
        layout field that differs (world size, shard elements, split sizes); None when all agree.
    """
    missing = [r for r, v in rows.items() if v is None]
    if missing:
        return (f"{name}: ranks {sorted(rows)} share its partition group, but rank(s) {missing} have no Muon plan "
                f"of that name")
    matrices = {r: v[0] for r, v in rows.items()}
    n = max(len(m) for m in matrices.values())
    # name and shape first (a shape that differs moves other matrices' pieces too), then owner and bucket, then pieces
    for width, note in ((3, ""), (5, ""), (None, " (same name, shape, owner and bucket; its pieces differ)")):
        for i in range(n):
            at = {r: (m[i][:width] if i < len(m) else None) for r, m in matrices.items()}
            if len(set(at.values())) > 1:
                shown = {r: (m[i][:5] if i < len(m) else None) for r, m in matrices.items()}
                return f"{name}, Muon matrix {i} (in parameter order){note}: {_by_value(shown, _matrix)}"
    layouts = {r: v[1] for r, v in rows.items()}
    for field, label in enumerate(("partition-group size", "shard elements", "all_to_all split sizes per bucket")):
        values = {r: layout[field] for r, layout in layouts.items()}
        if len(set(values.values())) > 1:
            return f"{name}, {label}: {_by_value(values, str)}"
    return None


def check_plans_agree(plans: Sequence[tuple[str, BucketedPlan, Optional[dist.ProcessGroup]]]) -> None:
    """Check that every rank of each sub-group's partition group built the same owner plan.

    One ``all_gather_object`` over the default (world) group of ``{name: (partition-group ranks, digest)}`` (the
    sub-groups' partition groups may differ, e.g. AutoEP's expert-data-parallel groups; every rank builds the
    optimizer). Only when a digest differs, a second one gathers the rows of the first differing sub-group, so
    every rank reaches the same collectives and raises the same error. Nothing without ``torch.distributed``.

    Args:
        plans: ``(name, plan, process group)`` per Muon sub-group of this rank (``None``: the default group);
            every rank passes its own, in its own order.

    Raises:
        RuntimeError: on every rank, naming the sub-group, the first differing matrix (name, shape, owner on each
            rank) and :data:`LIKELY_CAUSES`.
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    mine = {name: (_global_ranks(group), plan_digest(plan)) for name, plan, group in plans}
    gathered: list[Any] = [None] * dist.get_world_size()
    with named_collective("the owner-plan check at optimizer build (all_gather_object)"):
        dist.all_gather_object(gathered, mine)
    bad = _first_mismatch(gathered)
    if bad is None:
        return
    name, members = bad
    by_name = {n: plan for n, plan, _ in plans}
    rows: list[Any] = [None] * dist.get_world_size()
    with named_collective("the owner-plan check at optimizer build (all_gather_object)"):
        dist.all_gather_object(rows, plan_rows(by_name[name]) if name in by_name else None)
    detail = (plan_difference(name, {r: rows[r] for r in members})
              or f"{name}: its ranks disagree on its partition group (one of them has ranks {members})")
    raise RuntimeError(f"ds_muon: the Muon owner plan differs between ranks, so the owner exchange would hang or "
                       f"corrupt the update. {detail}. {LIKELY_CAUSES}.")


def _global_ranks(group: Optional[dist.ProcessGroup]) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(dist.group.WORLD if group is None else group))


def _first_mismatch(gathered: list[dict[str, tuple[tuple[int, ...], str]]]) -> Optional[tuple[str, tuple[int, ...]]]:
    """The first ``(sub-group name, partition-group ranks)`` whose ranks' digests (or groups) differ, scanning ranks
    in order and each rank's sub-groups in its order; None when every plan agrees. The same on every rank."""
    for entries in gathered:
        for name, (members, digest) in entries.items():
            if any(gathered[peer].get(name) != (members, digest) for peer in members):
                return name, members
    return None
