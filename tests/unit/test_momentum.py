"""The momentum step on a flat shard (ds_muon.core.muon_update): fp32 and bf16 storage, chunking."""
from __future__ import annotations

import pytest
import torch

import ds_muon.core.muon_update as momentum_mod
from ds_muon.core.muon_update import momentum_update_


def _data(n: int = 1000, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g), torch.randn(n, generator=g)


@pytest.mark.parametrize("nesterov", [True, False])
def test_fp32_matches_the_formula(nesterov: bool) -> None:
    m0, g0 = _data()
    m, g = m0.clone(), g0.clone()
    u = momentum_update_(m, g, 0.9, nesterov)
    m_want = 0.9 * m0 + 0.1 * g0
    torch.testing.assert_close(m, m_want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(u, 0.1 * g0 + 0.9 * m_want if nesterov else m_want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("nesterov", [True, False])
def test_bf16_rounds_only_the_stored_momentum(nesterov: bool, monkeypatch) -> None:
    monkeypatch.setattr(momentum_mod, "CHUNK_ELEMENTS", 64)  # 1000 elements: 16 chunks, the last one short
    m0, g0 = _data()
    m, g = m0.to(torch.bfloat16), g0.clone()
    m32 = m.float() * 0.9 + 0.1 * g0  # the fp32 momentum before it is stored
    u = momentum_update_(m, g, 0.9, nesterov)
    assert m.dtype == torch.bfloat16 and u.dtype == torch.float32 and u.data_ptr() == g.data_ptr()
    torch.testing.assert_close(m, m32.to(torch.bfloat16), rtol=0, atol=0)  # round to nearest, every chunk
    want = 0.1 * g0 + 0.9 * m32 if nesterov else m32  # from the unrounded value
    torch.testing.assert_close(u, want, rtol=1e-6, atol=1e-6)
    assert (u - m.float()).abs().max() > 0  # so the update really is not the rounded momentum


def test_fused_versions_match_and_do_not_recompile() -> None:
    # The one-pass versions the ZeRO-3 step runs on CUDA (torch.compile). Traced with AOT autograd and run eagerly
    # ("aot_eager": the graph-input handling of floats is inductor's, so a float torch.compile would specialize on
    # shows up as a recompile here too); results within an ulp of the eager functions; and one graph per function
    # and Nesterov flag for every shard length, learning rate, weight decay and beta (a schedule must not
    # recompile every step: past torch.compile's recompile limit it would silently run eagerly).
    from torch._dynamo.utils import counters
    from ds_muon.core.muon_update import _compiled, fused_apply_update_, fused_momentum_update_
    close = dict(rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()
    counters.clear()
    try:
        for n, beta, lr, wd in ((1000, 0.9, 0.02, 0.1), (1237, 0.95, 0.01, 0.0), (77, 0.8, 0.005, 0.05)):
            m0, g0 = _data(n, seed=n)
            for nesterov in (True, False):
                m, g, m_want, g_want = m0.clone(), g0.clone(), m0.clone(), g0.clone()
                u = fused_momentum_update_(m, g, beta, nesterov, backend="aot_eager")
                u_want = momentum_update_(m_want, g_want, beta, nesterov)
                torch.testing.assert_close(m, m_want, **close)
                torch.testing.assert_close(u, u_want, **close)
                torch.testing.assert_close(g, g_want, **close)
                assert u.data_ptr() == (g if nesterov else m).data_ptr()
            p, p_want = m0.clone(), m0.clone()
            fused_apply_update_(p, g0, lr, wd, backend="aot_eager")
            p_want.mul_(1 - lr * wd).add_(g0, alpha=-lr)
            torch.testing.assert_close(p, p_want, **close)
        # momentum with and without Nesterov, apply: 3 graphs for 3 lengths, lrs, weight decays and betas
        assert counters["stats"]["unique_graphs"] == 3, dict(counters["recompiles"])
        # bf16 momentum keeps the chunked eager path (no graph), with the same result
        m, g = m0.to(torch.bfloat16), g0.clone()
        m_want, g_want = m.clone(), g0.clone()
        fused_momentum_update_(m, g, 0.9, True, backend="aot_eager")
        momentum_update_(m_want, g_want, 0.9, True)
        assert torch.equal(m, m_want) and torch.equal(g, g_want) and counters["stats"]["unique_graphs"] == 3
    finally:
        _compiled.cache_clear()
        torch._dynamo.reset()


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="same 1-D shape"):
        momentum_update_(torch.zeros(3), torch.zeros(4), 0.9, True)
    with pytest.raises(ValueError, match="grad must be float32"):
        momentum_update_(torch.zeros(3), torch.zeros(3, dtype=torch.bfloat16), 0.9, True)
    with pytest.raises(ValueError, match="momentum dtype must be one of"):
        momentum_update_(torch.zeros(3, dtype=torch.float16), torch.zeros(3), 0.9, True)


def test_reference_keeps_bf16_momentum_through_state_dict() -> None:
    import ds_muon
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                                torch.nn.Linear(16, 2))
    opt = ds_muon.MuonAdamW(model, momentum_dtype="bfloat16")
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    muon = [p for g in opt.param_groups if g["use_muon"] for p in g["params"]]
    assert muon and all(opt.state[p]["momentum_buffer"].dtype == torch.bfloat16 for p in muon)
    fresh = ds_muon.MuonAdamW(model, momentum_dtype="bfloat16")
    fresh.load_state_dict(opt.state_dict())
    for p in muon:
        assert fresh.state[p]["momentum_buffer"].dtype == torch.bfloat16
        assert torch.equal(fresh.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"])


def test_zero_inner_load_casts_momentum_back() -> None:
    from ds_muon.names import MOMENTUM_KEY
    from ds_muon.integration.inner import cast_momentum_
    state = {MOMENTUM_KEY: torch.ones(4), "step": 3}
    cast_momentum_(state, {"momentum_dtype": "bfloat16"})
    assert state[MOMENTUM_KEY].dtype == torch.bfloat16 and state["step"] == 3
    cast_momentum_(state, {"momentum_dtype": "float32"})
    assert state[MOMENTUM_KEY].dtype == torch.float32


def test_zero_inner_load_keeps_the_running_momentum_dtype() -> None:
    # A checkpoint saved with bf16 momentum, loaded by a run configured for fp32 (and the reverse):
    # the running config's momentum_dtype wins (an NVMe swapper may only take fp32 state).
    from ds_muon.config import parse_muon_params
    from ds_muon.names import MOMENTUM_KEY
    from ds_muon.integration.inner import ZeroMuonInner
    for saved, running in (("bfloat16", "float32"), ("float32", "bfloat16")):
        p_saved, p_run = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
        src = ZeroMuonInner([{"params": [p_saved], "use_muon": True, "momentum_dtype": saved}], None,
                            parse_muon_params({"momentum_dtype": saved}))
        src.state[p_saved][MOMENTUM_KEY] = torch.arange(4.0).to(getattr(torch, saved))
        dst = ZeroMuonInner([{"params": [p_run], "use_muon": True, "momentum_dtype": running}], None,
                            parse_muon_params({"momentum_dtype": running}))
        dst.load_state_dict(src.state_dict())
        assert dst.param_groups[0]["momentum_dtype"] == running
        assert dst.state[p_run][MOMENTUM_KEY].dtype == getattr(torch, running)
        assert torch.equal(dst.state[p_run][MOMENTUM_KEY].float(), torch.arange(4.0))


def test_elementwise_kernel_choice_is_its_own_switch():
    """optimizer.params.elementwise_compile picks the element-wise kernels: 'auto' follows ns_compile on CUDA,
    true/false force them there, and a partition in CPU memory (CPU, optimizer offload) always runs eagerly."""
    from ds_muon.config import MuonOptimizerParams
    from ds_muon.core.muon_update import use_compiled_elementwise
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert use_compiled_elementwise("auto", True, cuda) and not use_compiled_elementwise("auto", False, cuda)
    assert use_compiled_elementwise(True, False, cuda) and not use_compiled_elementwise(False, True, cuda)
    assert not any(use_compiled_elementwise(s, True, cpu) for s in ("auto", True, False))
    assert MuonOptimizerParams().elementwise_compile == "auto"
    assert MuonOptimizerParams(elementwise_compile=False).elementwise_compile is False
    with pytest.raises(Exception, match="elementwise_compile"):
        MuonOptimizerParams(elementwise_compile="sometimes")


def test_apply_update_is_decoupled_weight_decay_then_the_step() -> None:
    """``p <- p (1 - lr wd) - lr o`` (AdamW's decoupled decay, arXiv 1711.05101): the sign and the factor of each
    term. (Found by mutation testing: the decay's or the step's sign flipped, or the step left out, passed the unit
    tests.)"""
    from ds_muon.core.muon_update import apply_update_
    p0, o = _data()
    p = p0.clone()
    apply_update_(p, o, 0.02, 0.1)
    torch.testing.assert_close(p, p0 * (1 - 0.02 * 0.1) - 0.02 * o, rtol=1e-6, atol=1e-7)
    p = p0.clone()
    apply_update_(p, o, 0.5, 0.0)  # no decay: the step alone, at a size where a wrong sign or factor is plain
    torch.testing.assert_close(p, p0 - 0.5 * o, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("method, steps, dtype, mode, out_dtype", [
    ("standard", 5, torch.float32, "shape", None),
    ("polar_express", 3, torch.bfloat16, "rms_match", None),
    ("gram", 4, torch.bfloat16, "shape", torch.float32),
])
def test_scaled_orthogonalizer_is_newton_schulz_times_the_update_scale(method, steps, dtype, mode, out_dtype) -> None:
    """``scaled_orthogonalizer(...)(blocks) == orthogonalize(blocks, method, steps, dtype) * update_scale(rows, cols,
    mode)``, in the compute dtype (or ``out_dtype``), for tall and wide blocks. (Found by mutation testing: the
    method, steps, dtype or mode dropped on the way passed the unit tests.)"""
    from ds_muon.core.matrix import update_scale
    from ds_muon.core.muon_update import scaled_orthogonalizer
    from ds_muon.core.newton_schulz import orthogonalize
    g = torch.Generator().manual_seed(1)
    fn = scaled_orthogonalizer(method, steps, dtype, mode, out_dtype=out_dtype)
    for shape in ((3, 16, 6), (2, 5, 12)):
        blocks = torch.randn(shape, generator=g)
        want = orthogonalize(blocks, method, steps, dtype)
        want = (want if out_dtype is None else want.to(out_dtype)) * update_scale(shape[-2], shape[-1], mode)
        got = fn(blocks)
        assert got.dtype == (out_dtype or dtype), (got.dtype, out_dtype, dtype)
        assert torch.equal(got, want), (shape, (got.float() - want.float()).abs().max())


@pytest.mark.parametrize("compiled", [False, True])
def test_commit_reads_a_bf16_gradient_and_stash_in_place_bit_for_bit(compiled: bool, monkeypatch) -> None:
    """The overlapped commit's in-place path (ZeRO-3's bf16 gradient slice, the bf16 stash): ``momentum_step_`` gives
    the momentum that the ordinary step's kernel gives from the float32 copy of the same gradient, leaving the
    gradient as it is; ``fused_apply_update_`` / ``apply_update_`` with a bf16 update give the float32 update's
    weights, bit for bit (compiled: torch.compile's graphs with the eager backend, the CPU stand-in); the eager
    momentum path works in fp32 chunks; bad input is named."""
    monkeypatch.setattr(momentum_mod, "CHUNK_ELEMENTS", 64)
    m0, g0 = _data(1000, seed=3)
    g16 = g0.to(torch.bfloat16)
    ordinary = momentum_mod.fused_momentum_update_ if compiled else momentum_update_
    kwargs = {"backend": "eager"} if compiled else {}
    for nesterov in (True, False):
        want, g32 = m0.clone(), g16.float()
        ordinary(want, g32, 0.95, nesterov, **kwargs)
        got, kept = m0.clone(), g16.clone()
        momentum_mod.momentum_step_(got, kept, 0.95, compiled, **kwargs)
        assert torch.equal(got, want) and torch.equal(kept, g16), nesterov
    p0 = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    o16 = (0.3 * g0).to(torch.bfloat16)
    apply = momentum_mod.fused_apply_update_ if compiled else momentum_mod.apply_update_
    want, got = p0.clone(), p0.clone()
    apply(want, o16.float(), 0.02, 0.1, **kwargs)
    apply(got, o16, 0.02, 0.1, **kwargs)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="float32 momentum"):
        momentum_mod.momentum_step_(m0.to(torch.bfloat16), g16, 0.95, compiled)
    with pytest.raises(ValueError, match="same 1-D shape"):
        momentum_mod.momentum_step_(m0, g16[:10], 0.95, compiled)
