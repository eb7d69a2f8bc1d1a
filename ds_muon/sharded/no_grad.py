"""No gradient, no step: which Muon blocks got a gradient this step, agreed over the partition group.

Layer ``sharded`` (torch.distributed, no DeepSpeed). A block (one matrix of a parameter's
Newton–Schulz view, e.g. one expert) has no gradient when its gradient is exactly zero in every
element on every rank (DeepSpeed leaves zeros where no gradient arrived); the oracle
:class:`ds_muon.MuonAdamW` applies the same rule to whole tensors (docs/how-it-works.md, "Steps with
no gradient"). Per sub-group: two ``segment_reduce`` passes over the local gradient shard (its largest and smallest
element per segment, no temporary of the shard's size), one byte per block,
and one all_reduce(MAX) shared by every sub-group whose gradient is in memory at once. The agreed flags reach the
host without a wait of their own (:class:`~ds_muon.sharded.host_copy.HostCopy`): agreed before a host sync the step
makes anyway (DeepSpeed's read of the global gradient norm, docs/design.md "Host syncs of the step"), taking them
waits for nothing.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.distributed as dist

from .blocks import PADDING, BlockMap
from .host_copy import HostCopy

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
        # this step's flags, agreed and not yet taken: (host copy of the agreed flags, start, n_blocks)
        self._agreed: dict[int, tuple[HostCopy, int, int]] = {}

    def begin_step(self) -> None:
        """Forget the previous step's flags (call at the start of every step)."""
        self._agreed = {}

    def agreed(self, i: int) -> bool:
        """Whether sub-group ``i``'s flags of this step are agreed and not yet taken."""
        return i in self._agreed

    def local(self, i: int, grad: Optional[torch.Tensor]) -> torch.Tensor:
        """``(n_blocks,)`` uint8 on ``grad``'s device: 1 where this rank's shard of the block holds a non-zero (or
        NaN) gradient element, all 0 for ``grad=None``. Two ``segment_reduce`` passes over ``grad`` (``(shard
        numel,)``, any float dtype), its largest and smallest element per segment (a segment is non-zero where either
        is: the same flags as ``max |g| != 0``, NaN included, as both reductions propagate it), so no temporary of
        the shard's size is made (``grad.abs()`` was one: 4 bytes per element of an fp32 partition at the step)."""
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
        nonzero = (torch.segment_reduce(grad, "max", lengths=lengths, unsafe=True, initial=0).ne(0)
                   | torch.segment_reduce(grad, "min", lengths=lengths, unsafe=True, initial=0).ne(0))
        flags = torch.zeros(bm.n_blocks, dtype=torch.uint8, device=grad.device)
        return flags.scatter_reduce_(0, ids, nonzero[real].to(torch.uint8), "amax")

    def agree(self, grads: Mapping[int, Optional[torch.Tensor]], group: Optional[dist.ProcessGroup]) -> None:
        """Agree on the flags of the sub-groups ``grads`` (``{sub_group: its (shard numel,) local gradient, any
        float dtype, or None}``, all of one partition ``group``; None: the default group) over the group: one
        all_reduce(MAX) of one byte per block for all of them, then the result copied to the host without a wait
        (:class:`~ds_muon.sharded.host_copy.HostCopy`; :meth:`take` waits for it only if no sync came between).
        Collective: every rank of the group must call it with the same sub-groups. Unscaling and clipping, applied
        to a gradient after this point, multiply by a positive factor and keep zeros zero, so the flags may be
        agreed before them."""
        local = [self.local(j, g) for j, g in grads.items()]
        flags = torch.cat(local).to(self._device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        copy = HostCopy(flags.bool())
        start = 0
        for j, t in zip(grads, local):
            self._agreed[j] = (copy, start, t.numel())
            start += t.numel()

    def take(self, i: int) -> torch.Tensor:
        """Sub-group ``i``'s agreed flags (:meth:`agree`), ``(n_blocks,)`` bool in host memory, the same on every rank
        of its group; each is taken once per step. Waits for the copy to the host only if it has not landed (no
        host sync came between :meth:`agree` and here: one sync then).

        Raises:
            KeyError: not agreed this step.
        """
        copy, start, n = self._agreed.pop(i)
        return copy.get().narrow(0, start, n)
