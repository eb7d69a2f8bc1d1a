"""``MuonZero12Optimizer``: DeepSpeed's ZeRO-1/2 optimizer with ds_muon's steps for Muon and Adam-mini param groups.

Layer ``integration``: DeepSpeed overrides only; the step itself is the one ZeRO-3 runs
(:class:`~ds_muon.sharded.muon_step.MuonShardStep`, :class:`~ds_muon.sharded.adam_mini_step.AdamMiniShardStep`),
built on ZeRO-1/2's flat layout (:func:`ds_muon.partitions.flat_pieces`). Checked against deepspeed 0.19.8
(docs/design.md, "Where DeepSpeed is hooked").

The layout: DeepSpeed's ``DeepSpeedZeroOptimizer`` flattens each param group into one buffer (its parameters
in ``round_robin_bit16_groups[i]`` order, at ``round_robin_bit16_offsets[i]``, with alignment padding) and cuts
it into ``W`` equal partitions of ``partition_size[i]`` elements; rank ``r`` keeps the fp32 master copy of
partition ``r`` (``single_partition_of_fp32_groups[i]``), so a parameter can start on one rank and end on
another. The owner plan takes each parameter's piece on every rank as input and sends exactly those pieces; a
matrix that lies inside one rank's partition is owned by that rank where the load balance allows, and then
costs no exchange at all (:func:`ds_muon.sharded.ownership.build_plan`).

When DeepSpeed's ``step()`` calls ``_optimizer_step(i)``, group ``i``'s gradient partition in
``single_partition_of_fp32_groups[i].grad`` is final: accumulated over micro-batches, reduced, unscaled and
clipped on the raw global norm; every rank calls it for every group in the same order, so the owner exchange's
collectives are safe there. DeepSpeed then copies the fp32 partition into the bf16/fp16 one and all-gathers
the parameters.

DeepSpeed 0.19.8's own ZeRO-1/2 Muon path switches on when the inner optimizer's class name contains "muon"
(``DeepSpeedZeroOptimizer._is_muon_group``); it then runs Newton–Schulz on every gradient partition it
builds, per micro-batch. ds_muon keeps it off by an explicit switch,
:class:`~ds_muon.integration.builtin_muon.BuiltinMuonSwitch` (``builtin_muon = False``), not by a class name: the
inner optimizer is :class:`~ds_muon.integration.inner.ZeroMuonInner` at every stage.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from ..names import ALGORITHM_KEY, BLOCK_ATTR, SPLIT_ATTR
from ..sharded.adam_mini_step import AdamMiniShardStep
from ..sharded.muon_step import MuonShardStep
from ..sharded.exchange import BufferPool
from ..partitions import Piece, flat_pieces
from ..sharded.ownership import ParamInfo
from .builtin_muon import BuiltinMuonSwitch
from .inner import DsMuonInner
from .overlap12 import FlatOverlapHooks  # the overlapped Muon step (docs/design.md, "The overlapped step")
from .tensor_parallel import TensorParallelLayout, autotp_world, tensor_parallel_split
from .zero12_checkpoint import FlatCheckpointing
from .zero_common import AdamMiniSlot, DsMuonZeroSteps

__all__ = ["MuonZero12Optimizer"]


class MuonZero12Optimizer(FlatCheckpointing, FlatOverlapHooks, DsMuonZeroSteps, BuiltinMuonSwitch,
                          DeepSpeedZeroOptimizer):
    """``DeepSpeedZeroOptimizer`` (ZeRO stage 1 or 2) with ds_muon's Muon and Adam-mini param-group steps.

    Per Muon param group and optimizer step, on this rank's flat fp32 partition ``(partition_size,)``: the
    momentum step (element-wise, never communicated), the owner exchange (all_to_all of this rank's pieces to
    each matrix's owner rank, Newton–Schulz there, all_to_all back), and the decoupled-weight-decay update; no
    gradient, no step per block (:mod:`ds_muon.sharded.no_grad`); QK-clip on the partitions after the update.
    Per Adam-mini group: per-block sums of ``g**2`` all-reduced, then the update. AdamW groups go to
    DeepSpeed's own step (FusedAdam, DeepSpeedCPUAdam under CPU offload, or torch's AdamW). The owner plans and
    block maps are built once, identically on every rank. ``__init__`` passes ``*args, **kwargs`` through
    unchanged; ``module`` (the engine's model, which DeepSpeed's ZeRO-1/2 optimizer is not given) is ds_muon's.

    Attributes:
        muon_steps: ``{param group: MuonShardStep}``; muon_plans: their owner plans.
        adam_mini_steps: ``{param group: AdamMiniShardStep}``; adam_mini_maps: their block maps.
        pieces: per param group, ``[(param, its Piece on every rank)]`` in the flat buffer's order.
        step_count, muon_step_count, skipped_step_count, qk_clip_stats, ...: see
            :class:`~ds_muon.integration.zero_common.DsMuonZeroSteps`.

    Checkpoints: :class:`~ds_muon.integration.zero12_checkpoint.FlatCheckpointing` (metadata, fit checks,
    universal checkpoints). The overlapped step (``overlap_backward``; ``speculative``, ``overlap_stats``):
    :class:`~ds_muon.integration.overlap12.FlatOverlapHooks`.

    Raises:
        TypeError: the inner optimizer is not ds_muon's.
        ConfigError: ``ns_autotune`` would make too many static Newton–Schulz graphs; QK-clip on a frozen weight;
            ``overlap_backward`` true where it is not served (:meth:`FlatOverlapHooks._overlap_wanted`).
        ValueError: a parameter does not fit the partitions DeepSpeed reports (a DeepSpeed layout change).
    """

    _stepping = False
    _states_linked = False

    def __init__(self, *args, module: Optional[torch.nn.Module] = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if module is None:
            raise TypeError("MuonZero12Optimizer needs the engine's module (module=...); ds_muon's engine hook "
                            "passes it")
        self.module = module
        if not isinstance(self.optimizer, DsMuonInner):
            raise TypeError("MuonZero12Optimizer needs a ds_muon inner optimizer (ZeroMuonInner or "
                            "ZeroAdamMiniInner); build the engine through ds_muon.initialize or ds_muon.enable()")
        # DeepSpeed replaces optimizer.param_groups by [group i] while it steps group i: read them once here.
        self._algorithms = [g[ALGORITHM_KEY] for g in self.optimizer.param_groups]
        self._device = torch.device(get_accelerator().current_device_name())
        self._pool = BufferPool()
        self._init_steps()
        self.pieces = [self._group_pieces(i) for i in range(len(self.bit16_groups))]
        self._pieces_by_id = {id(p): (i, pieces) for i, group in enumerate(self.pieces) for p, pieces in group}
        # AutoTP with tp_mode "full": each Muon group's exchange runs over the tensor-parallel x data-parallel ranks
        self.tensor_parallel = (TensorParallelLayout(self.dp_process_group)
                                if autotp_world(module) > 1 and getattr(self.optimizer.config, "tp_mode", "full") == "full" else None)
        self._build_steps()

    # ---- the layout ------------------------------------------------------------------------------
    def _world(self, i: int) -> int:
        return dist.get_world_size(group=self.real_dp_process_group[i])

    def _rank(self, i: int) -> int:
        return dist.get_rank(group=self.real_dp_process_group[i])

    def _group_pieces(self, i: int) -> list[tuple[torch.nn.Parameter, tuple[Piece, ...]]]:
        """Every parameter of group ``i`` with its :class:`Piece` on every rank (from DeepSpeed's offsets; the
        shapes from its meta tensors, which stay valid when parameter storage is swapped out)."""
        size, world = int(self.partition_size[i]), self._world(i)
        return [(p, flat_pieces(int(offset), meta.numel(), size, world))
                for p, meta, offset in zip(self.round_robin_bit16_groups[i], self.round_robin_bit16_meta[i],
                                           self.round_robin_bit16_offsets[i])]

    def _name(self, p) -> str:
        return self.param_names.get(p, f"param of shape {tuple(p.shape)}")

    def _infos(self, i: int) -> list[ParamInfo]:
        return [ParamInfo(self._name(p), tuple(meta.shape), meta.numel(), getattr(p, SPLIT_ATTR, None), pieces)
                for (p, pieces), meta in zip(self.pieces[i], self.round_robin_bit16_meta[i])]

    def _muon_layout(self, i: int) -> tuple[list[ParamInfo], int]:
        """Group ``i``'s plan parameters and the size of the group its exchange runs over: this rank's
        data-parallel group, or under AutoTP with ``tp_mode: "full"`` the tensor-parallel x data-parallel ranks
        (:class:`~ds_muon.integration.tensor_parallel.TensorParallelLayout`)."""
        if self.tensor_parallel is None:
            return self._infos(i), self._world(i)
        splits = {self._name(p): getattr(p, SPLIT_ATTR, None) for p, _ in self.pieces[i]}
        params = [(self._name(p), tuple(meta.shape), tensor_parallel_split(p, self._name(p)), pieces)
                  for (p, pieces), meta in zip(self.pieces[i], self.round_robin_bit16_meta[i])]
        infos = self.tensor_parallel.infos(f"ZeRO param group {i}", params, splits.get)
        return infos, len(self.tensor_parallel.coords)

    def sub_group_algorithm(self, i: int) -> str:
        """``"muon"``, ``"adam_mini"`` or ``"adamw"``: param group ``i``'s algorithm (read once at construction:
        DeepSpeed replaces ``optimizer.param_groups`` by ``[group i]`` while it steps group ``i``)."""
        return self._algorithms[i]

    def _param_group(self, i: int) -> dict:
        return self.optimizer.param_groups[i]

    def _fp32_partition(self, i: int) -> torch.Tensor:
        return self.single_partition_of_fp32_groups[i]

    def _offloaded(self) -> bool:
        return bool(self.cpu_offload)

    def _partition_group(self, i: int):
        """The process group of group ``i``'s owner exchange, no-gradient flags and Adam-mini sums: its
        data-parallel group, or under AutoTP the tensor-parallel x data-parallel ranks (AutoTP with Adam-mini is
        handed to DeepSpeed, :func:`ds_muon.config.sections.unserved_modes`)."""
        return self.real_dp_process_group[i] if self.tensor_parallel is None else self.tensor_parallel.group

    def _sub_group_count(self) -> int:
        return len(self.bit16_groups)

    def _muon_step_for(self, i: int) -> MuonShardStep:
        """Param group ``i``'s Muon step on ZeRO-1/2's flat layout (:meth:`_muon_layout`)."""
        return self._muon_step_of(f"ZeRO param group {i}", *self._muon_layout(i), int(self.partition_size[i]),
                                  self._param_group(i), self._partition_group(i))

    def _adam_mini_step_for(self, i: int) -> AdamMiniShardStep:
        """Param group ``i``'s Adam-mini step on ZeRO-1/2's flat layout.

        Raises:
            ValueError: a parameter's block does not divide it.
        """
        slots = []
        for (p, pieces), meta in zip(self.pieces[i], self.round_robin_bit16_meta[i]):
            block, numel = getattr(p, BLOCK_ATTR, None), meta.numel()
            if not block or numel % block:
                raise ValueError(f"ds_muon: Adam-mini parameter {self._name(p)!r} ({numel} elements) has block "
                                 f"{block}, which does not divide it")
            slots.append(AdamMiniSlot(self._name(p), tuple(meta.shape), numel, pieces, int(block)))
        return self._adam_mini_step_from(f"ZeRO param group {i}", slots, self._rank(i), int(self.partition_size[i]))

    def _locate_piece(self, p):
        """``(param group, this rank's Piece)`` of a trained parameter ``p`` (None: not trained)."""
        found = self._pieces_by_id.get(id(p))
        return None if found is None else (found[0], found[1][self._rank(found[0])])

    # ---- the step --------------------------------------------------------------------------------
    def step(self, closure=None):
        """DeepSpeed's ZeRO-1/2 step; counts the steps that were not skipped for overflow.

        Afterwards the exchange's buffer pool is released to the caching allocator and, under CPU optimizer
        offload, the fp32 gradient partitions are zeroed: DeepSpeed copies each parameter's gradient into its
        slot at the accumulation boundary, so a parameter that gets no gradient in a step would otherwise be
        stepped with what the slot held before (the oracle reads a zero gradient).

        Raises:
            RuntimeError: a parameter's ``requires_grad`` changed since initialize; too many skipped steps in a row.
        """
        with self._step_scope("ZeRO-1/2") as stats:
            super().step(closure)
        if not self.overflow and not self._states_linked:
            self.relink_optimizer_states()
        self._after_step(self.overflow, stats, dist.get_rank(group=self.dp_process_group) == 0)

    def relink_optimizer_states(self) -> None:
        """Point every parameter's optimizer-state fragments (``safe_get_full_optimizer_state``, universal
        checkpoints) at the current state tensors. DeepSpeed links them once, after the first param group's first
        update (``_lazy_init_hp_params_optimizer_state``), when the other groups' state does not exist yet; ds_muon
        links again after the first applied step and after every load."""
        self._hp_optimizer_states_linked = False
        self._lazy_init_hp_params_optimizer_state()
        self._states_linked = True

    def _get_preflattened_grad_partition(self, group_idx):
        """Group ``group_idx``'s gradient partition on this rank as one float32 tensor, assembled straight from its
        pieces, for DeepSpeed's step to use as the fp32 partition's ``.grad``.

        DeepSpeed's own hook returns its fp32 compact buffer where it keeps one (returned here unchanged);
        otherwise its step concatenates the pieces (``averaged_gradients``: this rank's part of each parameter's
        gradient and a zeros piece for the partition's padding, in the gradient accumulation dtype) and converts
        the result to float32. With bfloat16 (or float16) pieces and more than one of them that is two copies,
        6 bytes per element at the step's peak; here, inside a step, they are copied once into a new
        ``(partition_size,)`` float32 tensor (4 bytes per element, one pass less; DeepSpeed's conversion is then a
        no-op): the same values in the same places (``tests/dist/test_step_overrides.py``, bit for bit). None
        (DeepSpeed's path) where that gains nothing or might differ: float32 pieces (DeepSpeed's concatenation is
        already the only copy, or a view of a single piece), a single piece, CPU offload, ZenFlow, or pieces that
        are not tensors summing to the partition's size."""
        flat = super()._get_preflattened_grad_partition(group_idx)
        if flat is not None or not self._stepping or self.cpu_offload or getattr(self, "zenflow", False):
            return flat
        pieces = (self.averaged_gradients or {}).get(group_idx)
        target = self.single_partition_of_fp32_groups[group_idx].dtype
        if (not isinstance(pieces, list) or len(pieces) < 2 or not all(torch.is_tensor(t) for t in pieces)
                or all(t.dtype == target for t in pieces)):
            return None
        sizes = [t.numel() for t in pieces]
        if sum(sizes) != int(self.partition_size[group_idx]):
            return None
        out = torch.empty(sum(sizes), dtype=target, device=pieces[0].device)
        torch._foreach_copy_(list(out.split(sizes)), [t.reshape(-1) for t in pieces])
        return out

    def _clean_after_step(self) -> None:
        if self.cpu_offload:
            for fp32 in self.single_partition_of_fp32_groups:
                if fp32.grad is not None:
                    fp32.grad.zero_()

    def _update_scale(self, has_overflow=False):
        """DeepSpeed's; on a skipped step first finds the parameter to name (the gradients are still there)."""
        if has_overflow and self._stepping:
            self.skips.last_param = self._first_non_finite_grad()
        return super()._update_scale(has_overflow)

    def _local_grad_partition(self, i: int) -> Optional[torch.Tensor]:
        """This rank's flat gradient partition of group ``i`` at the overflow check, wherever DeepSpeed keeps it."""
        if self.cpu_offload:
            return self.single_partition_of_fp32_groups[i].grad
        grads = (self.averaged_gradients or {}).get(i)
        return None if not grads else torch.cat([g.reshape(-1) for g in grads])

    def _first_non_finite_grad(self) -> Optional[str]:
        """Name of the first parameter (group order, over all data-parallel ranks) whose gradient holds a NaN or
        Inf, or None. Collective: one all_reduce(MIN) of one int64."""
        ordered = [(i, p, pieces[self._rank(i)]) for i, group in enumerate(self.pieces) for p, pieces in group]
        first = len(ordered)
        flats = {i: self._local_grad_partition(i) for i in range(len(self.pieces))}
        for k, (i, p, piece) in enumerate(ordered):
            flat = flats[i]
            if (piece.length and flat is not None and piece.shard_offset + piece.length <= flat.numel()
                    and not torch.isfinite(flat.narrow(0, piece.shard_offset, piece.length)).all()):
                first = k
                break
        found = torch.tensor([first], dtype=torch.int64, device=self._device)
        dist.all_reduce(found, op=dist.ReduceOp.MIN, group=self.dp_process_group)
        k = int(found.item())
        return None if k == len(ordered) else self._name(ordered[k][1])
