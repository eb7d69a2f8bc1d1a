"""The owner exchange: shard -> owner (all_to_all), Newton–Schulz on the owner, owner -> shard.

Layer ``sharded``: it knows the :class:`~ds_muon.sharded.ownership.BucketedPlan`, a process group and
tensors, nothing about DeepSpeed (docs/design.md, "One optimizer step"). Per rank per step it sends
``plan.sent_elements(rank)`` elements, on
average ``2 * P * (W - 1) / W**2`` for ``P`` Muon elements, and never any optimizer state.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ..core.matrix import matrix_view, view_blocks
from .ownership import BucketedPlan, ExchangePlan
from .tensor_parallel import full_to_stacked_, stacked_to_full

# Buckets holding exchange buffers at once: one computing, one returning, one arriving.
PIPELINE_DEPTH = 3

# fn(batch) -> update: batch has shape (count, *blocks, rows, cols) in the compute dtype (count
# parameters with the same matrix view, the equal-shape blocks of one group of it); the result has
# the same shape (any float dtype) and already includes the update scale of a rows x cols block.
OrthogonalizeFn = Callable[[torch.Tensor], torch.Tensor]


class BufferPool:
    """Named flat buffers reused across the buckets and sub-groups of one optimizer step.

    ``get(name, numel, dtype, device)`` returns a view of the first ``numel`` elements of the buffer
    kept under ``(name, dtype, device)``, grown on demand, so the pipeline's few slots serve every
    bucket without a fresh allocation each. :meth:`clear` at the end of the step hands the memory
    back to PyTorch's caching allocator: it serves the next step's buffers without a new device
    allocation, and forward/backward can use it in between (the exchange's memory does not add to
    the activation peak). ``peak_nbytes`` keeps the largest size the pool reached.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self.peak_nbytes = 0

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, dtype, str(device))
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            self._buffers.pop(key, None)  # release the smaller one first
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buf
            self.peak_nbytes = max(self.peak_nbytes, self.nbytes())
        return buf[:numel]

    def nbytes(self) -> int:
        """Bytes held by the pool now."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        """Drop every buffer (their memory returns to the caching allocator)."""
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
        # The owner rebuilds matrices in the compute dtype, unless its range is narrower than the wire's
        # (fp16 compute, fp32 wire): a small matrix would flush to zero before Newton–Schulz normalizes it.
        narrower = torch.finfo(compute_dtype).max < torch.finfo(exchange_dtype).max
        self.assembly_dtype = exchange_dtype if narrower else compute_dtype
        self.pool = BufferPool() if pool is None else pool
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]):
        """Start ``out <- all_to_all(inp)``; returns a work handle to ``wait()`` on, or None (W=1, done)."""
        if self.world_size == 1:
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp)
            return None
        return dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=True)

    def run(self, plan: Union[ExchangePlan, BucketedPlan], u: torch.Tensor, out: torch.Tensor,
            fn: OrthogonalizeFn, u_offset: int = 0, out_offset: int = 0,
            pool: Optional[BufferPool] = None) -> None:
        """Orthogonalize every matrix of the sub-group and write this rank's chunks of the result.

        Buckets are pipelined: while the owner runs Newton–Schulz on bucket ``k``, bucket ``k+1``'s
        exchange-in and bucket ``k-1``'s exchange-out are in flight (async collectives; on GPU they
        run on the communicator's stream). At most ``PIPELINE_DEPTH`` buckets hold buffers at once,
        so device memory for the exchange is bounded by that many buckets.

        Args:
            plan: the sub-group's plan (same on every rank); an :class:`ExchangePlan` is one bucket.
            u: ``(plan.shard_numel,)`` local flat shard of the pre-orthogonalization update
                (momentum or its Nesterov blend), any float dtype, any device; or, with ``u_offset``, the
                stretch ``[u_offset, u_offset + u.numel())`` of it that holds every piece of ``plan`` on this rank
                (the overlapped step's per-bucket scratch).
            out: ``(plan.shard_numel,)`` local flat shard receiving the scaled orthogonalized
                update (may alias ``u``: every slot of ``u`` is read before the same slot is written); or, with
                ``out_offset``, a stretch of it as ``u`` may be (the overlapped step's per-bucket stash).
            fn: the owner-side orthogonalization, see ``OrthogonalizeFn``.
            u_offset: the shard offset of ``u[0]`` (elements; 0: ``u`` is the whole shard).
            out_offset: the shard offset of ``out[0]`` (elements; 0: ``out`` is the whole shard).
            pool: where this call's buffers come from (default: the exchange's own, ``self.pool``; the overlapped
                step gives each bucket one of its own).

        Raises:
            ValueError: the plan's world size does not match, or ``u`` or ``out`` is neither the shard nor (one
                bucket) a stretch of it holding every piece of this rank.
        """
        W = self.world_size
        buckets = plan.buckets if isinstance(plan, BucketedPlan) else (plan,)
        if plan.world_size != W:
            raise ValueError(f"plan for W={plan.world_size} does not match W={W}")
        # a whole plan reads and writes the whole shard; one bucket may come with just a stretch holding its pieces

        held: list = []  # this rank's pieces of a one-bucket plan, listed on the first call that needs them

        def fits(t: torch.Tensor, offset: int) -> bool:
            if (offset, t.numel()) == (0, plan.shard_numel):
                return True
            if isinstance(plan, BucketedPlan) or offset < 0:
                return False
            if not held:
                held.extend(s.pieces[self.rank] for s in plan.slots if s.pieces[self.rank].sent)
            return all(offset <= p.shard_offset and p.shard_offset + p.sent <= offset + t.numel() for p in held)
        if not fits(u, u_offset) or not fits(out, out_offset):
            raise ValueError(f"plan for shard {plan.shard_numel} does not match u {u.numel()} at offset {u_offset}, "
                             f"out {out.numel()} at offset {out_offset} (each the shard, or a stretch of it holding "
                             f"this rank's pieces of a one-bucket plan)")
        device = self.device or u.device
        pool = self.pool if pool is None else pool
        in_flight: dict[int, tuple] = {}   # bucket -> (work handle, shard_side, owner_side)

        def start_in(k: int) -> None:
            b, slot = buckets[k], k % PIPELINE_DEPTH
            out_splits, in_splits = self._splits(b)
            shard_side = pool.get(f"shard_side{slot}", sum(in_splits), self.exchange_dtype, device)
            # one rank: what it sends is what it owns, so the owner works on the same buffer (no copy either way)
            owner_side = shard_side if W == 1 else pool.get(f"owner_side{slot}", sum(out_splits),
                                                                 self.exchange_dtype, device)
            mine = [s.pieces[self.rank] for s in b.slots]
            torch._foreach_copy_(list(shard_side.split([p.sent for p in mine])),  # a piece this rank lacks: empty
                                 [u.narrow(0, p.shard_offset - u_offset, p.sent) if p.sent else u[:0] for p in mine])
            in_flight[k] = (self._all_to_all(owner_side, shard_side, out_splits, in_splits), shard_side, owner_side)

        def finish_out(k: int) -> None:
            work, shard_side, _ = in_flight.pop(k)
            if work is not None:
                with record_function("ds_muon/wait_exchange_out"):
                    work.wait()
            mine = [s.pieces[self.rank] for s in buckets[k].slots]
            torch._foreach_copy_([out.narrow(0, p.shard_offset - out_offset, p.sent) if p.sent else out[:0]
                                  for p in mine],
                                 list(shard_side.split([p.sent for p in mine])))

        if buckets:
            start_in(0)
        for k, b in enumerate(buckets):
            if k + 1 < len(buckets):
                if k + 1 - PIPELINE_DEPTH >= 0:
                    finish_out(k + 1 - PIPELINE_DEPTH)  # frees the buffer slot bucket k+1 reuses
                start_in(k + 1)
            work, shard_side, owner_side = in_flight[k]
            if work is not None:
                with record_function("ds_muon/wait_exchange_in"):
                    work.wait()
            with record_function("ds_muon/newton_schulz"):
                self._owner_compute(b, owner_side, fn, device, pool)
            out_splits, in_splits = self._splits(b)
            in_flight[k] = (self._all_to_all(shard_side, owner_side, in_splits, out_splits), shard_side, owner_side)
        for k in sorted(in_flight):
            finish_out(k)

    def _splits(self, b: ExchangePlan) -> tuple[list[int], list[int]]:
        """``(received from each rank, sent to each rank)`` of this rank in bucket ``b``'s exchange-in."""
        return [row[self.rank] for row in b.sends], list(b.sends[self.rank])

    def _owner_compute(self, b: ExchangePlan, owner_side: torch.Tensor, fn: OrthogonalizeFn,
                       device: torch.device, pool: Optional[BufferPool] = None) -> None:
        """In place on what the owner received: per batch of owned parameters with the same view, assemble each
        parameter from every rank's piece, orthogonalize the blocks of its matrix view (one call per block group),
        write the result back as pieces. ZeRO-3's chunked layout (``b.chunked``): the owner's
        ``(W, split_sizes[rank])`` block holds every owned parameter as ``W`` equal chunks, so a batch is one
        strided copy each way and the padding past ``numel`` is zeroed; otherwise (ZeRO-1/2, AutoTP) each piece is
        copied at its owner offset."""
        pool = self.pool if pool is None else pool
        W = self.world_size
        if b.chunked:
            block = owner_side.view(W, b.split_sizes[self.rank])
        else:
            received = [row[self.rank] for row in b.sends]
            starts = [sum(received[:s]) for s in range(W)]
        for batch in b.batches[self.rank]:
            # assemble: the batch's whole parameters, one flat row each, in the assembly dtype
            if b.chunked:
                k, c, numel = batch.count, batch.chunk, batch.numel
                chunks = block[:, batch.start:batch.start + k * c].view(W, k, c).permute(1, 0, 2)
                full = pool.get("matrix", k * W * c, self.assembly_dtype, device).view(k, W * c)
                full.view(k, W, c).copy_(chunks)
                rows = full[:, :numel]
            else:
                full = rows = pool.get("matrix", batch.count * batch.numel, self.assembly_dtype, device).view(
                    batch.count, batch.numel)
                pieces = [(full[j].narrow(0, p.start, p.length),
                           owner_side.narrow(0, starts[s] + slot.owner_offsets[s], p.length))
                          for j, slot in enumerate(batch.members) for s, p in enumerate(slot.pieces) if p.length]
                torch._foreach_copy_([f for f, _ in pieces], [w for _, w in pieces])
            # orthogonalize every block of the view, one batched call per block group; a tensor-parallel batch
            # (batch.tp) arrives in stacked form: rearranged into the full matrices and back
            view = batch.view if batch.view is not None else matrix_view(batch.ns_shape)
            matrices = rows if batch.tp is None else stacked_to_full(rows, batch.tp)
            for blocks in view_blocks(matrices, view):  # as core.matrix.orthogonalize_blocks_, one frame less
                blocks.copy_(fn(blocks))
            if batch.tp is not None:
                full_to_stacked_(rows, matrices, batch.tp)
            # write back as pieces (chunked: the padding past numel zeroed)
            if b.chunked:
                full[:, numel:].zero_()
                chunks.copy_(full.view(k, W, c))
            else:
                torch._foreach_copy_([w for _, w in pieces], [f for f, _ in pieces])
