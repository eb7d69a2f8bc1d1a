"""ds_muon's compiled kernels are compiled in the training process, without inductor's compile-worker pool.

Inductor compiles Triton kernels in a sidecar process (``python -m torch._inductor.compile_worker``, which forks
one worker per core) when its ``compile_threads`` is above 1. ds_muon compiles on the first optimizer step, so that
pool started in the middle of training; on one H200 it then took a core through the following fwd+bwd steps
(docs/benchmarks.md, "Issue 40, item 1"). Every graph ds_muon compiles in inductor's default mode now gets
``compile_threads=1`` (``ds_muon.core.ns_compile.INDUCTOR_OPTIONS``). Checked here where inductor receives its
options (``torch._inductor.compile_fx.compile_fx``'s ``config_patches``), with a spy that runs the captured graph
eagerly (no code generation, and the CPU build has no Triton to start a pool with), and ``compile_threads`` set to
8 as inductor sets it on a GPU host.
"""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def inductor_patches(monkeypatch):
    """The ``config_patches`` of every graph handed to inductor while the test runs."""
    import torch._inductor.compile_fx as compile_fx_module
    from ds_muon.core import muon_update, ns_compile
    seen: list[dict] = []

    def spy(model_, inputs_, *args, config_patches=None, **kwargs):
        seen.append(dict(config_patches or {}))
        return model_  # the captured graph, run eagerly

    def fresh() -> None:
        muon_update._compiled.cache_clear()
        ns_compile._compiled.cache_clear()
        torch._dynamo.reset()

    monkeypatch.setattr(compile_fx_module, "compile_fx", spy)
    fresh()
    with torch._inductor.config.patch(compile_threads=8):
        yield seen
    fresh()


def _assert_in_process(seen: list[dict]) -> None:
    assert seen, "nothing was compiled with inductor"
    assert all(p.get("compile_threads") == 1 for p in seen), seen


def test_elementwise_kernels_compile_without_worker_pool(inductor_patches):
    from ds_muon.core.muon_update import fused_apply_update_, fused_momentum_update_, momentum_update_
    g, m = torch.randn(1000), torch.randn(1000)
    m_ref = m.clone()
    u = fused_momentum_update_(m, g.clone(), 0.9, True)
    u_ref = momentum_update_(m_ref, g.clone(), 0.9, True)
    torch.testing.assert_close(u, u_ref)
    p = torch.randn(1000)
    fused_apply_update_(p, u, 0.02, 0.1)
    _assert_in_process(inductor_patches)
    assert len(inductor_patches) == 2


def test_newton_schulz_compiles_without_worker_pool(inductor_patches):
    from ds_muon.core.newton_schulz import orthogonalize
    from ds_muon.core.ns_compile import compiled_orthogonalize
    x = torch.randn(2, 8, 16)
    torch.testing.assert_close(compiled_orthogonalize("standard", 5)(x), orthogonalize(x, "standard", 5))
    _assert_in_process(inductor_patches)


def test_adam_mini_update_compiles_without_worker_pool(inductor_patches):
    from ds_muon.core import adam_update
    args = [torch.randn(64), torch.randn(64), torch.randn(64), torch.rand(64) + 1]
    adam_update._compiled(adam_update._block_update_graph_, "inductor")(*args, 0.9, 1e-3, 0.1, 0.9)
    _assert_in_process(inductor_patches)
