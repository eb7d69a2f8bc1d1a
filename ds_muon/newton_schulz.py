"""Newton–Schulz orthogonalization: the matrix math of Muon (design.md §3, "owner" step).

Pure and single-device: no ``torch.distributed``, no DeepSpeed. Every function works on a batch of
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
``tests/test_newton_schulz.py``), for ``s`` = singular value / Frobenius norm:

* standard / gram: every output singular value lies in ``[0.6818, 1.1344]`` when ``s >= 0.01``
  (``[0.6818, 1.2024]`` when ``s >= 0.0015``); for any ``s > 0`` it lies in ``(0, 1.2024]``.
* polar_express: ``[0.8401, 1.1236]`` when ``s >= 0.001`` (the paper's design interval).
"""
from __future__ import annotations

import functools
from fractions import Fraction

import torch

__all__ = [
    "NS_METHODS",
    "NS_DTYPES",
    "QUINTIC_COEFFS",
    "POLAR_EXPRESS_COEFFS",
    "resolve_ns_dtype",
    "orthogonalize",
    "newton_schulz_quintic",
    "gram_newton_schulz",
    "polar_express",
    "polar_express_coeffs",
    "gram_restart_points",
    "ns_flops",
    "ns_kernel",
    "ns_seconds",
    "NS_EFFICIENCY",
    "QUINTIC_FORMS",
    "QUINTIC_FORM",
    "COMPILE_MODE",
    "COMPILE_DYNAMIC",
    "AUTOTUNE_COMPILE",
]

NS_METHODS: tuple[str, ...] = ("standard", "gram", "polar_express")
NS_DTYPES: tuple[str, ...] = ("auto", "bfloat16", "float16", "float32")

#: How one quintic iteration ``X <- (a I + b A + c A^2) X`` (``A = X X^T``) is written; the same
#: polynomial and the same 3 matmuls of ``ns_flops`` either way (``_quintic_iterations``):
#:
#: * ``"plain"``: ``B = c A + b I``; ``P = B A + a I``; ``X <- P X``. Element-wise work on the
#:   ``(m, m)`` side between the matmuls (one pass for ``B``, the ``+ a I`` on the diagonal).
#: * ``"fused"``: ``P = c (A A) + b A + a I`` as one element-wise expression over the product ``A A``
#:   (the identity as ``torch.eye``, not an in-place diagonal add), then ``X <- P X``. Under
#:   ``torch.compile(mode="max-autotune...")`` inductor can then fold the whole expression into the
#:   epilogue of the ``A A`` matmul template (no separate pass over ``(m, m)``), and in half precision
#:   the compiled form rounds ``P`` once instead of ``B`` and ``P``.
QUINTIC_FORMS: tuple[str, ...] = ("plain", "fused")
#: The form ``orthogonalize`` uses when none is given. To be chosen by the GPU microbenchmark
#: (``python benchmarks/step_time.py --optimizers '' --ns-micro``, docs/benchmarks.md).
QUINTIC_FORM: str = "plain"
#: ``torch.compile`` ``mode`` and ``dynamic`` of ``compiled_orthogonalize`` when none is given (the
#: owner step's Newton–Schulz). ``None``/``True``: inductor's default mode, dynamic shapes (few graphs
#: per model, cuBLAS matmuls). heavyball compiles its Newton–Schulz with ``"max-autotune-no-cudagraphs"``
#: and static shapes (inductor benchmarks Triton matmul templates against cuBLAS per shape and can fuse
#: the element-wise work into the matmuls' epilogues); the microbenchmark times both.
COMPILE_MODE: str | None = None
COMPILE_DYNAMIC: bool | None = True
#: ``compiled_orthogonalize``'s ``mode``/``dynamic`` with the config key ``ns_autotune`` (opt-in):
#: heavyball's settings. Measured on one H200 (docs/benchmarks.md, 2026-12-01, bf16, 5 steps):
#: 83-85% of the matmul rate against 77-80% with the defaults, at the price of one graph per
#: ``(batch, rows, cols)`` and 4-9 s of autotuning per graph on first use.
AUTOTUNE_COMPILE: dict = {"mode": "max-autotune-no-cudagraphs", "dynamic": False}

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
# changed the update by ~20%); ``_normalize`` is exact at any scale and maps a zero matrix to zeros.
_NORM_SCALE = {"standard": 1.0, "gram": 1.0, "polar_express": _PE_SAFETY}

# Gram NS restarts after iteration 2 (the blog's choice for 5 steps), then every 3 iterations.
_GRAM_FIRST_RESTART = 2
_GRAM_RESTART_PERIOD = 3


# ----------------------------------------------------------------------------------------------
# validation helpers
# ----------------------------------------------------------------------------------------------
def _check_method(method: str) -> None:
    if method not in NS_METHODS:
        raise ValueError(f"ns method must be one of {NS_METHODS}, got {method!r}")


def _check_steps(steps: int) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")


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
# dtype policy
# ----------------------------------------------------------------------------------------------
def resolve_ns_dtype(ns_dtype: str, method: str, device: torch.device | str) -> torch.dtype:
    """Map a configured NS compute dtype name to a ``torch.dtype``.

    Args:
        ns_dtype: one of ``NS_DTYPES``. ``"auto"`` gives float32 on CPU (CPU parity tests are then
            exact to fp32 rounding); on any other device type (cuda, xpu, hpu, ...) bfloat16 for
            ``"standard"``/``"polar_express"`` and float16 for ``"gram"`` (the Gram NS blog runs
            in float16: its Gram matrices are bounded by 1, so fp16's extra mantissa is free).
            The other names give that dtype whatever the device.
        method: one of ``NS_METHODS``.
        device: a ``torch.device`` or device string (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...);
            only its type is looked at, no device is touched.

    Returns:
        ``torch.bfloat16``, ``torch.float16`` or ``torch.float32``.

    Raises:
        ValueError: ``ns_dtype`` not in ``NS_DTYPES`` or ``method`` not in ``NS_METHODS``
            (the message names the allowed values), or ``device`` is not a device.
    """
    _check_method(method)
    if ns_dtype not in NS_DTYPES:
        raise ValueError(f"ns_dtype must be one of {NS_DTYPES}, got {ns_dtype!r}")
    if ns_dtype != "auto":
        return getattr(torch, ns_dtype)
    try:
        device_type = torch.device(device).type
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"not a device: {device!r}") from err
    if device_type == "cpu":
        return torch.float32
    return torch.float16 if method == "gram" else torch.bfloat16


# ----------------------------------------------------------------------------------------------
# kernels: expect the normalized matrix (spectral norm <= 1), best in wide orientation (m <= n)
# ----------------------------------------------------------------------------------------------
def _check_form(form: str | None) -> str:
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
    # multiplies X (tests/test_newton_schulz.py, "half precision"); in fp32 every form is as exact
    # as the baddbmm form.
    form = _check_form(form)
    X = _as_batch(x)
    eye = torch.eye(X.shape[-2], dtype=X.dtype, device=X.device) if form == "fused" else None
    for a, b, c in coeffs:
        A = torch.bmm(X, X.mT)
        if form == "fused":
            P = torch.bmm(A, A) * c + A * b + eye * a
        else:
            P = A * c
            P.diagonal(dim1=-2, dim2=-1).add_(b)
            P = torch.bmm(P, A)
            P.diagonal(dim1=-2, dim2=-1).add_(a)
        X = torch.bmm(P, X)
    return X.reshape(x.shape)


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
    _check_steps(steps)
    return _quintic_iterations(x, [QUINTIC_COEFFS] * steps, form)


def polar_express_coeffs(steps: int) -> list[tuple[float, float, float]]:
    """The ``steps`` Polar Express triples ``(a_t, b_t, c_t)`` (safety factor 1.01 applied).

    From arXiv:2505.16932 Algorithm 1 (8 triples, optimal for singular values in ``[1e-3, 1]``);
    beyond 8 steps the last triple (the classical degree-5 Newton–Schulz ``(15, -10, 3)/8``) repeats.

    Raises:
        ValueError: ``steps`` is not an int >= 1.
    """
    _check_steps(steps)
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


def gram_restart_points(steps: int) -> tuple[int, ...]:
    """Iterations after which ``gram_newton_schulz`` restarts (``X <- Q X``, recompute ``X X^T``).

    After iteration 2 (the Gram NS blog's choice for 5 steps, https://tridao.me/blog/2026/gram-newton-schulz/),
    then every 3 iterations; never after the last one. ``steps=5`` -> ``(2,)``; ``steps=8`` -> ``(2, 5)``.

    Raises:
        ValueError: ``steps`` is not an int >= 1.
    """
    _check_steps(steps)
    return tuple(range(_GRAM_FIRST_RESTART, steps, _GRAM_RESTART_PERIOD))


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
    _check_steps(steps)
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
# cost model
# ----------------------------------------------------------------------------------------------
def _standard_flops(s: int, l: int, steps: int) -> int:
    # per iteration: X X^T (s*s*l), A @ A (s^3), B @ X (s*s*l)
    return steps * (2 * s * s * l + 2 * s**3 + 2 * s * s * l)


def _gram_flops(s: int, l: int, steps: int) -> int:
    restarts = gram_restart_points(steps)
    long_side = 2 * 2 * s * s * l  # first R = X X^T and final Q X
    long_side += len(restarts) * 2 * 2 * s * s * l  # each restart: Q X and X X^T
    small = 0
    fresh = True  # Q is the identity
    for t in range(1, steps + 1):
        small += 2 * s**3  # R @ R
        small += 0 if fresh else 2 * s**3  # Q @ P
        fresh = False
        if t == steps:
            break
        if t in restarts:
            fresh = True
        else:
            small += 2 * 2 * s**3  # P @ (R @ P)
    return long_side + small


#: Measured fraction of the bf16 matmul rate each Newton–Schulz kernel reaches, compiled as
#: ``compiled_orthogonalize`` compiles it, counting the FLOPs of ``ns_flops``: the cost model's
#: parameters. From the 1xH200 microbenchmark of 2026-12-01 (docs/benchmarks.md, "Performance II":
#: torch 2.11, inductor default mode, dynamic shapes; 16x5440x2048 and 16x2048x5440): the standard
#: quintic (plain form) 75% and 74%, Gram Newton–Schulz (fp16) 75% and 74%. Polar Express runs the
#: standard kernel. Re-measure with ``python benchmarks/step_time.py --optimizers '' --ns-micro``
#: when ``COMPILE_MODE``/``QUINTIC_FORM`` change.
NS_EFFICIENCY: dict[str, float] = {"standard": 0.745, "gram": 0.745}


def _gram_pays(s: int, l: int, steps: int) -> bool:
    # gram_time < standard_time with time = FLOPs / (efficiency * rate); integer arithmetic (the
    # efficiencies as a ratio of ints), so under torch.compile's dynamic shapes the choice is an
    # integer guard on the symbolic sizes.
    ratio = Fraction(NS_EFFICIENCY["standard"] / NS_EFFICIENCY["gram"]).limit_denominator(1000)
    return _gram_flops(s, l, steps) * ratio.numerator < _standard_flops(s, l, steps) * ratio.denominator


def ns_kernel(m: int, n: int, steps: int, method: str = "standard") -> str:
    """The kernel ``orthogonalize(x, method, steps)`` runs on an ``(..., m, n)`` input: the per-shape
    choice of the cost model.

    ``"polar_express"`` and ``"standard"`` run themselves. ``"gram"`` runs ``gram_newton_schulz``
    where its predicted time is below the standard kernel's, else the standard quintic (the same
    polynomial either way): predicted time = ``ns_flops`` of the kernel / (``NS_EFFICIENCY`` of the
    kernel x matmul rate), the efficiencies measured on one H200. With equal efficiencies that is
    ``max(m, n) > 1.5 min(m, n)`` at 5 steps (``8 s^2 l + 28 s^3 < 20 s^2 l + 10 s^3``).

    Args:
        m, n: matrix shape, >= 1. steps: >= 1. method: one of ``NS_METHODS``.

    Returns:
        ``"standard"``, ``"gram"`` or ``"polar_express"``.

    Raises:
        ValueError: bad ``method`` (names the allowed values), ``steps``, ``m`` or ``n``.
    """
    _check_method(method)
    _check_steps(steps)
    _check_dims(m=m, n=n)
    if method == "gram" and not _gram_pays(min(m, n), max(m, n), steps):
        return "standard"
    return method


def ns_seconds(m: int, n: int, steps: int, method: str = "standard", batch: int = 1,
               matmul_tflops: float = 1.0) -> float:
    """Predicted seconds of one ``orthogonalize(x, method, steps)`` call on a ``(batch, m, n)`` input:
    ``ns_flops / (NS_EFFICIENCY[ns_kernel(...)] * matmul_tflops * 1e12)``.

    Args:
        m, n, steps, method, batch: as ``ns_flops``. matmul_tflops: the device's measured dense
            matmul rate in TFLOP/s (> 0; ``benchmarks/step_time.py`` measures it on 8192^3 bf16).

    Returns:
        A ``float`` (seconds).

    Raises:
        ValueError: as ``ns_flops``, or ``matmul_tflops`` not > 0.
    """
    if not matmul_tflops > 0:
        raise ValueError(f"matmul_tflops must be > 0, got {matmul_tflops!r}")
    kernel = ns_kernel(m, n, steps, method)
    return ns_flops(m, n, steps, method, batch) / (NS_EFFICIENCY["gram" if kernel == "gram" else "standard"]
                                                    * matmul_tflops * 1e12)


def _check_dims(**dims: int) -> None:
    for name, v in dims.items():
        lo = 0 if name == "batch" else 1
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


def ns_flops(m: int, n: int, steps: int, method: str = "standard", batch: int = 1) -> int:
    """Matmul FLOPs of one ``orthogonalize(x, method, steps)`` call on a ``(batch, m, n)`` input.

    Each matmul of ``(p, k) @ (k, q)`` counts ``2 p k q``; element-wise work is not counted. With
    ``s = min(m, n)`` and ``l = max(m, n)`` (the wide orientation ``orthogonalize`` works in):

    * standard, polar_express: ``steps * (4 s^2 l + 2 s^3)`` (3 matmuls per iteration).
    * gram: what ``gram_newton_schulz`` does: ``4 s^2 l`` (first Gram product and final ``Q X``)
      ``+ 4 s^2 l`` per restart, plus per iteration ``2 s^3`` (``R^2``), ``2 s^3`` (``Q P``, not
      right after a (re)start) and ``4 s^3`` (``P R P``, not before a restart or at the end).
      For 5 steps: ``8 s^2 l + 28 s^3``. Where the cost model (``ns_kernel``) picks the standard
      kernel instead (``l <= 1.5 s`` at 5 steps with the measured efficiencies),
      ``orthogonalize`` runs it and this returns the standard count.

    Used by the owner-balancing plan and the benchmarks.

    Args:
        m, n: matrix shape, >= 1. steps: >= 1. method: one of ``NS_METHODS``. batch: >= 0.

    Returns:
        An ``int``.

    Raises:
        ValueError: bad ``method`` (names the allowed values), ``steps``, ``m``, ``n`` or ``batch``.
    """
    _check_method(method)
    _check_steps(steps)
    _check_dims(m=m, n=n, batch=batch)
    s, l = min(m, n), max(m, n)
    if ns_kernel(m, n, steps, method) == "gram":
        return batch * _gram_flops(s, l, steps)
    return batch * _standard_flops(s, l, steps)


# ----------------------------------------------------------------------------------------------
# entry point
# ----------------------------------------------------------------------------------------------
def orthogonalize(
    x: torch.Tensor, method: str = "standard", steps: int = 5, dtype: torch.dtype | None = None,
    form: str | None = None,
) -> torch.Tensor:
    """Approximate polar factor ``U V^T`` of every matrix in ``x`` (``x = U S V^T``, reduced SVD).

    Steps: ``X = x / (k ||x||_F)`` per matrix in fp32 (fp64 for fp64 input), with ``k = 1.01`` for
    polar_express (the paper's normalization) and 1 otherwise, computed scale-safely (``_normalize``:
    the same result for any rescaling of ``x`` whose entries stay normal numbers, so Muon's update does not
    depend on the loss scale), cast to the compute dtype (a zero matrix stays zero: zeros out, never
    NaN); transpose to wide orientation when
    ``m > n``; run the kernel; transpose back. Methods:

    * ``"standard"``: ``newton_schulz_quintic`` (https://kellerjordan.github.io/posts/muon/).
    * ``"gram"``: ``gram_newton_schulz`` (https://tridao.me/blog/2026/gram-newton-schulz/) where the
      cost model predicts it faster than the standard kernel (``ns_kernel``: FLOPs over measured
      efficiency; ``max(m,n) > 1.5 min(m,n)`` at 5 steps), else the standard kernel: the same
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
    _check_method(method)
    _check_steps(steps)
    form = _check_form(form)
    _check_matrix(x)
    dtype = x.dtype if dtype is None else dtype
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")

    X = _normalize(x, _NORM_SCALE[method]).to(dtype)

    m, n = x.shape[-2], x.shape[-1]
    tall = m > n
    if tall:
        X = X.mT
    s, l = min(m, n), max(m, n)
    # An enclosing torch.autocast region (an optimizer step called inside the user's autocast) would
    # otherwise run the matmuls in its own dtype, not in ``dtype``.
    with torch.autocast(device_type=x.device.type, enabled=False):
        if method == "standard" or (method == "gram" and not _gram_pays(s, l, steps)):
            out = newton_schulz_quintic(X, steps, form)
        elif method == "gram":
            out = gram_newton_schulz(X, steps)
        else:
            out = polar_express(X, steps, form)
    return out.mT if tall else out


def _normalize(x: torch.Tensor, k: float) -> torch.Tensor:
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


#: Graphs ds_muon's compiled Newton–Schulz may hold per (method, steps, dtype) before torch.compile
#: gives up (``torch._dynamo.config.recompile_limit``, 8 by default, is per code object and shared
#: by every compiled ``orthogonalize``). Each call of the compiled function raises the limit to this
#: value for itself only (``torch._dynamo.config.patch``), so the rest of the user's program keeps
#: its own setting.
COMPILE_GRAPH_LIMIT = 64


_DEFAULT = "default"  # compiled_orthogonalize: "use the module-level setting"


def compiled_orthogonalize(method: str = "standard", steps: int = 5, dtype: torch.dtype | None = None,
                           backend: str = "inductor", *, mode: str | None = _DEFAULT,
                           dynamic: bool | None = _DEFAULT, form: str | None = None):
    """``orthogonalize`` with ``method``, ``steps``, ``dtype`` and ``form`` fixed, compiled by ``torch.compile``.

    By default (``COMPILE_DYNAMIC``) compiled with dynamic shapes, so a new batch count or matrix shape
    mostly reuses a graph; torch
    still specializes on a batch of 1 against more, square against rectangular, wide against tall,
    and for ``"gram"`` on whether the Gram kernel pays (``ns_kernel``), so a model's set of shapes
    needs a handful of graphs (with ``dynamic=False``: one graph per input shape). torch.compile's
    default ``recompile_limit`` (8) is shared by every
    compiled function of the process and was hit in practice (it then silently falls back to
    eager); each call here runs under ``recompile_limit = COMPILE_GRAPH_LIMIT`` instead (see
    there). ``benchmarks/step_time.py`` counts the graphs. The compiled region fuses the
    normalization (no fp32 copy of the whole batch) and the element-wise parts of each iteration
    around the matmuls. Meant for accelerators. One compiled function per distinct argument tuple
    (cached).

    Args:
        method, steps, dtype, form: as ``orthogonalize``'s (``form`` ``None``: ``QUINTIC_FORM``).
        backend: ``torch.compile``'s backend (the tests use ``"eager"``, which has the same guards
            and compiles in milliseconds).
        mode: ``torch.compile``'s ``mode`` (inductor only), e.g. ``"max-autotune-no-cudagraphs"``;
            default ``COMPILE_MODE``.
        dynamic: ``torch.compile``'s ``dynamic``; default ``COMPILE_DYNAMIC``.

    Returns:
        ``fn(x) -> tensor`` with ``orthogonalize``'s contract.

    Raises:
        ValueError: bad ``method``, ``steps`` or ``form`` (checked eagerly here), or a ``mode`` with
            a backend other than inductor.
    """
    _check_method(method)
    _check_steps(steps)
    form = _check_form(form)
    mode = COMPILE_MODE if mode == _DEFAULT else mode
    dynamic = COMPILE_DYNAMIC if dynamic == _DEFAULT else dynamic
    if mode is not None and backend != "inductor":
        raise ValueError(f"a torch.compile mode ({mode!r}) needs backend='inductor', got {backend!r}")
    return _compiled(method, steps, dtype, backend, mode, dynamic, form)


@functools.lru_cache(maxsize=None)
def _compiled(method: str, steps: int, dtype: torch.dtype | None, backend: str, mode: str | None,
              dynamic: bool | None, form: str):
    compiled = torch.compile(functools.partial(orthogonalize, method=method, steps=steps, dtype=dtype, form=form),
                             dynamic=dynamic, backend=backend, mode=mode)

    # torch < 2.7 calls the limit cache_size_limit
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"

    def fn(x: torch.Tensor) -> torch.Tensor:
        with torch._dynamo.config.patch(**{limit: COMPILE_GRAPH_LIMIT}):
            return compiled(x)

    return fn


compiled_orthogonalize.cache_clear = _compiled.cache_clear  # type: ignore[attr-defined]
