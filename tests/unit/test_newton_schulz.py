"""Tests for ds_muon.core.newton_schulz against the exact SVD polar factor (float64).

Every NS method maps each singular value s of the normalized input through a scalar polynomial
composition phi and keeps the singular vectors: for x = U diag(sigma) V^T,
    orthogonalize(x) = U diag(phi(sigma / ||sigma||_2)) V^T     (exact arithmetic).
So the strongest check is O == U diag(phi(s)) V^T (the vectors *and* the values), and the bands
below follow from phi.

Bands after 5 steps, s = sigma / ||x||_F (float64 scalar map on a 2e5-point log grid, checked
in test_scalar_bands; the matrices then land on them to fp32 rounding):
  * quintic (standard, gram) (3.4445, -4.7750, 2.0315):
      s >= 0.01   -> [0.6818, 1.1344]   (the band the iteration cycles in: its plateau [0.6819, 1.1343])
      s >= 0.002  -> [0.6818, 1.2024]   (1.2024 = max of p on [0, 1]: still in the transient;
                                         0.68 is first reached from s = 0.0015)
      s >  0      -> (0, 1.2024]        (p > 0 on (0, inf): 3.4445 - 4.775 t + 2.0315 t^2 has no real root)
  * polar express (arXiv:2505.16932, input divided by 1.01 ||x||_F):
      s >= 1e-3   -> [0.8401, 1.1236];  s >= 2e-3 -> [0.8703, 1.1236];  after 8 steps: 1 +- 1e-5
"""
from __future__ import annotations

import pytest
import torch

from ds_muon.core import newton_schulz as ns
from ds_muon.core import ns_compile, ns_cost
from ds_muon.core.dtypes import NS_DTYPES, resolve_ns_dtype
from ds_muon.core.newton_schulz import NS_METHODS, gram_newton_schulz, newton_schulz_quintic, orthogonalize, polar_express, polar_express_coeffs
from ds_muon.core.ns_cost import ns_flops

F64 = torch.float64

# bands (see module docstring); tolerances are fp32 rounding of a 5-step NS on <= 64-wide matrices
QUINTIC_BAND = (0.6818, 1.1344)  # s >= 0.01
QUINTIC_MAX = 1.2024  # any s
PE_BAND = (0.8401, 1.1236)  # s >= 1e-3
FP32_REL = 1e-4  # ||O - U phi(S) V^T||_F / ||U phi(S) V^T||_F, measured <= 2.5e-5


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _orth(batch: tuple[int, ...], m: int, k: int, g: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(*batch, m, k, dtype=F64, generator=g))
    return q


def make_case(batch, m, n, spectrum, seed=0):
    """x (float64, (*batch, m, n)) with its reduced SVD U (.., m, k), s (.., k), V (.., n, k)."""
    g = _gen(seed)
    k = min(m, n)
    if spectrum == "gaussian":
        x = torch.randn(*batch, m, n, dtype=F64, generator=g)
        U, s, Vh = torch.linalg.svd(x, full_matrices=False)
        return x, U, s, Vh.mT
    if spectrum == "illcond":  # singular values spanning 1e-3 .. 1
        s = torch.logspace(-3, 0, k, dtype=F64).expand(*batch, k).clone()
    elif spectrum == "wellcond":
        s = 0.3 + 0.7 * torch.rand(*batch, k, dtype=F64, generator=g)
    elif spectrum == "rankdef":  # rank k // 2
        r = k // 2
        s = torch.zeros(*batch, k, dtype=F64)
        s[..., :r] = 0.1 + torch.rand(*batch, r, dtype=F64, generator=g)
    else:
        raise AssertionError(spectrum)
    U, V = _orth(batch, m, k, g), _orth(batch, n, k, g)
    return (U * s.unsqueeze(-2)) @ V.mT, U, s, V


def scalar_map(s_norm: torch.Tensor, method: str, steps: int, eps: float = 0.0) -> torch.Tensor:
    """phi: what the NS method does to one singular value s = sigma / ||x||_F (float64).

    orthogonalize divides by k ||x||_F, k = 1.01 for Polar Express (the paper) else 1; ``eps``
    (relative to ||x||_F) models an additive eps in that denominator."""
    k = 1.01 if method == "polar_express" else 1.0
    y = s_norm / (k + eps)
    coeffs = polar_express_coeffs(steps) if method == "polar_express" else [ns.QUINTIC_COEFFS] * steps
    for a, b, c in coeffs:
        y = a * y + b * y**3 + c * y**5
    return y


def normalized(s: torch.Tensor) -> torch.Tensor:
    return s / s.norm(dim=-1, keepdim=True)


def in_basis(O: torch.Tensor, U: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """U^T O V: diagonal (the output singular values, in the input's order) iff O shares U, V."""
    return U.mT @ O.to(F64) @ V


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.to(F64) - b.to(F64)).norm() / b.to(F64).norm()).item()


SHAPES = [  # (batch, m, n)
    ((), 24, 64),  # wide
    ((), 64, 24),  # tall
    ((), 32, 32),  # square
    ((3,), 16, 40),  # 3-D batch
    ((2, 3), 40, 16),  # 4-D batch, tall
]
SPECTRA = ["gaussian", "illcond", "rankdef"]


# ------------------------------------------------------------------------------------------------
# the theory: coefficient tables and scalar bands
# ------------------------------------------------------------------------------------------------
def test_coefficient_tables():
    assert ns.QUINTIC_COEFFS == (3.4445, -4.7750, 2.0315)
    pe = ns.POLAR_EXPRESS_COEFFS
    assert len(pe) == 8
    # arXiv:2505.16932 Alg. 1: first raw triple (8.2872, -23.5959, 17.3004) / (1.01, 1.01^3, 1.01^5)
    a, b, c = pe[0]
    assert a == pytest.approx(8.28721201814563 / 1.01, rel=1e-12)
    assert b == pytest.approx(-23.595886519098837 / 1.01**3, rel=1e-12)
    assert c == pytest.approx(17.300387312530933 / 1.01**5, rel=1e-12)
    assert pe[-1] == (1.875, -1.25, 0.375)  # unscaled: classical degree-5 Newton-Schulz
    # each PE polynomial maps its design interval's top end 1 into (0, 2]: p(1) = 1 +- (error < 1)
    for a, b, c in ns._POLAR_EXPRESS_RAW:
        assert 0 < a + b + c < 2
    assert polar_express_coeffs(3) == list(pe[:3])
    assert polar_express_coeffs(11) == list(pe) + [pe[-1]] * 3
    assert ns_cost.gram_restart_points(1) == ()
    assert ns_cost.gram_restart_points(2) == ()
    assert ns_cost.gram_restart_points(5) == (2,)
    assert ns_cost.gram_restart_points(8) == (2, 5)


# arXiv:2505.16932 (Amsel, Persson, Musco, Gower, "The Polar Express"), Algorithm 1, as published
# with the authors' code (github.com/NoahAmsel/PolarExpress, polar_express/basic.py): the degree-5
# coefficients before the 1.01 safety factor, from optimal_composition(l=1e-3, cushion=0.02407327424182761).
PAPER_PE_TABLE = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),  # "subsequent coeffs equal this numerically"
)
PAPER_PE_LOWER, PAPER_PE_CUSHION = 1e-3, 0.02407327424182761


def _minimax_odd_quintic(lo: float, hi: float) -> tuple[float, float, float]:
    """(a, b, c) of the odd quintic a x + b x^3 + c x^5 nearest to 1 in max-norm on [lo, hi]: Remez
    exchange on 4 alternation points (both ends and the two interior extrema), float64. On a vanishing
    interval the limit is the Newton-Schulz quintic (15, -10, 3) / 8 scaled to hi (paper, Sec. 4)."""
    if lo / hi >= 1 - 5e-6:
        return 15 / 8 / hi, -10 / 8 / hi ** 3, 3 / 8 / hi ** 5
    pts = [lo, (3 * lo + hi) / 4, (lo + 3 * hi) / 4, hi]
    last = None
    for _ in range(200):
        A = torch.tensor([[x, x ** 3, x ** 5, sign] for x, sign in zip(pts, (1.0, -1.0, 1.0, -1.0))], dtype=F64)
        a, b, c, err = torch.linalg.solve(A, torch.ones(4, dtype=F64)).tolist()
        root = (9 * b * b - 20 * a * c) ** 0.5  # p'(x) = a + 3b x^2 + 5c x^4 = 0
        pts[1], pts[2] = ((-3 * b - root) / (10 * c)) ** 0.5, ((-3 * b + root) / (10 * c)) ** 0.5
        if last is not None and abs(err - last) <= 1e-15:
            break
        last = err
    return a, b, c


def _paper_composition(lo: float, steps: int, cushion: float) -> list[tuple[float, float, float]]:
    """The paper's greedy composition: step t takes the minimax quintic on [max(l_t, cushion u_t), u_t],
    rescaled so that p(l_t) + p(u_t) = 2, then l_{t+1} = p(l_t), u_{t+1} = 2 - l_{t+1}."""
    hi, out = 1.0, []
    for _ in range(steps):
        a, b, c = _minimax_odd_quintic(max(lo, cushion * hi), hi)
        if cushion * hi > lo:
            k = 2 / (a * lo + b * lo ** 3 + c * lo ** 5 + a * hi + b * hi ** 3 + c * hi ** 5)
            a, b, c = a * k, b * k, c * k
        out.append((a, b, c))
        lo = a * lo + b * lo ** 3 + c * lo ** 5
        hi = 2 - lo
    return out


def test_polar_express_table_is_the_papers():
    """Every row of the table against the paper's published values, and against the table recomputed
    here from the paper's construction (an independent Remez): a mistyped digit in any row fails."""
    raw = ns._POLAR_EXPRESS_RAW
    assert len(raw) == len(PAPER_PE_TABLE) == 8
    for t, (got, want) in enumerate(zip(raw, PAPER_PE_TABLE)):
        assert got == want, f"row {t}: {got} != {want}"
    # the safety factor 1.01, p(x) -> p(x / 1.01), on every row but the last (paper, Alg. 1)
    want_scaled = [(a / 1.01, b / 1.01 ** 3, c / 1.01 ** 5) for a, b, c in PAPER_PE_TABLE[:-1]] + [PAPER_PE_TABLE[-1]]
    for t, (got, want) in enumerate(zip(ns.POLAR_EXPRESS_COEFFS, want_scaled)):
        assert got == pytest.approx(want, rel=1e-15, abs=0), f"row {t}"
    # recomputed: rows 0-5 to 1e-14; rows 6-7 sit at the Remez stopping rule / limit switch (~5e-9)
    recomputed = _paper_composition(PAPER_PE_LOWER, 8, PAPER_PE_CUSHION)
    for t, (got, want) in enumerate(zip(raw, recomputed)):
        assert got == pytest.approx(want, rel=1e-13 if t < 6 else 1e-8, abs=0), f"row {t}"


def test_scalar_bands():
    """The bands quoted above, from the float64 scalar maps on a fine grid."""
    s = torch.logspace(-5, 0, 200_001, dtype=F64)
    q = scalar_map(s, "standard", 5)
    pe = scalar_map(s, "polar_express", 5)

    def band(y, lo):
        sel = y[s >= lo]
        return sel.min().item(), sel.max().item()

    assert band(q, 0.01) == pytest.approx(QUINTIC_BAND, abs=1e-4)
    assert band(q, 0.002) == pytest.approx((0.6818, QUINTIC_MAX), abs=1e-4)
    assert q.min().item() > 0 and q.max().item() == pytest.approx(QUINTIC_MAX, abs=1e-4)
    assert band(q, 1e-3)[0] == pytest.approx(0.4705, abs=1e-4)  # below 0.0015 the band does not hold
    # 50 more quintic steps: the attracting band it cycles in
    tail = scalar_map(torch.linspace(0.05, 1, 10_001, dtype=F64), "standard", 55)
    assert (tail.min().item(), tail.max().item()) == pytest.approx((0.6819, 1.1343), abs=1e-4)

    assert band(pe, 1e-3) == pytest.approx(PE_BAND, abs=1e-4)
    assert band(pe, 2e-3) == pytest.approx((0.8703, PE_BAND[1]), abs=1e-4)
    pe8 = scalar_map(s[s >= 1e-3], "polar_express", 8)
    assert (pe8 - 1).abs().max().item() < 1e-5  # converges, unlike the quintic


# ------------------------------------------------------------------------------------------------
# against the SVD, fp32
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", NS_METHODS)
@pytest.mark.parametrize("spectrum", SPECTRA)
@pytest.mark.parametrize("batch,m,n", SHAPES)
def test_matches_svd_prediction_fp32(method, spectrum, batch, m, n):
    x, U, s, V = make_case(batch, m, n, spectrum, seed=m * n + len(batch))
    O = orthogonalize(x.float(), method)
    assert O.shape == x.shape and O.dtype == torch.float32 and torch.isfinite(O).all()

    s_n = normalized(s)
    d_pred = scalar_map(s_n, method, 5)
    # 1) O == U diag(phi(s)) V^T: same singular vectors, values as the theory says
    expected = (U * d_pred.unsqueeze(-2)) @ V.mT
    assert rel_err(O, expected) < FP32_REL

    # 2) in the input's singular basis, O is diagonal and its diagonal is the band
    B = in_basis(O, U, V)
    d = B.diagonal(dim1=-2, dim2=-1)
    off = B - torch.diag_embed(d)
    assert off.abs().max().item() < 1e-4
    pos = s_n > 0
    if method == "polar_express":
        sel = d[pos & (s_n >= 1e-3)]
        assert sel.min().item() >= PE_BAND[0] - 1e-4 and sel.max().item() <= PE_BAND[1] + 1e-4
    else:
        sel = d[pos & (s_n >= 0.01)]
        assert sel.min().item() >= QUINTIC_BAND[0] - 1e-4 and sel.max().item() <= QUINTIC_BAND[1] + 1e-4
        assert d[pos].min().item() > 0 and d[pos].max().item() <= QUINTIC_MAX + 1e-4
    assert sel.numel() >= pos.sum().item() // 2  # the band covers most of the spectrum here

    # 3) same row/column space: nothing outside span(U_r) / span(V_r) (rank r)
    Ur, Vr = U * pos.unsqueeze(-2), V * pos.unsqueeze(-2)
    O64 = O.to(F64)
    left_out = O64 - Ur @ (Ur.mT @ O64)
    right_out = O64 - (O64 @ Vr) @ Vr.mT
    assert left_out.norm().item() < 1e-4 * O64.norm().item()
    assert right_out.norm().item() < 1e-4 * O64.norm().item()

    # 4) close to the polar factor U_r V_r^T
    polar = Ur @ Vr.mT
    flat = lambda t: t.reshape(*t.shape[:-2], -1)  # noqa: E731
    cos = torch.nn.functional.cosine_similarity(flat(O64), flat(polar), dim=-1)
    assert cos.min().item() > 0.9


def test_fp64_compute_is_the_polynomial_exactly():
    x, U, s, V = make_case((2,), 20, 50, "illcond", seed=7)
    for method in NS_METHODS:
        for steps in (1, 3, 5, 8):
            O = orthogonalize(x, method, steps)
            assert O.dtype == F64
            expected = (U * scalar_map(normalized(s), method, steps).unsqueeze(-2)) @ V.mT
            assert rel_err(O, expected) < 1e-10, (method, steps)


def test_polar_express_beats_quintic_on_wellconditioned():
    x, U, s, V = make_case((4,), 32, 96, "wellcond", seed=3)
    polar = U @ V.mT
    out = {m: orthogonalize(x.float(), m).to(F64) for m in NS_METHODS}
    spec_err = {m: torch.linalg.matrix_norm(o - polar, ord=2).max().item() for m, o in out.items()}
    fro_err = {m: rel_err(o, polar) for m, o in out.items()}
    # PE's worst singular value is within its band (<= 0.16 from 1) and beats the quintic (~0.32)
    assert spec_err["polar_express"] < 0.16 < 0.3 < spec_err["standard"]
    assert fro_err["polar_express"] < 0.5 * fro_err["standard"]
    assert spec_err["gram"] == pytest.approx(spec_err["standard"], abs=1e-5)
    # 8 steps: PE has converged to U V^T (fp32), the quintic still sits in its band
    pe8 = orthogonalize(x.float(), "polar_express", 8).to(F64)
    q8 = orthogonalize(x.float(), "standard", 8).to(F64)
    assert torch.linalg.matrix_norm(pe8 - polar, ord=2).max().item() < 1e-4
    assert torch.linalg.matrix_norm(q8 - polar, ord=2).max().item() > 0.2


# ------------------------------------------------------------------------------------------------
# gram == standard
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spectrum", SPECTRA)
def test_gram_equals_standard_fp32(spectrum):
    # wide enough (n > 1.5 m) that orthogonalize really runs the Gram kernel
    for batch, m, n in [((), 24, 64), ((3,), 16, 40), ((2, 3), 40, 16)]:
        assert ns_flops(m, n, 5, "gram") < ns_flops(m, n, 5, "standard")
        x, *_ = make_case(batch, m, n, spectrum, seed=11)
        g, st = orthogonalize(x.float(), "gram"), orthogonalize(x.float(), "standard")
        assert rel_err(g, st) < 1e-4  # measured <= 3e-5
    # The kernel itself, 1..8 steps, any orientation (also square / tall, where orthogonalize would
    # pick the standard kernel), and with Polar Express coefficients. Rounding noise in a
    # (near-)null space grows like a^steps in both methods, differently: measured <= 4e-4.
    # (With fp64 compute they agree to 1e-10: test_fp64_compute_is_the_polynomial_exactly.)
    for m, n in [(24, 64), (32, 32), (40, 16)]:
        x, *_ = make_case((2,), m, n, spectrum, seed=m)
        X = (x / x.norm(dim=(-2, -1), keepdim=True)).float()
        for steps in range(1, 9):
            tol = 1e-5 if steps <= 3 else 1e-3
            assert rel_err(gram_newton_schulz(X, steps), newton_schulz_quintic(X, steps)) < tol, (m, n, steps)
        Xp = X / 1.01
        assert rel_err(gram_newton_schulz(Xp, 6, polar_express_coeffs(6)), polar_express(Xp, 6)) < 1e-3


def test_square_gram_falls_back_to_standard():
    x = torch.randn(2, 32, 32, generator=_gen(5))
    assert torch.equal(orthogonalize(x, "gram"), orthogonalize(x, "standard"))
    assert ns_flops(32, 32, 5, "gram") == ns_flops(32, 32, 5, "standard")


# ------------------------------------------------------------------------------------------------
# zeros, orientation, kernels on their own
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", NS_METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zero_matrix_gives_zeros(method, dtype):
    for shape in [(8, 20), (20, 8), (6, 6)]:
        z = orthogonalize(torch.zeros(shape), method, dtype=dtype)
        assert z.dtype == dtype and torch.equal(z, torch.zeros(shape, dtype=dtype))
    # one zero matrix inside a batch: zero out, the others untouched
    x = torch.randn(2, 3, 8, 20, generator=_gen(1))
    x[1, 2] = 0
    out = orthogonalize(x, method, dtype=dtype)
    assert torch.isfinite(out).all()
    assert torch.equal(out[1, 2], torch.zeros(8, 20, dtype=dtype))
    ref = orthogonalize(x[0, 1], method, dtype=dtype)
    torch.testing.assert_close(out[0, 1], ref, atol=1e-2 if dtype != torch.float32 else 1e-6, rtol=0)
    assert out[0, 1].float().norm() > 1.0


@pytest.mark.parametrize("method", NS_METHODS)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16, torch.float16])
def test_scale_invariant_down_to_smallest_normal(method, in_dtype, compute):
    """Muon's update does not depend on the gradient's scale (issue 17: an eps in the normalization made
    a loss x 1e-6 change the update by ~20%, x 1e-10 by 99%). Power-of-two rescalings that keep every entry
    a normal number of the input dtype (down to its smallest normal, and up to near its largest) give
    bit-identical output; decimal ones (1e-6 .. 1e-10, input rounding) equal it to that rounding."""
    x = torch.randn(2, 12, 30, generator=_gen(11)).to(in_dtype)
    x[1].mul_(1e-3)  # matrices of a batch at different scales are normalized apart
    base = orthogonalize(x, method, dtype=compute)
    fi = torch.finfo(in_dtype)
    smallest = x.abs().min().item()
    down = 2.0 ** int(torch.log2(torch.tensor(fi.tiny / smallest, dtype=F64)).ceil().item())  # min entry -> tiny
    up = 2.0 ** int(torch.log2(torch.tensor(fi.max / (8 * x.abs().max().item()), dtype=F64)).floor().item())
    for c in (2.0**-20, 2.0**-60, down, up):
        if c < down or c > up:
            continue
        y = x * c
        assert y.abs().min().item() >= fi.tiny and torch.isfinite(y).all(), c
        assert torch.equal(orthogonalize(y, method, dtype=compute), base), (method, in_dtype, compute, c)
    if in_dtype in (torch.float32, torch.float64):
        for c in (1e-6, 1e-8, 1e-10):
            out = orthogonalize(x * c, method, dtype=compute)
            tol = 1e-5 if compute == torch.float32 else 2e-2
            assert rel_err(out.to(F64), base.to(F64)) < tol, (method, compute, c)


@pytest.mark.parametrize("method", NS_METHODS)
@pytest.mark.parametrize("batch,m,n", SHAPES)
def test_transpose_equivariance(method, batch, m, n):
    x = torch.randn(*batch, m, n, generator=_gen(2))
    a, b = orthogonalize(x.mT, method), orthogonalize(x, method).mT
    # rectangular: both run on the same wide matrix; square: X^T X vs X X^T, rounding only
    torch.testing.assert_close(a, b, atol=1e-6 if m != n else 2e-5, rtol=0)


def test_kernels_on_their_own_match_orthogonalize():
    x = torch.randn(3, 16, 48, generator=_gen(4))
    X = x / x.norm(dim=(-2, -1), keepdim=True)  # orthogonalize first scales by 1/max|x|: fp32 rounding apart
    torch.testing.assert_close(newton_schulz_quintic(X, 5), orthogonalize(x, "standard"), atol=2e-6, rtol=0)
    torch.testing.assert_close(gram_newton_schulz(X, 5), orthogonalize(x, "gram"), atol=2e-6, rtol=0)
    torch.testing.assert_close(
        polar_express(x / (1.01 * x.norm(dim=(-2, -1), keepdim=True)), 5),
        orthogonalize(x, "polar_express"),
        atol=2e-6,
        rtol=0,
    )
    # tall input to a kernel: correct (same polynomial), just not the cheap orientation
    torch.testing.assert_close(newton_schulz_quintic(X.mT, 5), orthogonalize(x, "standard").mT, atol=2e-5, rtol=0)
    # 2-D and empty batch
    assert newton_schulz_quintic(X[0], 2).shape == (16, 48)
    assert orthogonalize(torch.zeros(0, 4, 6), "gram").shape == (0, 4, 6)


# ------------------------------------------------------------------------------------------------
# half precision
# ------------------------------------------------------------------------------------------------
# Looser tolerances, ~2x the worst measured on these cases: relative Frobenius error against
# U phi(S) V^T, the exact polynomial map (measured: bf16 standard 0.080, PE 0.053, gram 0.080 where
# it falls back to the standard kernel on a square matrix, 0.041 otherwise; fp16 <= 0.0104), and the
# band widened by HALF_BAND_SLACK (measured excess: bf16 0.0168, fp16 0.0003). bf16 has 8 mantissa
# bits, fp16 11. The quintic is evaluated as X <- ((cA + bI)A + aI)X with plain matmuls, which rounds
# the (m, m) polynomial matrix before it multiplies X; the earlier baddbmm form kept that sum in the
# fp32 accumulator (bf16 standard 0.018, fp16 0.0023) but ran 9-16% slower on H200, at the same
# orthogonality error against U V^T (0.596 on the benchmark's spectra; docs/benchmarks.md), which is
# what Muon's update depends on. Keller Jordan's reference rounds after every op, more often still.
HALF_REL = {torch.bfloat16: 0.16, torch.float16: 0.02}
HALF_BAND_SLACK = {torch.bfloat16: 0.03, torch.float16: 0.001}


@pytest.mark.parametrize("method", NS_METHODS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,m,n", [((2,), 24, 64), ((), 64, 24), ((), 32, 32)])
def test_half_precision_compute(method, dtype, batch, m, n):
    x, U, s, V = make_case(batch, m, n, "wellcond", seed=9)
    for inp, dt in [(x.float(), dtype), (x.to(dtype), None)]:  # explicit dtype, or the input's
        O = orthogonalize(inp, method, dtype=dt)
        assert O.dtype == dtype and torch.isfinite(O).all()
        d_pred = scalar_map(normalized(s), method, 5)
        assert rel_err(O, (U * d_pred.unsqueeze(-2)) @ V.mT) < HALF_REL[dtype]
        d = in_basis(O, U, V).diagonal(dim1=-2, dim2=-1)
        lo, hi = PE_BAND if method == "polar_express" else QUINTIC_BAND
        slack = HALF_BAND_SLACK[dtype]
        assert lo - slack <= d.min().item() and d.max().item() <= hi + slack
        cos = (O.to(F64) * (U @ V.mT)).sum() / (O.to(F64).norm() * (U @ V.mT).norm())
        assert cos.item() > 0.95


# ------------------------------------------------------------------------------------------------
# dtype policy and errors
# ------------------------------------------------------------------------------------------------
def test_resolve_ns_dtype():
    for method in NS_METHODS:
        assert resolve_ns_dtype("auto", method, "cpu") is torch.float32
        assert resolve_ns_dtype("auto", method, torch.device("cpu")) is torch.float32
        for name in ("bfloat16", "float16", "float32"):
            for dev in ("cpu", "cuda", "cuda:1"):
                assert resolve_ns_dtype(name, method, dev) is getattr(torch, name)
    # accelerators: only the device type is looked at, no GPU needed
    for dev in ("cuda", "cuda:3", torch.device("cuda", 0), "xpu", "hpu"):
        assert resolve_ns_dtype("auto", "standard", dev) is torch.bfloat16
        assert resolve_ns_dtype("auto", "polar_express", dev) is torch.bfloat16
        assert resolve_ns_dtype("auto", "gram", dev) is torch.float16
    assert NS_DTYPES == ("auto", "bfloat16", "float16", "float32")
    assert NS_METHODS == ("standard", "gram", "polar_express")


def test_errors():
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match="standard.*gram.*polar_express"):
        orthogonalize(x, "cubic")
    for bad in (0, -1, 2.5, True, "5"):
        with pytest.raises(ValueError, match="steps"):
            orthogonalize(x, "standard", steps=bad)
        with pytest.raises(ValueError, match="steps"):
            ns_flops(4, 6, bad)
    for fn in (newton_schulz_quintic, gram_newton_schulz, polar_express):
        with pytest.raises(ValueError, match="steps"):
            fn(x, 0)
    with pytest.raises(ValueError, match="coeffs"):
        gram_newton_schulz(x, 3, polar_express_coeffs(2))
    with pytest.raises(ValueError, match="dtype"):
        orthogonalize(x, dtype=torch.int32)
    with pytest.raises(ValueError, match="floating"):
        orthogonalize(torch.ones(4, 6, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\(\.\.\., m, n\)"):
        orthogonalize(torch.randn(6))
    with pytest.raises(ValueError, match=r"\(\.\.\., m, n\)"):
        orthogonalize(torch.randn(3, 0, 6))
    with pytest.raises(TypeError):
        orthogonalize([[1.0, 2.0]])
    with pytest.raises(ValueError, match="auto.*bfloat16.*float16.*float32"):
        resolve_ns_dtype("fp8", "standard", "cpu")
    with pytest.raises(ValueError, match="auto.*bfloat16"):
        resolve_ns_dtype("float64", "standard", "cuda")
    with pytest.raises(ValueError, match="standard.*gram.*polar_express"):
        resolve_ns_dtype("auto", "newton", "cpu")
    with pytest.raises(ValueError, match="device"):
        resolve_ns_dtype("auto", "standard", "not-a-device")
    with pytest.raises(ValueError, match="standard.*gram.*polar_express"):
        ns_flops(4, 6, 5, "svd")
    for kw in ({"m": 0}, {"n": -1}, {"batch": -1}, {"m": 2.0}):
        args = {"m": 4, "n": 6, "steps": 5, **kw}
        with pytest.raises(ValueError):
            ns_flops(**args)


# ------------------------------------------------------------------------------------------------
# FLOPs
# ------------------------------------------------------------------------------------------------
def test_ns_flops_hand_computed():
    # standard / PE on 4x8 (s=4, l=8), per step: X X^T 2*4*8*4=256, A@A 2*4^3=128, B@X 256 -> 640
    assert ns_flops(4, 8, 5, "standard") == 5 * 640 == 3200
    assert ns_flops(8, 4, 5, "standard") == 3200  # tall: same work in the wide orientation
    assert ns_flops(4, 8, 5, "polar_express") == 3200
    assert ns_flops(4, 8, 5, "standard", batch=3) == 9600
    # gram, 5 steps, restart after 2: long side R0, restart (QX, XX^T), final QX = 4 * 256 = 1024;
    # small side (units 2*4^3 = 128): it1 R^2 + PRP(2) = 3, it2 R^2 + QP = 2, it3 = 3,
    # it4 R^2 + QP + PRP(2) = 4, it5 R^2 + QP = 2 -> 14 * 128 = 1792
    assert ns_flops(4, 8, 5, "gram") == 1024 + 1792 == 2816
    assert ns_flops(4, 8, 5, "gram", batch=2) == 5632
    # 1 step: R0 256 + R^2 128 + QX 256 = 640, not cheaper than standard -> standard, same number
    assert ns_flops(4, 8, 1, "gram") == 640
    # 8 steps on 4x64 (restarts after 2, 5): long 6 * 2*16*64 = 12288; small 23 * 128 = 2944
    assert ns_flops(4, 64, 8, "gram") == 12288 + 23 * 128
    assert ns_flops(4, 64, 8, "standard") == 8 * (2 * 2 * 16 * 64 + 128)
    # square: Gram would cost more (8 s^3 + 28 s^3 > 30 s^3), so orthogonalize runs standard
    assert ns_flops(4, 4, 5, "gram") == ns_flops(4, 4, 5, "standard") == 5 * (256 + 128)
    assert ns_flops(4, 8, 5, "gram", batch=0) == 0


def test_ns_flops_count_what_each_form_runs():
    """``ns_flops(..., form=...)`` equals torch's own FLOP count of ``orthogonalize`` in that form: the sym forms'
    block-row products (unequal blocks where 13 rows do not split evenly, tall and wide), and the same count for
    ``plain`` and ``fused``; a form outside ``QUINTIC_FORMS`` is refused."""
    from torch.utils.flop_counter import FlopCounterMode
    # hand count, 2x16x40 in sym2: X X^T block rows [0, 8) x 16 cols + [8, 16) x 8 cols, times 2*40 (15360); P A
    # the same with 16 for 40 (6144); P X 2*16*16*40 (20480); per iteration 41984, times 5 steps and 2 matrices
    assert ns_flops(16, 40, 5, batch=2, form="sym2") == 2 * 5 * (15360 + 6144 + 20480) == 419840
    for shape in ((2, 16, 40), (3, 13, 7), (1, 5, 5)):
        x = torch.randn(*shape, generator=_gen(5), dtype=F64)
        for form in ns.QUINTIC_FORMS:
            with FlopCounterMode(display=False) as counter:
                orthogonalize(x, "standard", 5, form=form)
            assert counter.get_total_flops() == ns_flops(*shape[1:], 5, batch=shape[0], form=form), (shape, form)
    assert ns_flops(16, 40, 5, form="sym4") < ns_flops(16, 40, 5, form="sym2") < ns_flops(16, 40, 5) \
        == ns_flops(16, 40, 5, form="fused")
    with pytest.raises(ValueError, match="quintic form must be one of"):
        ns_flops(4, 8, 5, form="sym3")


@pytest.mark.parametrize("method", NS_METHODS)
def test_ns_flops_counts_the_real_matmuls(method):
    from torch.utils.flop_counter import FlopCounterMode

    for batch, m, n in [(1, 4, 8), (3, 8, 4), (2, 16, 16), (2, 4, 40), (1, 7, 5)]:
        for steps in (1, 2, 3, 5, 8):
            x = torch.randn(batch, m, n, generator=_gen(steps))
            with FlopCounterMode(display=False) as counter:
                orthogonalize(x, method, steps)
            assert counter.get_total_flops() == ns_flops(m, n, steps, method, batch), (m, n, steps)


# ------------------------------------------------------------------------------------------------
# torch.compile
# ------------------------------------------------------------------------------------------------
def test_torch_compile_fullgraph():
    # fullgraph=True fails on any graph break (data-dependent control flow); aot_eager also traces
    # the in-place diagonal add through functionalization. Inductor is left to the GPU benchmarks.
    torch._dynamo.reset()
    try:
        compiled = torch.compile(orthogonalize, fullgraph=True, backend="aot_eager")
        for method in NS_METHODS:
            for shape in [(2, 3, 8, 24), (24, 8)]:
                x = torch.randn(*shape, generator=_gen(6))
                torch.testing.assert_close(compiled(x, method), orthogonalize(x, method), atol=1e-6, rtol=0)
    finally:
        torch._dynamo.reset()



def test_compiled_orthogonalize_matches_eager_and_is_cached():
    from ds_muon.core.ns_compile import compiled_orthogonalize
    fn = compiled_orthogonalize("standard", 5, torch.float32)
    assert compiled_orthogonalize("standard", 5, torch.float32) is fn  # one compile per (method, steps, dtype)
    for shape in ((2, 8, 12), (3, 12, 8)):  # wide and tall, different batch: dynamic shapes
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(fn(x), orthogonalize(x, "standard", 5, torch.float32), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="method"):
        compiled_orthogonalize("bogus", 5, torch.float32)


def test_compiled_orthogonalize_never_falls_back_to_eager():
    # A model's shapes and per-bucket batch counts exceed torch.compile's default recompile_limit (8),
    # which is shared by every compiled function; past it torch silently runs eager. Under
    # fail_on_recompile_limit_hit it raises instead, so this fails if ds_muon's limit is not in force.
    from ds_muon.core.ns_compile import compiled_orthogonalize
    shapes = [(1, 8, 8), (3, 8, 8), (1, 8, 20), (2, 8, 20), (1, 20, 8), (4, 20, 8), (5, 4, 4), (1, 4, 12),
              (7, 12, 4), (2, 16, 8), (1, 6, 6), (3, 6, 30), (2, 30, 6)]
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=True):
            for method in NS_METHODS:
                fn = compiled_orthogonalize(method, 5, torch.float32, backend="eager")
                for shape in shapes:
                    x = torch.randn(*shape, generator=_gen(7))
                    torch.testing.assert_close(fn(x), orthogonalize(x, method, 5, torch.float32), rtol=1e-5, atol=1e-6)
    finally:
        torch._dynamo.reset()


def test_autocast_region_does_not_change_the_compute_dtype():
    # An optimizer step inside the user's torch.autocast must still run Newton-Schulz in `dtype`.
    x = torch.randn(2, 8, 20, generator=_gen(11))
    want = orthogonalize(x, "standard", 5, torch.float32)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        got = orthogonalize(x, "standard", 5, torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# quintic forms, the per-shape cost model, compile settings
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["standard", "polar_express"])
def test_quintic_forms_are_the_same_polynomial(method):
    # "fused" writes P = c A^2 + b A + a I over the product A A; "plain" B = c A + b I, P = B A + a I.
    # In fp64 both are the polynomial to rounding; each against the exact singular-value map.
    # "sym2"/"sym4" take A and P A from their upper blocks (symmetric_product); 12 rows cut into 2 or 4 block rows.
    x = torch.randn(3, 12, 30, generator=_gen(21), dtype=F64)
    assert ns.QUINTIC_FORMS == ("auto", "plain", "fused", "sym2", "sym4")
    plain = orthogonalize(x, method, 5, form="plain")
    for form in ns.QUINTIC_FORMS:
        other = orthogonalize(x, method, 5, form=form)
        assert rel_err(other, plain) < 1e-12, form
        assert rel_err(orthogonalize(x.mT, method, 5, form=form), plain.mT) < 1e-12, form  # tall input
    assert torch.equal(orthogonalize(x, method, 5), orthogonalize(x, method, 5, form=ns.QUINTIC_FORM))
    with pytest.raises(ValueError, match="quintic form must be one of"):
        orthogonalize(x, method, 5, form="bogus")


def test_auto_form_is_sym2_from_the_measured_size_and_plain_below(monkeypatch):
    """``"auto"`` (the default form) runs ``sym2`` where the short side is >= ``SYM2_MIN_ROWS`` (2048, the smallest
    size where it was measured faster) and ``plain`` below, in the eager and the compiled kernel, tall or wide; the
    FLOP count and the owner plan's cost follow the same choice."""
    from ds_muon.core.matrix import matrix_view
    assert ns.QUINTIC_FORM == ns_cost.DEFAULT_QUINTIC_FORM == "auto" and ns_cost.SYM2_MIN_ROWS == 2048
    assert [ns_cost.resolve_form("auto", *s) for s in ((2048, 5440), (5440, 2048), (2047, 5440), (2048, 2048),
                                                       (3072, 8192), (2048, 1408))] \
        == ["sym2", "sym2", "plain", "sym2", "sym2", "plain"]
    assert ns_cost.resolve_form("sym4", 8, 8) == "sym4"
    with pytest.raises(ValueError, match="quintic form must be one of"):
        ns_cost.resolve_form("sym3", 8, 8)
    assert ns_flops(3072, 8192, 5) == ns_flops(3072, 8192, 5, form="sym2") < ns_flops(3072, 8192, 5, form="plain")
    assert ns_flops(2048, 5440, 5) == ns_flops(2048, 5440, 5, form="sym2")  # the default form counts "auto"
    assert ns_flops(1408, 2048, 5) == ns_flops(1408, 2048, 5, form="plain")
    assert matrix_view((24, 3072, 8192)).cost(5, "standard") == ns_flops(3072, 8192, 5, batch=24, form="sym2")
    # the cost model counts the form the standard kernel runs: sym2's FLOPs at its measured relative rate
    rate = ns_cost.NS_EFFICIENCY["standard"] * ns_cost.FORM_RELATIVE_RATE["sym2"]
    assert ns_cost.ns_seconds(3072, 8192, 5, batch=24, matmul_tflops=800) == pytest.approx(
        ns_flops(3072, 8192, 5, batch=24, form="sym2") / (rate * 800e12), rel=1e-12)
    assert ns_cost.ns_seconds(1408, 2048, 5, matmul_tflops=800) == pytest.approx(
        ns_flops(1408, 2048, 5, form="plain") / (ns_cost.NS_EFFICIENCY["standard"] * 800e12), rel=1e-12)
    # at (4096, 7168) Gram's 5-step FLOPs beat plain's and lose to sym2's at sym2's measured rate: the standard kernel
    gram = ns_cost._gram_flops(4096, 7168, 5)
    assert ns_flops(4096, 7168, 5, form="sym2") / ns_cost.FORM_RELATIVE_RATE["sym2"] < gram \
        < ns_flops(4096, 7168, 5, form="plain")
    assert not ns_cost.gram_pays(4096, 7168, 5) and ns_cost.ns_kernel(4096, 7168, 5, "gram") == "standard"
    assert ns_flops(4096, 7168, 5, "gram") == ns_flops(4096, 7168, 5, form="sym2")  # what orthogonalize runs
    # the choice follows the form asked for: against plain, Gram pays there
    assert ns_cost.gram_pays(4096, 7168, 5, "plain") and ns_cost.ns_kernel(4096, 7168, 5, "gram", "plain") == "gram"
    assert ns_flops(4096, 7168, 5, "gram", form="plain") == gram
    calls = []
    real_pays = ns.gram_pays
    import ds_muon.core.newton_schulz as ns_module
    monkeypatch.setattr(ns_module, "gram_pays", lambda *a: calls.append(a) or real_pays(*a))
    orthogonalize(torch.randn(2, 3, 5, generator=_gen(7)), "gram", 5, torch.float32, form="plain")
    assert calls == [(3, 5, 5, "plain")]
    monkeypatch.setattr(ns_cost, "SYM2_MIN_ROWS", 12)  # small matrices through both branches on the CPU
    from ds_muon.core.ns_compile import compiled_orthogonalize
    torch._dynamo.reset()
    try:
        fns = {"static": compiled_orthogonalize("standard", 5, torch.float32, backend="eager", dynamic=False,
                                                form="auto"),
               "dynamic": compiled_orthogonalize("standard", 5, torch.float32, backend="eager", dynamic=True,
                                                 form="auto"),
               "default form": compiled_orthogonalize("standard", 5, torch.float32, backend="eager", dynamic=False)}
        for shape, picked in (((2, 12, 30), "sym2"), ((2, 30, 12), "sym2"), ((2, 11, 30), "plain"),
                              ((3, 13, 30), "sym2"), ((3, 11, 29), "plain")):
            x = torch.randn(*shape, generator=_gen(31))
            want = orthogonalize(x, "standard", 5, torch.float32, form=picked)
            assert torch.equal(orthogonalize(x, "standard", 5, torch.float32), want), shape
            for kind, fn in fns.items():
                torch.testing.assert_close(fn(x), want, rtol=0, atol=1e-6, msg=f"{kind} {shape}")
            other = "plain" if picked == "sym2" else "sym2"
            assert not torch.equal(want, orthogonalize(x, "standard", 5, torch.float32, form=other)), shape
            for kind, fn in fns.items():  # the compiled result is the picked form's, not the other one's
                assert (fn(x) - want).abs().max() < (fn(x) - orthogonalize(x, "standard", 5, torch.float32,
                                                                           form=other)).abs().max(), (kind, shape)
    finally:
        torch._dynamo.reset()


def test_symmetric_product_is_the_full_product_from_its_upper_blocks(monkeypatch):
    """``symmetric_product`` equals ``L @ R^T`` for both symmetric products of the quintic (``X X^T``, and ``P A``
    with ``P = c A + b I``), for row counts that the block rows do not divide and fewer rows than blocks, with
    one batched matmul per block row on rows from that block on; and the sym forms run it with 2 and 4 blocks."""
    for s in (1, 2, 5, 12, 13):
        X = torch.randn(2, s, 7, generator=_gen(s), dtype=F64)
        A, P = X @ X.mT, None
        P = A * 2.0315
        P.diagonal(dim1=-2, dim2=-1).add_(-4.775)
        for blocks in (1, 2, 3, 4):
            calls = []
            real = torch.bmm
            monkeypatch.setattr(torch, "bmm", lambda a, b: calls.append((a.shape, b.shape)) or real(a, b))
            got = ns.symmetric_product(X, X, blocks)
            monkeypatch.setattr(torch, "bmm", real)
            assert torch.allclose(got, A, rtol=0, atol=1e-12), (s, blocks)
            k = min(blocks, s)
            first = s // k  # the first block row's height: below it, every entry left of the diagonal block
            assert torch.equal(got[:, first:, :first], got[:, :first, first:].mT), (s, blocks)  # mirrored
            assert torch.allclose(ns.symmetric_product(P, A, blocks), P @ A, rtol=0, atol=1e-10), (s, blocks)
            assert len(calls) == k and sum(a[1] for a, _ in calls) == s  # block rows cover every row once
            assert [b[2] for _, b in calls] == [s - s * i // k for i in range(k)]  # columns from the block on
    with pytest.raises(ValueError, match="must be the same"):
        ns.symmetric_product(X, X[:, :, :3], 2)
    with pytest.raises(ValueError, match="blocks must be >= 1"):
        ns.symmetric_product(X, X, 0)
    used = []
    real_sym = ns.symmetric_product
    monkeypatch.setattr(ns, "symmetric_product", lambda L, R, k: used.append(k) or real_sym(L, R, k))
    for form, k in (("sym2", 2), ("sym4", 4)):
        used.clear()
        orthogonalize(torch.randn(2, 8, 16, generator=_gen(3), dtype=F64), "standard", 5, form=form)
        assert used == [k] * 10, (form, used)  # two products per iteration, 5 iterations


@pytest.mark.parametrize("form", ["sym2", "sym4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_symmetric_forms_in_half_precision_stay_within_the_plain_forms_bounds(form, dtype):
    """In half precision the sym forms meet the plain form's tolerances (``HALF_REL``, the band with
    ``HALF_BAND_SLACK``) against the exact polynomial map."""
    for batch, m, n in (((2,), 24, 64), ((), 64, 24), ((), 32, 32)):
        x, U, s, V = make_case(batch, m, n, "wellcond", seed=9)
        O = orthogonalize(x.float(), "standard", dtype=dtype, form=form)
        assert O.dtype == dtype and torch.isfinite(O).all()
        assert rel_err(O, (U * scalar_map(normalized(s), "standard", 5).unsqueeze(-2)) @ V.mT) < HALF_REL[dtype]
        d = in_basis(O, U, V).diagonal(dim1=-2, dim2=-1)
        lo, hi = QUINTIC_BAND
        assert lo - HALF_BAND_SLACK[dtype] <= d.min().item() and d.max().item() <= hi + HALF_BAND_SLACK[dtype]


def test_cost_model_picks_the_kernel_by_flops_over_measured_efficiency(monkeypatch):
    from torch.utils.flop_counter import FlopCounterMode
    # equal efficiencies: gram where its FLOPs are fewer (5 steps: max > 1.5 min)
    monkeypatch.setattr(ns_cost, "NS_EFFICIENCY", {"standard": 0.75, "gram": 0.75})
    assert ns_cost.ns_kernel(16, 24, 5, "gram") == "standard" and ns_cost.ns_kernel(16, 25, 5, "gram") == "gram"
    assert ns_cost.ns_kernel(40, 16, 5, "gram") == "gram" and ns_cost.ns_kernel(32, 32, 5, "gram") == "standard"
    assert ns_cost.ns_kernel(16, 40, 5, "standard") == "standard" and ns_cost.ns_kernel(16, 40, 5, "polar_express") == "polar_express"
    # 16x40: gram 8*16^2*40 + 28*16^3 = 196608 FLOP-units vs standard 20*16^2*40 + 10*16^3 = 245760 (0.8x).
    # A Gram kernel measured at 0.7x the standard's efficiency would take 0.8/0.7 = 1.14x as long: standard.
    monkeypatch.setattr(ns_cost, "NS_EFFICIENCY", {"standard": 0.75, "gram": 0.75 * 0.7})
    assert ns_cost.ns_kernel(16, 40, 5, "gram") == "standard"
    assert ns_cost.ns_kernel(16, 200, 5, "gram") == "gram"  # far wider: gram's FLOPs 0.44x, still pays
    assert ns_flops(16, 40, 5, "gram") == ns_flops(16, 40, 5, "standard")  # counts what runs
    # orthogonalize runs the kernel the model picked (the FLOPs it does, and the standard kernel's output)
    x = torch.randn(2, 16, 40, generator=_gen(22))
    with FlopCounterMode(display=False) as counter:
        out = orthogonalize(x, "gram", 5)
    assert counter.get_total_flops() == ns_flops(16, 40, 5, "standard", batch=2)
    assert torch.equal(out, orthogonalize(x, "standard", 5))
    monkeypatch.setattr(ns_cost, "NS_EFFICIENCY", {"standard": 0.75, "gram": 0.75})
    with FlopCounterMode(display=False) as counter:
        orthogonalize(x, "gram", 5)
    assert counter.get_total_flops() == ns_flops(16, 40, 5, "gram", batch=2) < ns_flops(16, 40, 5, "standard", batch=2)
    # predicted seconds: FLOPs / (efficiency of the kernel that runs * rate)
    assert ns_cost.ns_seconds(16, 40, 5, "gram", batch=2, matmul_tflops=1e-6) == pytest.approx(
        ns_flops(16, 40, 5, "gram", batch=2) / (0.75 * 1e6))
    with pytest.raises(ValueError, match="matmul_tflops"):
        ns_cost.ns_seconds(16, 40, 5, "gram", matmul_tflops=0)
    with pytest.raises(ValueError, match="m must be"):
        ns_cost.ns_kernel(0, 4, 5, "gram")


def test_recorded_efficiencies_match_the_documented_measurement():
    # NS_EFFICIENCY is the 1xH200 measurement recorded in docs/benchmarks.md (16x5440x2048 and
    # 16x2048x5440: standard 75%/74%, gram 75%/74%): at the measured 795 TFLOP/s it predicts the
    # measured gram times (11.42 and 11.56 ms) within 2%.
    for shape, ms in (((5440, 2048), 11.42), ((2048, 5440), 11.56)):
        assert ns_cost.ns_seconds(*shape, 5, "gram", batch=16, matmul_tflops=795) * 1e3 == pytest.approx(ms, rel=0.02)


def test_compiled_orthogonalize_settings():
    from ds_muon.core.ns_compile import compiled_orthogonalize
    with pytest.raises(ValueError, match="needs backend='inductor'"):
        compiled_orthogonalize("standard", 5, torch.float32, backend="eager", mode="max-autotune-no-cudagraphs")
    with pytest.raises(ValueError, match="quintic form"):
        compiled_orthogonalize("standard", 5, torch.float32, backend="eager", form="bogus")
    # the defaults resolve to the module settings: the same cached function as spelling them out
    assert compiled_orthogonalize("standard", 5, torch.float32, backend="eager") is compiled_orthogonalize(
        "standard", 5, torch.float32, backend="eager", mode=ns_compile.COMPILE_MODE, dynamic=ns_compile.COMPILE_DYNAMIC,
        form=ns.QUINTIC_FORM)
    torch._dynamo.reset()
    try:
        fn = compiled_orthogonalize("polar_express", 5, torch.float32, backend="eager", dynamic=False, form="fused")
        x = torch.randn(2, 8, 20, generator=_gen(23))
        torch.testing.assert_close(fn(x), orthogonalize(x, "polar_express", 5, torch.float32, form="fused"),
                                   rtol=1e-5, atol=1e-6)
    finally:
        torch._dynamo.reset()
