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
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

#: Elements of a shard the Adam-mini shard step updates at once (64 MiB of fp32 temporaries).
CHUNK_ELEMENTS = 1 << 24


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


@dataclass(frozen=True)
class ShardChunk:
    """One window of a rank's flat shard, as the chunked Adam-mini step reads it.

    Attributes:
        start: first element of the window in the shard.
        numel: elements in the window (at most the chunk size).
        lengths: ``(k,)`` int64, lengths of the pieces of the :class:`ds_muon.sharded.blocks.BlockMap` segments
            that fall in the window (tiling it; a segment cut by a window boundary appears in both).
        block: ``(k,)`` int64, the block id of each piece, ``n_blocks`` for padding.
    """

    start: int
    numel: int
    lengths: torch.Tensor
    block: torch.Tensor


def shard_chunks(lengths: Sequence[int], block_of_segment: Sequence[int], n_blocks: int, device: torch.device,
                 chunk: Optional[int] = None) -> list[ShardChunk]:
    """Cut a shard's segments (a :class:`ds_muon.sharded.blocks.BlockMap`'s ``lengths``/``block_of_segment``, padding
    ``-1``) into windows of at most ``chunk`` elements (default :data:`CHUNK_ELEMENTS`), built once per
    sub-group.

    Returns:
        The windows in order; together they tile the shard exactly (an empty shard gives none).
    """
    chunk = int(chunk or CHUNK_ELEMENTS)
    out, seg, used, pos, total = [], 0, 0, 0, sum(lengths)
    while pos < total:
        end, start, pieces, blocks = min(total, pos + chunk), pos, [], []
        while pos < end:
            take = min(lengths[seg] - used, end - pos)
            if take > 0:
                pieces.append(take)
                blocks.append(n_blocks if block_of_segment[seg] < 0 else block_of_segment[seg])
            pos, used = pos + take, used + take
            if used == lengths[seg]:
                seg, used = seg + 1, 0
        out.append(ShardChunk(start, end - start, torch.tensor(pieces, dtype=torch.int64, device=device),
                              torch.tensor(blocks, dtype=torch.int64, device=device)))
    return out


def block_square_sums(grad: torch.Tensor, chunks: Sequence[ShardChunk], n_blocks: int) -> torch.Tensor:
    """Per-block partial sums of ``grad**2`` over one rank's shard, one window at a time.

    Args:
        grad: ``(shard numel,)`` fp32, the local gradient shard.
        chunks: the shard's windows (:func:`shard_chunks`).
        n_blocks: blocks in the sub-group (global numbering).

    Returns:
        ``(n_blocks,)`` fp32: the sum of ``g**2`` over this rank's elements of each block (0 for blocks
        with no element here); summed over the ranks (all_reduce SUM) it is the whole block's sum.
        Temporaries: one window's ``g**2`` (at most the chunk size), never the shard's.
    """
    sums = torch.zeros(n_blocks + 1, dtype=torch.float32, device=grad.device)  # the last one collects padding
    for c in chunks:
        piece = torch.segment_reduce(grad.narrow(0, c.start, c.numel).square(), "sum", lengths=c.lengths, unsafe=True,
                                     initial=0)
        sums.index_add_(0, c.block, piece.float())
    return sums[:n_blocks]


def adam_mini_shard_update_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, block_v: torch.Tensor,
                            block_sq_sum: torch.Tensor, block_numel: torch.Tensor, chunks: Sequence[ShardChunk],
                            step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """The Adam-mini update of one rank's shard, in place, given the blocks' global sums of ``g**2``.

    Args:
        param, grad, exp_avg: ``(shard numel,)`` fp32: the fp32 partition, its gradient, the first moment.
        block_v: ``(n_blocks,)`` fp32, the second moments (updated in place; the same on every rank).
        block_sq_sum: ``(n_blocks,)`` fp32, the sum of ``g**2`` over each whole block (all ranks).
        block_numel: ``(n_blocks,)`` fp32, each block's global element count.
        chunks: the shard's windows (:func:`shard_chunks`); the per-element denominator is built one
            window at a time, so no temporary of the shard's size is allocated.
        step: the step number ``t`` after this step (1 for the first).
        lr, betas, eps, weight_decay: the group's hyperparameters.
    """
    beta1, beta2 = betas
    block_v.mul_(beta2).add_(block_sq_sum / block_numel, alpha=1 - beta2)
    denom = adam_denominator(block_v, step, beta2, eps)
    denom = torch.cat([denom, denom.new_ones(1)])  # padding divides by 1 (its m is 0)
    for c in chunks:
        p, g, m = (t.narrow(0, c.start, c.numel) for t in (param, grad, exp_avg))
        per_element = torch.repeat_interleave(denom[c.block], c.lengths, output_size=c.numel)
        adam_apply_(p, g, m, per_element, step, lr, beta1, weight_decay)
