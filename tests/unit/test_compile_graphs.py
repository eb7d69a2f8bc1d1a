"""Compile stability: how many graphs the compiled Newton–Schulz needs for a real model's owner calls.

The owner step calls ``compiled_orthogonalize(method, steps, dtype)`` once per block group of each
bucket's shape batches (:meth:`ds_muon.sharded.exchange.OwnerExchange._owner_compute`), with inputs of shape
``(count, *blocks, rows, cols)``. The default (``COMPILE_DYNAMIC = False``) compiles one graph per distinct
input shape (faster kernels: ds_muon/core/ns_compile.py); with ``dynamic=True`` a graph is reused across
sizes; torch still specializes on a size of 1 against more, on the orientation (``rows > cols``) and, for
``"gram"``, on whether the Gram kernel pays. Here the exact calls of the benchmark models' plans
(``examples/model.py``: 934M, 2.9B with per-head Q/K/V views, the 8-expert MoE) are replayed on
meta tensors (no arithmetic) for every rank at W = 1, 2, 4, 8, and the graphs counted by a counting
backend. Static: one graph per distinct shape, within ds_muon's per-call ``COMPILE_GRAPH_LIMIT`` (64),
so nothing falls back to eager (measured: 3-4 for 934M, 10 for the per-head 2.9B plan at W=4, 5-7 for
the MoE). Dynamic: within torch.compile's default ``recompile_limit`` (8) and shared across shapes
(measured: at most 7, the per-head 2.9B plan with ``gram`` at W=4; 2-5 for the others).
On GPU, ``benchmarks/step_time.py`` reports the graphs of a whole run.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from tests.support.tools import repo_module

model_module = repo_module("examples/model.py")

GRAPH_BUDGET = 8  # torch.compile's default recompile_limit


def _owner_calls(preset: str, world_size: int, method: str, per_head: bool) -> list[tuple]:
    """``(shape, stride, dtype)`` of every Newton–Schulz call the owners make in one step, all ranks."""
    CausalLM, ModelConfig = model_module.CausalLM, model_module.ModelConfig

    from ds_muon.sharded.exchange import OwnerExchange
    from ds_muon.names import SPLIT_ATTR
    from ds_muon.sharded.ownership import ParamInfo, build_bucketed_plan
    from ds_muon.model.structure import param_numel, param_shape
    from ds_muon.model.selection import SelectionRules, tag_model
    with torch.device("meta"):
        model = CausalLM(ModelConfig.preset(preset))
    tag_model(model, SelectionRules.of(per_head_muon=per_head), log=False)
    infos = [ParamInfo(n, param_shape(p), param_numel(p), getattr(p, SPLIT_ATTR, None))
             for n, p in model.named_parameters() if getattr(p, "use_muon", False)]
    plan = build_bucketed_plan(infos, world_size, 128 * 2**20, 5, method)  # exchange_bucket_mb 256, bf16
    calls: list[tuple] = []
    for rank in range(world_size):
        exchange = OwnerExchange(None, torch.bfloat16, torch.bfloat16, torch.device("meta"))
        exchange.world_size, exchange.rank = world_size, rank  # the plan's view of that rank, no process group
        for bucket in plan.buckets:
            owner_side = torch.empty(world_size * bucket.split_sizes[rank], dtype=torch.bfloat16, device="meta")
            exchange._owner_compute(bucket, owner_side,
                                    lambda t: (calls.append((tuple(t.shape), t.stride(), t.dtype)), t)[1], "meta")
    return calls


# (preset, per_head_muon, methods, world sizes): the per-head 2.9B plan makes ~70-130 calls per step,
# so it runs at one W (measured up to 7 graphs at W = 1..8 for every case here, standard and gram)
@pytest.mark.parametrize("preset,per_head,methods,sizes", [("934m", False, ("standard", "gram"), (1, 2, 4, 8)),
                                                           ("2.9b", True, ("standard",), (4,)),
                                                           ("moe-1.5b", False, ("standard",), (2, 8))])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static-default", "dynamic"])
def test_compiled_newton_schulz_graphs_for_model_plans(preset, per_head, methods, sizes, dynamic, monkeypatch):
    from ds_muon.core import ns_compile
    from ds_muon.core.ns_compile import compiled_orthogonalize
    assert ns_compile.COMPILE_DYNAMIC is False  # the default this test's static case stands for
    graphs = [0]

    def counting_backend(gm, example_inputs):  # torch.compile calls it once per new graph
        graphs[0] += 1
        return gm.forward

    # meta tensors have no autocast state; orthogonalize's autocast-off region is a no-op here
    monkeypatch.setattr(torch, "autocast", lambda **kw: contextlib.nullcontext())
    worst = {}
    for method in methods:
        for world_size in sizes:
            torch._dynamo.reset()
            graphs[0] = 0
            fn = compiled_orthogonalize(method, 5, torch.bfloat16, backend=counting_backend,
                                        **({"dynamic": True} if dynamic else {}))
            calls = _owner_calls(preset, world_size, method, per_head)
            assert len(calls) >= world_size
            for shape, stride, dtype in calls:
                fn(torch.empty_strided(shape, stride, dtype=dtype, device="meta"))
            worst[(method, world_size)] = (graphs[0], len(set(c[0] for c in calls)))
    compiled_orthogonalize.cache_clear()
    torch._dynamo.reset()
    if not dynamic:  # one graph per distinct shape, within ds_muon's per-call limit
        assert all(g == n <= ns_compile.COMPILE_GRAPH_LIMIT for g, n in worst.values()), f"{preset}: {worst}"
        return
    assert all(g <= GRAPH_BUDGET for g, _ in worst.values()), f"{preset}: (graphs, distinct shapes) {worst}"
    # more distinct input shapes than graphs somewhere: the graphs are shared across shapes
    assert any(n > g for g, n in worst.values()), worst


@pytest.mark.parametrize("preset,per_head,world_size", [("934m", False, 2), ("2.9b", True, 4), ("moe-1.5b", False, 8)])
def test_plan_names_the_static_call_shapes(preset, per_head, world_size):
    """``BucketedPlan.ns_call_shapes(rank)`` (what ``ns_autotune`` counts against ``COMPILE_GRAPH_LIMIT``
    before the first step) is exactly the set of input shapes the owner replay calls Newton–Schulz with
    on that rank, and within the limit for the benchmark models."""
    CausalLM, ModelConfig = model_module.CausalLM, model_module.ModelConfig

    from ds_muon.sharded.exchange import OwnerExchange
    from ds_muon.names import SPLIT_ATTR
    from ds_muon.core.ns_compile import COMPILE_GRAPH_LIMIT
    from ds_muon.sharded.ownership import ParamInfo, build_bucketed_plan
    from ds_muon.model.structure import param_numel, param_shape
    from ds_muon.model.selection import SelectionRules, tag_model
    with torch.device("meta"):
        model = CausalLM(ModelConfig.preset(preset))
    tag_model(model, SelectionRules.of(per_head_muon=per_head), log=False)
    infos = [ParamInfo(n, param_shape(p), param_numel(p), getattr(p, SPLIT_ATTR, None))
             for n, p in model.named_parameters() if getattr(p, "use_muon", False)]
    plan = build_bucketed_plan(infos, world_size, 128 * 2**20, 5, "standard")
    for rank in range(world_size):
        seen: set = set()
        exchange = OwnerExchange(None, torch.bfloat16, torch.bfloat16, torch.device("meta"))
        exchange.world_size, exchange.rank = world_size, rank
        for bucket in plan.buckets:
            owner_side = torch.empty(world_size * bucket.split_sizes[rank], dtype=torch.bfloat16, device="meta")
            exchange._owner_compute(bucket, owner_side, lambda t: (seen.add(tuple(t.shape)), t)[1], "meta")
        assert plan.ns_call_shapes(rank) == seen
        assert 0 < len(seen) <= COMPILE_GRAPH_LIMIT, (rank, len(seen))


def test_ns_autotune_refuses_more_static_graphs_than_the_limit(monkeypatch):
    """``MuonZeroOptimizer._check_autotune_graphs``: with ns_autotune on CUDA, a plan of more distinct call
    shapes on some rank than ``COMPILE_GRAPH_LIMIT`` is a ConfigError naming the key; at the limit, on CPU,
    or without ns_autotune nothing is raised (the per-head 2.9B plan at W=1: 11 shapes on rank 0)."""
    import types

    import ds_muon.integration.zero3 as zero3
    import ds_muon.integration.zero_common as zero_common
    from ds_muon.config import ConfigError, parse_muon_params
    CausalLM, ModelConfig = model_module.CausalLM, model_module.ModelConfig

    from ds_muon.names import SPLIT_ATTR
    from ds_muon.sharded.ownership import ParamInfo, build_bucketed_plan
    from ds_muon.model.structure import param_numel, param_shape
    from ds_muon.model.selection import SelectionRules, tag_model
    with torch.device("meta"):
        model = CausalLM(ModelConfig.preset("2.9b"))
    tag_model(model, SelectionRules.of(per_head_muon=True), log=False)
    infos = [ParamInfo(n, param_shape(p), param_numel(p), getattr(p, SPLIT_ATTR, None))
             for n, p in model.named_parameters() if getattr(p, "use_muon", False)]
    plan = build_bucketed_plan(infos, 1, 128 * 2**20, 5, "standard")
    shapes = len(plan.ns_call_shapes(0))
    cuda = torch.device("cuda")  # only the device type is read

    def fake(device, **params):
        return types.SimpleNamespace(muon_plans={0: plan}, _device=device,
                                     optimizer=types.SimpleNamespace(config=parse_muon_params(params)))

    check = zero3.MuonZeroOptimizer._check_autotune_graphs
    monkeypatch.setattr(zero_common, "COMPILE_GRAPH_LIMIT", shapes - 1)
    with pytest.raises(ConfigError, match=rf"optimizer.params.ns_autotune: .* {shapes} distinct .* set ns_autotune: false"):
        check(fake(cuda, ns_autotune=True))
    check(fake(torch.device("cpu"), ns_autotune=True))
    check(fake(cuda, ns_autotune=False))
    monkeypatch.setattr(zero_common, "COMPILE_GRAPH_LIMIT", shapes)
    monkeypatch.setattr(zero_common.AUTOTUNE_PROGRESS, "expected", None)
    check(fake(cuda, ns_autotune=True))
    assert zero_common.AUTOTUNE_PROGRESS.expected == shapes  # the progress lines' total (this rank's shapes)


def test_static_default_hands_shapes_past_its_cap_to_dynamic_shapes(monkeypatch):
    """The static default compiles one graph per distinct input; past ``STATIC_GRAPH_CAP`` distinct inputs new
    ones go to a dynamic-shape twin (a few graphs for all of them), so a model with very many call shapes never
    reaches the recompile limit (past it torch.compile would silently run eagerly). Broken by hand (the cap
    removed): 12 graphs for the 12 shapes."""
    from ds_muon.core import ns_compile
    from ds_muon.core.newton_schulz import orthogonalize
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(tuple(t.shape for t in example_inputs if isinstance(t, torch.Tensor)))
        return gm.forward

    monkeypatch.setattr(ns_compile, "STATIC_GRAPH_CAP", 4)
    ns_compile.compiled_orthogonalize.cache_clear()
    torch._dynamo.reset()
    try:
        fn = ns_compile.compiled_orthogonalize("standard", 5, torch.float32, backend=counting_backend)
        shapes = [(2, 8, 8 + k) for k in range(12)]
        for shape in shapes + shapes[:3]:  # repeats reuse their graphs
            x = torch.randn(*shape, generator=torch.Generator().manual_seed(len(graphs)))
            torch.testing.assert_close(fn(x), orthogonalize(x, "standard", 5, torch.float32), rtol=1e-5, atol=1e-6)
        static, dynamic = len(graphs[:4]), len(graphs) - 4
        assert static == 4 and 1 <= dynamic <= 3, graphs  # 4 static graphs, then dynamic ones for 8 more shapes
    finally:
        ns_compile.compiled_orthogonalize.cache_clear()
        torch._dynamo.reset()
