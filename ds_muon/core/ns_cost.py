"""Newton–Schulz cost model: matmul FLOPs per call and the per-shape kernel choice (pure integers).

No torch: the owner plan (:mod:`ds_muon.sharded.ownership`), the matrix views
(:meth:`ds_muon.core.matrix.MatrixView.cost`) and the benchmarks import it without a tensor library,
and under ``torch.compile``'s dynamic shapes the Gram/standard choice is an integer guard. The kernels
themselves are in :mod:`ds_muon.core.newton_schulz`.

Sources: Keller Jordan's quintic (https://kellerjordan.github.io/posts/muon/), Gram Newton–Schulz
(Zhang, Amsel, Chen, Dao, https://tridao.me/blog/2026/gram-newton-schulz/), Polar Express
(arXiv:2505.16932).
"""
from __future__ import annotations

from fractions import Fraction

__all__ = ["NS_METHODS", "NS_EFFICIENCY", "FORM_RELATIVE_RATE", "QUINTIC_FORMS", "DEFAULT_QUINTIC_FORM", "SYM_BLOCKS",
           "SYM2_MIN_ROWS", "check_method", "check_steps", "check_dims", "resolve_form", "gram_pays",
           "gram_restart_points", "ns_flops", "ns_kernel", "ns_seconds", "block_row_cuts", "symmetric_product_flops"]

NS_METHODS: tuple[str, ...] = ("standard", "gram", "polar_express")
#: How the standard and Polar Express quintics can be written (:data:`ds_muon.core.newton_schulz.QUINTIC_FORMS`
#: says how each one computes); here for the FLOP count, which the ``sym`` forms change. ``"auto"`` picks one of the
#: others per matrix shape (:func:`resolve_form`).
QUINTIC_FORMS: tuple[str, ...] = ("auto", "plain", "fused", "sym2", "sym4")
#: The form ``orthogonalize`` uses when none is given (``ds_muon.core.newton_schulz.QUINTIC_FORM`` starts as this)
#: and the one the owner plan's cost counts (:meth:`ds_muon.core.matrix.MatrixView.cost`).
DEFAULT_QUINTIC_FORM: str = "auto"
#: Block rows of each of a ``sym`` form's two symmetric products (:func:`ds_muon.core.newton_schulz.symmetric_product`).
SYM_BLOCKS: dict[str, int] = {"sym2": 2, "sym4": 4}
#: ``"auto"`` runs ``sym2`` where the matrix's short side (the ``(s, s)`` products' size) is at least this, ``plain``
#: below. Measured on one H100 (torch 2.11, bf16, 5 steps, static shapes; docs/benchmarks.md, "Issue 40: 2.9B's gap
#: split, MoE-1.5B's host time, the symmetric Newton–Schulz forms"): at
#: ``s = 3072`` ``sym2`` took 114.98 / 117.28 / 57.64 ms against ``plain``'s 126.59 / 130.61 / 64.88 ms on 2.9B's
#: ``96x3072x3072`` / ``48x8192x3072`` / ``24x3072x8192`` (9-11% less; ``sym4`` 2.5% slower at ``3072x3072``),
#: and 2.9B's whole step 0.720 against 0.749 s (3 rotated rounds). At ``s = 2048`` (934M's and MoE-1.5B's shapes,
#: section "Issue 40: the reduce bucket in three rounds") ``sym2`` took 24.56 / 23.28 / 11.57 / 58.84 ms against
#: 25.50 / 26.30 / 12.90 / 62.86 ms on ``64x2048x2048`` / ``32x5440x2048`` / ``16x2048x5440`` / ``128x2816x2048``
#: (4-11% less), and at ``s = 1408`` (``128x2048x1408``) 23.00 against 22.94 ms (no gain), so ``plain`` stays
#: below 2048.
SYM2_MIN_ROWS: int = 2048

# Gram NS restarts after iteration 2 (the blog's choice for 5 steps), then every 3 iterations.
_GRAM_FIRST_RESTART = 2
_GRAM_RESTART_PERIOD = 3


def check_method(method: str) -> None:
    """Raise ValueError (naming the allowed values) unless ``method`` is one of :data:`NS_METHODS`."""
    if method not in NS_METHODS:
        raise ValueError(f"ns method must be one of {NS_METHODS}, got {method!r}")


def check_steps(steps: int) -> None:
    """Raise ValueError unless ``steps`` is an int >= 1."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")


def gram_restart_points(steps: int) -> tuple[int, ...]:
    """Iterations after which ``gram_newton_schulz`` restarts (``X <- Q X``, recompute ``X X^T``).

    After iteration 2 (the Gram NS blog's choice for 5 steps, https://tridao.me/blog/2026/gram-newton-schulz/),
    then every 3 iterations; never after the last one. ``steps=5`` -> ``(2,)``; ``steps=8`` -> ``(2, 5)``.

    Raises:
        ValueError: ``steps`` is not an int >= 1.
    """
    check_steps(steps)
    return tuple(range(_GRAM_FIRST_RESTART, steps, _GRAM_RESTART_PERIOD))


def resolve_form(form: str, m: int, n: int) -> str:
    """The quintic form that ``form`` means for an ``(m, n)`` matrix: ``"auto"`` is ``"sym2"`` where
    ``min(m, n) >= SYM2_MIN_ROWS`` and ``"plain"`` below; any other form is itself. Plain integers, so also a guard
    on ``torch.compile``'s symbolic sizes.

    Raises:
        ValueError: ``form`` not in :data:`QUINTIC_FORMS` (the message names them).
    """
    if form not in QUINTIC_FORMS:
        raise ValueError(f"quintic form must be one of {QUINTIC_FORMS}, got {form!r}")
    if form != "auto":
        return form
    return "sym2" if min(m, n) >= SYM2_MIN_ROWS else "plain"


def block_row_cuts(s: int, blocks: int) -> list[int]:
    """Where ``symmetric_product`` cuts ``s`` rows into ``k = min(blocks, s)`` block rows: ``[s * i // k for i in
    0..k]`` (sizes differ by at most one row). Shared with :func:`symmetric_product_flops`, so the count is of the
    same blocks; plain integer arithmetic, also on ``torch.compile``'s symbolic sizes."""
    k = min(blocks, s)
    return [s * i // k for i in range(k + 1)]


def symmetric_product_flops(s: int, inner: int, blocks: int) -> int:
    """Matmul FLOPs of ``symmetric_product`` of two ``(s, inner)`` matrices cut into ``blocks`` block rows
    (:func:`block_row_cuts`): block row ``[lo, hi)`` multiplies against rows ``lo:``, ``2 (hi - lo) (s - lo) inner``;
    about ``(k + 1) / (2 k)`` of the full product's ``2 s^2 inner``."""
    cuts = block_row_cuts(s, blocks)
    return sum(2 * (hi - lo) * (s - lo) * inner for lo, hi in zip(cuts[:-1], cuts[1:]))


def _standard_flops(s: int, l: int, steps: int, form: str = "plain") -> int:
    # per iteration: X X^T (s*s*l), A @ A (s^3), B @ X (s*s*l); a sym form takes the first two from upper blocks
    blocks = SYM_BLOCKS.get(form)
    if blocks is None:
        return steps * (2 * s * s * l + 2 * s**3 + 2 * s * s * l)
    return steps * (symmetric_product_flops(s, l, blocks) + symmetric_product_flops(s, s, blocks) + 2 * s * s * l)


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
#: parameters. From the 1xH200 microbenchmark in docs/benchmarks.md ("Performance II":
#: torch 2.11, inductor default mode, dynamic shapes; 16x5440x2048 and 16x2048x5440): the standard
#: quintic (plain form) 75% and 74%, Gram Newton–Schulz (fp16) 75% and 74%. Polar Express runs the
#: standard kernel. The standard value is the ``plain`` form's (measured in it; the ``auto`` form runs ``sym2`` at
#: these shapes since :data:`SYM2_MIN_ROWS` is 2048); a ``sym`` form's is it times :data:`FORM_RELATIVE_RATE`.
#: Re-measure with ``python benchmarks/step_time.py --optimizers '' --ns-micro`` when ``COMPILE_MODE`` or
#: ``QUINTIC_FORM`` change.
NS_EFFICIENCY: dict[str, float] = {"standard": 0.745, "gram": 0.745}
#: A ``sym`` form's FLOP rate as a fraction of the ``plain`` form's on the same shapes (its smaller matmuls run
#: slower): the FLOPs' ratio over the time's, on one H100 over 2.9B's three shapes at ``s = 3072`` (the microbenchmark
#: that set the first :data:`SYM2_MIN_ROWS`): ``sym2`` 0.847 / 0.900 (289.9 against 322.1 ms), ``sym4`` 0.770 / 0.964
#: (310.6 ms). At ``s = 2048`` ``sym2``'s rate is 0.87-0.97 of ``plain``'s (its time 0.885-0.963 of ``plain``'s),
#: which this single value does not follow: it only weighs Gram's choice and the cost model's seconds.
FORM_RELATIVE_RATE: dict[str, float] = {"sym2": 0.941, "sym4": 0.799}


def _standard_efficiency(m: int, n: int, form: str = DEFAULT_QUINTIC_FORM) -> float:
    """``NS_EFFICIENCY["standard"]`` in the form ``form`` resolves to for ``(m, n)``."""
    return NS_EFFICIENCY["standard"] * FORM_RELATIVE_RATE.get(resolve_form(form, m, n), 1.0)


def gram_pays(s: int, l: int, steps: int, form: str = DEFAULT_QUINTIC_FORM) -> bool:
    """Whether Gram Newton–Schulz is predicted faster than the standard kernel on ``(s, l)`` (``s <= l``).

    Predicted time = FLOPs / measured efficiency (:data:`NS_EFFICIENCY`); the standard kernel counted in the form
    it would run (``form`` resolved for ``(s, l)``, with :data:`FORM_RELATIVE_RATE`). At 5 steps that is
    ``l > 1.5 s`` where the form is ``plain`` and ``l > 1.89 s`` where it is ``sym2``.
    """
    # gram_time < standard_time with time = FLOPs / (efficiency * rate); integer arithmetic (the
    # efficiencies as a ratio of ints), so under torch.compile's dynamic shapes the choice is an
    # integer guard on the symbolic sizes.
    form = resolve_form(form, s, l)
    ratio = Fraction(_standard_efficiency(s, l, form) / NS_EFFICIENCY["gram"]).limit_denominator(1000)
    return _gram_flops(s, l, steps) * ratio.numerator < _standard_flops(s, l, steps, form) * ratio.denominator


def ns_kernel(m: int, n: int, steps: int, method: str = "standard", form: str = DEFAULT_QUINTIC_FORM) -> str:
    """The kernel ``orthogonalize(x, method, steps)`` runs on an ``(..., m, n)`` input: the per-shape
    choice of the cost model.

    ``"polar_express"`` and ``"standard"`` run themselves. ``"gram"`` runs ``gram_newton_schulz``
    where its predicted time is below the standard kernel's, else the standard quintic (the same
    polynomial either way): predicted time = ``ns_flops`` of the kernel / (``NS_EFFICIENCY`` of the
    kernel x matmul rate), the efficiencies measured on one H200. With equal efficiencies that is
    ``max(m, n) > 1.5 min(m, n)`` at 5 steps (``8 s^2 l + 28 s^3 < 20 s^2 l + 10 s^3``) against the ``plain``
    form, and ``> 1.89 min(m, n)`` against ``sym2`` (:func:`gram_pays`).

    Args:
        m, n: matrix shape, >= 1. steps: >= 1. method: one of ``NS_METHODS``. form: the quintic form the
            standard kernel would run in (one of :data:`QUINTIC_FORMS`).

    Returns:
        ``"standard"``, ``"gram"`` or ``"polar_express"``.

    Raises:
        ValueError: bad ``method`` (names the allowed values), ``steps``, ``m`` or ``n``.
    """
    check_method(method)
    check_steps(steps)
    check_dims(m=m, n=n)
    if method == "gram" and not gram_pays(min(m, n), max(m, n), steps, form):
        return "standard"
    return method


def ns_seconds(m: int, n: int, steps: int, method: str = "standard", batch: int = 1,
               matmul_tflops: float = 1.0, form: str = DEFAULT_QUINTIC_FORM) -> float:
    """Predicted seconds of one ``orthogonalize(x, method, steps)`` call on a ``(batch, m, n)`` input:
    ``ns_flops / (NS_EFFICIENCY[ns_kernel(...)] * matmul_tflops * 1e12)``, the standard kernel's efficiency in the
    form it runs (times :data:`FORM_RELATIVE_RATE` for a ``sym`` form).

    Args:
        m, n, steps, method, batch, form: as ``ns_flops``. matmul_tflops: the device's measured dense
            matmul rate in TFLOP/s (> 0; ``benchmarks/step_time.py`` measures it on 8192^3 bf16).

    Returns:
        A ``float`` (seconds).

    Raises:
        ValueError: as ``ns_flops``, or ``matmul_tflops`` not > 0.
    """
    if not matmul_tflops > 0:
        raise ValueError(f"matmul_tflops must be > 0, got {matmul_tflops!r}")
    kernel = ns_kernel(m, n, steps, method, form)
    efficiency = NS_EFFICIENCY["gram"] if kernel == "gram" else _standard_efficiency(m, n, form)
    return ns_flops(m, n, steps, method, batch, form) / (efficiency * matmul_tflops * 1e12)


def check_dims(**dims: int) -> None:
    """Raise ValueError unless each dim is an int >= 1 (``batch``: >= 0), naming it."""
    for name, v in dims.items():
        lo = 0 if name == "batch" else 1
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


def ns_flops(m: int, n: int, steps: int, method: str = "standard", batch: int = 1,
             form: str = DEFAULT_QUINTIC_FORM) -> int:
    """Matmul FLOPs of one ``orthogonalize(x, method, steps, form=form)`` call on a ``(batch, m, n)`` input.

    Each matmul of ``(p, k) @ (k, q)`` counts ``2 p k q``; element-wise work is not counted. With
    ``s = min(m, n)`` and ``l = max(m, n)`` (the wide orientation ``orthogonalize`` works in):

    * standard, polar_express: ``steps * (4 s^2 l + 2 s^3)`` (3 matmuls per iteration) in the forms
      ``plain`` and ``fused``; the ``sym`` forms (:data:`SYM_BLOCKS`) take ``X X^T`` and ``(cA + bI) A`` from
      their upper block rows, :func:`symmetric_product_flops` each, plus ``2 s^2 l`` for ``P X``.
    * gram: what ``gram_newton_schulz`` does: ``4 s^2 l`` (first Gram product and final ``Q X``)
      ``+ 4 s^2 l`` per restart, plus per iteration ``2 s^3`` (``R^2``), ``2 s^3`` (``Q P``, not
      right after a (re)start) and ``4 s^3`` (``P R P``, not before a restart or at the end).
      For 5 steps: ``8 s^2 l + 28 s^3``. Where the cost model (``ns_kernel``) picks the standard
      kernel instead (``l <= 1.5 s`` at 5 steps with the measured efficiencies, ``1.89 s`` against ``sym2``),
      ``orthogonalize`` runs it and this returns the standard count.

    Used by the owner-balancing plan (counting :data:`DEFAULT_QUINTIC_FORM`) and the benchmarks.

    Args:
        m, n: matrix shape, >= 1. steps: >= 1. method: one of ``NS_METHODS``. batch: >= 0.
        form: one of :data:`QUINTIC_FORMS` (the Gram kernel has one way only; ``"auto"``: the form
            :func:`resolve_form` picks for ``(m, n)``).

    Returns:
        An ``int``.

    Raises:
        ValueError: bad ``method`` or ``form`` (names the allowed values), ``steps``, ``m``, ``n`` or ``batch``.
    """
    check_method(method)
    check_steps(steps)
    check_dims(m=m, n=n, batch=batch)
    form = resolve_form(form, m, n)
    s, l = min(m, n), max(m, n)
    if ns_kernel(m, n, steps, method, form) == "gram":
        return batch * _gram_flops(s, l, steps)
    return batch * _standard_flops(s, l, steps, form)
