"""The DeepSpeed hook of the overlapped Muon step at ZeRO stages 1 and 2 (no optimizer offload): docs/design.md,
"The overlapped step".

:class:`FlatOverlapHooks` is a mixin of :class:`~ds_muon.integration.zero12.MuonZero12Optimizer` (before
``DsMuonZeroSteps`` in its bases). Everything but the backward hook is the ZeRO-3 mixin's
(:class:`~ds_muon.integration.overlap.OverlapHooks`: the build, the step's join and discard, the commit in
``_commit_speculation``, ``zero_grad``); its ``partition_grads`` is a ZeRO-3 method that DeepSpeed's ZeRO-1/2
optimizer never calls. It hooks DeepSpeed 0.19.8's ``DeepSpeedZeroOptimizer`` at:

- ``reduce_ipg_grads(comm_dtype)``: called during backward for each full reduce bucket
  (``reduce_independent_p_g_buckets_and_remove_grads``) and once at its end for the rest
  (``independent_gradient_partition_epilogue``). When it returns, the bucket's gradients are reduced
  (``average_tensor``'s reduce-scatter, or the all-reduce of ``buffered_reduce_fallback``) and, with
  ``contiguous_gradients``, copied into ``grads_in_partition``; with ``overlap_comm`` that work was queued on
  DeepSpeed's ``reduction_stream``. The same buckets in the same order on every rank (the reduction is a
  collective over them), so on the last micro-batch the Muon parameters of the bucket are final in the same
  order everywhere. This rank's piece of each (``partitions.flat_pieces``) is copied into a gradient partition
  of the param group's flat layout, ``(partition_size,)`` in the gradient dtype, built up bucket by bucket
  (DeepSpeed assembles its own flat partition only in the epilogue, ``averaged_gradients``); with gradient
  accumulation the piece is DeepSpeed's sum, ``all_grad_tensors`` (the earlier micro-batches, added in each
  epilogue) plus this micro-batch's reduced gradient, the same addition in the same dtype. Then the parameters
  are marked final (:meth:`~ds_muon.sharded.overlap.SpeculativeMuon.mark_final`), which speculates every owner-plan
  bucket now complete. A param group whose gradient DeepSpeed accumulates in its fp32 compact partition
  (``gradient_accumulation_dtype`` fp32 with a bf16/fp16 model) hands over that partition itself.

ZeRO stage 1 reduces on the last micro-batch only: with ``overlap_comm`` bucket by bucket in its backward
(``process_gradients`` -> ``reduce_ready_partitions_and_remove_grads``), the same ``reduce_ipg_grads`` and the
same hook as stage 2; without it after backward (the engine's ``allreduce_gradients`` -> ``reduce_gradients``),
where nothing would overlap, so ``overlap_backward: true`` is refused there, naming ``overlap_comm``
(:meth:`FlatOverlapHooks._overlap_wanted`).

Memory per rank beyond :mod:`ds_muon.sharded.overlap`'s: the flat gradient partition of each Muon param group,
``partition_size * gradient itemsize`` bytes, allocated at the first boundary backward and kept (none where
DeepSpeed's own fp32 partition is handed over).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from deepspeed.accelerator import get_accelerator

from ..errors import ConfigError
from .overlap import OverlapHooks

__all__ = ["FlatOverlapHooks"]


class FlatOverlapHooks(OverlapHooks):
    """The overlapped Muon step's hook on DeepSpeed's ZeRO-1/2 optimizer (see the module docstring).

    Attributes:
        speculative, overlap_stats: as :class:`~ds_muon.integration.overlap.OverlapHooks`.
    """

    _overlap_grads: dict = {}
    _overlap_accumulated: dict = {}

    def _overlap_auto(self) -> bool:
        """``"auto"`` is off at ZeRO-1/2: this path has not been measured on a GPU yet."""
        return False

    def _overlap_wanted(self, plans_built: bool = True) -> bool:
        """:meth:`OverlapHooks._overlap_wanted`, and at ZeRO-1/2 also refused where DeepSpeed does not reduce
        during backward (stage 1 without ``overlap_comm``) or where the ranks of one exchange need not reduce the
        same buckets (AutoTP).

        Raises:
            ConfigError: ``overlap_backward`` true with optimizer offload, at ZeRO stage 1 without
                ``overlap_comm``, or with AutoTP.
        """
        if not super()._overlap_wanted(plans_built):
            return False
        if not self.partition_gradients and not self.overlap_comm:
            raise ConfigError("ds_muon: optimizer.params.overlap_backward is true, but at ZeRO stage 1 without "
                              "zero_optimization.overlap_comm DeepSpeed reduces the gradients after backward, so "
                              "there is nothing to overlap; set zero_optimization.overlap_comm true (DeepSpeed then "
                              "reduces bucket by bucket during the last micro-batch's backward), or use stage 2 or 3, "
                              "or overlap_backward \"auto\" or false")
        if self.tensor_parallel is not None:
            raise ConfigError("ds_muon: optimizer.params.overlap_backward is true, but with AutoTP "
                              "(tensor_parallel.autotp_size > 1) the overlapped Muon step is not served; use "
                              "overlap_backward \"auto\" or false")
        return True

    def _build_overlap(self) -> None:
        """:meth:`OverlapHooks._build_overlap`, with no flat gradient partition yet (built on first use) and each
        Muon parameter's place in DeepSpeed's ``all_grad_tensors[i]`` (its index in ``params_in_partition[i]``)."""
        self._overlap_grads = {}
        self._overlap_accumulated = {id(p): k for i in self.muon_steps
                                     for k, p in enumerate(self.params_in_partition[i])}
        super()._build_overlap()

    def _overlap_keys(self) -> dict:
        """``{id(param): (param group, index in the group's owner plan)}`` of every Muon parameter (the plan's
        index is the parameter's position in ``round_robin_bit16_groups``, ``MuonZero12Optimizer._infos``)."""
        return {id(p): (i, k) for i in self.muon_steps for k, (p, _) in enumerate(self.pieces[i])}

    # ---- backward ------------------------------------------------------------------------------
    def reduce_ipg_grads(self, comm_dtype=None):
        """DeepSpeed's; then on the last micro-batch this rank's pieces of the bucket's Muon parameters are final:
        copy them into the flat gradient partition and start every owner-plan bucket now complete
        (:meth:`~ds_muon.sharded.overlap.SpeculativeMuon.mark_final`, in the bucket's order: the same on every rank)."""
        spec = self.speculative
        if spec is None:
            return super().reduce_ipg_grads(comm_dtype)
        if not self.is_gradient_accumulation_boundary():
            spec.discard(None)  # an earlier boundary backward never reached a step
            return super().reduce_ipg_grads(comm_dtype)
        buckets = getattr(self, "ipg_buckets", {})
        dtypes = sorted(buckets, key=str) if comm_dtype is None else [comm_dtype]
        params = [self.bit16_groups[g][k] for d in dtypes if d in buckets for g, k, _ in buckets[d].params]
        out = super().reduce_ipg_grads(comm_dtype)
        finals = [self._overlap_index[id(p)] for p in params if id(p) in self._overlap_index]
        if finals:
            # where DeepSpeed's reduce_ipg_grads left the reduced gradients: its reduction stream with overlap_comm
            stream = self.reduction_stream if self.overlap_comm else None
            with get_accelerator().stream(stream) if stream is not None else contextlib.nullcontext():
                for i, k in finals:
                    self._collect_piece(i, k)
            spec.mark_final(finals, self._speculative_grad, self._speculative_momentum, self._param_group,
                            float(self.loss_scale), wait_for=stream)
        return out

    def _collect_piece(self, i: int, k: int) -> None:
        """Copy this rank's piece of parameter ``k`` of Muon param group ``i`` (plan order), its gradient final, into
        the group's flat gradient partition: this micro-batch's reduced gradient plus, with gradient accumulation,
        the earlier micro-batches' sum DeepSpeed holds in ``all_grad_tensors`` (the same ``add`` in the same dtype as
        its epilogue's). Nothing where DeepSpeed accumulates into its own flat fp32 partition."""
        p, pieces = self.pieces[i][k]
        piece = pieces[self._rank(i)]
        if not piece.length or self._use_compact_grad_partition_buffer(i):
            return
        grad = self.get_gradient_for_reduction(p).reshape(-1).narrow(0, piece.start, piece.length)
        flat = self._overlap_grads.get(i)
        if flat is None:
            flat = self._overlap_grads[i] = torch.zeros(int(self.partition_size[i]), dtype=grad.dtype,
                                                        device=grad.device)
        out = flat.narrow(0, piece.shard_offset, piece.length)
        earlier = self.all_grad_tensors.get(i)
        if earlier is None:
            out.copy_(grad)
        else:
            earlier = earlier[self._overlap_accumulated[id(p)]].reshape(-1).narrow(0, piece.start, piece.length)
            torch.add(earlier, grad, out=out)

    def _speculative_grad(self, i: int) -> Optional[torch.Tensor]:
        """Muon param group ``i``'s ``(partition_size,)`` gradient partition as built in backward (final where the
        marked parameters' pieces lie; read only): DeepSpeed's flat fp32 partition where it accumulates in one, else
        the one :meth:`_collect_piece` fills (zeros where it has no piece yet)."""
        if self._use_compact_grad_partition_buffer(i):
            return self._get_compact_grad_partition_buffer(i).flat_partition
        flat = self._overlap_grads.get(i)
        if flat is None:  # no piece of this group on this rank: an empty partition's worth of zeros
            flat = self._overlap_grads[i] = torch.zeros(int(self.partition_size[i]), dtype=self.dtype,
                                                        device=self._device)
        return flat
