"""Newton–Schulz orthogonalization: the matrix math of Muon (docs/design.md, "One optimizer step", owner).

Pure and single-device (layer ``core``: torch only). The cost model that picks a kernel per shape is
:mod:`ds_muon.core.ns_cost`; the ``torch.compile`` wrapper is :mod:`ds_muon.core.ns_compile`. Every function works on a batch of
matrices of shape ``(..., m, n)`` with batched matmuls only (no Python loop over the batch, no
data-dependent Python control flow), so it also runs under ``torch.compile(fullgraph=True)``.

``orthogonalize`` is the entry point. It normalizes by the Frobenius norm, turns the matrix to its
wide orientation (``m <= n``) and runs one of three kernels, each of which maps every singular value
``s`` of the normalized input through a composition of odd quintics ``p_t(s) = a_t s + b_t s^3 + c_t s^5``
while keeping the singular vectors:

* ``"standard"``: Keller Jordan's quintic with fixed ``(a, b, c) = (3.4445, -4.7750, 2.0315)``,
  https://kellerjordan.github.io/posts/muon/
* ``"gram"``: the same polynomial, evaluated on the small Gram matrix ``X X^T`` with one restart
  (Zhang, Amsel, Chen, Dao, "Gram Newton-Schulz", https://tridao.me/blog/2026/gram-newton-schulz/).
* ``"polar_express"``: per-iteration minimax-optimal quintics (Amsel, Persson, Musco, Gower,
  "The Polar Express", arXiv:2505.16932, Algorithm 1).

Singular-value bands after 5 steps (float64 scalar map, checked on matrices in
``tests/unit/test_newton_schulz.py``), for ``s`` = singular value / Frobenius norm:

* standard / gram: every output singular value lies in ``[0.6818, 1.1344]`` when ``s >= 0.01``
  (``[0.6818, 1.2024]`` when ``s >= 0.0015``); for any ``s > 0`` it lies in ``(0, 1.2024]``.
* polar_express: ``[0.8401, 1.1236]`` when ``s >= 0.001`` (the paper's design interval).
"""
from __future__ import annotations

import torch

from .ns_cost import (DEFAULT_QUINTIC_FORM, NS_METHODS, QUINTIC_FORMS, SYM_BLOCKS, block_row_cuts, check_method,
                      check_steps, gram_pays, gram_restart_points, resolve_form)

__all__ = [
    "NS_METHODS",
    "QUINTIC_COEFFS",
    "POLAR_EXPRESS_COEFFS",
    "QUINTIC_FORMS",
    "QUINTIC_FORM",
    "orthogonalize",
    "symmetric_product",
    "frobenius_normalize",
    "newton_schulz_quintic",
    "gram_newton_schulz",
    "polar_express",
    "polar_express_coeffs",
]


# How one quintic iteration ``X <- (a I + b A + c A^2) X`` (``A = X X^T``) is written, in
# ``QUINTIC_FORMS``: the same polynomial either way (``_quintic_iterations``), and the same 3 matmuls
# but for the ``sym`` forms' smaller two:
#
# * ``"plain"``: ``B = c A + b I``; ``P = B A + a I``; ``X <- P X``. Element-wise work on the
#   ``(m, m)`` side between the matmuls (one pass for ``B``, the ``+ a I`` on the diagonal).
# * ``"fused"``: ``P = c (A A) + b A + a I`` as one element-wise expression over the product ``A A``
#   (the identity as ``torch.eye``, not an in-place diagonal add), then ``X <- P X``. Under
#   ``torch.compile(mode="max-autotune...")`` inductor can then fold the whole expression into the
#   epilogue of the ``A A`` matmul template (no separate pass over ``(m, m)``), and in half precision
#   the compiled form rounds ``P`` once instead of ``B`` and ``P``.
# * ``"sym2"``, ``"sym4"``: ``"plain"`` with its two symmetric products (``A = X X^T`` and
#   ``(c A + b I) A``, a polynomial in ``A`` times ``A``) taken from their upper blocks
#   (:func:`symmetric_product`, 2 or 4 block rows): the ``(m, m)`` products cost
#   ``(k + 1) / (2 k)`` of theirs, so 15% (``sym2``) or 23% (``sym4``) of the standard quintic's
#   FLOPs are saved at 2.9B's shapes (``(96, 3072, 3072)``, ``(48, 8192, 3072)``), for ``k`` smaller
#   matmuls per product and a copy of each block row into the ``(m, m)`` result plus the mirror.
#   Equal to ``"plain"`` in exact arithmetic (tests/unit/test_newton_schulz.py checks fp64, and half
#   precision against the plain form's tolerances). On one H100 at ``s = 3072`` ``sym2`` is 9-11%
#   faster than ``"plain"`` and ``sym4`` no faster (docs/benchmarks.md, "Issue 40: 2.9B's gap split,
#   MoE-1.5B's host time, the symmetric Newton–Schulz forms"); at ``s = 2048`` ``sym2`` is 4-11%
#   faster, at ``s = 1408`` no faster ("Issue 40: the reduce bucket in three rounds").
#   ``ns_flops(..., form=...)`` counts each form's FLOPs.
# * ``"auto"`` (the default): ``sym2`` where the matrix's short side is at least ``SYM2_MIN_ROWS``
#   (2048, the smallest size measured faster), ``"plain"`` below (``ns_cost.resolve_form``, a static-shape choice).
# QUINTIC_FORMS and the sym forms' block rows (SYM_BLOCKS) live in ns_cost, which counts FLOPs by form.

#: The form ``orthogonalize`` uses when none is given (``ns_cost.DEFAULT_QUINTIC_FORM``, ``"auto"``), chosen by the
#: GPU microbenchmark (``python benchmarks/step_time.py --optimizers '' --ns-micro``, docs/benchmarks.md).
QUINTIC_FORM: str = DEFAULT_QUINTIC_FORM
#: Keller Jordan's quintic, https://kellerjordan.github.io/posts/muon/
QUINTIC_COEFFS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)

# Polar Express, degree 5, arXiv:2505.16932 Algorithm 1 (designed for the interval [1e-3, 1]).
_POLAR_EXPRESS_RAW: tuple[tuple[float, float, float], ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),  # the paper: later coefficients equal this numerically
)
_PE_SAFETY = 1.01  # the paper's safety factor: p(x) -> p(x / 1.01), all but the last polynomial
#: Per-iteration ``(a_t, b_t, c_t)`` of Polar Express with the safety factor applied.
POLAR_EXPRESS_COEFFS: tuple[tuple[float, float, float], ...] = tuple(
    (a / _PE_SAFETY, b / _PE_SAFETY**3, c / _PE_SAFETY**5) for a, b, c in _POLAR_EXPRESS_RAW[:-1]
) + (_POLAR_EXPRESS_RAW[-1],)

# The paper normalizes Polar Express by ||X||_F * 1.01; the quintic by ||X||_F. No eps is added to the
# norm: a fixed eps dominates a small matrix's norm and breaks Muon's scale invariance (a loss x 1e-6
# changed the update by ~20%); ``frobenius_normalize`` is exact at any scale and maps a zero matrix to zeros.
_NORM_SCALE = {"standard": 1.0, "gram": 1.0, "polar_express": _PE_SAFETY}

# ----------------------------------------------------------------------------------------------
# validation helpers
# ----------------------------------------------------------------------------------------------
def _check_matrix(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2 or x.shape[-2] < 1 or x.shape[-1] < 1:
        raise ValueError(f"expected shape (..., m, n) with m, n >= 1, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"expected a floating-point tensor, got {x.dtype}")


def _as_batch(x: torch.Tensor) -> torch.Tensor:
    """(..., m, n) -> (B, m, n) (a view where the strides allow), for bmm/baddbmm."""
    return x.reshape(-1, x.shape[-2], x.shape[-1])


# ----------------------------------------------------------------------------------------------
# kernels: expect the normalized matrix (spectral norm <= 1), best in wide orientation (m <= n)
# ----------------------------------------------------------------------------------------------
def check_form(form: str | None) -> str:
    """``form``, or :data:`QUINTIC_FORM` for None; ValueError (naming the allowed values) for anything else."""
    form = QUINTIC_FORM if form is None else form
    if form not in QUINTIC_FORMS:
        raise ValueError(f"quintic form must be one of {QUINTIC_FORMS}, got {form!r}")
    return form


def _quintic_iterations(x: torch.Tensor, coeffs: list[tuple[float, float, float]],
                        form: str | None = None) -> torch.Tensor:
    # X <- (a I + b A + c A^2) X with A = X X^T: 3 matmuls per iteration, the scalars on the small
    # (m, m) side, in one of the QUINTIC_FORMS (see there). "plain", measured on H200 (bf16,
    # docs/benchmarks.md): 80% of the matmul rate eager against 67-73% for the same polynomial as
    # baddbmm with alpha/beta epilogues (X <- baddbmm(X, baddbmm(A, A, A), X)), at the same
    # orthogonality error. In half precision "plain" rounds the (m, m) polynomial matrix before it
    # multiplies X (tests/unit/test_newton_schulz.py, "half precision"); in fp32 every form is as exact
    # as the baddbmm form.
    X = _as_batch(x)
    form = resolve_form(check_form(form), X.shape[-2], X.shape[-1])
    eye = torch.eye(X.shape[-2], dtype=X.dtype, device=X.device) if form == "fused" else None
    blocks = SYM_BLOCKS.get(form)  # A and P A are symmetric: a sym form takes their upper blocks only
    for a, b, c in coeffs:
        A = torch.bmm(X, X.mT) if blocks is None else symmetric_product(X, X, blocks)
        if form == "fused":
            P = torch.bmm(A, A) * c + A * b + eye * a
        else:
            P = A * c
            P.diagonal(dim1=-2, dim2=-1).add_(b)
            P = torch.bmm(P, A) if blocks is None else symmetric_product(P, A, blocks)
            P.diagonal(dim1=-2, dim2=-1).add_(a)
        X = torch.bmm(P, X)
    return X.reshape(x.shape)


def symmetric_product(L: torch.Tensor, R: torch.Tensor, blocks: int) -> torch.Tensor:
    """``L @ R^T`` for a product known to be symmetric (``X X^T``; ``P A`` for symmetric ``A`` and ``P`` a
    polynomial in ``A``), computed from its upper blocks only.

    The ``s`` rows are cut into ``blocks`` block rows (sizes differ by at most one row; ``min(blocks, s)`` of
    them). Block row ``i`` is one batched matmul of ``L``'s rows of that block against ``R``'s rows from that
    block on (views, no copy of the inputs), written into the result; the blocks below the diagonal are then
    written as the transposes of those above it. With ``k`` equal block rows that costs ``(k + 1) / (2 k)`` of
    the full product's FLOPs (3/4 at ``k = 2``, 5/8 at ``k = 4``). The blocks below the diagonal are exact
    mirrors, so in half precision they can differ from ``torch.bmm(L, R.mT)``'s by rounding. Source of the
    saving: the Gram matrix of the Newton–Schulz iteration is symmetric (https://kellerjordan.github.io/posts/muon/
    computes ``A = X X^T`` in full); the block-row split is ds_muon's.

    Args:
        L, R: ``(b, s, l)``, the same shape and dtype.
        blocks: block rows, >= 1 (1: one full ``bmm``).

    Returns:
        ``(b, s, s)`` in ``L.dtype``.

    Raises:
        ValueError: ``L`` and ``R`` differ in shape or are not 3-dimensional, or ``blocks`` < 1.
    """
    if L.shape != R.shape or L.dim() != 3:
        raise ValueError(f"symmetric_product: L {tuple(L.shape)} and R {tuple(R.shape)} must be the same (b, s, l)")
    if blocks < 1:
        raise ValueError(f"symmetric_product: blocks must be >= 1, got {blocks}")
    s = L.shape[1]
    cuts = block_row_cuts(s, blocks)
    if len(cuts) == 2:  # one block row
        return torch.bmm(L, R.mT)
    out = L.new_empty(L.shape[0], s, s)
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        out[:, lo:hi, lo:] = torch.bmm(L[:, lo:hi], R[:, lo:].mT)
    for lo, hi in zip(cuts[1:-1], cuts[2:]):
        out[:, lo:hi, :lo] = out[:, :lo, lo:hi].mT
    return out


def newton_schulz_quintic(x: torch.Tensor, steps: int, form: str | None = None) -> torch.Tensor:
    """Keller Jordan's quintic Newton–Schulz iteration (the Muon default).

    ``steps`` times ``X <- a X + b (X X^T) X + c (X X^T)^2 X`` with
    ``(a, b, c) = (3.4445, -4.7750, 2.0315)`` (https://kellerjordan.github.io/posts/muon/).
    It does not converge to ``U V^T``: after 5 steps every singular value ``s >= 0.01`` of the input
    lands in ``[0.6818, 1.1344]`` (the band the iteration then cycles in).

    Args:
        x: ``(..., m, n)``, any float dtype (computed in ``x.dtype``), already normalized so that
            its spectral norm is <= 1 (``orthogonalize`` divides by the Frobenius norm). Wide
            orientation (``m <= n``) is cheapest; a tall matrix gives the same result at more cost.
        steps: number of iterations, >= 1.
        form: one of ``QUINTIC_FORMS`` (default ``QUINTIC_FORM``): how the iteration is written,
            the same polynomial either way.

    Returns:
        ``(..., m, n)`` in ``x.dtype``.

    Raises:
        ValueError: ``steps`` is not an int >= 1, or ``form`` not in ``QUINTIC_FORMS``.
    """
    check_steps(steps)
    return _quintic_iterations(x, [QUINTIC_COEFFS] * steps, form)


def polar_express_coeffs(steps: int) -> list[tuple[float, float, float]]:
    """The ``steps`` Polar Express triples ``(a_t, b_t, c_t)`` (safety factor 1.01 applied).

    From arXiv:2505.16932 Algorithm 1 (8 triples, optimal for singular values in ``[1e-3, 1]``);
    beyond 8 steps the last triple (the classical degree-5 Newton–Schulz ``(15, -10, 3)/8``) repeats.

    Raises:
        ValueError: ``steps`` is not an int >= 1.
    """
    check_steps(steps)
    table = list(POLAR_EXPRESS_COEFFS)
    return table[:steps] + [table[-1]] * max(0, steps - len(table))


def polar_express(x: torch.Tensor, steps: int, form: str | None = None) -> torch.Tensor:
    """Polar Express (Amsel, Persson, Musco, Gower, arXiv:2505.16932, degree 5).

    Like ``newton_schulz_quintic`` but iteration ``t`` uses its own minimax-optimal quintic
    (``polar_express_coeffs``), so it converges to ``U V^T``. After 5 steps every singular value
    ``s >= 1e-3`` of ``x`` (normalized as below) lands in ``[0.8401, 1.1236]``; after 8 steps
    within ``1e-5`` of 1.

    Args:
        x: ``(..., m, n)``, any float dtype (computed in ``x.dtype``), normalized as the paper
            prescribes: ``X / (1.01 * ||X||_F)`` (``orthogonalize`` does this). Wide
            orientation (``m <= n``) is cheapest.
        steps: number of iterations, >= 1.
        form: one of ``QUINTIC_FORMS`` (default ``QUINTIC_FORM``), as in ``newton_schulz_quintic``.

    Returns:
        ``(..., m, n)`` in ``x.dtype``.

    Raises:
        ValueError: ``steps`` is not an int >= 1, or ``form`` not in ``QUINTIC_FORMS``.
    """
    return _quintic_iterations(x, polar_express_coeffs(steps), form)


def gram_newton_schulz(
    x: torch.Tensor, steps: int, coeffs: list[tuple[float, float, float]] | None = None
) -> torch.Tensor:
    """Gram Newton–Schulz with restarts (Zhang, Amsel, Chen, Dao, 2026,
    https://tridao.me/blog/2026/gram-newton-schulz/).

    Evaluates the same quintic composition as ``newton_schulz_quintic`` (so in exact arithmetic
    the result is identical), but iterates on the small ``m x m`` Gram matrix ``R = X X^T``:
    with ``P_t = a I + b R + c R^2`` (a polynomial in ``R``, so everything commutes),
    ``Q <- Q P_t`` and ``R <- P_t R P_t``; the result is ``Q X``. Only the first Gram product, the
    restarts and the final product touch the long side ``n``. After the iterations listed by
    ``gram_restart_points`` (after 2 for 5 steps) it restarts: ``X <- Q X``, ``R <- X X^T``,
    ``Q <- I``, which stops rounding error in ``R`` (spurious negative eigenvalues in half
    precision) from compounding.

    Args:
        x: ``(..., m, n)``, any float dtype (computed in ``x.dtype``), spectral norm <= 1
            (``orthogonalize`` divides by the Frobenius norm). Pays off when wide (``n`` well
            above ``m``); on a tall matrix it is correct but costly.
        steps: number of iterations, >= 1.
        coeffs: ``steps`` triples ``(a_t, b_t, c_t)``; default: ``QUINTIC_COEFFS`` every step
            (``polar_express_coeffs(steps)`` gives Gram Polar Express).

    Returns:
        ``(..., m, n)`` in ``x.dtype``.

    Raises:
        ValueError: ``steps`` is not an int >= 1, or ``coeffs`` does not have ``steps`` entries.
    """
    check_steps(steps)
    coeffs = [QUINTIC_COEFFS] * steps if coeffs is None else list(coeffs)
    if len(coeffs) != steps:
        raise ValueError(f"coeffs has {len(coeffs)} triples, steps is {steps}")
    restarts = gram_restart_points(steps)
    X = _as_batch(x)
    R = torch.bmm(X, X.mT)
    Q = None  # None stands for the identity: saves a matmul after every (re)start
    for t, (a, b, c) in enumerate(coeffs, start=1):
        P = torch.baddbmm(R, R, R, beta=b, alpha=c)  # b R + c R^2
        P.diagonal(dim1=-2, dim2=-1).add_(a)  # + a I
        Q = P if Q is None else torch.bmm(Q, P)
        if t == steps:
            break
        if t in restarts:
            X = torch.bmm(Q, X)
            R = torch.bmm(X, X.mT)
            Q = None
        else:
            R = torch.bmm(P, torch.bmm(R, P))
    return torch.bmm(Q, X).reshape(x.shape)


# ----------------------------------------------------------------------------------------------
# entry point
# ----------------------------------------------------------------------------------------------
def orthogonalize(
    x: torch.Tensor, method: str = "standard", steps: int = 5, dtype: torch.dtype | None = None,
    form: str | None = None,
) -> torch.Tensor:
    """Approximate polar factor ``U V^T`` of every matrix in ``x`` (``x = U S V^T``, reduced SVD).

    Steps: ``X = x / (k ||x||_F)`` per matrix in fp32 (fp64 for fp64 input), with ``k = 1.01`` for
    polar_express (the paper's normalization) and 1 otherwise, computed scale-safely (``frobenius_normalize``:
    the same result for any rescaling of ``x`` whose entries stay normal numbers, so Muon's update does not
    depend on the loss scale), cast to the compute dtype (a zero matrix stays zero: zeros out, never
    NaN); transpose to wide orientation when
    ``m > n``; run the kernel; transpose back. Methods:

    * ``"standard"``: ``newton_schulz_quintic`` (https://kellerjordan.github.io/posts/muon/).
    * ``"gram"``: ``gram_newton_schulz`` (https://tridao.me/blog/2026/gram-newton-schulz/) where the
      cost model predicts it faster than the standard kernel (``ns_kernel``: FLOPs over measured
      efficiency; ``max(m,n) > 1.5 min(m,n)`` at 5 steps against the ``plain`` form, ``> 1.89 min(m,n)``
      against ``sym2``), else the standard kernel: the same
      polynomial either way. ``ns_flops`` counts the same choice.
    * ``"polar_express"``: ``polar_express`` (arXiv:2505.16932).

    Args:
        x: ``(..., m, n)`` with ``m, n >= 1`` and any number of leading (batch) dims, any float dtype.
        method: one of ``NS_METHODS``.
        steps: iterations, >= 1.
        dtype: compute dtype (see ``resolve_ns_dtype``); default ``x.dtype``.
        form: how the standard and Polar Express iterations are written, one of ``QUINTIC_FORMS``
            (default ``QUINTIC_FORM``); the same polynomial, differing only in rounding.

    Returns:
        ``(..., m, n)`` in the compute dtype, also inside a ``torch.autocast`` region (autocast is
        turned off for the iteration). For tall input (``m > n``) it is a transposed view (not
        contiguous).

    Raises:
        ValueError: bad ``method``, ``steps`` or ``form`` (names the allowed values), ``x`` not
            floating or not of shape ``(..., m, n)`` with ``m, n >= 1``, ``dtype`` not floating.
        TypeError: ``x`` is not a tensor.
    """
    check_method(method)
    check_steps(steps)
    form = check_form(form)
    _check_matrix(x)
    dtype = x.dtype if dtype is None else dtype
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")

    X = frobenius_normalize(x, _NORM_SCALE[method]).to(dtype)

    m, n = x.shape[-2], x.shape[-1]
    tall = m > n
    if tall:
        X = X.mT
    s, l = min(m, n), max(m, n)
    # An enclosing torch.autocast region (an optimizer step called inside the user's autocast) would
    # otherwise run the matmuls in its own dtype, not in ``dtype``.
    with torch.autocast(device_type=x.device.type, enabled=False):
        if method == "standard" or (method == "gram" and not gram_pays(s, l, steps, form)):
            out = newton_schulz_quintic(X, steps, form)
        elif method == "gram":
            out = gram_newton_schulz(X, steps)
        else:
            out = polar_express(X, steps, form)
    return out.mT if tall else out


def frobenius_normalize(x: torch.Tensor, k: float) -> torch.Tensor:
    """``x / (k ||x||_F)`` per matrix, in fp32 (fp64 for fp64 input), at any scale; zeros stay zeros.

    Scale-safe: each matrix is first multiplied by ``1 / max|x|`` (its largest magnitude becomes 1), so
    the Frobenius norm is taken of entries in ``[-1, 1]`` and neither underflows (squares of entries
    below ~1e-19 are 0 in fp32) nor overflows. For a power-of-two rescaling of ``x`` whose entries stay
    normal numbers the result is bit-identical; otherwise equal to fp32 rounding. ``max|x|`` is clamped
    to the smallest normal number so ``1 / max|x|`` stays finite for an all-subnormal matrix.
    """
    norm_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    tiny = torch.finfo(norm_dtype).tiny
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=(-2, -1), keepdim=True, dtype=norm_dtype)
    y = x.to(norm_dtype) * amax.clamp_min(tiny).reciprocal()
    norm = torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True)
    return y.div_(norm.clamp_min(tiny).mul_(k))  # a zero matrix: 0 / tiny = 0
