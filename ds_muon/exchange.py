"""The owner exchange: shard -> owner (all_to_all), Newton–Schulz on the owner, owner -> shard.

Runtime only: it knows the :class:`~ds_muon.ownership.ExchangePlan`, a process group and tensors,
nothing about DeepSpeed. Per rank per step it sends ``plan.sent_elements(rank)`` elements, on
average ``2 * P * (W - 1) / W**2`` for ``P`` Muon elements, and never any optimizer state.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from .ownership import ExchangePlan

# fn(batch) -> update: batch has shape (count, b, rows, cols) in the compute dtype; the result has
# the same shape (any float dtype) and already includes the update scale.
OrthogonalizeFn = Callable[[torch.Tensor], torch.Tensor]


class BufferPool:
    """Named flat buffers reused across steps and sub-groups, grown on demand, never shrunk.

    Avoids per-step allocation churn. ``get(name, numel, dtype, device)`` returns a view of the
    first ``numel`` elements of the buffer kept under ``(name, dtype, device)``.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, dtype, str(device))
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel]

    def nbytes(self) -> int:
        """Bytes held by the pool."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        self._buffers.clear()


class OwnerExchange:
    """Runs one Muon sub-group's update through its owner plan.

    Args:
        group: the data-parallel process group (``None`` = default group); its size must equal
            ``plan.world_size``.
        exchange_dtype: dtype on the wire (bf16 halves the bytes; fp32 is exact).
        compute_dtype: dtype Newton–Schulz runs in on the owner.
        device: where the exchange buffers live and Newton–Schulz runs (the accelerator; with
            optimizer offload the shard ``u``/``out`` stay in CPU memory and only the buffers
            are on ``device``). ``None``: the device of ``u``.
        pool: buffer pool to draw from (shared across sub-groups).
    """

    def __init__(self, group: Optional[dist.ProcessGroup], exchange_dtype: torch.dtype,
                 compute_dtype: torch.dtype, device: Optional[torch.device] = None,
                 pool: Optional[BufferPool] = None) -> None:
        self.group = group
        self.device = device
        self.exchange_dtype = exchange_dtype
        self.compute_dtype = compute_dtype
        self.pool = pool or BufferPool()
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]):
        if self.world_size == 1:
            out.copy_(inp)
        else:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)

    @torch.no_grad()
    def run(self, plan: ExchangePlan, u: torch.Tensor, out: torch.Tensor, fn: OrthogonalizeFn) -> None:
        """Orthogonalize every matrix of the sub-group and write this rank's chunks of the result.

        Args:
            plan: the sub-group's plan (same on every rank).
            u: ``(plan.shard_numel,)`` local flat shard of the pre-orthogonalization update
                (momentum or its Nesterov blend), any float dtype.
            out: ``(plan.shard_numel,)`` local flat shard receiving the scaled orthogonalized
                update (may alias ``u``: ``u`` is fully read before ``out`` is written).
            fn: the owner-side orthogonalization, see ``OrthogonalizeFn``.

        Raises:
            ValueError: the plan's world size or shard size does not match.
        """
        W, me = self.world_size, self.rank
        if plan.world_size != W or u.numel() != plan.shard_numel or out.numel() != plan.shard_numel:
            raise ValueError(f"plan for W={plan.world_size}, shard {plan.shard_numel} does not match "
                             f"W={W}, u {u.numel()}, out {out.numel()}")
        splits = list(plan.split_sizes)
        total, mine = sum(splits), splits[me]
        device, xdt = self.device or u.device, self.exchange_dtype
        order = [slice(s.shard_offset, s.shard_offset + s.chunk) for s in plan.slots]

        # Two buffers, each reused in place: `shard_side` holds this rank's packed chunks and later
        # receives its chunks of the results; `owner_side` holds the owned matrices' chunks from
        # every rank and is overwritten with the results (shape batches use disjoint columns).
        shard_side = self.pool.get("shard_side", total, xdt, device)
        torch._foreach_copy_(list(shard_side.split([s.chunk for s in plan.slots])), [u[sl] for sl in order])
        owner_side = self.pool.get("owner_side", W * mine, xdt, device)
        self._all_to_all(owner_side, shard_side, [mine] * W, splits)

        # Owner: rebuild each full matrix, orthogonalize per shape batch, cut it back into chunks.
        block = owner_side.view(W, mine)
        for batch in plan.batches[me]:
            k, c, numel = batch.count, batch.chunk, batch.numel
            b, rows, cols = batch.ns_shape
            chunks = block[:, batch.start:batch.start + k * c].view(W, k, c).permute(1, 0, 2)
            full = self.pool.get("matrix", k * W * c, self.compute_dtype, device).view(k, W * c)
            full.view(k, W, c).copy_(chunks)
            mats = full.as_strided((k, b, rows, cols), (W * c, rows * cols, cols, 1))
            mats.copy_(fn(mats))
            full[:, numel:].zero_()
            chunks.copy_(full.view(k, W, c))

        # Back to the shards: from owner d this rank receives its chunks of d's matrices.
        self._all_to_all(shard_side, owner_side, splits, [mine] * W)
        torch._foreach_copy_([out[sl] for sl in order], list(shard_side.split([s.chunk for s in plan.slots])))
