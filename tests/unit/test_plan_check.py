"""The owner-plan check's digest and diff (ds_muon.sharded.plan_check), without torch.distributed.

The multi-rank check (one all_gather_object, the error on every rank) is tests/dist/test_plan_check.py.
"""
from __future__ import annotations

import dataclasses

from ds_muon.sharded.ownership import BucketedPlan, ParamInfo, build_bucketed_plan
from ds_muon.sharded.plan_check import plan_difference, plan_digest, plan_rows

W = 2


def _plan(shapes: dict[str, tuple[int, int]], bucket_elements: int = 10_000) -> BucketedPlan:
    infos = [ParamInfo(name, shape, shape[0] * shape[1]) for name, shape in shapes.items()]
    return build_bucketed_plan(infos, W, bucket_elements)


SHAPES = {"a.weight": (16, 8), "b.weight": (8, 24), "c.weight": (32, 8), "d.weight": (8, 8)}


def _with_owner(plan: BucketedPlan, name: str, owner: int) -> BucketedPlan:
    """``plan`` with the matrix ``name`` given another owner (what a nondeterministic LPT would do on one rank)."""
    buckets = tuple(dataclasses.replace(b, slots=tuple(dataclasses.replace(s, owner=owner) if s.name == name else s
                                                       for s in b.slots)) for b in plan.buckets)
    return dataclasses.replace(plan, buckets=buckets)


def test_equal_plans_have_equal_digests_and_no_difference() -> None:
    one, two = _plan(SHAPES), _plan(dict(SHAPES))
    assert plan_digest(one) == plan_digest(two) and len(plan_digest(one)) == 64
    assert plan_difference("ZeRO sub-group 0", {0: plan_rows(one), 1: plan_rows(two)}) is None
    rows, layout = plan_rows(one)
    assert [r[1] for r in rows] == list(SHAPES) and layout[0] == W  # parameter order, not exchange order


def test_a_different_shape_names_that_matrix_with_each_ranks_shape_and_owner() -> None:
    other = dict(SHAPES, **{"b.weight": (8, 25)})
    one, two = _plan(SHAPES), _plan(other)
    assert plan_digest(one) != plan_digest(two)
    text = plan_difference("ZeRO sub-group 3", {0: plan_rows(one), 1: plan_rows(two)})
    owner = {s.name: s.owner for s in one.slots}["b.weight"]
    owner2 = {s.name: s.owner for s in two.slots}["b.weight"]
    assert text.startswith("ZeRO sub-group 3, Muon matrix 1 (in parameter order): "), text
    assert f"rank 0: 'b.weight' shape (8, 24) owner rank {owner}" in text, text
    assert f"rank 1: 'b.weight' shape (8, 25) owner rank {owner2}" in text, text


def test_a_different_name_or_order_is_the_first_differing_matrix() -> None:
    renamed = {("x.weight" if k == "c.weight" else k): v for k, v in SHAPES.items()}
    text = plan_difference("g", {0: plan_rows(_plan(SHAPES)), 1: plan_rows(_plan(renamed))})
    assert "Muon matrix 2" in text and "'c.weight'" in text and "'x.weight'" in text, text
    reordered = dict(reversed(list(SHAPES.items())))
    text = plan_difference("g", {0: plan_rows(_plan(SHAPES)), 1: plan_rows(_plan(reordered))})
    assert "Muon matrix 0" in text and "'a.weight'" in text and "'d.weight'" in text, text


def test_an_owner_on_one_rank_groups_the_agreeing_ranks() -> None:
    plan = _plan(SHAPES)
    owner = {s.name: s.owner for s in plan.slots}["d.weight"]
    moved = _with_owner(plan, "d.weight", 1 - owner)
    assert plan_digest(moved) != plan_digest(plan)
    text = plan_difference("g", {0: plan_rows(plan), 1: plan_rows(moved), 2: plan_rows(plan)})
    assert f"ranks 0, 2: 'd.weight' shape (8, 8) owner rank {owner}" in text, text
    assert f"rank 1: 'd.weight' shape (8, 8) owner rank {1 - owner}" in text, text


def test_bucket_layout_and_missing_plans_are_differences() -> None:
    one, small = _plan(SHAPES), _plan(SHAPES, bucket_elements=64)
    assert len(small.buckets) > len(one.buckets)
    assert plan_digest(one) != plan_digest(small)
    text = plan_difference("g", {0: plan_rows(one), 1: plan_rows(small)})
    assert "bucket" in text, text
    text = plan_difference("g", {0: plan_rows(one), 1: None})
    assert "rank(s) [1] have no Muon plan" in text, text
    fewer = {k: v for k, v in SHAPES.items() if k != "d.weight"}
    text = plan_difference("g", {0: plan_rows(_plan(SHAPES)), 1: plan_rows(_plan(fewer))})
    assert "Muon matrix 3" in text and "rank 1: no such matrix" in text, text
