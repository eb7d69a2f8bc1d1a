"""benchmarks/ortho_error.py's core: orthogonality error of each Newton–Schulz method on real Muon
momentum (a tiny transformers Llama trained a few steps by the oracle ds_muon.MuonAdamW), checked
against an SVD computed here."""
from __future__ import annotations


import pytest
import torch

import ds_muon.core.newton_schulz
from ds_muon.names import MOMENTUM_KEY

from tests.support.hf_clients import SEQ, VOCAB, tiny_llama
from tests.support.tools import repo_module

ortho_error = repo_module("benchmarks/ortho_error.py")


@pytest.fixture(scope="module")
def momenta() -> dict[str, torch.Tensor]:
    model = tiny_llama()
    opt = ds_muon.MuonAdamW(model, lr=0.02, adam_lr=3e-3, momentum=0.95)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randint(0, VOCAB, (8, SEQ), generator=g)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    names = {p: n for n, p in model.named_parameters()}
    return {names[p]: st[MOMENTUM_KEY].clone() for p, st in opt.state.items() if MOMENTUM_KEY in st}


def test_matrix_kinds(momenta):
    kinds = {ortho_error.matrix_kind(n) for n in momenta}
    assert kinds == {"q", "k", "v", "o", "gate", "up", "down"}, kinds
    assert ortho_error.matrix_kind("model.layers.0.mlp.experts.gate_up_proj") == "gate_up"
    assert ortho_error.matrix_kind("lm_head.weight") == "other"


def test_errors_against_svd_and_their_ordering(momenta):
    rows = ortho_error.ortho_errors(momenta, ("standard", "polar_express", "gram"), (4, 5, 6), ("float32",))
    assert len(rows) == len(momenta) * 3 * 3
    # fp32 errors equal ||O - U V^T||_F / ||U V^T||_F computed here (fp64 SVD of the momentum)
    for r in rows:
        if r["steps"] != 5:
            continue
        m = momenta[r["name"]].double()
        u, _, vt = torch.linalg.svd(m, full_matrices=False)
        o = ds_muon.core.newton_schulz.orthogonalize(momenta[r["name"]], r["method"], 5, torch.float32).double()
        want = float(torch.linalg.matrix_norm(o - u @ vt) / torch.linalg.matrix_norm(u @ vt))
        assert r["error"] == pytest.approx(want, rel=1e-9, abs=1e-12), r
        sv = torch.linalg.svdvals(o)
        assert (r["sv_min"], r["sv_max"]) == pytest.approx((float(sv.min()), float(sv.max())), rel=1e-9)
        # significant directions (sigma >= 1e-2 ||M||_F): O's gains there, and their rms deviation from 1
        s = torch.linalg.svdvals(m)
        keep = s >= ortho_error.TOP * torch.linalg.vector_norm(s)
        gains = torch.linalg.vecdot(u[:, keep], o @ vt[keep].mT, dim=0)
        assert (r["top_min"], r["top_max"]) == pytest.approx((float(gains.min()), float(gains.max())), rel=1e-9)
        assert r["error_top"] >= float((gains - 1).square().mean().sqrt()) - 1e-12  # off-diagonal terms add to it
    mean = {(s["method"], s["steps"]): s["error"] for s in ortho_error.summarize(rows) if s["kind"] == "all"}
    # Polar Express converges (error falls with every step) and beats the fixed quintic at 5 and 6 steps;
    # Gram evaluates the standard quintic's polynomial (same error to fp32 rounding)
    assert mean["polar_express", 4] > mean["polar_express", 5] > mean["polar_express", 6]
    assert mean["polar_express", 5] < mean["standard", 5] and mean["polar_express", 6] < mean["standard", 6]
    assert mean["gram", 5] == pytest.approx(mean["standard", 5], rel=1e-3)
    top = {(s["method"], s["steps"]): s for s in ortho_error.summarize(rows) if s["kind"] == "all"}
    assert top["polar_express", 6]["error_top"] < top["standard", 6]["error_top"]
    assert 0.68 <= top["standard", 5]["top_min"] and top["standard", 5]["top_max"] <= 1.1344 + 1e-4  # s >= 0.01 band
    # the quintic's output band (tests/unit/test_newton_schulz.py): every singular value in (0, 1.2024]
    assert all(0 < r["sv_min"] and r["sv_max"] <= 1.2024 + 1e-4 for r in rows if r["method"] == "standard")
