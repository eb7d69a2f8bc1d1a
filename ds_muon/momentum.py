"""Muon's momentum step on a flat shard, in the momentum's storage dtype (design.md §3, "local shard").

Pure and single-device, shared by the reference optimizer and the ZeRO-3 step, so both round the
momentum the same way.
"""
from __future__ import annotations

import functools

import torch

MOMENTUM_DTYPES = ("float32", "bfloat16")

# Elements per chunk when the momentum is stored in a narrower dtype than the gradient: the fp32
# working copy of one chunk is the only temporary (64 MiB), never one of the whole shard.
CHUNK_ELEMENTS = 1 << 24


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
    if momentum.shape != grad.shape or momentum.dim() != 1:
        raise ValueError(f"momentum {tuple(momentum.shape)} and grad {tuple(grad.shape)} must be the same 1-D shape")
    if grad.dtype != torch.float32:
        raise ValueError(f"grad must be float32, got {grad.dtype}")
    if momentum.dtype == torch.float32:
        _momentum_fp32_(momentum, grad, beta, nesterov)  # the same function the fused path compiles
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


@functools.lru_cache(maxsize=None)
def _compiled(fn, backend: str):
    # dynamic=True: one graph for every shard length; floats are graph inputs (torch.compile does not
    # specialize on them), so a new lr or beta does not recompile either
    return torch.compile(fn, dynamic=True, backend=backend)


def fused_momentum_update_(momentum: torch.Tensor, grad: torch.Tensor, beta: float, nesterov: bool,
                           backend: str = "inductor") -> torch.Tensor:
    r""":func:`momentum_update_` in one pass over the shard: for fp32 momentum the momentum step and
    the Nesterov blend are one compiled kernel (``torch.compile``, dynamic shapes), which reads
    ``m`` and ``g`` once and writes both (16 bytes per element instead of 24). Same math and contract
    as :func:`momentum_update_` (fp32 rounding may differ by an ulp where the compiler contracts
    a multiply-add); bf16 momentum goes to :func:`momentum_update_` unchanged.

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
    _compiled(_momentum_fp32_, backend)(momentum, grad, float(beta), bool(nesterov))
    return grad if nesterov else momentum


def fused_apply_update_(param: torch.Tensor, update: torch.Tensor, lr: float, weight_decay: float,
                        backend: str = "inductor") -> None:
    r"""``p <- p (1 - lr wd) - lr o`` in place, one compiled pass (reads ``p`` and ``o`` once: 12
    bytes per element instead of 20 for ``p.mul_(1 - lr wd).add_(o, alpha=-lr)``): decoupled weight
    decay (Loshchilov & Hutter, arXiv 1711.05101) and the Muon update.

    Args:
        param: ``(n,)`` float32 shard, updated in place.
        update: ``(n,)`` float32 scaled orthogonalized update ``o``.
        lr: learning rate. weight_decay: decoupled weight decay coefficient.
        backend: ``torch.compile``'s backend.
    """
    _compiled(_apply_update_, backend)(param, update, 1 - lr * weight_decay, -lr)


def apply_update_(param: torch.Tensor, update: torch.Tensor, lr: float, weight_decay: float) -> None:
    """:func:`fused_apply_update_` in eager mode (two passes; CPU and CPU offload): the same function, not compiled."""
    _apply_update_(param, update, 1 - lr * weight_decay, -lr)
