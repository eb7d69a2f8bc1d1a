r"""Muon's update on one device: the momentum step, the scaled orthogonalization, the weight update.

Layer ``core`` (torch only), shared by the oracle (:class:`ds_muon.MuonAdamW`) and the sharded step
(:class:`ds_muon.sharded.muon_step.MuonShardStep`), so both round the momentum the same way and
compose Newton–Schulz with the update scale the same way (docs/design.md, "One optimizer step"):

.. math::
    m \leftarrow \beta m + (1-\beta) g, \quad u \leftarrow \text{nesterov} ? \mathrm{lerp}(g, m, \beta) : m, \quad
    o \leftarrow \mathrm{NS}(u) \cdot s(\text{rows}, \text{cols}), \quad p \leftarrow p (1 - \eta\lambda) - \eta o

(Keller Jordan's Muon, https://kellerjordan.github.io/posts/muon/; decoupled weight decay, Loshchilov &
Hutter, arXiv 1711.05101).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import torch

from .dtypes import MOMENTUM_DTYPES
from .matrix import update_scale
from .newton_schulz import orthogonalize
from .ns_compile import AUTOTUNE_COMPILE, compile_in_process, compiled_orthogonalize


# Elements per chunk when the momentum is stored in a narrower dtype than the gradient, or the gradient in a
# narrower one than the momentum (momentum_step_): the fp32 working copy of one chunk is the only temporary
# (64 MiB), never one of the whole shard.
CHUNK_ELEMENTS = 1 << 24


def _check_same_1d(momentum: torch.Tensor, grad: torch.Tensor) -> None:
    """Raise ValueError unless ``momentum`` and ``grad`` are 1-D of the same shape (the momentum steps' contract)."""
    if momentum.shape != grad.shape or momentum.dim() != 1:
        raise ValueError(f"momentum {tuple(momentum.shape)} and grad {tuple(grad.shape)} must be the same 1-D shape")


def momentum_update_(momentum: torch.Tensor, grad: torch.Tensor, beta: float, nesterov: bool) -> torch.Tensor:
    r"""``m <- beta m + (1 - beta) g`` and the update Newton–Schulz orthogonalizes, in place.

    .. math::
        m_{32} \leftarrow \beta\, m + (1-\beta)\, g \quad (\text{in fp32}), \qquad
        m \leftarrow \mathrm{round}(m_{32}), \qquad
        u \leftarrow \text{nesterov} \; ? \; (1-\beta)\, g + \beta\, m_{32} : m_{32}

    (Keller Jordan's Muon, https://kellerjordan.github.io/posts/muon/). With fp32 momentum the
    rounding is the identity. With bf16 momentum (``momentum_dtype: "bfloat16"``, half the
    momentum memory) the update still uses the unrounded fp32 value, so only the stored state is
    rounded (round to nearest even), and the work runs in chunks of ``CHUNK_ELEMENTS``: the fp32
    temporary is one chunk, not the shard.

    Args:
        momentum: ``(n,)`` float32 or bfloat16 momentum, updated in place.
        grad: ``(n,)`` float32 gradient; overwritten with the update ``u`` unless the momentum is
            fp32 and ``nesterov`` is off (then ``u`` is the momentum itself and ``grad`` is left as is).
        beta: momentum coefficient in ``[0, 1)``.
        nesterov: blend the gradient back in (Nesterov momentum).

    Returns:
        ``(n,)`` float32 update ``u``: ``grad`` (overwritten) or ``momentum``.

    Raises:
        ValueError: the shapes differ, ``grad`` is not float32, or the momentum dtype is not one of
            ``MOMENTUM_DTYPES``.
    """
    _check_same_1d(momentum, grad)
    if grad.dtype != torch.float32:
        raise ValueError(f"grad must be float32, got {grad.dtype}")
    if momentum.dtype == torch.float32:
        _momentum_fp32_(momentum, grad, beta, nesterov)  # the fused path compiles its twin, _momentum_graph_
        return grad if nesterov else momentum
    if momentum.dtype != torch.bfloat16:
        raise ValueError(f"momentum dtype must be one of {MOMENTUM_DTYPES}, got {momentum.dtype}")
    for start in range(0, grad.numel(), CHUNK_ELEMENTS):
        m = momentum[start:start + CHUNK_ELEMENTS]
        g = grad[start:start + CHUNK_ELEMENTS]
        m32 = m.float().lerp_(g, 1 - beta)
        m.copy_(m32)
        if nesterov:
            g.lerp_(m32, beta)
        else:
            g.copy_(m32)
    return grad


# ------------------------------------------------------------------------------------------------
# one-pass versions for accelerators (torch.compile; the ZeRO-3 step uses them on CUDA)
# ------------------------------------------------------------------------------------------------
def _momentum_fp32_(momentum: torch.Tensor, grad: torch.Tensor, beta: float, nesterov: bool) -> None:
    momentum.lerp_(grad, 1 - beta)
    if nesterov:
        grad.lerp_(momentum, beta)


def _apply_update_(param: torch.Tensor, update: torch.Tensor, decay: float, step: float) -> None:
    param.mul_(decay).add_(update, alpha=step)


# The compiled forms of the two functions above. torch.compile specializes on a Python float passed as a
# scalar argument (``alpha=``, ``lerp``'s scalar weight): it guards ``step == -0.02`` and compiles a new graph for
# every new lr or beta, so a schedule recompiles every step until the recompile limit, then runs eagerly. Here
# every float multiplies a tensor, which keeps it a symbolic graph input (torch >= 2.6 with inductor or AOT
# autograd); the temporaries fuse away in the one kernel. Same math, rounding within an ulp of the eager forms.
def _lerp_graph_(start: torch.Tensor, end: torch.Tensor, weight: float) -> None:
    # torch.lerp's own formula: start + w (end - start) for w < 0.5, else end - (end - start)(1 - w)
    if weight < 0.5:
        start.add_((end - start) * weight)
    else:
        start.copy_(end - (end - start) * (1 - weight))


def _momentum_graph_(momentum: torch.Tensor, grad: torch.Tensor, beta: float, nesterov: bool) -> None:
    _lerp_graph_(momentum, grad, 1 - beta)
    if nesterov:
        _lerp_graph_(grad, momentum, beta)


def _apply_update_graph_(param: torch.Tensor, update: torch.Tensor, decay: float, step: float) -> None:
    param.mul_(decay).add_(update * step)


def _apply_update_upcast_graph_(param: torch.Tensor, update: torch.Tensor, decay: float, step: float) -> None:
    # an update narrower than the parameter (the bf16 stash): upcast exactly before the multiply, as the fp32 update
    # the ordinary step applies holds the same values, so that ``update * step`` is not rounded to the narrow dtype
    param.mul_(decay).add_(update.to(param.dtype) * step)


@functools.lru_cache(maxsize=None)
def _compiled(fn, backend: str):
    # dynamic=True: one graph for every shard length; the functions compiled take their floats as multiplicands
    # (see _momentum_graph_), so a new lr or beta does not recompile either; compiled in this process, without
    # inductor's compile-worker pool (ns_compile.INDUCTOR_OPTIONS)
    return compile_in_process(fn, backend, dynamic=True)


def use_compiled_elementwise(setting, ns_compile: bool, device: torch.device) -> bool:
    """Whether the Muon step's element-wise passes (momentum step, update apply) run compiled
    (:func:`fused_momentum_update_`, :func:`fused_apply_update_`) on a partition held on ``device``: chosen once
    per sub-group from ``optimizer.params.elementwise_compile``.

    Args:
        setting: ``"auto"`` (compiled where Newton–Schulz is: on CUDA with ``ns_compile``), True (compiled on
            CUDA), False (eager).
        ns_compile: ``optimizer.params.ns_compile``.
        device: where the fp32 partition and its gradient live (the CPU under optimizer offload: always eager,
            inductor's CPU code is not faster there).
    """
    if device.type != "cuda":
        return False
    return bool(ns_compile) if setting == "auto" else bool(setting)


def fused_momentum_update_(momentum: torch.Tensor, grad: torch.Tensor, beta: float, nesterov: bool,
                           backend: str = "inductor") -> torch.Tensor:
    r""":func:`momentum_update_` in one pass over the shard: for fp32 momentum the momentum step and
    the Nesterov blend are one compiled kernel (``torch.compile``, dynamic shapes), which reads
    ``m`` and ``g`` once and writes both (16 bytes per element instead of 24). Same math and contract
    as :func:`momentum_update_` (fp32 rounding may differ by an ulp where the compiler contracts
    a multiply-add); bf16 momentum goes to :func:`momentum_update_` unchanged. A new ``beta`` does
    not recompile (``beta`` is a symbolic graph input).

    Args:
        momentum, grad, beta, nesterov: as :func:`momentum_update_`.
        backend: ``torch.compile``'s backend (tests use ``"eager"``: same guards, no code generation).

    Returns:
        ``(n,)`` float32 update ``u``: ``grad`` (overwritten) or ``momentum``.

    Raises:
        ValueError: as :func:`momentum_update_`.
    """
    if momentum.dtype != torch.float32 or momentum.shape != grad.shape or momentum.dim() != 1 \
            or grad.dtype != torch.float32:
        return momentum_update_(momentum, grad, beta, nesterov)  # checks, or the chunked bf16 path
    _compiled(_momentum_graph_, backend)(momentum, grad, float(beta), bool(nesterov))
    return grad if nesterov else momentum


def fused_apply_update_(param: torch.Tensor, update: torch.Tensor, lr: float, weight_decay: float,
                        backend: str = "inductor") -> None:
    r"""``p <- p (1 - lr wd) - lr o`` in place, one compiled pass (reads ``p`` and ``o`` once: 12
    bytes per element instead of 20 for ``p.mul_(1 - lr wd).add_(o, alpha=-lr)``): decoupled weight
    decay (Loshchilov & Hutter, arXiv 1711.05101) and the Muon update.

    Args:
        param: ``(n,)`` float32 shard, updated in place.
        update: ``(n,)`` scaled orthogonalized update ``o``: float32, or bfloat16 (the overlapped step's stash,
            read directly): upcast exactly inside the pass, so the result is the float32 update's bit for bit.
        lr: learning rate. weight_decay: decoupled weight decay coefficient. New values (a schedule) do not
            recompile: both enter the graph as symbolic inputs.
        backend: ``torch.compile``'s backend.
    """
    graph = _apply_update_graph_ if update.dtype == param.dtype else _apply_update_upcast_graph_
    _compiled(graph, backend)(param, update, float(1 - lr * weight_decay), float(-lr))


def apply_update_(param: torch.Tensor, update: torch.Tensor, lr: float, weight_decay: float) -> None:
    """:func:`fused_apply_update_` in eager mode (two passes; CPU and CPU offload): the same math, not compiled
    (a bfloat16 ``update`` is upcast inside ``add_``, which computes in float32: the float32 update's result)."""
    _apply_update_(param, update, 1 - lr * weight_decay, -lr)


def momentum_step_(momentum: torch.Tensor, grad: torch.Tensor, beta: float, compiled: bool,
                   backend: str = "inductor") -> None:
    r"""The momentum step alone, ``m <- beta m + (1 - beta) g`` (``m.lerp_(g, 1 - beta)``, as
    :func:`momentum_update_` and :func:`fused_momentum_update_` compute it), with ``g`` read and left as it is: for
    a step whose update ``u`` was already orthogonalized (the overlapped step's commit). ``g`` may be narrower than
    ``m`` (the bfloat16 gradient buffer, read directly): upcast exactly (in fp32 chunks of ``CHUNK_ELEMENTS`` eagerly,
    inside the compiled pass otherwise), so the momentum is the float32 gradient's bit for bit.

    Args:
        momentum: ``(n,)`` float32 momentum, updated in place. grad: ``(n,)`` float32 or bfloat16 gradient.
        beta: momentum coefficient in ``[0, 1)``. compiled: one compiled pass (accelerators,
            :func:`use_compiled_elementwise`), else eager. backend: ``torch.compile``'s backend.

    Raises:
        ValueError: the shapes differ, or the momentum is not float32.
    """
    _check_same_1d(momentum, grad)
    if momentum.dtype != torch.float32:
        raise ValueError(f"momentum_step_ takes float32 momentum, got {momentum.dtype}")
    if compiled:
        _compiled(_momentum_graph_, backend)(momentum, grad, float(beta), False)
    elif grad.dtype == torch.float32:
        _momentum_fp32_(momentum, grad, beta, False)
    else:
        for start in range(0, grad.numel(), CHUNK_ELEMENTS):
            _momentum_fp32_(momentum[start:start + CHUNK_ELEMENTS], grad[start:start + CHUNK_ELEMENTS].float(), beta,
                            False)


def set_aside(ranges: Sequence[tuple[int, int]], *flats: torch.Tensor) -> Callable[[], None]:
    """Copies of every ``(offset, length)`` range of the flat tensors ``flats``; calling the result writes them
    back. No gradient, no step: the blocks that had no gradient keep their momentum and weights through an update
    (docs/how-it-works.md, "Steps with no gradient"), in the oracle and the sharded step alike.

    Args:
        ranges: ``[(offset, length)]`` in elements. flats: 1-D tensors (momentum, weights) of any dtype.
    """
    saved = [(offset, n, [f.narrow(0, offset, n).clone() for f in flats]) for offset, n in ranges]

    def put_back() -> None:
        for offset, n, copies in saved:
            for f, copy in zip(flats, copies):
                f.narrow(0, offset, n).copy_(copy)

    return put_back


# ------------------------------------------------------------------------------------------------
# scaled orthogonalization: what Newton–Schulz hands back for one group of equal-shape blocks
# ------------------------------------------------------------------------------------------------
def scaled_orthogonalizer(method: str, steps: int, dtype: torch.dtype, mode: str, *, compiled: bool = False,
                          autotune: bool = False, out_dtype: Optional[torch.dtype] = None
                          ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn(blocks) = orthogonalize(blocks) * update_scale(rows, cols, mode)``, built once per param group.

    Args:
        method, steps: the Newton–Schulz kernel (:func:`ds_muon.core.newton_schulz.orthogonalize`).
        dtype: the Newton–Schulz compute dtype (:func:`ds_muon.core.dtypes.resolve_ns_dtype`).
        mode: the update scale, ``"shape"`` or ``"rms_match"`` (:func:`ds_muon.core.matrix.update_scale`).
        compiled: use :func:`ds_muon.core.ns_compile.compiled_orthogonalize` (accelerators); with
            ``autotune`` in heavyball's compile mode (:data:`ds_muon.core.ns_compile.AUTOTUNE_COMPILE`).
        out_dtype: cast the orthogonalized blocks to it before scaling (the oracle: float32); None keeps
            the compute dtype (the owner step: the exchange casts to the wire dtype).

    Returns:
        ``fn((..., rows, cols) tensor) -> same shape``: the scaled orthogonalized blocks.
    """
    if compiled:
        ns = compiled_orthogonalize(method, steps, dtype, **(AUTOTUNE_COMPILE if autotune else {}))
    else:
        ns = functools.partial(orthogonalize, method=method, steps=steps, dtype=dtype)

    def scaled(blocks: torch.Tensor) -> torch.Tensor:
        out = ns(blocks)
        if out_dtype is not None:
            out = out.to(out_dtype)
        return out.mul_(update_scale(blocks.shape[-2], blocks.shape[-1], mode))

    return scaled
