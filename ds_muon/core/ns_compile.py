"""``torch.compile`` of Newton–Schulz: the owner step's compiled ``orthogonalize`` (layer ``core``).

The default is inductor's default mode with static shapes (one graph per call shape: 84-87% of the
matmul rate on one H200 against 77-79% with dynamic shapes, docs/benchmarks.md, "Issue 27, items 3–5");
``ns_autotune`` selects heavyball's settings (:data:`AUTOTUNE_COMPILE`). Every compiled call raises
torch.compile's recompile limit for itself only (:data:`COMPILE_GRAPH_LIMIT`), so it never silently
falls back to eager while the rest of the user's program keeps its own setting.
"""
from __future__ import annotations

import functools
import os
import sys
import time

import torch

from .newton_schulz import check_form, orthogonalize
from .ns_cost import check_method, check_steps

__all__ = ["COMPILE_MODE", "COMPILE_DYNAMIC", "AUTOTUNE_COMPILE", "COMPILE_GRAPH_LIMIT", "INDUCTOR_OPTIONS",
           "compile_in_process", "compiled_orthogonalize", "AUTOTUNE_PROGRESS", "persistent_inductor_cache"]

#: ``torch.compile`` ``mode`` and ``dynamic`` of ``compiled_orthogonalize`` when none is given (the
#: owner step's Newton–Schulz). ``None``/``False``: inductor's default mode, static shapes (one graph per
#: ``(batch, rows, cols)``, about 1-8 s of compiling each on first use, cuBLAS matmuls). Measured on one
#: H200 (bf16, 5 steps, the 934M shapes 16x2048x2048, 16x5440x2048, 16x2048x5440; docs/benchmarks.md,
#: "Issue 27, items 3–5"): 87.1 / 83.8 / 84.9% of the matmul rate static against 79.0 / 78.2 / 77.7% dynamic, the
#: same orthogonality error. heavyball compiles its Newton–Schulz with ``"max-autotune-no-cudagraphs"``
#: and static shapes (inductor benchmarks Triton matmul templates against cuBLAS per shape and can fuse
#: the element-wise work into the matmuls' epilogues); the microbenchmark times both.
COMPILE_MODE: str | None = None
COMPILE_DYNAMIC: bool | None = False
#: ``compiled_orthogonalize``'s ``mode``/``dynamic`` with the config key ``ns_autotune`` (opt-in):
#: heavyball's settings. Measured on one H200 (docs/benchmarks.md, bf16, 5 steps): 83-85% of the
#: matmul rate against 77-80% with the former dynamic-shape default ("Performance II"); later 86.1% on
#: 16x2048x2048 against 87.1% with the static-shape default ("Issue 27, items 3–5"), at the price of 19.9 s of
#: autotuning for that graph on a cold start (2.9 s from the warm cache).
AUTOTUNE_COMPILE: dict = {"mode": "max-autotune-no-cudagraphs", "dynamic": False}

#: Graphs ds_muon's compiled Newton–Schulz may hold per (method, steps, dtype) before torch.compile
#: gives up (``torch._dynamo.config.recompile_limit``, 8 by default, is per code object and shared
#: by every compiled ``orthogonalize``). Each call of the compiled function raises the limit to this
#: value for itself only (``torch._dynamo.config.patch``), so the rest of the user's program keeps
#: its own setting.
COMPILE_GRAPH_LIMIT = 64


_DEFAULT = "default"  # compiled_orthogonalize: "use the module-level setting"

#: Inductor options of every graph ds_muon compiles in inductor's default mode: ``compile_threads`` 1, so inductor
#: compiles ds_muon's few Triton kernels in the training process instead of starting its compile-worker pool (a
#: sidecar process, ``python -m torch._inductor.compile_worker``, that forks one worker per core). ds_muon compiles
#: on its first optimizer step, so that pool started in the middle of training and took a core while the next
#: steps ran: on one H200 (934M, W=1; docs/benchmarks.md, "Issue 40, item 1") the sidecar used 100% of a core through
#: every timed fwd+bwd in 3 of 5 runs of a compiled arm and none of the uncompiled ones, and those runs' fwd+bwd
#: was 0.229-0.296 s against 0.184-0.225 s.
INDUCTOR_OPTIONS: dict = {"compile_threads": 1}


def compile_in_process(fn, backend: str = "inductor", mode: str | None = None, **kwargs):
    """``torch.compile(fn, backend=backend, mode=mode, **kwargs)``; with inductor in its default mode (``mode`` None)
    also ``options=INDUCTOR_OPTIONS`` (:data:`INDUCTOR_OPTIONS`: no compile-worker processes). A ``mode`` (the
    opt-in ``ns_autotune``) keeps inductor's worker pool, which compiles the autotuning candidates in parallel.

    Returns:
        the compiled callable (compiles lazily, on its first call, as ``torch.compile`` does).
    """
    if backend == "inductor" and mode is None:
        return torch.compile(fn, backend=backend, options=dict(INDUCTOR_OPTIONS), **kwargs)
    return torch.compile(fn, backend=backend, mode=mode, **kwargs)

#: Where inductor's caches go when ``ns_autotune`` is on and the user has not chosen
#: (``TORCHINDUCTOR_CACHE_DIR`` unset): ``$XDG_CACHE_HOME/ds_muon/torchinductor`` (``~/.cache/...``), which
#: survives reboots, unlike inductor's own default under ``/tmp``.
CACHE_SUBDIR = os.path.join("ds_muon", "torchinductor")


def persistent_inductor_cache() -> str:
    """Point inductor's on-disk caches at a persistent directory unless the user chose one; return the directory.

    With static shapes and ``max-autotune`` every Newton–Schulz call shape costs seconds to a minute of
    Triton autotuning on its first compile. Inductor caches the compiled graph (FX graph cache, which
    holds the autotuned kernel choice), the autotuning results (``autotune_local_cache``) and the Triton
    binaries under ``TORCHINDUCTOR_CACHE_DIR`` (Triton's under ``<dir>/triton`` unless ``TRITON_CACHE_DIR``
    is set), so a second start with the same shapes, torch and GPU only re-traces (seconds). Inductor's
    default directory is under ``/tmp``; this sets ``TORCHINDUCTOR_CACHE_DIR`` to
    ``$XDG_CACHE_HOME/ds_muon/torchinductor`` (default ``~/.cache/ds_muon/torchinductor``) when it is unset,
    before the first compile, and turns the two local caches on. An existing ``TORCHINDUCTOR_CACHE_DIR``
    (the user's, or the one inductor fixed on an earlier compile in this process) is kept.
    """
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        current = os.path.join(base, CACHE_SUBDIR)
        try:
            os.makedirs(current, exist_ok=True)
        except OSError:  # read-only home: inductor's own default stays in force
            return ""
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = current
    from torch._inductor import config as inductor_config
    inductor_config.fx_graph_cache = True
    inductor_config.autotune_local_cache = True
    return current


class AutotuneProgress:
    """Progress lines of the static-shape (``ns_autotune``) Newton–Schulz compiles, on rank 0 (stderr).

    ``expect(n)`` (the integration layer, from the owner plan's distinct call shapes of this rank) gives the
    total; each first call of a new shape prints ``ds_muon ns_autotune: compiling Newton-Schulz graph k/n for
    (batch, rows, cols) dtype ...`` before it compiles and ``... done in s; m left`` after.
    """

    def __init__(self) -> None:
        self.expected: int | None = None
        self.seen: set = set()
        self.stream = sys.stderr

    def expect(self, n: int) -> None:
        """The number of distinct call shapes this process will compile (None: unknown)."""
        self.expected = n

    def _print(self, text: str) -> None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return
        print(f"ds_muon ns_autotune: {text}", file=self.stream, flush=True)

    def call(self, key: tuple, run):
        """``run()``; around its first call for ``key`` (a shape, dtype, method), the two progress lines."""
        if key in self.seen:
            return run()
        self.seen.add(key)
        k, n = len(self.seen), self.expected
        total = f"/{n}" if n else ""
        where = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "inductor's default cache")
        self._print(f"compiling Newton-Schulz graph {k}{total} for {key[0]} {key[1]} {key[2]} (first use: Triton "
                    f"autotuning, seconds to a minute; cached in {where})")
        t0 = time.perf_counter()
        out = run()
        left = f"; {max(0, n - k)} left" if n else ""
        self._print(f"graph {k}{total} done in {time.perf_counter() - t0:.1f} s{left}")
        return out


#: The progress of this process's ``ns_autotune`` compiles (see :class:`AutotuneProgress`).
AUTOTUNE_PROGRESS = AutotuneProgress()


def compiled_orthogonalize(method: str = "standard", steps: int = 5, dtype: torch.dtype | None = None,
                           backend: str = "inductor", *, mode: str | None = _DEFAULT,
                           dynamic: bool | None = _DEFAULT, form: str | None = None):
    """``orthogonalize`` with ``method``, ``steps``, ``dtype`` and ``form`` fixed, compiled by ``torch.compile``.

    By default (``COMPILE_DYNAMIC``) compiled with static shapes: one graph per input shape, which inductor
    specializes (faster kernels: see ``COMPILE_DYNAMIC``); a model's Muon matrices have a handful of shapes
    and each owner rank a handful of batch counts. With ``dynamic=True`` a new batch count or matrix shape
    mostly reuses a graph; torch still specializes on a batch of 1 against more, square against
    rectangular, wide against tall, and for ``"gram"`` on whether the Gram kernel pays (``ns_kernel``). torch.compile's
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
    check_method(method)
    check_steps(steps)
    form = check_form(form)
    mode = COMPILE_MODE if mode == _DEFAULT else mode
    dynamic = COMPILE_DYNAMIC if dynamic == _DEFAULT else dynamic
    if mode is not None and backend != "inductor":
        raise ValueError(f"a torch.compile mode ({mode!r}) needs backend='inductor', got {backend!r}")
    return _compiled(method, steps, dtype, backend, mode, dynamic, form)


@functools.lru_cache(maxsize=None)
def _compiled(method: str, steps: int, dtype: torch.dtype | None, backend: str, mode: str | None,
              dynamic: bool | None, form: str):
    static_autotune = mode is not None and "autotune" in mode and not dynamic
    if static_autotune:
        persistent_inductor_cache()
    compiled = compile_in_process(functools.partial(orthogonalize, method=method, steps=steps, dtype=dtype, form=form),
                                  backend, mode, dynamic=dynamic)

    # torch < 2.7 calls the limit cache_size_limit
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"

    def call(x: torch.Tensor) -> torch.Tensor:
        with torch._dynamo.config.patch(**{limit: COMPILE_GRAPH_LIMIT}):
            return compiled(x)

    if dynamic is False and not static_autotune:
        return _static_then_dynamic(call, lambda: _compiled(method, steps, dtype, backend, mode, True, form))
    if not static_autotune:
        return call

    def fn(x: torch.Tensor) -> torch.Tensor:
        return AUTOTUNE_PROGRESS.call((tuple(x.shape), str(x.dtype).replace("torch.", ""), method),
                                      lambda: call(x))

    return fn


def _static_then_dynamic(static, dynamic):
    """``fn(x)``: ``static(x)`` for the first ``STATIC_GRAPH_CAP`` distinct ``(shape, stride, dtype)`` inputs (one
    static graph each, what torch.compile guards on), ``dynamic()(x)`` (built on first need: a handful of
    graphs for any number of shapes) for every later one, so a model with very many Newton–Schulz call shapes
    never reaches ``COMPILE_GRAPH_LIMIT``, past which torch.compile would silently run eagerly."""
    seen: set = set()
    fallback: list = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        key = (tuple(x.shape), x.stride(), x.dtype)
        if key in seen or len(seen) < STATIC_GRAPH_CAP:
            seen.add(key)
            return static(x)
        if not fallback:
            fallback.append(dynamic())
        return fallback[0](x)

    return fn


#: Distinct input shapes one statically compiled Newton–Schulz serves before it hands new shapes to its
#: dynamic-shape twin (:func:`_static_then_dynamic`); half of ``COMPILE_GRAPH_LIMIT``, which counts every graph
#: of ``orthogonalize``'s code object, so the dynamic graphs and other methods or dtypes still fit.
STATIC_GRAPH_CAP = COMPILE_GRAPH_LIMIT // 2


compiled_orthogonalize.cache_clear = _compiled.cache_clear  # type: ignore[attr-defined]
