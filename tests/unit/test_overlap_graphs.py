"""The overlapped step's graph capture (``SpeculativeMuon(graphs=True)``, ds_muon/sharded/overlap.py), on the CPU.

A CUDA graph replays the kernels it captured on the buffers it captured them with. Here a capture notes the
addresses of every tensor the bucket's work is given and each replay runs the work again after checking them
(``_StrictCapture``): a replay after the gradient buffer, the momentum or the graphs' output buffer moved fails, and one after the
settings changed differs from the eager speculation's result. The stashes come from a stand-in of CUDA's caching
allocator (``_CachingAllocator``: a freed block is handed back for the next request of its size). W=1, several owner-plan buckets, one sub-group; every step is compared bit for
bit with ``graphs=False`` (which is itself the ordinary step: tests/dist/test_overlap.py). The real CUDA graphs run
in scripts/overlap_nccl.py on a GPU.
"""
from __future__ import annotations

import pytest
import torch

from ds_muon.sharded.blocks import build_block_map
from ds_muon.sharded.exchange import OwnerExchange
from ds_muon.sharded.muon_step import MuonShardStep
from ds_muon.sharded.overlap import SpeculativeMuon
from ds_muon.sharded.ownership import ParamInfo, build_bucketed_plan

pytestmark = pytest.mark.unit

GROUP = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9, "nesterov": True, "ns_method": "standard",
         "ns_steps": 5, "update_scale": "shape", "momentum_dtype": "float32"}
SHAPES = [(8, 4), (6, 6), (4, 4), (8, 4), (5, 3)]


def _speculative(graphs: bool) -> tuple[SpeculativeMuon, MuonShardStep]:
    infos = [ParamInfo(f"w{k}", shape, shape[0] * shape[1], None) for k, shape in enumerate(SHAPES)]
    plan = build_bucketed_plan(infos, 1, 40, order="reverse")  # 40 elements: one matrix or two per bucket
    exchange = OwnerExchange(None, torch.float32, torch.float32, torch.device("cpu"))
    step = MuonShardStep("sub-group 0", plan, build_block_map(plan.slots, 0, plan.shard_numel), exchange, GROUP,
                         ns_compile=False, ns_autotune=False)
    spec = SpeculativeMuon({0: step}, {0: exchange}, graphs=graphs)
    spec._capture = _StrictCapture(spec)
    spec._new_stash = _CachingAllocator()
    return spec, step


def _addresses(args: tuple) -> tuple:
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else None for a in args)


class _StrictCapture:
    """A CUDA graph's stand-in: ``capture(work)`` runs nothing but notes the addresses of every tensor that
    ``_bucket_update`` (the captured work) is given; each replay runs ``work`` again and fails if any of them is at
    another address (where a CUDA graph would read or write stale memory)."""

    def __init__(self, spec: SpeculativeMuon) -> None:
        self.spec = spec

    def _run(self, work, compute: bool) -> tuple:
        seen, real = [], SpeculativeMuon._bucket_update.__get__(self.spec)
        self.spec._bucket_update = lambda *a: (seen.append(_addresses(a)), real(*a) if compute else None)
        try:
            work()
        finally:
            del self.spec._bucket_update
        return tuple(seen)

    def __call__(self, work):
        captured = self._run(work, compute=False)

        def replay() -> None:
            assert self._run(work, compute=True) == captured, "a replay would use other addresses than its graph's"
        return replay


class _CachingAllocator:
    """The CPU's stand-in for CUDA's caching allocator where the stashes come from: a block none of whose handed-out
    views is alive any more is handed back for the next request of its size, so a steady run's stash addresses
    repeat. ``fresh = True``: new blocks only (an allocator that has moved things: the stashes' addresses change)."""

    def __init__(self) -> None:
        import weakref
        self._ref = weakref.ref
        self.blocks: list[tuple[torch.Tensor, list]] = []
        self.fresh = False

    def __call__(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        for block, views in ([] if self.fresh else self.blocks):
            if block.numel() == numel and block.dtype == dtype and all(v() is None for v in views):
                break
        else:
            block, views = torch.empty(numel, dtype=dtype, device=device), []
            self.blocks.append((block, views))
        view = block.view(-1)
        views.append(self._ref(view))
        return view


def _train(graphs: bool, steps: int, events: dict) -> tuple[list[torch.Tensor], SpeculativeMuon]:
    """``steps`` optimizer steps, all speculated and committed; ``events[t]`` changes something before step ``t``:
    ``"new_grad_buffer"`` (DeepSpeed reallocating its gradient buffer), ``"new_momentum"`` (a checkpoint load
    replacing the momentum tensor), ``"beta"`` (a momentum schedule), ``"loss_scale"``, ``"stash_moves"`` (the
    allocator has released its cached blocks, as ``torch.cuda.empty_cache`` does: new ones from this step on),
    ``"stash_moves_from_here"`` (an allocator that never settles: new blocks in this step and every later one),
    ``"discard"`` (first a backward whose step is skipped, as for an fp16 overflow). The param group is a new dict
    every step (as ``load_state_dict`` makes it), so a replay cannot see a change through a dict it captured.
    Returns the partition after every step."""
    spec, step = _speculative(graphs)
    n, group = step.plan.shard_numel, dict(GROUP)
    gen = torch.Generator().manual_seed(0)
    p, grad, momentum, scale = torch.randn(n, generator=gen), torch.empty(n), None, 1.0
    finals = [(0, s.index) for b in reversed(step.plan.buckets) for s in b.slots]
    history, moving = [], False
    for t in range(steps):
        event = events.get(t)
        group = dict(group)
        moving = moving or event == "stash_moves_from_here"
        if graphs:
            spec._new_stash.fresh = moving
            if event == "stash_moves":
                spec._new_stash.blocks.clear()
        if event == "discard":
            grad.copy_(torch.randn(n, generator=gen))
            spec.mark_final(finals, lambda i: grad, lambda i: momentum, lambda i: group, scale)
            spec.discard("overflow")
        if event == "new_grad_buffer":
            grad = torch.empty(n)
        elif event == "new_momentum":
            momentum = momentum.clone()
        elif event == "beta":
            group["momentum"] = 0.8
        elif event == "loss_scale":
            scale = 4.0
        grad.copy_(torch.randn(n, generator=gen) * scale)
        spec.mark_final(finals, lambda i: grad, lambda i: momentum, lambda i: group, scale)
        if momentum is None:
            momentum = torch.zeros(n)
        spec.join()
        assert spec.commit(0, p, grad.clone().div_(scale), momentum, None, False, group, loss_scale=scale)
        history.append(p.clone())
    return history, spec


@pytest.mark.parametrize("events", [{}, {3: "new_grad_buffer"}, {3: "new_momentum"}, {3: "beta"}, {2: "loss_scale"}],
                         ids=["steady", "new_grad_buffer", "new_momentum", "beta", "loss_scale"])
def test_graph_replays_equal_the_eager_speculation(events) -> None:
    want, _ = _train(False, 6, events)
    got, spec = _train(True, 6, events)
    for t, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {t}: the replayed speculation differs from the eager one ({events})"
    buckets = len(spec.steps[0].plan.buckets)
    assert buckets >= 3
    # step 0 has no momentum (eager), step 1 captures every bucket, later steps replay; an event that changes an
    # address or the loss scale captures again at once; one that changes the settings runs eagerly once first
    recaptures = {"new_grad_buffer": 1, "new_momentum": 1, "loss_scale": 1, "beta": 1}.get(
        next(iter(events.values()), None), 0)
    # the stash is allocated every step and is none of the graph's addresses: the graphs write their output buffer
    stats = spec.stats()
    assert spec.captures == buckets * (1 + recaptures) and "graph_recaptures_stash" not in stats
    want = {"grad": "new_grad_buffer", "momentum": "new_momentum", "loss_scale": "loss_scale"}
    for part, event in want.items():
        assert stats[f"graph_recaptures_{part}"] == (buckets if event in events.values() else 0), part
    eager_steps = 1 + (1 if "beta" in events.values() else 0)
    assert spec.replays == buckets * (6 - eager_steps) and stats["graph_captures"] == spec.captures
    assert stats["graph_replays"] == spec.replays and spec.commits == 6


@pytest.mark.parametrize("event", ["stash_moves", "stash_moves_from_here", "discard"])
def test_a_stash_at_a_new_address_costs_no_capture(event) -> None:
    """The stash is allocated every step, where the allocator likes (on one H100 every bucket's block moved): the
    graph writes ``o`` into the graphs' output buffer, one buffer of the largest bucket's stretch at a fixed address,
    and a copy after the replay moves it into the stash, so a stash at a new address (once, ``empty_cache``; every
    step, an allocator that never settles) is captured again never and kept across steps never, and the steps equal
    the eager ones bit for bit. A skipped step (discard) replays and drops its speculation."""
    at = 2 if event == "stash_moves_from_here" else 3
    want, _ = _train(False, 7, {at: event})
    got, spec = _train(True, 7, {at: event})
    for t, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {t}: the replayed speculation differs from the eager one ({event})"
    buckets = spec.steps[0].plan.buckets
    assert spec.captures == len(buckets) and sum(spec.recaptures.values()) == 0
    assert spec.replays == len(buckets) * (6 + (event == "discard")) and spec.commits == 7  # a discarded backward replays
    assert spec.fallbacks["overflow"] == (1 if event == "discard" else 0)
    (out,) = spec._graph_out.values()
    assert out.numel() == max(spec._stretch(0, k)[1] for k in range(len(buckets))) < spec.steps[0].plan.shard_numel
    assert not spec._state  # no stash held after the last commit


def test_the_output_buffer_serves_sub_groups_of_different_sizes() -> None:
    """Two sub-groups whose largest buckets differ in size: the graphs' output buffer is sized to the largest stretch
    of all of them (sized from one sub-group, the other's replay would not fit), and three steps of both, the stashes
    at new addresses every step, equal the eager speculation bit for bit."""
    def build(graphs: bool) -> tuple[SpeculativeMuon, dict]:
        steps, exchanges = {}, {}
        for i, shapes in enumerate((SHAPES, [(12, 10), (10, 10), (6, 4)])):
            infos = [ParamInfo(f"g{i}w{k}", shape, shape[0] * shape[1], None) for k, shape in enumerate(shapes)]
            plan = build_bucketed_plan(infos, 1, 40 if i == 0 else 130, order="reverse")
            exchanges[i] = OwnerExchange(None, torch.float32, torch.float32, torch.device("cpu"))
            steps[i] = MuonShardStep(f"sub-group {i}", plan, build_block_map(plan.slots, 0, plan.shard_numel),
                                     exchanges[i], GROUP, ns_compile=False, ns_autotune=False)
        spec = SpeculativeMuon(steps, exchanges, graphs=graphs)
        spec._capture = _StrictCapture(spec)
        spec._new_stash = _CachingAllocator()
        spec._new_stash.fresh = True  # every stash at a new address
        return spec, steps

    results = []
    for graphs in (False, True):
        spec, steps = build(graphs)
        gen = torch.Generator().manual_seed(1)
        state = {i: (torch.randn(s.plan.shard_numel, generator=gen), torch.zeros(s.plan.shard_numel),
                     torch.empty(s.plan.shard_numel)) for i, s in steps.items()}
        finals = [(i, sl.index) for i, s in steps.items() for b in reversed(s.plan.buckets) for sl in b.slots]
        for _ in range(3):
            for i, (p, m, g) in state.items():
                g.copy_(torch.randn(g.numel(), generator=gen))
            spec.mark_final(finals, lambda i: state[i][2], lambda i: state[i][1], lambda i: GROUP, 1.0)
            spec.join()
            for i, (p, m, g) in state.items():
                assert spec.commit(i, p, g.clone(), m, None, False, GROUP)
        results.append([state[i][0].clone() for i in steps])
        if graphs:
            stretches = {i: max(spec._stretch(i, k)[1] for k in range(len(s.plan.buckets))) for i, s in steps.items()}
            assert stretches[0] != stretches[1]
            (out,) = spec._graph_out.values()
            assert out.numel() == max(stretches.values())
            assert spec.captures == sum(len(s.plan.buckets) for s in steps.values()) and spec.replays > 0
    for a, b in zip(*results):
        assert torch.equal(a, b), "the replayed speculation differs from the eager one"


def test_commit_equals_the_ordinary_step_with_runs_cut_and_a_bf16_stash(monkeypatch) -> None:
    """Buckets of several matrices, each bucket's runs cut at 7 elements (``RUN_ELEMENTS``, so a piece spans runs
    and the stash is read at many offsets), a bf16 exchange (the stash holds bf16, the commit widens it): the
    speculation's commit equals the ordinary step bit for bit, momentum and weights."""
    from ds_muon.sharded import overlap
    monkeypatch.setattr(overlap, "RUN_ELEMENTS", 7)
    infos = [ParamInfo(f"w{k}", shape, shape[0] * shape[1], None) for k, shape in enumerate(SHAPES)]
    plan = build_bucketed_plan(infos, 1, 80, order="reverse")  # two or three matrices per bucket
    assert any(len(b.slots) > 1 for b in plan.buckets)
    n, group = plan.shard_numel, dict(GROUP)
    exchange = OwnerExchange(None, torch.bfloat16, torch.float32, torch.device("cpu"))
    step = MuonShardStep("sub-group 0", plan, build_block_map(plan.slots, 0, n), exchange, GROUP,
                         ns_compile=False, ns_autotune=False)
    spec = SpeculativeMuon({0: step}, {0: exchange})
    gen = torch.Generator().manual_seed(1)
    grad, p, m = torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    spec.mark_final([(0, s.index) for b in reversed(plan.buckets) for s in b.slots], lambda i: grad,
                    lambda i: m, lambda i: group, 1.0)
    assert max(len(spec._runs(0, k)) for k in range(len(plan.buckets))) > 2
    want_p, want_m, g = p.clone(), m.clone(), grad.clone()
    step.orthogonalize(step.prepare(g, want_m, group), g, group)
    step.finalize(want_p, g, group)
    got_m = m.clone()
    assert spec.commit(0, p, grad.clone(), got_m, None, False, group)
    assert torch.equal(got_m, want_m) and torch.equal(p, want_p)


def test_commit_sets_blocks_without_gradient_aside_as_the_ordinary_step() -> None:
    """A block with no gradient on any rank (a stacked expert without tokens) inside a complete speculation: the
    commit equals the ordinary step with that block set aside (``set_aside`` before ``prepare``, put back after
    ``finalize``), bit for bit, momentum and weights; where no block had one, nothing changes, the gradient buffer
    included (the ordinary step returns early). Both count as ``commits_idle_blocks``."""
    spec, step = _speculative(False)
    n, group = step.plan.shard_numel, dict(GROUP)
    gen = torch.Generator().manual_seed(2)
    grad, p, m = torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    had = torch.ones(step.block_map.n_blocks, dtype=torch.bool)
    had[2] = False
    for lo, size in step.block_map.local_ranges([2]):
        grad[lo:lo + size] = 0
    order = [(0, s.index) for b in reversed(step.plan.buckets) for s in b.slots]
    spec.mark_final(order, lambda i: grad, lambda i: m, lambda i: group, 1.0)
    want_p, want_m, g = p.clone(), m.clone(), grad.clone()
    put_back = step.set_aside(had, want_m, want_p)
    step.orthogonalize(step.prepare(g, want_m, group), g, group)
    step.finalize(want_p, g, group)
    put_back()
    got_p, got_m = p.clone(), m.clone()
    assert spec.commit(0, got_p, grad.clone(), got_m, had, False, group)
    assert torch.equal(got_m, want_m) and torch.equal(got_p, want_p)
    idle = torch.zeros(n, dtype=torch.bool)
    for lo, size in step.block_map.local_ranges([2]):
        idle[lo:lo + size] = True
    assert torch.equal(got_p[idle], p[idle]) and torch.equal(got_m[idle], m[idle]) and not torch.equal(got_p, p)
    # no block had a gradient: the commit leaves everything as it was
    spec.mark_final(order, lambda i: torch.zeros(n), lambda i: m, lambda i: group, 1.0)
    got_p, got_m, untouched = p.clone(), m.clone(), torch.zeros(n)
    assert spec.commit(0, got_p, untouched, got_m, torch.zeros_like(had), False, group)
    assert torch.equal(got_p, p) and torch.equal(got_m, m) and torch.equal(untouched, torch.zeros(n))
    assert spec.stats()["commits"] == spec.stats()["commits_idle_blocks"] == 2
    assert not spec.active() and sum(spec.fallbacks.values()) == 0


def test_stashes_live_from_their_bucket_to_the_commit() -> None:
    """No stash is held between steps (none in the forward, where the peak usually is): each bucket's is allocated
    when the bucket is speculated, covers that bucket's stretch of the shard only, and goes with the commit."""
    spec, step = _speculative(True)
    n, group = step.plan.shard_numel, dict(GROUP)
    grad, p = torch.randn(n), torch.randn(n)
    buckets = step.plan.buckets
    spec.mark_final([(0, s.index) for s in buckets[-1].slots], lambda i: grad, lambda i: None, lambda i: group, 1.0)
    held = spec._state[0].stashes
    assert list(held) == [len(buckets) - 1]
    assert held[len(buckets) - 1].numel() == sum(s.pieces[0].sent for s in buckets[-1].slots) < n
    rest = [(0, s.index) for b in reversed(buckets[:-1]) for s in b.slots]
    spec.mark_final(rest, lambda i: grad, lambda i: None, lambda i: group, 1.0)
    assert sum(t.numel() for t in spec._state[0].stashes.values()) == n
    assert spec.commit(0, p, grad.clone(), torch.zeros(n), None, False, group)
    assert not spec.active() and not spec._state


def _padded(pad: int, bucket: int, wire: torch.dtype) -> tuple[SpeculativeMuon, MuonShardStep, list[int], int]:
    """One sub-group of :data:`SHAPES` laid out flat with ``pad`` elements of padding after every matrix
    (ZeRO-1/2's layout; 0: ZeRO-3's at one rank), owner-plan buckets of ``bucket`` elements in reverse order, a
    ``wire``-dtype exchange: ``(speculation, step, each matrix's offset, partition elements)``."""
    import math

    from ds_muon.partitions import flat_pieces
    offsets, at = [], 0
    for shape in SHAPES:
        offsets.append(at)
        at += math.prod(shape) + pad
    infos = [ParamInfo(f"w{k}", shape, math.prod(shape), None, flat_pieces(o, math.prod(shape), at, 1))
             for k, (shape, o) in enumerate(zip(SHAPES, offsets))]
    plan = build_bucketed_plan(infos, 1, bucket, order="reverse", shard_numel=at)
    exchange = OwnerExchange(None, wire, torch.float32, torch.device("cpu"))
    step = MuonShardStep("sub-group 0", plan, build_block_map(plan.slots, 0, at), exchange, GROUP,
                         ns_compile=False, ns_autotune=False)
    return SpeculativeMuon({0: step}, {0: exchange}), step, offsets, at


def test_commit_zeroes_what_no_bucket_covers() -> None:
    """A flat partition with padding after every matrix (ZeRO-1/2's layout): the commit's ``o`` is 0 on the padding
    (whatever the gradient buffer holds there), so those elements only decay, and every matrix's elements get the
    ordinary step's update."""
    import math
    spec, step, offsets, at = _padded(3, 40, torch.float32)
    plan, group = step.plan, dict(GROUP)
    assert spec._uncovered_runs(0) == [(o + math.prod(shape), 3) for shape, o in zip(SHAPES, offsets)]
    grad, p = torch.randn(at), torch.randn(at)
    spec.mark_final([(0, s.index) for b in reversed(plan.buckets) for s in b.slots], lambda i: grad,
                    lambda i: None, lambda i: group, 1.0)
    want, g = p.clone(), grad.clone()
    step.orthogonalize(step.prepare(g, torch.zeros(at), group), g, group)
    step.finalize(want, g, group)
    got = p.clone()
    assert spec.commit(0, got, grad.clone(), torch.zeros(at), None, False, group)
    pad = torch.zeros(at, dtype=torch.bool)
    for lo, n in spec._uncovered_runs(0):
        pad[lo:lo + n] = True
    assert torch.equal(got[~pad], want[~pad])
    assert torch.equal(got[pad], p[pad] * (1 - group["lr"] * group["weight_decay"]))


@pytest.mark.parametrize("pad", [0, 3])
@pytest.mark.parametrize("nesterov", [True, False])
def test_commit_from_a_bf16_gradient_in_place_equals_the_ordinary_step(pad, nesterov, monkeypatch) -> None:
    """ZeRO-3's in-place commit (a bf16 gradient slice, read and left as it is): with runs cut at 7 elements (so the
    stash is read at many offsets) and, with ``pad``, padding after every matrix (weights there decay only), the
    commit equals the ordinary step on the float32 copy of the gradient, bit for bit, momentum and weights, and
    counts as ``commits_from_grad``; a gradient of another dtype that is not narrower is refused."""
    from ds_muon.sharded import overlap
    monkeypatch.setattr(overlap, "RUN_ELEMENTS", 7)
    spec, step, _, at = _padded(pad, 80, torch.bfloat16)
    plan, group = step.plan, dict(GROUP, nesterov=nesterov)
    gen = torch.Generator().manual_seed(1)
    g16 = torch.randn(at, generator=gen).bfloat16()
    p, m = torch.randn(at, generator=gen), torch.randn(at, generator=gen)
    for lo, n in spec._uncovered_runs(0):  # ZeRO-3's padding: zero gradient and momentum
        g16[lo:lo + n], m[lo:lo + n] = 0, 0
    assert bool(spec._uncovered_runs(0)) == bool(pad)
    spec.mark_final([(0, s.index) for b in reversed(plan.buckets) for s in b.slots], lambda i: g16,
                    lambda i: m, lambda i: group, 1.0)
    assert max(len(spec._runs(0, k)) for k in range(len(plan.buckets))) > 2
    assert spec.would_commit(0, False, 1.0) and not spec.would_commit(0, True, 1.0)
    assert not spec.would_commit(0, False, 2.0)
    want_p, want_m, g = p.clone(), m.clone(), g16.float()
    step.orthogonalize(step.prepare(g, want_m, group), g, group)
    step.finalize(want_p, g, group)
    got_p, got_m, kept = p.clone(), m.clone(), g16.clone()
    assert spec.commit(0, got_p, kept, got_m, None, False, group)
    assert torch.equal(kept, g16) and torch.equal(got_m, want_m) and torch.equal(got_p, want_p)
    assert spec.stats()["commits_from_grad"] == spec.stats()["commits"] == 1
    spec.mark_final([(0, s.index) for b in reversed(plan.buckets) for s in b.slots], lambda i: g16.double(),
                    lambda i: m, lambda i: group, 1.0)
    with pytest.raises(ValueError, match="narrower"):
        spec.commit(0, p.clone(), g16.double(), m.clone(), None, False, group)


@pytest.mark.parametrize("graphs", [False, True])
def test_commit_falls_back_when_the_step_unscales_by_another_loss_scale(graphs) -> None:
    """fp16's dynamic loss scale grows at a step without overflow after ``loss_scale_window`` steps, and DeepSpeed
    updates it before unscaling: the gradient is then divided by the new scale, the speculation by the old one.
    The commit must leave such a step to the ordinary path (counted as "loss_scale")."""
    spec, step = _speculative(graphs)
    n, group = step.plan.shard_numel, dict(GROUP)
    grad, p = torch.randn(n) * 8.0, torch.randn(n)
    finals = [(0, s.index) for b in reversed(step.plan.buckets) for s in b.slots]
    spec.mark_final(finals, lambda i: grad, lambda i: None, lambda i: group, 8.0)
    before = p.clone()
    assert not spec.commit(0, p, grad / 16.0, torch.zeros(n), None, False, group, loss_scale=16.0)
    assert spec.fallbacks["loss_scale"] == 1 and spec.commits == 0 and torch.equal(p, before)
    spec.mark_final(finals, lambda i: grad, lambda i: None, lambda i: group, 8.0)
    assert spec.commit(0, p, grad / 8.0, torch.zeros(n), None, False, group, loss_scale=8.0)


@pytest.mark.parametrize("device,world,offloaded,graphs,want", [
    ("cuda", 1, False, True, True),     # measured faster: ZeRO-3, one rank, graphs
    ("cuda", 2, False, True, False),    # W >= 2: no graphs around NCCL, launches on backward's thread
    ("cpu", 1, False, True, False),     # no streams
    ("cuda", 1, True, True, False),     # optimizer offload: today's step
    ("cuda", 1, False, False, False),   # eager launches: measured slower
])
def test_auto_turns_the_overlap_on_only_where_it_was_measured_faster(monkeypatch, device, world, offloaded, graphs,
                                                                     want) -> None:
    from types import SimpleNamespace

    import torch.distributed as dist

    from ds_muon.integration.overlap import OverlapHooks
    from ds_muon.integration.overlap12 import FlatOverlapHooks
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)

    def engine(cls):
        obj = cls.__new__(cls)
        obj._device, obj._offloaded = torch.device(device), lambda: offloaded
        obj.optimizer = SimpleNamespace(config=SimpleNamespace(overlap_backward="auto", overlap_cuda_graphs=graphs))
        return obj

    assert OverlapHooks._overlap_auto(engine(OverlapHooks)) is want
    assert FlatOverlapHooks._overlap_auto(engine(FlatOverlapHooks)) is False  # ZeRO-1/2: not measured on a GPU


def test_a_failed_capture_falls_back_exactly_and_stays_eager() -> None:
    spec, step = _speculative(True)

    def refuse(work):
        raise RuntimeError("operation not permitted when stream is capturing")

    spec._capture = refuse
    n, group = step.plan.shard_numel, dict(GROUP)
    grad, momentum, p = torch.randn(n), torch.zeros(n), torch.randn(n)
    finals = [(0, s.index) for b in reversed(step.plan.buckets) for s in b.slots]
    spec._warm = {(0, k): (0.9, True, "float32", step._ns_key) for k in range(len(step.plan.buckets))}
    with pytest.warns(UserWarning, match="runs eagerly from now on"):
        spec.mark_final(finals, lambda i: grad, lambda i: momentum, lambda i: group, 1.0)
    assert not spec.commit(0, p, grad.clone(), momentum, None, False, group) and spec.fallbacks["not_ready"] == 1
    assert spec.graphs is False
    spec.mark_final(finals, lambda i: grad, lambda i: momentum, lambda i: group, 1.0)  # eager, no capture tried
    assert spec.commit(0, p, grad.clone(), momentum, None, False, group) and spec.captures == 0
