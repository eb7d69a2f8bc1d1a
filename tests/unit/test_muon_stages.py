"""The Muon step of one sub-group as the stages its caller runs in order (:class:`ds_muon.sharded.muon_step.MuonShardStep`,
docs/design.md "The walk, file by file"): ``set_aside``, ``prepare`` (g -> u) and ``orthogonalize`` (u -> o) leave the
fp32 partition untouched, ``finalize`` applies o, ``put_back`` restores the blocks without gradient. W=1, no process
group, against the update written out from the formulas. The caller's sequence itself
(``DsMuonZeroSteps._muon_step``) is guarded by tests/dist/test_no_grad.py and the parity tests."""
from __future__ import annotations

import pytest
import torch

from ds_muon.core.muon_update import scaled_orthogonalizer
from ds_muon.sharded.blocks import build_block_map
from ds_muon.sharded.exchange import OwnerExchange
from ds_muon.sharded.muon_step import MuonShardStep
from ds_muon.sharded.ownership import ParamInfo, build_bucketed_plan

pytestmark = pytest.mark.unit

GROUP = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9, "nesterov": True, "ns_method": "standard",
         "ns_steps": 5, "update_scale": "shape"}
SHAPES = [(8, 4), (6, 6)]


def one_rank_step() -> MuonShardStep:
    infos = [ParamInfo(f"w{k}", shape, shape[0] * shape[1], None) for k, shape in enumerate(SHAPES)]
    plan = build_bucketed_plan(infos, 1, 1 << 20)
    exchange = OwnerExchange(None, torch.float32, torch.float32, torch.device("cpu"))
    return MuonShardStep("sub-group 0", plan, build_block_map(plan.slots, 0, plan.shard_numel), exchange, GROUP,
                         ns_compile=False, ns_autotune=False)


def run_stages(step: MuonShardStep, p, g, m, had):
    put_back = step.set_aside(had, m, p)
    u = step.prepare(g, m, GROUP)
    step.orthogonalize(u, g, GROUP)
    assert put_back is not None or had is None or bool(had.all())
    return put_back


@pytest.mark.parametrize("without_grad", [None, 1])
def test_stages_compute_o_first_and_only_finalize_writes_the_partition(without_grad) -> None:
    step = one_rank_step()
    n = step.plan.shard_numel
    torch.manual_seed(0)
    p, g, m = torch.randn(n), torch.randn(n), torch.randn(n)
    p0, g0, m0 = p.clone(), g.clone(), m.clone()
    had = None
    if without_grad is not None:
        had = torch.ones(step.block_map.n_blocks, dtype=torch.bool)
        had[without_grad] = False
    put_back = run_stages(step, p, g, m, had)
    assert torch.equal(p, p0), "set_aside/prepare/orthogonalize wrote the partition"
    step.finalize(p, g, GROUP)
    if put_back is not None:
        put_back()

    m_want = m0 * 0.9 + g0 * 0.1
    u_want = g0.lerp(m_want, 0.9)
    ns = scaled_orthogonalizer("standard", 5, torch.float32, "shape")
    sizes = [r * c for r, c in SHAPES]
    o_want = torch.cat([ns(seg.view(shape)).flatten() for seg, shape in zip(u_want.split(sizes), SHAPES)])
    p_want = p0 * (1 - 0.02 * 0.1) - 0.02 * o_want
    if without_grad is not None:  # that block (parameter w1): momentum and weights as they were
        lo, hi = sizes[0], sizes[0] + sizes[1]
        m_want[lo:hi], p_want[lo:hi] = m0[lo:hi], p0[lo:hi]
    torch.testing.assert_close(m, m_want)
    torch.testing.assert_close(p, p_want)


def test_every_block_with_gradient_sets_nothing_aside() -> None:
    step = one_rank_step()
    n = step.plan.shard_numel
    assert step.set_aside(None, torch.zeros(n), torch.zeros(n)) is None
    assert step.set_aside(torch.ones(step.block_map.n_blocks, dtype=torch.bool), torch.zeros(n), torch.zeros(n)) is None


def test_speculative_runs_tile_exactly_the_pieces_and_are_capped(monkeypatch) -> None:
    """``SpeculativeMuon._runs``: adjacent pieces merged, a gap kept (never covering what lies between), no run
    longer than ``RUN_ELEMENTS``."""
    import ds_muon.sharded.overlap as overlap
    monkeypatch.setattr(overlap, "RUN_ELEMENTS", 40)
    infos = [ParamInfo(f"w{k}", shape, shape[0] * shape[1], None) for k, shape in enumerate([(8, 4), (6, 6), (4, 4)])]
    plan = build_bucketed_plan(infos, 1, 1 << 20)
    exchange = OwnerExchange(None, torch.float32, torch.float32, torch.device("cpu"))
    step = MuonShardStep("sub-group 0", plan, build_block_map(plan.slots, 0, plan.shard_numel), exchange, GROUP,
                         ns_compile=False, ns_autotune=False)
    spec = overlap.SpeculativeMuon({0: step}, {0: exchange})
    covered = []
    for k in range(len(plan.buckets)):
        runs = spec._runs(0, k)
        assert all(0 < length <= 40 for _, length in runs), runs
        covered += [x for lo, length in runs for x in range(lo, lo + length)]
    pieces = [x for b in plan.buckets for s in b.slots
              for x in range(s.pieces[0].shard_offset, s.pieces[0].shard_offset + s.pieces[0].sent)]
    assert sorted(covered) == sorted(pieces) and len(covered) == len(set(covered))


def test_view_blocks_refuses_a_layout_it_cannot_stride() -> None:
    from ds_muon.core.matrix import matrix_view, view_blocks
    with pytest.raises(ValueError, match="unit stride"):
        view_blocks(torch.zeros(12, 2).t(), matrix_view((3, 4)))


def test_mark_final_starts_each_bucket_when_its_last_parameter_is_final(monkeypatch) -> None:
    """``SpeculativeMuon.mark_final``: a bucket starts once every parameter with a matrix in it is final, each bucket
    once; a parameter reduced again after its bucket started voids the sub-group's speculation (``complete``
    false), one reduced twice before its bucket started does not. The bookkeeping visits only the bucket that holds
    the parameter (``_buckets_of``: each parameter is one slot of the plan)."""
    import ds_muon.sharded.overlap as overlap
    infos = [ParamInfo(f"w{k}", shape, shape[0] * shape[1], None) for k, shape in enumerate([(4, 4)] * 3 + [(6, 6)])]
    plan = build_bucketed_plan(infos, 1, 64, order="reverse")
    exchange = OwnerExchange(None, torch.float32, torch.float32, torch.device("cpu"))
    step = MuonShardStep("sub-group 0", plan, build_block_map(plan.slots, 0, plan.shard_numel), exchange, GROUP,
                         ns_compile=False, ns_autotune=False)
    members = [{s.index for s in b.slots} for b in plan.buckets]
    assert members == [{2, 3}, {0, 1}]  # backward's order: the last two parameters, then the first two
    started = []

    def speculation(reduce_order):
        spec = overlap.SpeculativeMuon({0: step}, {0: exchange})

        def speculate(i, k, *args):
            started.append(k)
            spec._state[i].started[k] = True
        monkeypatch.setattr(spec, "_speculate", speculate)
        started.clear()
        final = set()
        for index in reduce_order:
            before = list(started)
            spec.mark_final([(0, index)], lambda i: None, lambda i: None, lambda i: GROUP, 1.0)
            final.add(index)
            due = [k for k, m in enumerate(members) if k not in before and m <= final]
            assert started[len(before):] == due, (index, started, due)
        return spec

    spec = speculation([3, 2, 1, 0])
    assert started == [0, 1] and spec._state[0].complete
    assert spec._buckets_of(0) == {3: (0,), 2: (0,), 1: (1,), 0: (1,)}
    spec.mark_final([(0, 3)], lambda i: None, lambda i: None, lambda i: GROUP, 1.0)  # again, after its bucket started
    assert not spec._state[0].complete
    spec = speculation([3, 1, 1, 2, 0])  # w1 twice before its bucket started
    assert started == [0, 1] and spec._state[0].complete


def test_mark_final_keeps_sub_groups_apart_and_starts_buckets_in_the_order_they_complete(monkeypatch) -> None:
    """One ``mark_final`` call across two sub-groups with different plans: each bucket starts when its own
    sub-group's parameters are final, in the order the call's parameters complete them (every rank launches the
    same buckets in the same order), not in the plans' order."""
    import ds_muon.sharded.overlap as overlap

    def step_of(shapes, bucket_elements):
        infos = [ParamInfo(f"w{k}", shape, shape[0] * shape[1], None) for k, shape in enumerate(shapes)]
        plan = build_bucketed_plan(infos, 1, bucket_elements, order="reverse")
        exchange = OwnerExchange(None, torch.float32, torch.float32, torch.device("cpu"))
        return MuonShardStep("sub-group", plan, build_block_map(plan.slots, 0, plan.shard_numel), exchange, GROUP,
                             ns_compile=False, ns_autotune=False), exchange

    (s0, e0), (s1, e1) = step_of([(4, 4)] * 3 + [(6, 6)], 64), step_of([(6, 6), (6, 6)], 40)
    assert [{s.index for s in b.slots} for b in s0.plan.buckets] == [{2, 3}, {0, 1}]
    assert [{s.index for s in b.slots} for b in s1.plan.buckets] == [{1}, {0}]
    spec = overlap.SpeculativeMuon({0: s0, 1: s1}, {0: e0, 1: e1})
    started = []

    def speculate(i, k, *args):
        started.append((i, k))
        spec._state[i].started[k] = True
    monkeypatch.setattr(spec, "_speculate", speculate)
    spec.mark_final([(0, 1), (0, 0), (1, 0), (0, 3), (0, 2), (1, 1)], lambda i: None, lambda i: None,
                    lambda i: GROUP, 1.0)
    assert started == [(0, 1), (1, 1), (0, 0), (1, 0)]
    assert spec._state[0].complete and spec._state[1].complete
