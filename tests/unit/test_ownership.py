"""Tests for the owner plan (ds_muon.sharded.ownership), the partition layouts (ds_muon.partitions) and the single-process owner exchange (ds_muon.sharded.exchange)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from ds_muon.sharded.exchange import BufferPool, OwnerExchange
from ds_muon.core.matrix import ns_view_shape, update_scale
from ds_muon.core.ns_cost import ns_flops
from ds_muon.core.newton_schulz import orthogonalize
from ds_muon.sharded.ownership import ExchangePlan, ParamInfo, build_bucketed_plan, build_plan, chunk_size


def infos(shapes, prefix="p") -> list[ParamInfo]:
    return [ParamInfo(f"{prefix}{i}", tuple(s), math.prod(s)) for i, s in enumerate(shapes)]


# mixed shapes: odd numels, duplicates (batching), 3-D stacks, 4-D conv, tall and wide
MIXED = [(24, 24), (12, 24), (12, 24), (24, 12), (41, 24), (24, 41), (3, 24, 16), (24, 24, 3, 1), (24, 72),
         (24, 24), (7, 5), (5, 7), (24, 24), (2, 9, 11), (16, 3, 3, 3)]


def llama_like(layers: int = 16) -> list[ParamInfo]:
    shapes = []
    for _ in range(layers):
        shapes += [(2048, 2048)] * 4 + [(5440, 2048)] * 2 + [(2048, 5440)]
    return infos(shapes)


def check_plan(plan: ExchangePlan, params: list[ParamInfo], W: int) -> None:
    """Every structural invariant the exchange relies on."""
    assert plan.world_size == W
    # every matrix exactly once
    assert sorted(s.index for s in plan.slots) == list(range(len(params)))
    # per-slot facts
    offset = 0
    for s in sorted(plan.slots, key=lambda s: s.index):
        p = params[s.index]
        assert (s.name, s.shape, s.numel) == (p.name, p.shape, p.numel)
        assert s.ns_shape == ns_view_shape(p.shape)
        assert s.chunk == -(-p.numel // W) == chunk_size(p.numel, W)
        assert s.shard_offset == offset  # sub-group order, chunks back to back
        offset += s.chunk
        assert 0 <= s.owner < W
        b, m, n = s.ns_shape
        assert s.cost == ns_flops(m, n, 5, "standard", batch=b)
    assert plan.shard_numel == offset
    # split sizes and owner offsets tile each owner's block without gaps
    assert len(plan.split_sizes) == W
    for r in range(W):
        owned = [s for s in plan.slots if s.owner == r]
        assert plan.split_sizes[r] == sum(s.chunk for s in owned)
        pos = 0
        for s in sorted(owned, key=lambda s: s.owner_offset):
            assert s.owner_offset == pos
            pos += s.chunk
        assert pos == plan.split_sizes[r]
    # exchange order: by owner, and within an owner by increasing owner_offset
    keys = [(s.owner, s.owner_offset) for s in plan.slots]
    assert keys == sorted(keys)
    # batches: same ns_shape, adjacent columns, maximal, covering every owned slot once
    assert len(plan.batches) == W
    for r in range(W):
        owned = [s for s in plan.slots if s.owner == r]
        covered = []
        for bi, batch in enumerate(plan.batches[r]):
            members = [s for s in owned if batch.start <= s.owner_offset < batch.start + batch.count * batch.chunk]
            assert len(members) == batch.count >= 1
            assert all(s.ns_shape == batch.ns_shape and s.chunk == batch.chunk and s.numel == batch.numel
                       for s in members)
            assert [s.owner_offset for s in members] == [batch.start + j * batch.chunk for j in range(batch.count)]
            covered += members
            if bi:
                assert plan.batches[r][bi - 1].ns_shape != batch.ns_shape  # same shapes were merged
        assert sorted(s.index for s in covered) == sorted(s.index for s in owned)


@pytest.mark.parametrize("W", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("policy", ["lpt", "round_robin"])
def test_plan_invariants(W, policy):
    params = infos(MIXED)
    plan = build_plan(params, W, policy=policy)
    check_plan(plan, params, W)
    assert plan == build_plan(params, W, policy=policy)  # deterministic
    assert plan.describe().startswith(f"{len(params)} Muon matrices over W={W}")


def test_round_robin_owners_and_shape_batching():
    params = infos([(8, 8), (4, 8), (8, 8), (4, 8), (8, 8), (8, 8)])
    plan = build_plan(params, 2, policy="round_robin")
    owners = {s.index: s.owner for s in plan.slots}
    assert owners == {i: i % 2 for i in range(6)}
    # rank 0 owns 0, 2, 4: all (8, 8) -> one batch of 3; rank 1 owns 1, 3 (4x8) and 5 (8x8) -> 2 batches
    assert [(b.ns_shape, b.count) for b in plan.batches[0]] == [((1, 8, 8), 3)]
    assert sorted((b.ns_shape, b.count) for b in plan.batches[1]) == [((1, 4, 8), 2), ((1, 8, 8), 1)]
    assert plan.split_sizes == (3 * 32, 2 * 16 + 32)


def test_lpt_ties_go_to_lower_rank():
    plan = build_plan(infos([(6, 6)] * 4), 4)
    assert {s.index: s.owner for s in plan.slots} == {0: 0, 1: 1, 2: 2, 3: 3}
    plan = build_plan(infos([(6, 6)] * 3), 4)
    assert {s.index: s.owner for s in plan.slots} == {0: 0, 1: 1, 2: 2}
    assert plan.split_sizes[3] == 0 and plan.batches[3] == ()


@pytest.mark.parametrize("W", [2, 4, 8])
def test_lpt_balances_llama_like(W):
    params = llama_like()
    plan = build_plan(params, W)
    assert plan.imbalance() <= 1.10, plan.describe()
    assert sum(plan.load()) == sum(ns_flops(*ns_view_shape(p.shape)[1:], 5) for p in params)
    rr = build_plan(params, W, policy="round_robin")
    assert max(plan.load()) <= max(rr.load())


def test_lpt_no_worse_than_round_robin_on_skewed_list():
    # large matrices at stride W: round-robin stacks them all on rank 0
    for W in (2, 3, 4):
        shapes = []
        for _ in range(4):
            shapes += [(512, 512)] + [(32, 64)] * (W - 1)
        params = infos(shapes)
        lpt, rr = build_plan(params, W), build_plan(params, W, policy="round_robin")
        assert max(lpt.load()) <= max(rr.load())
        assert lpt.imbalance() < rr.imbalance()
        assert rr.imbalance() > 1.5 * lpt.imbalance()
    # a generic skewed list (one huge, many varied)
    shapes = [(1024, 1024)] + [(64 + 16 * i, 64) for i in range(20)] + [(300, 100), (100, 300), (2, 50, 40)]
    for W in (2, 3, 5):
        lpt, rr = build_plan(infos(shapes), W), build_plan(infos(shapes), W, policy="round_robin")
        assert max(lpt.load()) <= max(rr.load())


def test_imbalance_without_work_and_single_rank():
    empty = build_plan([], 3)
    assert empty.imbalance() == 1.0 and empty.split_sizes == (0, 0, 0) and empty.shard_numel == 0
    one = build_plan(infos(MIXED), 1)
    assert one.imbalance() == 1.0 and one.split_sizes == (one.shard_numel,)


@pytest.mark.parametrize("W", [1, 2, 3, 4, 5, 8])
def test_sent_elements_formula_and_identity(W):
    params = infos(MIXED)
    plan = build_plan(params, W)
    total_chunks = sum(s.chunk for s in plan.slots)
    for r in range(W):
        not_owned = sum(s.chunk for s in plan.slots if s.owner != r)
        owned = sum(s.chunk for s in plan.slots if s.owner == r)
        assert plan.sent_elements(r) == not_owned + (W - 1) * owned
    # exchange-in: every rank sends its chunk of every matrix it does not own: (W-1) sum_k chunk_k in total;
    # exchange-out: each owner sends W-1 chunks of each of its matrices: (W-1) sum_k chunk_k again.
    assert sum(plan.sent_elements(r) for r in range(W)) == 2 * (W - 1) * total_chunks
    # so the mean is 2 (W-1)/W sum_k chunk_k ~ 2 P (W-1)/W^2 (docs/design.md, "One optimizer step")
    P = sum(p.numel for p in params)
    mean = sum(plan.sent_elements(r) for r in range(W)) / W
    assert mean == pytest.approx(2 * (W - 1) / W * total_chunks)
    assert P <= W * total_chunks < P + W * len(params)


def test_build_plan_errors():
    with pytest.raises(ValueError, match="world_size"):
        build_plan(infos([(4, 4)]), 0)
    with pytest.raises(ValueError, match="world_size"):
        build_plan(infos([(4, 4)]), -2)
    with pytest.raises(ValueError, match="policy"):
        build_plan(infos([(4, 4)]), 2, policy="greedy")
    with pytest.raises(ValueError, match=r"\(5,\)"):
        build_plan([ParamInfo("w", (4, 4), 16), ParamInfo("bias", (5,), 5)], 2)
    with pytest.raises(ValueError):
        build_plan([ParamInfo("s", (), 1)], 1)


# ------------------------------------------------------------------------------------------------
# OwnerExchange with no process group (W = 1)
# ------------------------------------------------------------------------------------------------
def scaled_orth(batch: torch.Tensor) -> torch.Tensor:
    """OrthogonalizeFn: (count, b, rows, cols) -> orthogonalized * shape scale."""
    return orthogonalize(batch, "standard", 5, torch.float32) * update_scale(batch.shape[-2], batch.shape[-1])


def expected_update(t: torch.Tensor) -> torch.Tensor:
    b, m, n = ns_view_shape(t.shape)
    mats = t.reshape(b, m, n)
    o = torch.stack([orthogonalize(mats[i], "standard", 5, torch.float32) for i in range(b)])
    return (o * update_scale(m, n)).reshape(t.shape)


@pytest.mark.parametrize("alias", [True, False])
def test_owner_exchange_single_process_matches_per_matrix(alias):
    assert not dist.is_initialized()
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=gen) for s in MIXED]
    params = infos(MIXED)
    plan = build_plan(params, 1)
    assert any(b.count > 1 for b in plan.batches[0])  # batching is exercised
    u = torch.cat([t.reshape(-1) for t in tensors])
    assert u.numel() == plan.shard_numel
    out = u if alias else torch.full_like(u, float("nan"))
    ex = OwnerExchange(None, torch.float32, torch.float32)
    assert (ex.world_size, ex.rank) == (1, 0)
    ex.run(plan, u, out, scaled_orth)
    got = out.split([p.numel for p in params])
    for p, t, g in zip(params, tensors, got):
        torch.testing.assert_close(g.view(t.shape), expected_update(t), rtol=1e-6, atol=1e-6, msg=p.name)


def test_buffer_pool_reused_across_runs():
    """The exchange's own buffers (whatever it names them) are the same tensor objects after a second
    run: the pool's contents are snapshotted, not looked up by guessed names (``get`` would create those)."""
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(s, generator=gen) for s in MIXED]
    plan = build_plan(infos(MIXED), 1)
    pool = BufferPool()
    ex = OwnerExchange(None, torch.float32, torch.float32, pool=pool)
    u = torch.cat([t.reshape(-1) for t in tensors])
    out1 = torch.empty_like(u)
    ex.run(plan, u, out1, scaled_orth)
    first = dict(pool._buffers)  # holds references: a freed-and-reallocated buffer cannot reuse the address
    names = {key[0] for key in first}
    assert {"shard_side0", "matrix"} <= names, names
    assert "owner_side0" not in names, names  # one rank: the owner works in the shard-side buffer (no copy)
    nbytes = pool.nbytes()
    assert nbytes > 0 and pool.peak_nbytes == nbytes
    out2 = torch.empty_like(u)
    ex.run(plan, u.clone(), out2, scaled_orth)
    assert pool._buffers.keys() == first.keys()
    assert all(pool._buffers[k] is first[k] for k in first), "a buffer was reallocated on the second run"
    assert pool.nbytes() == nbytes
    assert torch.equal(out1, out2)
    # a second exchange sharing the pool reuses the same buffers too
    OwnerExchange(None, torch.float32, torch.float32, pool=pool).run(plan, u, torch.empty_like(u), scaled_orth)
    assert pool._buffers.keys() == first.keys() and all(pool._buffers[k] is first[k] for k in first)


def test_buffer_pool_grows_never_shrinks():
    pool = BufferPool()
    a = pool.get("x", 10, torch.float32, torch.device("cpu"))
    assert a.numel() == 10 and pool.nbytes() == 40
    b = pool.get("x", 4, torch.float32, torch.device("cpu"))
    assert b.numel() == 4 and b.data_ptr() == a.data_ptr() and pool.nbytes() == 40
    c = pool.get("x", 20, torch.float32, torch.device("cpu"))
    assert c.numel() == 20 and pool.nbytes() == 80
    pool.get("x", 4, torch.bfloat16, "cpu")
    assert pool.nbytes() == 88  # separate buffer per dtype
    pool.clear()
    assert pool.nbytes() == 0


def test_owner_exchange_rejects_mismatched_plan():
    ex = OwnerExchange(None, torch.float32, torch.float32)
    plan = build_plan(infos([(4, 4)]), 1)
    with pytest.raises(ValueError, match="does not match"):
        ex.run(plan, torch.zeros(15), torch.zeros(15), scaled_orth)
    with pytest.raises(ValueError, match="does not match"):
        ex.run(build_plan(infos([(4, 4)]), 2), torch.zeros(8), torch.zeros(8), scaled_orth)


def test_owner_exchange_takes_a_stretch_only_where_it_holds_every_piece():
    """One bucket may come with stretches of the shard (the overlapped step's scratch and stash, with their shard
    offsets): the result equals the whole-shard run's there; a stretch that misses a piece of this rank, for ``u``
    or for ``out``, is refused, and a whole plan takes the whole shard only."""
    ex = OwnerExchange(None, torch.float32, torch.float32)
    plan = build_bucketed_plan(infos([(4, 4), (2, 4), (4, 2)]), 1, 16, order="reverse")
    assert len(plan.buckets) >= 2
    u = torch.randn(plan.shard_numel)
    whole = torch.zeros(plan.shard_numel)
    ex.run(plan, u, whole, scaled_orth)
    for b in plan.buckets:
        lo = min(s.pieces[0].shard_offset for s in b.slots)
        hi = max(s.pieces[0].shard_offset + s.pieces[0].sent for s in b.slots)
        out = torch.zeros(hi - lo)
        ex.run(b, u[lo:hi].clone(), out, scaled_orth, u_offset=lo, out_offset=lo)
        assert torch.equal(out, whole[lo:hi])
        for kw in ({"out": torch.zeros(hi - lo - 1)}, {"out_offset": lo + 1}, {"u": u[lo:hi - 1]},
                   {"u_offset": lo + 1}):
            args = {"u": u[lo:hi], "out": torch.zeros(hi - lo), "u_offset": lo, "out_offset": lo, **kw}
            with pytest.raises(ValueError, match="does not match"):
                ex.run(b, args.pop("u"), args.pop("out"), scaled_orth, **args)
    with pytest.raises(ValueError, match="does not match"):
        ex.run(plan, u, torch.zeros(plan.shard_numel - 1), scaled_orth)


# ---- bucketed plans ---------------------------------------------------------------------------


def _mixed_params():
    shapes = [(24, 24), (12, 24), (41, 24), (24, 41), (3, 24, 16), (5, 7), (1, 3), (24, 72), (16, 16), (7, 5)]
    return [ParamInfo(f"p{i}", s, int(torch.tensor(s).prod())) for i, s in enumerate(shapes)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket_elements", [1, 600, 1500, 10**9])
def test_bucketed_plan_covers_every_matrix_once_within_bound(world_size, bucket_elements):
    params = _mixed_params()
    plan = build_bucketed_plan(params, world_size, bucket_elements)
    whole = build_plan(params, world_size)
    assert sorted(s.index for s in plan.slots) == list(range(len(params)))
    # owners are the whole sub-group's LPT assignment, whatever the bucketing
    assert {s.index: s.owner for s in plan.slots} == {s.index: s.owner for s in whole.slots}
    assert plan.load() == whole.load() and plan.imbalance() == whole.imbalance()
    for b in plan.buckets:
        size = sum(s.numel for s in b.slots)
        assert size <= bucket_elements or len(b.slots) == 1
        assert b.shard_numel == whole.shard_numel
    if bucket_elements == 10**9:
        assert len(plan.buckets) == 1
    if bucket_elements == 1:
        assert len(plan.buckets) == len(params)
    assert sum(plan.sent_elements(r) for r in range(world_size)) == \
        2 * (world_size - 1) * sum(s.chunk for s in whole.slots)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_reverse_order_buckets_follow_backward(world_size):
    """order="reverse" (the overlapped step): buckets hold the parameters last to first, as ZeRO-3 finalizes their
    gradients in backward, each bucket a run of consecutive parameters; owners and bytes are those of "cost"."""
    params = _mixed_params()
    rev = build_bucketed_plan(params, world_size, 1500, order="reverse")
    cost = build_bucketed_plan(params, world_size, 1500)
    runs = [sorted(s.index for s in b.slots) for b in rev.buckets]
    assert all(r == list(range(r[0], r[-1] + 1)) for r in runs), runs  # each bucket: consecutive parameters
    assert [i for r in runs for i in reversed(r)] == list(range(len(params)))[::-1], runs  # last to first
    assert len(runs) > 1
    assert {s.index: s.owner for s in rev.slots} == {s.index: s.owner for s in cost.slots}
    assert [rev.sent_elements(r) for r in range(world_size)] == [cost.sent_elements(r) for r in range(world_size)]
    with pytest.raises(ValueError, match="order"):
        build_bucketed_plan(params, world_size, 1500, order="forward")


def test_buckets_interleave_owners():
    params = [ParamInfo(f"p{i}", (32, 32), 1024) for i in range(8)]
    plan = build_bucketed_plan(params, 4, bucket_elements=4096)
    assert len(plan.buckets) == 2
    for b in plan.buckets:  # each bucket gives each of the 4 ranks one matrix to orthogonalize
        assert sorted(s.owner for s in b.slots) == [0, 1, 2, 3]


def test_bucketed_plan_rejects_bad_bucket_size():
    with pytest.raises(ValueError, match="bucket_elements"):
        build_bucketed_plan(_mixed_params(), 2, 0)


def test_single_process_exchange_with_buckets_matches_per_matrix():
    params = _mixed_params()
    plan = build_bucketed_plan(params, 1, bucket_elements=700)
    assert len(plan.buckets) > 3
    u = torch.randn(plan.shard_numel, dtype=torch.float64).float()
    expect = torch.empty_like(u)
    for s in plan.slots:
        b, m, n = s.ns_shape
        expect[s.shard_offset:s.shard_offset + s.chunk] = orthogonalize(
            u[s.shard_offset:s.shard_offset + s.numel].view(b, m, n), "standard", 5, torch.float32).reshape(-1)
    OwnerExchange(None, torch.float32, torch.float32).run(
        plan, u, u, lambda x: orthogonalize(x, "standard", 5, torch.float32))  # out aliases u
    torch.testing.assert_close(u, expect, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# ZeRO-1/2's flat layout (ds_muon.partitions.flat_pieces)
# ------------------------------------------------------------------------------------------------
def flat_infos(shapes, W: int, gap: int = 0) -> tuple[list[ParamInfo], int]:
    """Parameters back to back in one flat buffer (``gap`` elements of padding after each), cut into W equal
    partitions as DeepSpeed's ZeRO-1/2 optimizer does; returns the infos and the partition size."""
    from ds_muon.partitions import flat_pieces
    offsets, at = [], 0
    for s in shapes:
        offsets.append(at)
        at += math.prod(s) + gap
    size = -(-at // W)
    return [ParamInfo(f"p{i}", tuple(s), math.prod(s), None, flat_pieces(o, math.prod(s), size, W))
            for i, (s, o) in enumerate(zip(shapes, offsets))], size


def test_flat_pieces_tile_each_parameter():
    from ds_muon.partitions import flat_pieces
    pieces = flat_pieces(10, 25, 16, 3)  # [10, 35) over partitions [0,16) [16,32) [32,48)
    assert [(p.start, p.length, p.shard_offset, p.sent) for p in pieces] == [(0, 6, 10, 6), (6, 16, 0, 16),
                                                                            (22, 3, 0, 3)]
    assert [p.length for p in flat_pieces(0, 8, 16, 3)] == [8, 0, 0]
    with pytest.raises(ValueError, match="does not fit 3 partitions of 16"):
        flat_pieces(40, 9, 16, 3)


def test_flat_layout_matrices_stay_where_they_lie():
    """Equal matrices, each inside one partition: every matrix is owned by the rank holding it, nothing crosses
    the wire, and the Newton–Schulz load is balanced."""
    W = 4
    params, size = flat_infos([(16, 16)] * 8, W)
    plan = build_plan(params, W, shard_numel=size)
    assert not plan.chunked
    assert all(s.pieces[s.owner].length == s.numel for s in plan.slots)
    assert [plan.sent_elements(r) for r in range(W)] == [0] * W
    assert plan.imbalance() == 1.0


def test_flat_layout_straddling_matrix_goes_to_its_larger_piece():
    W = 2
    params, size = flat_infos([(8, 8), (8, 8), (8, 8)], W)  # 192 elements: p1 is cut 32 | 32, p0 on 0, p2 on 1
    plan = build_plan(params, W, shard_numel=size)
    owners = {s.name: s.owner for s in plan.slots}
    assert owners["p0"] == 0 and owners["p2"] == 1
    assert sum(plan.sent_elements(r) for r in range(W)) == 2 * 32  # p1's smaller piece, there and back


def test_flat_layout_balance_beats_locality():
    """One rank holds every large matrix: keeping them all there would overload it, so matrices move (LPT) until
    no rank is above (1 + HOME_SLACK) of the mean by more than one matrix."""
    from ds_muon.sharded.ownership import HOME_SLACK
    W = 2
    params, size = flat_infos([(32, 32)] * 4 + [(2, 2)] * 300, W)
    plan = build_plan(params, W, shard_numel=size)
    loads = plan.load()
    assert max(loads) <= (1 + HOME_SLACK) * sum(loads) / W + max(s.cost for s in plan.slots)
    assert 0 < plan.sent_elements(0)


def test_chunked_layout_is_plain_lpt():
    """ZeRO-3's chunked layout gives every owner the same traffic, so owners are LPT's (cost order, least loaded,
    ties to the lower rank), as before the flat layout existed."""
    W = 3
    params = infos(MIXED)
    plan = build_plan(params, W)
    loads, want = [0] * W, {}
    for i, p in sorted(enumerate(params), key=lambda ip: (-next(s.cost for s in plan.slots if s.index == ip[0]),
                                                          -chunk_size(ip[1].numel, W), ip[0])):
        cost = next(s.cost for s in plan.slots if s.index == i)
        r = min(range(W), key=lambda k: (loads[k], k))
        want[i], loads[r] = r, loads[r] + cost
    assert {s.index: s.owner for s in plan.slots} == want


@pytest.mark.parametrize("general", [False, True])
def test_flat_layout_single_process_exchange_matches_per_matrix(general, monkeypatch):
    """The exchange at W=1 on a flat layout with padding gaps, through the chunked fast path and (``general``)
    the general piece-by-piece path: both equal per-matrix Newton–Schulz times the update scale (the W>1 flat
    exchange is checked against the oracle in tests/dist/test_zero12_parity.py)."""
    torch.manual_seed(0)
    params, size = flat_infos([(8, 8), (6, 10), (3, 4, 5)], 1, gap=3)
    plan = build_plan(params, 1, shard_numel=size)
    if general:
        monkeypatch.setattr(ExchangePlan, "chunked", property(lambda self: False))
    u = torch.randn(size)
    out = torch.zeros(size)
    OwnerExchange(None, torch.float32, torch.float32).run(plan, u, out, scaled_orth)
    for info in params:
        p = info.pieces[0]
        t = u.narrow(0, p.shard_offset, info.numel).view(info.shape)
        torch.testing.assert_close(out.narrow(0, p.shard_offset, info.numel).view(info.shape), expected_update(t),
                                   rtol=1e-6, atol=1e-6, msg=info.name)


@pytest.mark.parametrize("world_size", [1, 3])
def test_plan_summary_and_loads_of_an_empty_and_a_full_sub_group(world_size):
    """A sub-group with no Muon matrix: no buckets, zero FLOPs on each of the W ranks, imbalance 1.0; a full one:
    the per-rank loads in describe() are load()'s. (Found by mutation testing: ``[0] * W`` for the empty plan's
    loads, and describe()'s text, were never read by a unit test.)"""
    empty = build_bucketed_plan([], world_size, 4096)
    assert empty.buckets == () and empty.load() == [0] * world_size and empty.imbalance() == 1.0
    assert empty.describe() == (f"0 Muon matrices in 0 exchange buckets over W={world_size}; NS GFLOP per rank "
                                f"[{', '.join(['0'] * world_size)}]; imbalance max/mean 1.000")
    plan = build_bucketed_plan(_mixed_params(), world_size, 600)
    loads = ", ".join(f"{x / 1e9:.3g}" for x in plan.load())
    assert plan.describe() == (f"10 Muon matrices in {len(plan.buckets)} exchange buckets over W={world_size}; "
                               f"NS GFLOP per rank [{loads}]; imbalance max/mean {plan.imbalance():.3f}")
    whole = build_plan(_mixed_params(), world_size)
    assert whole.describe() == (f"10 Muon matrices over W={world_size}; NS GFLOP per rank "
                                f"[{', '.join(f'{x / 1e9:.3g}' for x in whole.load())}]; "
                                f"imbalance max/mean {whole.imbalance():.3f}")
