"""``MuonZeroOptimizer``: DeepSpeed's ZeRO-3 optimizer with ds_muon's steps for Muon and Adam-mini sub-groups.

Layer ``integration``: this class holds only DeepSpeed overrides and dispatches each sub-group to its shard
step, built once at construction: :class:`~ds_muon.sharded.muon_step.MuonShardStep` (Muon: the owner exchange),
:class:`~ds_muon.sharded.adam_mini_step.AdamMiniShardStep` (Adam-mini), or DeepSpeed's own element-wise AdamW.
The rest lives beside it: the NVMe swap guard (:mod:`ds_muon.integration.nvme`), skipped steps and the
trainable set (:mod:`ds_muon.integration.faults`), the monitor (:mod:`ds_muon.integration.monitor`), the
checkpoint overrides (:mod:`ds_muon.integration.zero3_checkpoint`). Checked against deepspeed 0.19.8
(docs/design.md, "Where DeepSpeed is hooked").

When the parent's ``step()`` calls ``_optimizer_step(sub_group_id)``, the sub-group's gradient in
``fp32_partitioned_groups_flat[i].grad`` is final: accumulated over micro-batches, reduced (reduce-scatter or
all-reduce, whichever the config says), unscaled and clipped on the raw global norm; except for a Muon sub-group
the overlapped step commits from the bf16 gradient slice in place, whose ``.grad`` is a zero-stride placeholder
and whose gradient the commit reads from the slice (:meth:`MuonZeroOptimizer._prepare_fp32_grad_for_sub_group`).
Every rank calls it for every sub-group in the same order, so the owner exchange's collectives are safe there.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from ..errors import SUPPORTED_DEEPSPEED, DeepSpeedVersionError
from ..names import ALGORITHM_KEY, BLOCK_ATTR, SPLIT_ATTR
from ..sharded.adam_mini_step import AdamMiniShardStep
from ..sharded.collectives import named_collective
from ..sharded.exchange import BufferPool
from ..partitions import chunked_pieces
from ..sharded.muon_step import MuonShardStep
from ..sharded.overlap import NARROW_GRADS
from ..sharded.ownership import ParamInfo
from .faults import first_non_finite_grad
from .inner import DsMuonInner
from .nvme import SwapGuard
from .overlap import OverlapHooks  # the overlapped Muon step (docs/design.md, "The overlapped step")
from .zero3_checkpoint import ZeroCheckpointing
from .zero_common import AdamMiniSlot, DsMuonZeroSteps

__all__ = ["MuonZeroOptimizer", "AdamMiniSlot"]


class MuonZeroOptimizer(ZeroCheckpointing, OverlapHooks, DsMuonZeroSteps, DeepSpeedZeroOptimizer_Stage3):
    """``DeepSpeedZeroOptimizer_Stage3`` with ds_muon's Muon and Adam-mini sub-group steps (docs/design.md).

    Per Muon sub-group and optimizer step, on the local fp32 shard: the momentum step (element-wise, never
    communicated), the owner exchange with Newton–Schulz on one LPT-balanced owner per matrix, and the
    decoupled-weight-decay update (:mod:`ds_muon.sharded.muon_step`); no gradient, no step per block
    (:mod:`ds_muon.sharded.no_grad`); QK-clip on the local shards after the update. Per Adam-mini sub-group:
    per-block sums of ``g**2`` all-reduced, then the update (:mod:`ds_muon.sharded.adam_mini_step`). The owner
    plans and block maps are built once, identically on every rank. ``__init__`` passes ``*args, **kwargs``
    through unchanged (the keyword set changes between DeepSpeed releases).

    Attributes:
        muon_steps: ``{sub_group: MuonShardStep}``; muon_plans: their owner plans.
        adam_mini_steps: ``{sub_group: AdamMiniShardStep}``; adam_mini_maps: their block maps.
        step_count, muon_step_count, skipped_step_count, qk_clip_stats, ...: see
            :class:`~ds_muon.integration.zero_common.DsMuonZeroSteps`.
        swap_guard: the :class:`~ds_muon.integration.nvme.SwapGuard` under NVMe optimizer offload, else None.
    """

    # Reached by DeepSpeed's own __init__ through the overrides below, before this class's __init__ body runs.
    swap_guard: Optional[SwapGuard] = None
    _stepping = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.optimizer, DsMuonInner):
            raise TypeError("MuonZeroOptimizer needs a ds_muon inner optimizer (ZeroMuonInner or ZeroAdamMiniInner); "
                            "build the engine through ds_muon.initialize or ds_muon.enable()")
        if self.swap_optimizer:  # in case DeepSpeed's step that runs initialize_optimizer_states was renamed
            self._require_swap_guard().check_names()
        self._offloaded_grad_ids: set[int] = set()  # ds_ids whose gradient DeepSpeed offloaded this window
        # zero_optimization.save_muon_momentum_buffer_in_memory: keep Muon momentum out of the NVMe swap.
        self._momentum_in_memory = bool(self.swap_optimizer and self.save_muon_momentum_buffer_in_memory)
        self._device = torch.device(get_accelerator().current_device_name())
        self._pool = BufferPool()
        self._trained_ids = {id(p) for group in self.fp16_groups for p in group}
        self._init_steps()
        self._build_steps()
        self._grad_slices = self._grad_buffer_slices()

    # ---- what the sub-groups are -------------------------------------------------------------
    def sub_group_algorithm(self, i: int) -> str:
        """``"muon"``, ``"adam_mini"`` or ``"adamw"``: the algorithm of sub-group ``i``'s param group."""
        return self._param_group(i)[ALGORITHM_KEY]

    def _param_group(self, i: int) -> dict:
        return self.optimizer.param_groups[self.sub_group_to_group_id[i]]

    def _fp32_partition(self, i: int) -> torch.Tensor:
        return self.fp32_partitioned_groups_flat[i]

    def _partition_group(self, i: int):
        return self._get_sub_group_process_group(i)

    def _offloaded(self) -> bool:
        return bool(self.offload_optimizer)

    def _resident_grad(self, j: int) -> Optional[torch.Tensor]:
        """Muon sub-group ``j``'s gradient before its turn in the step. Without offload: its slice of DeepSpeed's
        ``grad_partitions_flat_buffer`` (its parameters' gradient partitions back to back, where
        :meth:`_grad_buffer_slices` found them once); under CPU offload: its fp32 gradient; NVMe-swapped, or not a
        Muon sub-group: None."""
        if self._swappable_optimizer_subgroup(j):
            return None
        if self.offload_optimizer:
            return self.fp32_partitioned_groups_flat[j].grad
        where = self._grad_slices.get(j)
        if where is None or j not in self.muon_plans or where[1] != self.muon_plans[j].shard_numel:
            return None
        return self.grad_partitions_flat_buffer.narrow(0, *where)

    def _grad_buffer_slices(self) -> dict[int, tuple[int, int]]:
        """``{sub-group: (offset, elements)}``: where each sub-group's gradient partitions lie back to back in
        ``grad_partitions_flat_buffer`` (DeepSpeed lays every sub-group's parameters' partitions out in order), for
        the sub-groups whose partitions tile their fp32 partition exactly; ``{}`` under optimizer offload (there the
        gradient is the fp32 partition's own ``.grad``)."""
        if self.offload_optimizer:
            return {}
        slices, offset = {}, 0
        for j, params in enumerate(self.fp16_groups):
            numel = sum(p.partition_numel() for p in params)
            if numel == self.fp32_partitioned_groups_flat[j].numel():
                slices[j] = (offset, numel)
            offset += numel
        return slices

    def _prepare_fp32_grad_for_sub_group(self, sub_group_id):
        """Give sub-group ``sub_group_id``'s fp32 partition its final gradient as ``.grad``, without a copy where
        that is exact.

        DeepSpeed's own concatenates the sub-group's gradient partitions (``averaged_gradients``, views of
        ``grad_partitions_flat_buffer``, in the gradient accumulation dtype) into a new tensor and converts that to
        float32: per sub-group and step one full-size copy with a float32 buffer (4 bytes per element at the step's
        peak), two with a bfloat16 one (6 during the conversion, then 4). Where those views lie back to back in the
        buffer (checked at each step: the first view starts and the last ends where :meth:`_grad_buffer_slices`
        says), ``.grad`` is that slice of the buffer itself when the buffer is float32 (0 bytes per element, 4
        saved), else the slice converted once (4 bytes per element, 2 saved). The values are DeepSpeed's either
        way (``tests/dist/test_step_overrides.py``, bit for bit). With the view the step may overwrite the buffer
        (DeepSpeed's unscale and clip, the Muon step's ``o``): :meth:`_step_scope` zeroes it after every step,
        applied or skipped, before the next backward writes it. Where the overlapped step will commit this
        sub-group from the bf16 slice itself (:meth:`~ds_muon.integration.overlap.OverlapHooks._commits_in_place`),
        no copy at all: the slice is kept for the commit and ``.grad`` is a zero-stride float32 placeholder until
        then (6 bytes per element less than the converted copy, counting its write and read). Elsewhere (a layout
        DeepSpeed changed, outside a step) DeepSpeed's copy.
        """
        views = self.averaged_gradients.get(sub_group_id)  # DeepSpeed's ZeRO-3 keeps a dict
        where = self._grad_slices.get(sub_group_id)
        buffer = getattr(self, "grad_partitions_flat_buffer", None)
        fp32 = self.fp32_partitioned_groups_flat[sub_group_id]
        if not (self._stepping and views and where is not None and buffer is not None and buffer.device == fp32.device):
            return super()._prepare_fp32_grad_for_sub_group(sub_group_id)
        offset, numel = where
        size = buffer.element_size()
        start = buffer.data_ptr() + offset * size
        if views[0].data_ptr() != start or views[-1].data_ptr() + views[-1].numel() * size != start + numel * size:
            return super()._prepare_fp32_grad_for_sub_group(sub_group_id)
        grad = buffer.narrow(0, offset, numel)
        if grad.dtype in NARROW_GRADS and self._commits_in_place(sub_group_id):
            # the commit reads the slice itself (SpeculativeMuon.commit): no float32 copy; .grad holds a zero-stride
            # placeholder of the right shape meanwhile (DeepSpeed's unscale is skipped: the factor is 1)
            self._grads_in_place[sub_group_id] = grad
            fp32.grad = torch.zeros((), dtype=fp32.dtype, device=fp32.device).expand(numel)
        else:
            fp32.grad = grad if grad.dtype == fp32.dtype else grad.to(fp32.dtype)
        self.averaged_gradients[sub_group_id] = None

    def _name(self, p) -> str:
        return self.param_names.get(p, f"ds_id={p.ds_id}")

    def _sub_group_count(self) -> int:
        return len(self.fp16_groups)

    def _muon_step_for(self, i: int) -> MuonShardStep:
        """Sub-group ``i``'s Muon step on ZeRO-3's chunked layout (each parameter cut in ``W`` chunks).

        Raises:
            RuntimeError: the plan does not cover DeepSpeed's partition (a DeepSpeed layout change).
        """
        infos = [ParamInfo(self._name(p), tuple(p.ds_shape), int(p.ds_numel), getattr(p, SPLIT_ATTR, None))
                 for p in self.fp16_groups[i]]
        step = self._muon_step_of(f"ZeRO sub-group {i}", infos, self._get_sub_group_partition_count(i), None,
                                  self._param_group(i), self._partition_group(i))
        if step.plan.shard_numel != self.fp16_partitioned_groups_flat_numel[i]:
            raise RuntimeError(f"ds_muon: sub-group {i} holds {self.fp16_partitioned_groups_flat_numel[i]} "
                               f"elements but its owner plan covers {step.plan.shard_numel}; this DeepSpeed "
                               "version lays out ZeRO-3 partitions differently than ds_muon expects")
        return step

    def _adam_mini_step_for(self, i: int) -> AdamMiniShardStep:
        """Sub-group ``i``'s Adam-mini step, from the parameters' global numel and block size
        (``param.ds_adam_mini_block``) and DeepSpeed's ``grad_position``.

        Raises:
            RuntimeError: a parameter's block does not divide it, or its chunk is not ZeRO-3's.
        """
        slots = []
        for p in self.fp16_groups[i]:
            _, offset, chunk = self.grad_position[self.get_param_id(p)]
            block, numel = getattr(p, BLOCK_ATTR, None), int(p.ds_numel)
            if not block or numel % block or chunk != -(-numel // self._get_sub_group_partition_count(i)):
                raise RuntimeError(f"ds_muon: Adam-mini parameter {self._name(p)!r} ({numel} elements, block "
                                   f"{block}, chunk {chunk}) does not fit the ZeRO-3 layout ds_muon expects")
            pieces = chunked_pieces(numel, self._get_sub_group_partition_count(i), int(offset))
            slots.append(AdamMiniSlot(self._name(p), tuple(p.ds_shape), numel, pieces, int(block)))
        return self._adam_mini_step_from(f"ZeRO sub-group {i}", sorted(slots, key=lambda s: s.shard_offset),
                                         self._get_sub_group_partition_rank(i),
                                         int(self.fp16_partitioned_groups_flat_numel[i]))

    def _locate_piece(self, p):
        """``(sub-group, this rank's Piece)`` of a trained parameter ``p`` (None: not trained)."""
        if id(p) not in self._trained_ids:
            return None
        i, offset, _ = self.grad_position[self.get_param_id(p)]
        pieces = chunked_pieces(int(p.ds_numel), self._get_sub_group_partition_count(i), offset)
        return i, pieces[self._get_sub_group_partition_rank(i)]

    # ---- NVMe (ds_muon.integration.nvme) -------------------------------------------------------
    @torch.no_grad()
    def _create_fp32_partitions(self):
        """DeepSpeed's, after zeroing each parameter's partition padding (the tail of ``ds_tensor`` past the
        parameter's last element, on the last rank(s)).

        DeepSpeed allocates a partition with ``torch.empty`` and copies only the parameter's elements into it, so
        the padding holds whatever memory was there before, and the fp32 master partitions built here inherit it:
        random bits, a NaN about once in 30 padded elements (an fp16 exponent of all ones). A NaN never equals
        itself, so bit-for-bit state checks failed at random (the fp16 overflow case of test_zero3_parity.py: 7 of
        200 runs of scripts/stress_fp16_overflow.py, always rank 1, one element of an AdamW sub-group), and
        checkpoints carried the garbage. Zeroed, the padding is deterministic, as the oracle's semantics assume.
        """
        for group in self.fp16_groups:
            for p in group:
                rank = dist.get_rank(group=p.ds_process_group) if dist.is_initialized() else 0
                numel = p.partition_numel()
                real = max(0, min(p.ds_numel - rank * numel, numel))
                if real < numel and p.ds_tensor is not None and p.ds_tensor.numel() == numel:
                    p.ds_tensor.data.narrow(0, real, numel - real).zero_()
        return super()._create_fp32_partitions()

    def _configure_tensor_swapping(self, offload_optimizer_config, aio_config):
        """DeepSpeed's, then the :class:`~ds_muon.integration.nvme.SwapGuard` wraps its swapper's async_io handles.

        Raises:
            DeepSpeedVersionError: a DeepSpeed name the NVMe checks rely on is missing.
        """
        super()._configure_tensor_swapping(offload_optimizer_config, aio_config)
        self.swap_guard = SwapGuard(self, self.sub_group_algorithm)
        self.swap_guard.install()

    def _require_swap_guard(self) -> SwapGuard:
        if self.swap_guard is None:
            raise DeepSpeedVersionError(
                "ds_muon: DeepSpeed's ZeRO-3 optimizer set up NVMe swapping without calling "
                f"_configure_tensor_swapping, so ds_muon's swap I/O checks are not installed. ds_muon supports "
                f"deepspeed{SUPPORTED_DEEPSPEED} (tested with 0.19.8): install one, or offload the optimizer to the CPU")
        return self.swap_guard

    def initialize_optimizer_states(self) -> None:
        """DeepSpeed's, after the swap guard's checks (its first swap-in is in there); then every rank agrees that
        the initial swap writes succeeded.

        Raises:
            ConfigError: ``offload_optimizer.buffer_count`` or the swap filesystem is too small.
            NvmeSwapError: a swap file could not be written (on every rank).
        """
        if self.swap_optimizer:
            self._require_swap_guard().check_before_first_swap()
        super().initialize_optimizer_states()
        if self.swap_optimizer:
            self.swap_guard.agree("the initial swap-out of the optimizer state")

    def swap_buffers_needed(self) -> int:
        """Pinned swap buffers DeepSpeed's optimizer swapper needs (:meth:`ds_muon.integration.nvme.SwapGuard.buffers_needed`)."""
        return self._require_swap_guard().buffers_needed()

    def swap_bytes_needed(self) -> int:
        """Bytes of NVMe swap files this rank writes (:meth:`ds_muon.integration.nvme.SwapGuard.bytes_needed`)."""
        return self._require_swap_guard().bytes_needed()

    def _refuse_after_swap_failure(self) -> None:
        if self.swap_guard is not None:
            self.swap_guard.refuse_if_failed()

    def _agree_on_swap_errors(self, what: str) -> None:
        if self.swap_optimizer:
            self.swap_guard.agree(what)

    # ---- the step ------------------------------------------------------------------------------
    def step(self, closure=None):
        """DeepSpeed's ZeRO-3 step; counts the steps that were not skipped for overflow.

        Afterwards the exchange's buffer pool is released to the caching allocator (see
        :class:`~ds_muon.sharded.exchange.BufferPool`) and the gradient partitions are zeroed. DeepSpeed copies a
        parameter's gradient into its partition on the window's first micro-step and adds on later ones, so a
        parameter that gets no gradient in a step (or in the first micro-step) would otherwise be stepped with last
        step's gradient again. Zeroed, such a parameter sees a zero gradient, the oracle's semantics.

        Raises:
            NvmeSwapError: on every rank, after a step in which some rank's NVMe swap write or read failed (and at
                every later step).
            RuntimeError: a parameter's ``requires_grad`` changed since initialize; too many skipped steps in a row.
        """
        self._refuse_after_swap_failure()
        with self._step_scope("ZeRO-3") as stats:
            super().step(closure)
        self._agree_on_swap_errors("an optimizer step")
        rank0 = self.dp_process_group is None or dist.get_rank(group=self.dp_process_group) == 0
        self._after_step(self.overflow, stats, rank0)

    def _get_norm_groups(self):
        """DeepSpeed's per-sub-group gradient norms; inside a step first the no-gradient flags of every resident
        Muon sub-group (:meth:`_agree_flags_ahead`): DeepSpeed's step reads the combined norm on the host right after
        (``is_invalid_grad_norm``), and that read brings the flags with it (one host sync for both)."""
        if self._stepping:
            self._agree_flags_ahead()
        return super()._get_norm_groups()

    def _loss_scale_update_and_overflow_cleanup(self):
        """DeepSpeed's; on a skipped step first finds the parameter to name (the gradients are still there:
        DeepSpeed's clean-up drops them)."""
        if self.overflow and self._stepping:
            self.skips.last_param = first_non_finite_grad(self, self._offloaded_grad_ids)
        return super()._loss_scale_update_and_overflow_cleanup()

    def _clean_after_step(self) -> None:
        self._offloaded_grad_ids.clear()
        self._zero_grad_partitions()

    def _zero_grad_partitions(self) -> None:
        if getattr(self, "grad_partitions_flat_buffer", None) is not None:
            self.grad_partitions_flat_buffer.zero_()
        if self.offload_optimizer:
            for i, fp32 in enumerate(self.fp32_partitioned_groups_flat):
                if fp32.grad is not None and not self._swappable_optimizer_subgroup(i):
                    fp32.grad.zero_()

    def reduce_ready_partitions_and_remove_grads(self, param):
        """DeepSpeed's (the gradient hook); a failed gradient reduce-scatter names itself."""
        with named_collective("DeepSpeed's gradient reduce-scatter (ZeRO-3, in backward)"):
            return super().reduce_ready_partitions_and_remove_grads(param)

    def independent_gradient_partition_epilogue(self):
        """DeepSpeed's (reduces the last gradient bucket after backward); a failure names the collective."""
        with named_collective("DeepSpeed's gradient reduce-scatter (ZeRO-3, end of backward)"):
            return super().independent_gradient_partition_epilogue()

    def _offload_grad_partition_at_boundary(self, param, *args, **kwargs):
        """DeepSpeed's; also records that ``param``'s gradient was offloaded in this window."""
        self._offloaded_grad_ids.add(param.ds_id)
        return super()._offload_grad_partition_at_boundary(param, *args, **kwargs)

    def _prepare_sub_group(self, sub_group_id: int, timer_names) -> None:
        """DeepSpeed's (swap-in under NVMe), then, inside a step, :meth:`_fix_swapped_grad`: before DeepSpeed
        unscales and clips the gradient, which needs it to exist."""
        super()._prepare_sub_group(sub_group_id, timer_names)
        if self._stepping and self._swappable_optimizer_subgroup(sub_group_id):
            self._fix_swapped_grad(sub_group_id)

    def _fix_swapped_grad(self, i: int) -> None:
        """Make a swapped (NVMe) sub-group's gradient this step's, with zeros where there was none.

        The swapper swaps in the gradient fragments DeepSpeed offloaded at the end of this accumulation window
        into a pinned buffer that still holds older data elsewhere, and leaves ``grad`` None when no fragment of
        the sub-group was ever swapped out. A parameter whose gradient was not offloaded in this window would
        therefore read stale values; the oracle reads zeros. No extra I/O: the fix is in memory.
        """
        fp32 = self.fp32_partitioned_groups_flat[i]
        if fp32.grad is None:
            fp32.grad = torch.zeros_like(fp32)
            return
        for param in self.fp16_groups[i]:
            if param.ds_id not in self._offloaded_grad_ids:
                _, offset, numel = self.grad_position[self.get_param_id(param)]
                fp32.grad.narrow(0, offset, numel).zero_()

