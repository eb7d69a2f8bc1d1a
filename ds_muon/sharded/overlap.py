"""The Muon step run speculatively in the last micro-batch's backward, exactly (layer ``sharded``: no DeepSpeed).

docs/design.md, "The overlapped step". As ZeRO reduces each gradient bucket on the last micro-batch, the Muon
parameters whose gradient partitions are final are marked (:meth:`SpeculativeMuon.mark_final`); when every
parameter of an owner-plan bucket is final, that bucket's update is computed without touching the momentum or the
gradient: ``u = lerp(g/s, beta*m + (1-beta)*g/s, beta)`` (Nesterov) or ``beta*m + (1-beta)*g/s`` into a scratch
buffer (``s`` the loss scale, clip coefficient 1 assumed), the owner exchange and Newton–Schulz of the bucket, and
the orthogonalized update ``o`` (this rank's chunks) kept in a stash. At the step, :meth:`SpeculativeMuon.commit`
applies ``m <- beta*m + (1-beta)*g`` (the same kernel as today) and ``p <- p*(1-lr*wd) - lr*o`` from the stash;
any step where that would not be exact (clipping fired, a block had no gradient, the sub-group was not fully
speculated, the loss scale changed) is left to the ordinary step, which is exact because ``g`` and ``m`` are as
they were. Every rank marks the same parameters in the same order (ZeRO's reduce-scatter sequence is the same on
every rank), so the buckets' collectives are issued in the same order everywhere.

Memory per rank: one stash of the local Muon shard per speculated sub-group in the exchange dtype
(``shard_numel * exchange_dtype.itemsize`` bytes, bf16 by default off the CPU), plus one fp32 scratch of the
shard (``4 * shard_numel`` bytes) while a sub-group's buckets are being speculated, plus a momentum copy of at most
:data:`RUN_ELEMENTS` elements at a time, plus the exchange's own bucket buffers (its own
:class:`~ds_muon.sharded.exchange.BufferPool`).
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable, Optional

import torch
from torch.profiler import record_function

from .muon_step import MuonShardStep
from .exchange import OwnerExchange

__all__ = ["SpeculativeMuon", "FALLBACK_REASONS", "RUN_ELEMENTS"]

#: the longest stretch of the shard one speculative momentum call covers (elements): its momentum copy, a
#: temporary of ``RUN_ELEMENTS * 4`` bytes at most (64 MiB), lives on the side stream during backward.
RUN_ELEMENTS = 1 << 24

#: why a sub-group's step fell back to the ordinary path: the clip coefficient was not 1, the step was skipped for
#: an fp16 overflow (or never came), a block had no gradient on any rank, the sub-group's speculation was not
#: complete (a parameter without gradient, or a gradient reduced again after its bucket started).
FALLBACK_REASONS = ("clip", "overflow", "no_grad_block", "not_ready")


class _SubGroupState:
    """One Muon sub-group's speculation in one step: buckets still waiting, the scratch ``u`` and the stash ``o``."""

    def __init__(self, step: MuonShardStep) -> None:
        self.waiting = [{s.index for s in b.slots} for b in step.plan.buckets]
        self.started = [False] * len(self.waiting)
        self.stale = False
        self.u: Optional[torch.Tensor] = None
        self.stash: Optional[torch.Tensor] = None
        self.loss_scale: Optional[float] = None

    @property
    def complete(self) -> bool:
        return not self.stale and all(self.started)


class SpeculativeMuon:
    """The speculative Muon step of every Muon sub-group of one optimizer.

    Args:
        steps: ``{sub_group: MuonShardStep}``, the ordinary steps (plans, block maps, the step's exchange).
        exchanges: ``{sub_group: OwnerExchange}`` for the speculative exchange: same plan, its own process group
            where the step's runs on a communicator that may be in use on another stream (CUDA), and its own pool.
        stream: the side stream the speculative work runs on (CUDA), or None (inline: CPU, or no streams).

    Attributes:
        commits: sub-group steps that applied a stash. fallbacks: ``Counter`` over :data:`FALLBACK_REASONS`.
    """

    def __init__(self, steps: dict[int, MuonShardStep], exchanges: dict[int, OwnerExchange],
                 stream: Optional[torch.cuda.Stream] = None) -> None:
        self.steps, self.exchanges, self.stream = steps, exchanges, stream
        self.commits = 0
        self.fallbacks: Counter = Counter({r: 0 for r in FALLBACK_REASONS})
        self._state: dict[int, _SubGroupState] = {}
        self._run_cache: dict[tuple[int, int], list[tuple[int, int]]] = {}

    def stats(self) -> dict:
        """``{"commits": int, "fallback_<reason>": int, ...}`` since construction (for the monitor and benchmarks)."""
        return {"commits": self.commits, **{f"fallback_{r}": n for r, n in self.fallbacks.items()}}

    def active(self) -> bool:
        """Whether some speculation of this step is held (started, not yet committed or discarded)."""
        return bool(self._state)

    @torch.no_grad()
    def mark_final(self, finals: Iterable[tuple[int, int]], grad_of: Callable[[int], torch.Tensor],
                   momentum_of: Callable[[int], Optional[torch.Tensor]], group_of: Callable[[int], dict],
                   loss_scale: float, wait_for: Optional[torch.cuda.Stream] = None) -> None:
        """Record that these parameters' gradient partitions are final and speculate every bucket now complete.

        Collective over each started bucket's partition group (the exchange's all_to_all): every rank must call it
        with the same ``finals`` in the same order.

        Args:
            finals: ``(sub_group, parameter index in the sub-group)`` in ZeRO's reduce order.
            grad_of: sub-group -> its ``(n,)`` gradient partition (any float dtype, before unscaling; read only), or
                None where it is not one resident slice (the sub-group is then left to the ordinary step).
            momentum_of: sub-group -> its momentum (``(n,)``, fp32 or bf16), or None before the first step; read only.
            group_of: sub-group -> its param group (``momentum``, ``nesterov``, NS settings read now).
            loss_scale: the loss scale the gradients carry (1.0 without fp16).
            wait_for: the stream that wrote the gradients (the side stream waits on it), or None.
        """
        ready = []
        for i, index in finals:
            st = self._state.get(i)
            if st is None:
                st = self._state[i] = _SubGroupState(self.steps[i])
            for k, waiting in enumerate(st.waiting):
                if index in waiting:
                    waiting.discard(index)
                    if not waiting:
                        ready.append((i, k))
                elif st.started[k] and any(index == s.index for s in self.steps[i].plan.buckets[k].slots):
                    st.stale = True  # reduced again after its bucket was speculated: this speculation is void
        if not ready:
            return
        if self.stream is None:
            for i, k in ready:
                self._speculate(i, k, grad_of(i), momentum_of(i), group_of(i), loss_scale)
            return
        self.stream.wait_stream(wait_for or torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for i, k in ready:
                grad, momentum = grad_of(i), momentum_of(i)
                if grad is not None:
                    grad.record_stream(self.stream)
                self._speculate(i, k, grad, momentum, group_of(i), loss_scale)

    def _speculate(self, i: int, k: int, grad: torch.Tensor, momentum: Optional[torch.Tensor], group: dict,
                   loss_scale: float) -> None:
        st, step = self._state[i], self.steps[i]
        st.started[k] = True
        if grad is None:  # the gradient is not resident as one slice of the shard: leave it to the step
            st.stale = True
        if st.stale:
            return
        if st.loss_scale is None:
            st.loss_scale = loss_scale
        elif st.loss_scale != loss_scale:
            st.stale = True
            return
        n, exchange = step.plan.shard_numel, self.exchanges[i]
        if st.u is None:
            st.u = torch.zeros(n, dtype=torch.float32, device=grad.device)
            st.stash = torch.zeros(n, dtype=exchange.exchange_dtype, device=grad.device)
        bucket = step.plan.buckets[k]
        with record_function("ds_muon/speculative_momentum"):
            for lo, length in self._runs(i, k):  # a handful of launches per bucket, not a handful per matrix
                g = st.u.narrow(0, lo, length)
                g.copy_(grad.narrow(0, lo, length))
                if loss_scale != 1.0:
                    g.mul_(1. / loss_scale)  # DeepSpeed's unscale with clip coefficient 1 (stage3 unscale_and_clip_grads)
                m = (torch.zeros(length, dtype=getattr(torch, group["momentum_dtype"]), device=g.device)
                     if momentum is None else momentum.narrow(0, lo, length).clone())
                u = step.prepare(g, m, group)
                if u.data_ptr() != g.data_ptr():
                    g.copy_(u)
        with record_function("ds_muon/speculative_exchange_and_newton_schulz"):
            exchange.run(bucket, st.u, st.stash, step._orthogonalizer(group))
        if all(st.started):
            st.u = None  # the scratch is free once every bucket is exchanged

    def _runs(self, i: int, k: int) -> list[tuple[int, int]]:
        """``[(shard offset, length), ...]``: this rank's pieces of bucket ``k`` of sub-group ``i``, adjacent pieces
        merged (a bucket of consecutive layers is a few runs), each at most :data:`RUN_ELEMENTS` long (the momentum
        copy of a run is a temporary), built once. Element-wise work on a run equals the same work piece by piece."""
        key = (i, k)
        runs = self._run_cache.get(key)
        if runs is None:
            rank = self.exchanges[i].rank
            pieces = sorted((s.pieces[rank].shard_offset, s.pieces[rank].sent)
                            for s in self.steps[i].plan.buckets[k].slots if s.pieces[rank].sent)
            merged: list[tuple[int, int]] = []
            for lo, length in pieces:
                if merged and merged[-1][0] + merged[-1][1] == lo:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((lo, length))
            runs = [(lo + start, min(RUN_ELEMENTS, length - start))
                    for lo, length in merged for start in range(0, length, RUN_ELEMENTS)]
            self._run_cache[key] = runs
        return runs

    def join(self) -> None:
        """Make the current stream wait for the speculative work (call before the first commit)."""
        if self.stream is not None and self._state:
            torch.cuda.current_stream().wait_stream(self.stream)

    @torch.no_grad()
    def commit(self, i: int, fp32: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor,
               had: Optional[torch.Tensor], clipped: bool, group: dict) -> bool:
        """Apply sub-group ``i``'s speculation if that is exact, else count why not and leave the step to the caller.

        Exact when the speculation is complete, ``clipped`` is False (DeepSpeed's combined scale was the loss scale
        the speculation divided by) and every block had a gradient: then ``m <- beta*m + (1-beta)*g`` (the same
        kernel as :meth:`MuonShardStep.prepare`, on the final ``g``) and ``p <- p*(1-lr*wd) - lr*o`` with the stash
        (:meth:`MuonShardStep.finalize`, lr and weight decay read now). The same decision on every rank (its inputs
        are agreed: the global norm, the agreed flags, the same reduce sequence).

        Args:
            fp32: ``(n,)`` float32 partition. grad: ``(n,)`` float32 final gradient (overwritten).
            momentum: ``(n,)`` momentum. had: the agreed no-gradient flags (None: all had).
            clipped: whether the gradient clipping fired this step.

        Returns:
            True: committed (the caller must not step); False: the caller runs the ordinary step.
        """
        st = self._state.pop(i, None)
        if st is None or not st.complete:
            reason = "not_ready"
        elif clipped:
            reason = "clip"
        elif had is not None and not bool(had.all()):
            reason = "no_grad_block"
        else:
            reason = None
        if reason is not None:
            self.fallbacks[reason] += 1
            return False
        step = self.steps[i]
        if self.stream is not None:
            st.stash.record_stream(torch.cuda.current_stream())  # allocated on the side stream, read here
        step.prepare(grad, momentum, group)
        o = grad.copy_(st.stash)  # the fp32 values today's exchange writes (the stash holds the wire dtype's)
        step.finalize(fp32, o, group)
        self.commits += 1
        return True

    def discard(self, reason: Optional[str]) -> None:
        """Drop every held speculation (a skipped step, a backward that never reached a step); count it as
        ``reason`` per sub-group (None: not counted)."""
        if reason is not None:
            self.fallbacks[reason] += len(self._state)
        self._state.clear()
