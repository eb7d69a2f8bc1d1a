"""No gradient, no step: which Muon blocks got a gradient this step, agreed over the partition group.

Layer ``sharded`` (torch.distributed, no DeepSpeed). A block (one matrix of a parameter's
Newton–Schulz view, e.g. one expert) has no gradient when its gradient is exactly zero in every
element on every rank (DeepSpeed leaves zeros where no gradient arrived); the oracle
:class:`ds_muon.MuonAdamW` applies the same rule to whole tensors (docs/how-it-works.md, "Steps with
no gradient"). Per sub-group: one ``segment_reduce`` over the local gradient shard, one byte per block,
and one all_reduce(MAX) shared by every sub-group whose gradient is in memory at once.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch
import torch.distributed as dist

from .blocks import PADDING, BlockMap

__all__ = ["GradientFlags"]


class GradientFlags:
    """Per-block "had a gradient" flags of the Muon sub-groups of one optimizer, built once.

    Args:
        block_maps: ``{sub_group: BlockMap}`` of this rank (:func:`ds_muon.sharded.blocks.build_block_map`).
        device: where the flags are reduced (the accelerator: the collective's device).
    """

    def __init__(self, block_maps: Mapping[int, BlockMap], device: torch.device) -> None:
        self._maps = dict(block_maps)
        self._device = device
        self._index: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._ahead: dict[int, torch.Tensor] = {}  # this step's flags of later sub-groups, computed ahead

    def begin_step(self) -> None:
        """Forget the flags computed ahead in the previous step (call at the start and end of every step)."""
        self._ahead = {}

    def local(self, i: int, grad: Optional[torch.Tensor]) -> torch.Tensor:
        """``(n_blocks,)`` uint8 on ``grad``'s device: 1 where this rank's shard of the block holds a non-zero
        gradient element (one ``segment_reduce`` over ``grad``, ``(shard numel,)``); all 0 for ``grad=None``."""
        bm = self._maps[i]
        if grad is None:
            return torch.zeros(bm.n_blocks, dtype=torch.uint8, device=self._device)
        index = self._index.get(i)
        if index is None or index[0].device != grad.device:
            real = [k for k, b in enumerate(bm.block_of_segment) if b != PADDING]
            index = self._index[i] = (
                torch.tensor(bm.lengths, dtype=torch.int64, device=grad.device),
                torch.tensor(real, dtype=torch.int64, device=grad.device),
                torch.tensor([bm.block_of_segment[k] for k in real], dtype=torch.int64, device=grad.device))
        lengths, real, ids = index
        largest = torch.segment_reduce(grad.abs(), "max", lengths=lengths, unsafe=True, initial=0)
        flags = torch.zeros(bm.n_blocks, dtype=torch.uint8, device=grad.device)
        return flags.scatter_reduce_(0, ids, largest[real].ne(0).to(torch.uint8), "amax")

    def blocks_with_gradient(self, i: int, grad: Optional[torch.Tensor], group: Optional[dist.ProcessGroup],
                             ahead: Mapping[int, Callable[[], Optional[torch.Tensor]]]) -> torch.Tensor:
        """Which blocks of sub-group ``i`` had a gradient this step, on any rank of ``group``.

        Args:
            i: the sub-group; ``grad`` its ``(shard numel,)`` local gradient (any float dtype; None: none).
            group: its partition group (None: the default group).
            ahead: ``{j: fetch}`` for later sub-groups of the same partition group whose gradient is already
                in memory (``fetch()`` returns it): their flags go through the same all_reduce and are
                kept for their turn. Must be the same set on every rank (it depends on the layout only).
                Unscaling and clipping, applied to a later sub-group's gradient after this point, multiply
                by a positive factor and keep zeros zero.

        Returns:
            ``(n_blocks,)`` bool on the CPU, the same on every rank of the group. Collective (one
            all_reduce(MAX) of one byte per block, one host sync) unless computed ahead.
        """
        if i in self._ahead:
            return self._ahead.pop(i)
        grads = {i: grad}
        grads.update((j, fetch()) for j, fetch in ahead.items() if j > i and j not in self._ahead)
        local = [self.local(j, g) for j, g in grads.items()]
        flags = torch.cat(local).to(self._device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        flags = flags.bool().cpu()
        split = dict(zip(grads, flags.split([t.numel() for t in local])))
        self._ahead.update((j, f) for j, f in split.items() if j != i)
        return split[i]
