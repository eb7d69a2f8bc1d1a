r"""Adam's element-wise update and Adam-mini's block update, on one device (layer ``core``: torch only).

Used three ways, so the math is written once: the oracle's AdamW half (:class:`ds_muon.MuonAdamW`), the
oracle Adam-mini (:class:`ds_muon.AdamMini`), and the Adam-mini shard step
(:class:`ds_muon.sharded.adam_mini_step.AdamMiniShardStep`) on one rank's flat fp32 partition.

.. math::
    m_t &\leftarrow \beta_1 m_{t-1} + (1-\beta_1) g_t \\
    v_t &\leftarrow \beta_2 v_{t-1} + (1-\beta_2)\, g_t^2 \quad\text{(AdamW: per element; Adam-mini: }
        \tfrac{1}{|B|}\textstyle\sum_{i\in B} g_{t,i}^2\text{ per block } B) \\
    \theta_t &\leftarrow \theta_{t-1}(1-\gamma\lambda) - \gamma\,\frac{m_t/(1-\beta_1^t)}{\sqrt{v_t/(1-\beta_2^t)}+\epsilon}

AdamW: Loshchilov & Hutter, arXiv 1711.05101 (as ``torch.optim.AdamW``); Adam-mini: Zhang et al.,
arXiv:2406.16793.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .block_tiles import BlockTiles, block_tiles
from .muon_update import _compiled

#: The most elements one pass of the Adam-mini shard step covers. None (the default): the whole shard, one
#: pass. A small value cuts the shard into windows of at most this many elements, stepped one after
#: another (the tests' way to put window boundaries inside blocks, segments and padding).
CHUNK_ELEMENTS: Optional[int] = None


def adam_denominator(v: torch.Tensor, step: int, beta2: float, eps: float) -> torch.Tensor:
    """``sqrt(v / (1 - beta2**step)) + eps`` (a new tensor of ``v``'s shape and dtype), Adam's bias-corrected
    denominator; ``step`` is the step number after this step (1 for the first)."""
    return (v.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)


def adam_apply_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, denom: torch.Tensor, step: int,
                lr: float, beta1: float, weight_decay: float) -> None:
    """In place: ``exp_avg <- beta1 exp_avg + (1 - beta1) grad``, then decoupled weight decay and the Adam step
    ``param <- param (1 - lr wd) - lr/(1 - beta1**step) * exp_avg / denom``.

    Args:
        param: the weights (any float dtype; the moments are cast to it for the step).
        grad, exp_avg: fp32, ``param``'s shape. denom: broadcastable to it (:func:`adam_denominator`).
        step: the step number after this step (1 for the first).
    """
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    param.mul_(1 - lr * weight_decay)
    param.addcdiv_(exp_avg.to(param.dtype), denom.to(param.dtype), value=-lr / (1 - beta1**step))


def adamw_update_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """One AdamW step in place, exactly as ``torch.optim.AdamW`` (``grad``, ``exp_avg``, ``exp_avg_sq``: fp32,
    ``param``'s shape; ``step``: after this step)."""
    beta1, beta2 = betas
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    adam_apply_(param, grad, exp_avg, adam_denominator(exp_avg_sq, step, beta2, eps), step, lr, beta1, weight_decay)


def adam_mini_update_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, block_v: torch.Tensor,
                      block: int, step: int, lr: float, betas: tuple[float, float], eps: float,
                      weight_decay: float) -> None:
    """One Adam-mini step of a whole parameter in place (the oracle's): ``block_v`` ``(numel / block,)`` fp32,
    one second moment per block of ``block`` consecutive elements of the flattened parameter."""
    beta1, beta2 = betas
    block_v.mul_(beta2).add_(grad.reshape(-1, block).square().mean(dim=1), alpha=1 - beta2)
    per_block = adam_denominator(block_v, step, beta2, eps)
    denom = per_block[:, None].expand(-1, block).reshape(param.shape)
    adam_apply_(param, grad, exp_avg, denom, step, lr, beta1, weight_decay)


def cut_windows(lengths: Sequence[int], block_of_segment: Sequence[int], chunk: int) -> list[tuple[int, list, list]]:
    """A shard's segments cut into windows of at most ``chunk`` elements: ``[(start, piece lengths, piece block
    ids)]`` in order, the pieces of each window tiling it (a segment cut by a window boundary is in both)."""
    out, seg, used, pos, total = [], 0, 0, 0, sum(lengths)
    while pos < total:
        end, start, pieces, blocks = min(total, pos + chunk), pos, [], []
        while pos < end:
            take = min(lengths[seg] - used, end - pos)
            if take > 0:
                pieces.append(take)
                blocks.append(block_of_segment[seg])
            pos, used = pos + take, used + take
            if used == lengths[seg]:
                seg, used = seg + 1, 0
        out.append((start, pieces, blocks))
    return out


def shard_chunks(lengths: Sequence[int], block_of_segment: Sequence[int], n_blocks: int, device: torch.device,
                 chunk: Optional[int] = None, tile: Optional[int] = None) -> list[BlockTiles]:
    """A shard's segments (a :class:`ds_muon.sharded.blocks.BlockMap`'s ``lengths``/``block_of_segment``, padding
    negative) as the tiles of :mod:`ds_muon.core.block_tiles`, built once per sub-group: one window, the whole
    shard, unless ``chunk`` (default :data:`CHUNK_ELEMENTS`) cuts it into windows of at most that many elements.

    Args:
        lengths, block_of_segment: the segments that tile the shard exactly, and each one's block id.
        n_blocks: blocks in the sub-group (global numbering). device: the shard's device.
        chunk: elements per window (None: :data:`CHUNK_ELEMENTS`; None there too: the whole shard).
        tile: elements per tile (None: :func:`ds_muon.core.block_tiles.choose_tile` per window).

    Returns:
        The windows in order; together they tile the shard exactly (an empty shard gives none). Their index
        tensors hold ``O(segments + blocks)`` int64 values, nothing of the shard's length
        (:meth:`~ds_muon.core.block_tiles.BlockTiles.nbytes`).
    """
    chunk = int(chunk or CHUNK_ELEMENTS or sum(lengths) or 1)
    return [block_tiles(pieces, blocks, n_blocks, device, start=start, tile=tile)
            for start, pieces, blocks in cut_windows(lengths, block_of_segment, chunk)]


def block_square_sums(grad: torch.Tensor, chunks: Sequence[BlockTiles], n_blocks: int) -> torch.Tensor:
    """Per-block partial sums of ``grad**2`` over one rank's shard (Zhang et al., arXiv:2406.16793: the block
    mean of ``g**2`` is this sum, over all ranks, divided by the block's numel).

    Args:
        grad: ``(shard numel,)`` fp32, the local gradient shard.
        chunks: the shard's windows (:func:`shard_chunks`; one unless :data:`CHUNK_ELEMENTS` is set).
        n_blocks: blocks in the sub-group (global numbering).

    Returns:
        ``(n_blocks,)`` fp32: the sum of ``g**2`` over this rank's elements of each block (0 for blocks
        with no element here); summed over the ranks (all_reduce SUM) it is the whole block's sum.
        Per window: one row reduction of the ``(tiles, T)`` view and a reduction of the short mixed region
        (:meth:`ds_muon.core.block_tiles.BlockTiles.sums_of_squares`); no temporary of the shard's size.
    """
    sums = torch.zeros(n_blocks, dtype=torch.float32, device=grad.device)
    for c in chunks:
        sums += c.sums_of_squares(grad.narrow(0, c.start, c.numel))
    return sums


def _block_update_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, denom: torch.Tensor, beta1: float,
                   one_minus_beta1: float, decay: float, step_size: float) -> None:
    # adam_apply_'s operations, in its order, on fp32 (denom broadcast: a per-tile column or per element)
    exp_avg.mul_(beta1).add_(grad, alpha=one_minus_beta1)
    param.mul_(decay).addcdiv_(exp_avg, denom, value=step_size)


def _block_update_graph_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, denom: torch.Tensor,
                         beta1: float, one_minus_beta1: float, decay: float, step_size: float) -> None:
    # _block_update_ for torch.compile: every float multiplies a tensor (a graph input); as ``alpha=``/``value=``
    # torch.compile would specialize on it and recompile for every new step size. The temporaries fuse away.
    exp_avg.mul_(beta1).add_(grad * one_minus_beta1)
    param.mul_(decay).add_(exp_avg / denom * step_size)


def adam_mini_shard_update_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, block_v: torch.Tensor,
                            block_sq_sum: torch.Tensor, block_numel: torch.Tensor, chunks: Sequence[BlockTiles],
                            step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                            compiled: bool = False, backend: str = "inductor") -> None:
    r"""The Adam-mini update of one rank's shard, in place, given the blocks' global sums of ``g**2``
    (Zhang et al., arXiv:2406.16793; the module docstring's formulas):

    .. math::
        v_B \leftarrow \beta_2 v_B + (1-\beta_2) \frac{S_B}{|B|}, \quad
        m \leftarrow \beta_1 m + (1-\beta_1) g, \quad
        p \leftarrow p (1 - \gamma\lambda) - \frac{\gamma}{1-\beta_1^t} \frac{m}{\sqrt{v_{B(i)}/(1-\beta_2^t)} + \epsilon}

    Args:
        param, grad, exp_avg: ``(shard numel,)`` fp32: the fp32 partition, its gradient, the first moment.
        block_v: ``(n_blocks,)`` fp32, the second moments (updated in place; the same on every rank).
        block_sq_sum: ``(n_blocks,)`` fp32, ``S_B``: the sum of ``g**2`` over each whole block (all ranks).
        block_numel: ``(n_blocks,)`` fp32, ``|B|``: each block's global element count.
        chunks: the shard's windows (:func:`shard_chunks`). Per window, one element-wise pass over its
            ``(tiles, T)`` view with the denominators as a per-tile column, and one over the short mixed
            region (:meth:`ds_muon.core.block_tiles.BlockTiles.apply_`): no temporary of the shard's size.
        step: the step number ``t`` after this step (1 for the first).
        lr, betas, eps, weight_decay: the group's hyperparameters (``gamma``, ``beta1, beta2``, ``epsilon``,
            ``lambda``).
        compiled: run the pass over the tiles as one ``torch.compile`` kernel (dynamic shapes; reads ``p``, ``g``,
            ``m`` once and writes ``p``, ``m``: 20 bytes per element instead of 40 eager). Accelerators.
        backend: ``torch.compile``'s backend (tests: ``"eager"``).
    """
    beta1, beta2 = betas
    block_v.mul_(beta2).add_(block_sq_sum / block_numel, alpha=1 - beta2)
    denom = adam_denominator(block_v, step, beta2, eps)
    denom = torch.cat([denom, denom.new_ones(1)])  # padding divides by 1 (its m is 0)
    fn = _compiled(_block_update_graph_, backend) if compiled else _block_update_
    args = (float(beta1), float(1 - beta1), float(1 - lr * weight_decay), float(-lr / (1 - beta1**step)))
    for c in chunks:
        c.apply_(fn, [t.narrow(0, c.start, c.numel) for t in (param, grad, exp_avg)], denom, mutated=(0, 2), args=args,
                 mixed_fn=_block_update_)
