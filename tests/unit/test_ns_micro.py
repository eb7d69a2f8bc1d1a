"""benchmarks/step_time.py's Newton–Schulz microbenchmark (``--ns-micro``) on CPU with tiny shapes, so
the one GPU run does not fail on plumbing: variant parsing, the rows it writes, a failing variant kept
as a row. torch.compile runs with the ``eager`` backend here (same dynamo tracing and guards; the
autotune mode is inductor's, dropped with another backend)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.support.tools import repo_module

step_time = repo_module("benchmarks/step_time.py")


def test_shapes_and_variant_lists():
    assert step_time.parse_shapes("16x2048x2048, 2x64x96") == ((16, 2048, 2048), (2, 64, 96))
    with pytest.raises(ValueError, match="BxMxN"):
        step_time.parse_shapes("16x2048")
    assert step_time.split_variants("standard,gram[autotune,dynamic];heavyball") == (
        "standard", "gram[autotune,dynamic]", "heavyball")
    assert step_time.split_variants(",".join(step_time.NS_VARIANTS)) == step_time.NS_VARIANTS


def test_ns_microbenchmark_on_cpu(tmp_path):
    torch._dynamo.reset()
    out = tmp_path / "ns.json"
    variants = ("standard", "standard[fused,autotune]", "standard[eager]", "polar_express[static]", "standard[hybrid]",
                "standard[sym2]", "standard[sym4,eager]", "torch.optim.Muon", "gram[bogus]")
    shapes = ((2, 8, 8), (2, 20, 8))
    try:
        result = step_time.ns_microbenchmark(str(out), shapes=shapes, variants=variants, device="cpu", iters=1,
                                             backend="eager")
    finally:
        torch._dynamo.reset()
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    rows = {(r["method"], tuple(r["shape"])): r for r in result["rows"]}
    assert len(rows) == len(variants) * len(shapes)
    for shape in shapes:
        bad = rows["gram[bogus]", shape]
        assert "bad Newton-Schulz variant" in bad["error"] and "seconds" not in bad
        good = [rows[v, shape] for v in variants if v != "gram[bogus]"]
        assert all("error" not in r and r["seconds"] > 0 and r["fraction_of_matmul"] > 0 for r in good), good
        # fp32 on CPU: every form of the standard quintic gives the same
        # output to rounding; torch.optim.Muon runs the same quintic in bf16; Polar Express converges further
        errs = {r["method"]: r["ortho_error"] for r in good}
        for v in ("standard[fused,autotune]", "standard[eager]", "standard[hybrid]", "standard[sym2]",
                  "standard[sym4,eager]"):
            assert errs[v] == pytest.approx(errs["standard"], rel=1e-4), (v, shape)
        assert errs["torch.optim.Muon"] == pytest.approx(errs["standard"], rel=0.05)
        # the rate counts each variant's own FLOPs: the sym forms' fewer, the default form's for no form option
        from ds_muon.core.ns_cost import ns_flops
        for v, form in (("standard[sym2]", "sym2"), ("standard[sym4,eager]", "sym4"), ("standard[eager]", "plain")):
            r = rows[v, shape]
            assert r["tflops"] * r["seconds"] * 1e12 == pytest.approx(ns_flops(*shape[1:], 5, batch=shape[0],
                                                                                form=form), rel=1e-9), v
        assert errs["polar_express[static]"] < errs["standard"]
    # compiled variants report the graphs they added; the eager one none
    assert rows["standard[eager]", shapes[0]]["graphs"] == 0 and rows["polar_express[static]", shapes[0]]["graphs"] == 1


def test_ns_autotune_runs_the_measured_variant():
    """The config key ns_autotune compiles Newton–Schulz with the settings of the microbenchmark's
    ``standard[autotune]`` row (mode and static shapes), and needs ns_compile."""
    from ds_muon.config import ConfigError, parse_muon_params
    from ds_muon.core.ns_compile import AUTOTUNE_COMPILE
    assert AUTOTUNE_COMPILE == {"mode": step_time.AUTOTUNE, "dynamic": False}
    assert parse_muon_params({"ns_autotune": True}).ns_autotune
    assert not parse_muon_params({}).ns_autotune
    with pytest.raises(ConfigError, match="ns_autotune.*ns_compile: true"):
        parse_muon_params({"ns_autotune": True, "ns_compile": False})


def test_ns_autotune_progress_lines_and_persistent_cache(monkeypatch, tmp_path):
    """``ns_autotune`` (issue 27, item 4): each new static call shape prints a line before it compiles (which
    graph of how many, the shape) and one after (seconds, how many left), on rank 0; a shape seen before
    prints nothing. The compile of an autotuned graph first points inductor's caches at a persistent
    directory (``$XDG_CACHE_HOME/ds_muon/torchinductor``) when ``TORCHINDUCTOR_CACHE_DIR`` is unset, and keeps
    a directory the user set."""
    import io

    from torch._inductor import config as inductor_config

    from ds_muon.core import ns_compile
    progress = ns_compile.AutotuneProgress()
    progress.stream = io.StringIO()
    progress.expect(3)
    calls = []
    for shape in [(16, 64, 64), (16, 64, 64), (4, 32, 96)]:
        assert progress.call((shape, "bfloat16", "standard"), lambda: calls.append(shape) or 7) == 7
    lines = progress.stream.getvalue().splitlines()
    assert len(calls) == 3 and len(lines) == 4, lines
    assert "graph 1/3 for (16, 64, 64) bfloat16 standard" in lines[0] and "2 left" in lines[1]
    assert "graph 2/3 for (4, 32, 96)" in lines[2] and "1 left" in lines[3]

    # restored by inductor's own patch: monkeypatch.setattr reads these ConfigModule entries as unset and deletes
    # them at undo, which breaks every later inductor compile in the process ("fx_graph_cache does not exist")
    restore = inductor_config.patch(fx_graph_cache=inductor_config.fx_graph_cache,
                                    autotune_local_cache=inductor_config.autotune_local_cache)
    restore.__enter__()
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    want = str(tmp_path / "ds_muon" / "torchinductor")
    # the compiled function of ns_autotune's settings: torch.compile replaced (no inductor run on CPU)
    monkeypatch.setattr(ns_compile.torch, "compile", lambda f, **kw: f)
    monkeypatch.setattr(ns_compile, "AUTOTUNE_PROGRESS", progress)
    ns_compile.compiled_orthogonalize.cache_clear()
    try:
        fn = ns_compile.compiled_orthogonalize("standard", 5, torch.float32, **ns_compile.AUTOTUNE_COMPILE)
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == want and os.path.isdir(want)
        assert inductor_config.fx_graph_cache and inductor_config.autotune_local_cache
        fn(torch.randn(2, 8, 12))
        assert "(2, 8, 12) float32 standard" in progress.stream.getvalue().splitlines()[-2]
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
        assert ns_compile.persistent_inductor_cache() == str(tmp_path / "mine")
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
        # the default (dynamic) compile touches neither the cache directory nor the progress
        before = progress.stream.getvalue()
        ns_compile.compiled_orthogonalize("standard", 5, torch.float32)(torch.randn(2, 8, 12))
        assert progress.stream.getvalue() == before
    finally:
        ns_compile.compiled_orthogonalize.cache_clear()
        restore.__exit__(None, None, None)


def test_sym_variants_run_ds_muons_own_forms(monkeypatch):
    """``standard[sym2]``/``[sym4]`` (and under Polar Express) time ds_muon's own ``orthogonalize`` forms, eager and
    compiled, so what the microbenchmark measures is what a run with that ``QUINTIC_FORM`` computes
    (``symmetric_product`` itself: tests/unit/test_newton_schulz.py); ``baddbmm``/``hybrid`` stay forms of the
    standard quintic only."""
    from ds_muon.core import newton_schulz as ns
    seen = []
    real = ns.symmetric_product
    monkeypatch.setattr(ns, "symmetric_product", lambda L, R, k: seen.append(k) or real(L, R, k))
    x = torch.randn(2, 8, 24, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for name, k in (("standard[sym2,eager]", 2), ("standard[sym4]", 4), ("polar_express[sym4,eager]", 4)):
        seen.clear()
        fn, method, _ = step_time.ns_variant(name, 5, "cpu", backend="eager")
        want = ns.orthogonalize(x, method, 5, torch.float32, form="plain")
        assert torch.allclose(fn(x), want, rtol=0, atol=1e-5) and seen and set(seen) == {k}, (name, seen)
    for name in ("polar_express[hybrid,eager]", "gram[baddbmm]"):
        with pytest.raises(ValueError, match="is a form of the standard quintic"):
            step_time.ns_variant(name, 5, "cpu", backend="eager")
