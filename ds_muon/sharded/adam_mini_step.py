"""The Adam-mini step of one sub-group on one rank's flat fp32 partition (layer ``sharded``: no DeepSpeed).

On the local shard ``(n,)`` (the math: :mod:`ds_muon.core.adam_update`; the blocks:
:mod:`ds_muon.model.adam_mini_blocks`):

1. per-block partial sums of ``g**2`` over this rank's elements: one row reduction of the shard viewed as
   fixed-size tiles and one over the short region of tiles that hold a block boundary
   (:mod:`ds_muon.core.block_tiles`, built once from the :class:`~ds_muon.sharded.blocks.BlockMap`'s segments;
   a block may start on one rank and end on another, and padding belongs to no block);
2. one all_reduce(SUM) of ``n_blocks`` fp32 over the sub-group's partition group;
3. ``v_B <- beta2*v_B + (1-beta2) * sum_B / |B|`` with ``|B|`` the block's global numel, then the
   element-wise first moment and update in one pass over the tiles (the denominators a per-tile column;
   compiled into one kernel on CUDA) and one over the boundary region: a fixed number of tensor operations
   per step, whatever the number of blocks, and no temporary of the shard's size.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ..core.adam_update import adam_mini_shard_update_, block_square_sums, shard_chunks
from .blocks import BlockMap
from .collectives import named_collective

__all__ = ["AdamMiniShardStep"]


class AdamMiniShardStep:
    """Adam-mini on one sub-group's local fp32 partition, built once per sub-group.

    Args:
        name: how messages name the sub-group (e.g. ``"ZeRO sub-group 3"``).
        block_map: this rank's :class:`~ds_muon.sharded.blocks.BlockMap` with one block per Adam-mini block.
        block_numel: the global element count of every block of the sub-group, in block order.
        compiled: the element-wise pass as one ``torch.compile`` kernel
            (:func:`ds_muon.core.adam_update.adam_mini_shard_update_`); None: on CUDA shards, not elsewhere.
    """

    def __init__(self, name: str, block_map: BlockMap, block_numel: Sequence[int],
                 compiled: Optional[bool] = None) -> None:
        self.name, self.block_map = name, block_map
        self._block_numel = list(block_numel)
        self._compiled = compiled
        self._index: Optional[tuple] = None  # (windows, block numel tensor) on the gradient's device

    @property
    def n_blocks(self) -> int:
        return self.block_map.n_blocks

    @torch.no_grad()
    def run(self, fp32: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, block_v: torch.Tensor, step: int,
            group: dict, process_group: Optional[dist.ProcessGroup], comm_device: torch.device) -> None:
        """One Adam-mini step of the sub-group, in place. Collective over ``process_group`` (one all_reduce).

        Args:
            fp32, grad, exp_avg: ``(n,)`` float32: the local partition, its final gradient, the first moment.
            block_v: ``(n_blocks,)`` float32 second moments, the same on every rank (updated in place).
            step: the step number after this step (1 for the first).
            group: the param group (``lr``, ``betas``, ``eps``, ``weight_decay``).
            process_group: the sub-group's partition group. comm_device: the collective's device.

        Raises:
            ds_muon.errors.CollectiveError: the all_reduce failed (a peer died), naming the sub-group.
        """
        bm = self.block_map
        if self._index is None or self._index[1].device != grad.device:
            self._index = (shard_chunks(bm.lengths, bm.block_of_segment, bm.n_blocks, grad.device),
                           torch.tensor(self._block_numel, dtype=torch.float32, device=grad.device))
        chunks, block_numel = self._index
        with record_function("ds_muon/adam_mini_block_sums"):
            wire = block_square_sums(grad, chunks, bm.n_blocks).to(comm_device)
            with named_collective(f"the Adam-mini block all_reduce of {self.name}"):
                dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=process_group)
            sums = wire.to(grad.device)
        with record_function("ds_muon/adam_mini_update"):
            compiled = grad.device.type == "cuda" if self._compiled is None else self._compiled
            adam_mini_shard_update_(fp32, grad, exp_avg, block_v, sums, block_numel, chunks, step, group["lr"],
                                    tuple(group["betas"]), group["eps"], group["weight_decay"], compiled=compiled)
