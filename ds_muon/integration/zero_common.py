"""What ds_muon's ZeRO optimizers share, at every stage they serve (layer ``integration``).

:class:`DsMuonZeroSteps` is a mixin of :class:`~ds_muon.integration.zero3.MuonZeroOptimizer` (ZeRO-3, over
``DeepSpeedZeroOptimizer_Stage3``) and :class:`~ds_muon.integration.zero12.MuonZero12Optimizer` (ZeRO-1/2, over
``DeepSpeedZeroOptimizer``). It holds the one ``_optimizer_step`` both stages run, dispatching each sub-group by
its algorithm (``{"muon": _muon_step, "adam_mini": _adam_mini_step}``, else DeepSpeed's own AdamW), the Muon and
Adam-mini steps themselves, the shard steps built once (:meth:`DsMuonZeroSteps._build_steps`), the no-gradient
flags, QK-clip, the step counts and skipped steps, the trainable-set check and the monitor. Each stage class
answers a few questions about its layout (:mod:`ds_muon.partitions`): a sub-group's fp32 partition, param group,
process group and algorithm, and its parameters' pieces.
"""
from __future__ import annotations

import contextlib
import inspect
import time
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger

from ..checkpoint.metadata import raise_on_every_rank, saved_step_counts, zero_state_dict_problems
from ..core.dtypes import resolve_exchange_dtype, resolve_ns_dtype
from ..core.muon_update import use_compiled_elementwise
from ..core.ns_compile import AUTOTUNE_PROGRESS, COMPILE_GRAPH_LIMIT, persistent_inductor_cache
from ..core.qk_clip import factor_vector
from ..errors import ConfigError
from ..model.attention import (check_recorded, factor_spans, find_clip_targets, stop_recording, sync_recording,
                               take_max_logits)
from ..names import ADAM_MINI, BLOCK_STATE_KEY, MOMENTUM_KEY, MUON
from ..sharded.adam_mini_step import AdamMiniShardStep
from ..sharded.blocks import build_block_map
from ..sharded.collectives import named_collective
from ..sharded.exchange import OwnerExchange
from ..sharded.muon_step import MuonShardStep
from ..sharded.no_grad import GradientFlags
from ..sharded.ownership import ParamInfo, build_bucketed_plan
from ..sharded.plan_check import check_plans_agree
from ..sharded.qk_clip import scale_shard_, shard_ranges
from .faults import SkippedSteps, TrainableSet
from .monitor import MonitorReporter

__all__ = ["DsMuonZeroSteps", "AdamMiniSlot"]


class AdamMiniSlot:
    """One parameter of an Adam-mini sub-group as :func:`ds_muon.sharded.blocks.build_block_map` reads it: name,
    shape, numel, its :class:`~ds_muon.partitions.Piece` on every rank, and its Adam-mini block (elements)."""

    def __init__(self, name: str, shape: tuple, numel: int, pieces: tuple, block: int) -> None:
        self.name, self.shape, self.numel, self.pieces, self.block = name, shape, numel, pieces, block

    @property
    def shard_offset(self) -> int:
        return self.pieces[0].shard_offset


class DsMuonZeroSteps:
    """Mixin of ds_muon's ZeRO optimizers: bookkeeping and the Muon partition step (see the module docstring).

    The host sets, before :meth:`_init_steps`: ``self.optimizer`` (a ds_muon inner optimizer), ``self.module``,
    ``self.param_names``, ``self._device``, ``self._pool``.

    Attributes:
        step_count: optimizer steps applied (overflow-skipped ones excluded); muon_step_count: the same count
            under its first name (checkpoint format 1 as first written has only it; clients read it).
        skipped_step_count, consecutive_skipped_steps, last_non_finite_param: see
            :class:`ds_muon.integration.faults.SkippedSteps`.
        step_seconds: ``{"muon": s, "adam_mini": s}``, wall time of the last step's Muon / Adam-mini updates
            (measured only while a monitor is attached).
        qk_clip_stats: the last applied step's QK-clip figures (``heads_clipped``, ``max_logit``, per layer, per head).
    """

    muon_steps: dict
    muon_plans: dict
    #: keep Muon momentum out of the NVMe swap (ZeRO-3's ``save_muon_momentum_buffer_in_memory``)
    _momentum_in_memory = False

    def _init_steps(self) -> None:
        cfg = self.optimizer.config
        self.step_count = 0
        self.skips = SkippedSteps(cfg.max_consecutive_skipped_steps)
        self.trainable = TrainableSet(self.module, self.param_names)
        self.step_seconds = {MUON: 0.0, ADAM_MINI: 0.0}
        self.monitor_reporter: Optional[MonitorReporter] = None
        self.qk_clip_targets: list = []
        self._qk_ranges: dict[int, list[tuple[int, int, int]]] = {}
        self._qk_factors: Optional[list[float]] = None
        self.qk_clip_stats: Optional[dict] = None

    @property
    def muon_step_count(self) -> int:
        return self.step_count

    @property
    def skipped_step_count(self) -> int:
        return self.skips.count

    @property
    def consecutive_skipped_steps(self) -> int:
        return self.skips.consecutive

    @property
    def last_non_finite_param(self) -> Optional[str]:
        return self.skips.last_param

    def attach_monitor(self, monitor, step_fn: Callable[[], Optional[int]]) -> None:
        """Report per-step figures to DeepSpeed's monitor (the events: :mod:`ds_muon.integration.monitor`)."""
        self.monitor_reporter = MonitorReporter(monitor, step_fn)

    def exchange_bytes(self) -> int:
        """Bytes this rank sends per optimizer step in the owner exchange (both directions)."""
        return sum(s.plan.sent_elements(s.exchange.rank) * s.exchange.exchange_dtype.itemsize
                   for s in self.muon_steps.values())

    # ---- built once, identically on every rank ------------------------------------------------------------
    def _build_steps(self) -> None:
        """The shard step of every Muon and Adam-mini sub-group (:meth:`_muon_step_for`,
        :meth:`_adam_mini_step_for`, from the stage's layout), the owner plans checked equal on every rank, the
        no-gradient flags, QK-clip's plan and the ``ns_autotune`` graph check."""
        algorithms = {i: self.sub_group_algorithm(i) for i in range(self._sub_group_count())}
        self.muon_steps = {i: self._muon_step_for(i) for i, a in algorithms.items() if a == MUON}
        self.muon_plans = {i: s.plan for i, s in self.muon_steps.items()}
        self._check_plans_agree()
        self.gradient_flags = GradientFlags({i: s.block_map for i, s in self.muon_steps.items()}, self._device)
        self.adam_mini_steps = {i: self._adam_mini_step_for(i) for i, a in algorithms.items() if a == ADAM_MINI}
        self.adam_mini_maps = {i: s.block_map for i, s in self.adam_mini_steps.items()}
        self._build_qk_clip()
        self._check_autotune_graphs()

    def _sub_group_count(self) -> int:
        raise NotImplementedError

    def _muon_step_for(self, i: int) -> MuonShardStep:
        """Muon sub-group ``i``'s :class:`MuonShardStep` (the stage builds its parameters' pieces, then calls
        :meth:`_muon_step_of`)."""
        raise NotImplementedError

    def _adam_mini_step_for(self, i: int) -> AdamMiniShardStep:
        """Adam-mini sub-group ``i``'s step (the stage builds its slots, then calls :meth:`_adam_mini_step_from`)."""
        raise NotImplementedError

    def _locate_piece(self, p) -> Optional[tuple]:
        """``(sub-group, this rank's Piece)`` of a trained parameter ``p``, or None (QK-clip's head ranges)."""
        raise NotImplementedError

    @staticmethod
    def _adam_mini_step_from(name: str, slots: Sequence[AdamMiniSlot], rank: int, shard_numel: int) -> AdamMiniShardStep:
        """The :class:`AdamMiniShardStep` of one partition of ``shard_numel`` elements from its ``slots`` in the
        partition's order: this rank's block map and every block's size in elements."""
        block_map = build_block_map(slots, rank, shard_numel, block_numel=lambda s: s.block)
        return AdamMiniShardStep(name, block_map, [s.block for s in slots for _ in range(s.numel // s.block)])

    def _build_qk_clip(self) -> None:
        """QK-clip's plan (``optimizer.params.qk_clip``): the attention modules and, per sub-group, the flat
        ranges of this rank's fp32 partition that hold each query/key head's rows (:mod:`ds_muon.sharded.qk_clip`)."""
        if self.optimizer.optimizer_type != "Muon" or not self.optimizer.config.qk_clip.enabled:
            return
        self.qk_clip_targets = find_clip_targets(self.module)
        names = {id(p): n for n, p in self.module.named_parameters()}
        self._qk_ranges = shard_ranges(factor_spans(self.qk_clip_targets), names, self._locate_piece)

    def _muon_step_of(self, name: str, infos: Sequence[ParamInfo], world_size: int, shard_numel: Optional[int],
                      group: dict, process_group) -> MuonShardStep:
        """The :class:`MuonShardStep` of one Muon partition: its owner plan (LPT-balanced, bucketed by
        ``exchange_bucket_mb``), this rank's block map, and the exchange over ``process_group``.

        Args:
            name: how messages name the partition (``"ZeRO sub-group 3"``).
            infos: its parameters (with their pieces, or None: ZeRO-3's chunked layout).
            shard_numel: elements of the local partition (None: the chunks back to back).
            group: its param group (``ns_dtype``, ``ns_method``, ``ns_steps``, ``exchange_dtype``, ...).
        """
        cfg = self.optimizer.config
        compute = resolve_ns_dtype(group["ns_dtype"], group["ns_method"], self._device)
        wire = resolve_exchange_dtype(group["exchange_dtype"], compute)
        bucket_elements = max(1, int(cfg.exchange_bucket_mb * 2**20) // wire.itemsize)
        plan = build_bucketed_plan(infos, world_size, bucket_elements, group["ns_steps"], group["ns_method"],
                                   shard_numel=shard_numel, order=self._bucket_order())
        exchange = OwnerExchange(process_group, wire, compute, self._device, self._pool)
        elementwise = use_compiled_elementwise(cfg.elementwise_compile, cfg.ns_compile,
                                               torch.device("cpu") if self._offloaded() else self._device)
        step = MuonShardStep(name, plan, build_block_map(plan.slots, exchange.rank, plan.shard_numel), exchange,
                             group, cfg.ns_compile, cfg.ns_autotune, elementwise)
        if exchange.rank == 0:
            logger.info("ds_muon %s: %s", name, plan.describe())
        return step

    def _bucket_order(self) -> str:
        """How the owner plans group matrices into exchange buckets (:func:`ds_muon.sharded.ownership.build_bucketed_plan`):
        ``"cost"`` for the step after backward; the overlapped step asks for ``"reverse"``."""
        return "cost"

    def _check_plans_agree(self) -> None:
        """Every rank built the same owner plans (:func:`ds_muon.sharded.plan_check.check_plans_agree`: one
        all_gather_object on every rank; a RuntimeError on every rank naming the first differing matrix)."""
        check_plans_agree([(s.name, s.plan, s.exchange.group) for s in self.muon_steps.values()])

    def _momentum_of(self, fp32: torch.Tensor, group: dict, in_memory: bool = False) -> torch.Tensor:
        """The Muon momentum of the flat fp32 partition ``fp32`` (``(n,)``), created as zeros on first use in the
        group's ``momentum_dtype`` (first use, not construction: the NVMe swapper latches a sub-group's state keys
        on its first swap-out). ``in_memory``: mark it to stay out of the NVMe swap."""
        state = self.optimizer.state[fp32]
        momentum = state.get(MOMENTUM_KEY)
        if momentum is None:
            momentum = state[MOMENTUM_KEY] = torch.zeros_like(fp32, dtype=getattr(torch, group["momentum_dtype"]))
            if in_memory:
                momentum.swappable = False  # the swapper leaves tensors marked so in memory
        return momentum

    def _check_autotune_graphs(self) -> None:
        """With ``ns_autotune`` on CUDA: every distinct Newton–Schulz call shape of a rank is a static graph;
        refuse more than ``COMPILE_GRAPH_LIMIT`` of them (past it torch.compile would run the rest eagerly).
        Every rank has every plan, so all ranks see the same count and raise together.

        Raises:
            ConfigError: naming ``optimizer.params.ns_autotune`` and the count.
        """
        cfg = self.optimizer.config
        if not (self.muon_plans and cfg.ns_autotune and cfg.ns_compile and self._device.type == "cuda"):
            return
        # before anything in this process compiles with inductor (the compiled momentum step runs first at each
        # step), which would fix TORCHINDUCTOR_CACHE_DIR at inductor's /tmp default
        persistent_inductor_cache()
        plans = list(self.muon_plans.values())
        worst = max(len(set().union(*(p.ns_call_shapes(r) for p in plans)))
                    for r in range(max(p.world_size for p in plans)))
        rank = dist.get_rank(group=self.dp_process_group) if dist.is_initialized() else 0
        AUTOTUNE_PROGRESS.expect(len(set().union(*(p.ns_call_shapes(rank) for p in plans))))  # progress lines
        if worst > COMPILE_GRAPH_LIMIT:
            raise ConfigError(f"optimizer.params.ns_autotune: this model's owner plan makes {worst} distinct "
                              f"Newton-Schulz call shapes on one rank, more than the {COMPILE_GRAPH_LIMIT} static "
                              "graphs ds_muon lets torch.compile build (the rest would silently run eagerly); "
                              "set ns_autotune: false (dynamic shapes, few graphs)")

    def _qk_clip_prepare(self, group) -> Optional[dict]:
        """The step's QK-clip factors, before DeepSpeed's step runs: the recorded per-head max logits of every
        attention module, reduced over the data-parallel ``group`` by one all_reduce(MAX) of all heads concatenated
        (an overflow-skipped step never reaches the update, so it clips nothing). Returns the step's figures, or
        None (no QK-clip, or past its ``until_step`` window: no all_reduce then, and the recording is stopped)."""
        if not self.qk_clip_targets:
            return None
        clip = self.optimizer.config.qk_clip
        if clip.until_step is not None and self.step_count >= clip.until_step:
            stop_recording(self.qk_clip_targets)  # the window is over (also right after a resume past it)
            return None
        s = take_max_logits(self.qk_clip_targets, self._device)
        with named_collective("the QK-clip max-logit all_reduce"):
            dist.all_reduce(s, op=dist.ReduceOp.MAX, group=group)
        s = s.cpu()
        check_recorded(s)
        factors, stats = factor_vector(self.qk_clip_targets, s, clip.threshold, clip.alpha)
        self._qk_factors = factors.tolist()
        return stats

    def _restore_step_counts(self, meta: Optional[dict]) -> None:
        """After a load with optimizer states: the step counts from the saved ds_muon metadata ``meta``
        (:func:`~ds_muon.checkpoint.metadata.saved_step_counts`; unchanged without metadata), and QK-clip's
        max-logit recording as the restored count says (:func:`~ds_muon.model.attention.sync_recording`: stopped
        past the ``until_step`` window, so the first forward after the load computes nothing; on again inside
        it, also when this process had stopped it, e.g. loading an earlier checkpoint into the same engine)."""
        counts = saved_step_counts(meta)
        if counts is not None:
            self.step_count = counts[1]
        if self.qk_clip_targets:
            sync_recording(self.qk_clip_targets, self.step_count, self.optimizer.config.qk_clip.until_step)

    def _after_step(self, overflow: bool, stats: Optional[dict], rank0: bool) -> None:
        """Bookkeeping after DeepSpeed's step: count it (applied or skipped), keep its QK-clip figures, report.

        Raises:
            RuntimeError: too many skipped steps in a row (:class:`~ds_muon.integration.faults.SkippedSteps`).
        """
        if not overflow:
            self.qk_clip_stats = stats
            self.step_count += 1
            until = self.optimizer.config.qk_clip.until_step if self.qk_clip_targets else None
            if until is not None and self.step_count == until:
                stop_recording(self.qk_clip_targets)  # the window's last step: the next forwards need not record
            self.skips.applied()
            if self.monitor_reporter is not None:
                self.monitor_reporter.applied(self)
        else:
            self.skips.skipped(rank0, self.loss_scale,
                               self.monitor_reporter.skipped if self.monitor_reporter is not None else None)

    # ---- the step of one sub-group: one dispatch for every stage --------------------------------------------
    # What each stage class says about its layout (ZeRO-3: sub-groups of DeepSpeed's flat fp32 partitions;
    # ZeRO-1/2: param groups, one flat partition each).
    def sub_group_algorithm(self, i: int) -> str:
        """``"muon"``, ``"adam_mini"`` or ``"adamw"``: the algorithm of sub-group ``i``'s param group."""
        raise NotImplementedError

    def _param_group(self, i: int) -> dict:
        """Sub-group ``i``'s param group (its current ``lr``, ``weight_decay``, ...)."""
        raise NotImplementedError

    def _fp32_partition(self, i: int) -> torch.Tensor:
        """Sub-group ``i``'s ``(n,)`` float32 partition on this rank; its ``.grad`` is final when DeepSpeed's step
        calls :meth:`_optimizer_step`."""
        raise NotImplementedError

    def _partition_group(self, i: int):
        """The process group of sub-group ``i``'s owner exchange and collectives (None: the default group)."""
        raise NotImplementedError

    def _offloaded(self) -> bool:
        """Whether the fp32 partitions live in CPU memory (optimizer offload to the CPU or NVMe)."""
        raise NotImplementedError

    def _resident_grad(self, j: int) -> Optional[torch.Tensor]:
        """Sub-group ``j``'s ``(n,)`` gradient if it is in memory before its turn (for the no-gradient flags
        agreed ahead, :meth:`_blocks_with_gradient`), else None. The same answer on every rank (layout only)."""
        return None

    def _grad_scale_is_one(self) -> bool:
        """Whether DeepSpeed's ``unscale_and_clip_grads`` multiplies the gradient by exactly 1 this step, as known on
        the host without waiting for the device: the loss scale is 1 (a Python number: bf16, fp32) and clipping is
        off or known not to fire (:meth:`_clip_known_not_to_fire`)."""
        scale = self.loss_scale
        return (isinstance(scale, (int, float)) and scale == 1
                and (self.clip_grad <= 0. or self._clip_known_not_to_fire()))

    def _clip_known_not_to_fire(self) -> bool:
        """Whether clipping, which is on, is known on the host without a wait not to fire this step: here never;
        :class:`~ds_muon.integration.overlap.OverlapHooks` knows it where the overlapped step has that decision."""
        return False

    def unscale_and_clip_grads(self, *args, **kwargs):
        """DeepSpeed's (either stage's signature), skipped inside a step where its factor
        ``1 / (clip coefficient * loss scale)`` is exactly 1 (:meth:`_grad_scale_is_one`). DeepSpeed's ZeRO-3 one
        multiplies the sub-group's whole fp32 gradient by that factor even then: a pass reading and writing 4 bytes
        per element each, per sub-group and step, that changes no value (``x * 1.0 == x`` bit for bit for finite
        values, +-0 and +-inf; a step whose gradient norm is not finite is skipped before this call at ZeRO-3, and
        clips at ZeRO-1/2, where the factor is then not 1). Bit for bit: ``tests/dist/test_step_overrides.py``."""
        if self._stepping and self._grad_scale_is_one():
            return None
        return super().unscale_and_clip_grads(*args, **kwargs)

    @torch.no_grad()
    def _optimizer_step(self, i: int) -> None:
        """Sub-group ``i``'s update, where DeepSpeed's step calls it (the gradient final: accumulated, reduced,
        unscaled, clipped; every rank calls it for every sub-group in the same order): ds_muon's Muon or
        Adam-mini step from the table below, else DeepSpeed's own (AdamW); then QK-clip's head scaling of the
        fp32 partition (DeepSpeed copies it to the bf16/fp16 partition right after). Timed into
        :attr:`step_seconds` while a monitor is attached (the accelerator is synchronized around it only then)."""
        own = {MUON: self._muon_step, ADAM_MINI: self._adam_mini_step}.get(self.sub_group_algorithm(i))
        if own is None:
            super()._optimizer_step(i)
        elif self.monitor_reporter is None:
            own(i)
        else:
            get_accelerator().synchronize()
            start = time.perf_counter()
            own(i)
            get_accelerator().synchronize()
            self.step_seconds[self.sub_group_algorithm(i)] += time.perf_counter() - start
        if self._qk_factors is not None and i in self._qk_ranges:
            scale_shard_(self._fp32_partition(i).data, self._qk_ranges[i], self._qk_factors)

    def _muon_step(self, i: int) -> None:
        """Sub-group ``i``'s Muon step on its fp32 partition, in place (under :meth:`_optimizer_step`'s no_grad),
        with its momentum and its no-gradient flags: a speculation committed in its place
        (:meth:`_commit_speculation`), or the three stages of its :class:`~ds_muon.sharded.muon_step.MuonShardStep`
        on one buffer, the gradient's: g -> u (``prepare``), u -> o (``orthogonalize``: the owner exchange and
        Newton–Schulz), apply o (``finalize``); blocks that had no gradient on any rank are set aside around them.
        Collective over the sub-group's partition group (every rank holds the same flags, so all take the same
        branches)."""
        fp32, group, step = self._fp32_partition(i), self._param_group(i), self.muon_steps[i]
        momentum = self._momentum_of(fp32, group, self._momentum_in_memory)
        had = self._blocks_with_gradient(i)
        if self._commit_speculation(i, fp32, momentum, had, group):
            return
        if had is not None and not bool(had.any()):
            return  # no block had a gradient on any rank: no exchange, nothing changes
        put_back = step.set_aside(had, momentum, fp32)
        g = o = fp32.grad
        u = step.prepare(g, momentum, group)
        step.orthogonalize(u, o, group)
        step.finalize(fp32, o, group)
        if put_back is not None:
            put_back()

    def _commit_speculation(self, i: int, fp32: torch.Tensor, momentum: torch.Tensor, had: Optional[torch.Tensor],
                            group: dict) -> bool:
        """Whether sub-group ``i``'s step was applied from a speculation made in backward (the overlapped step,
        :class:`ds_muon.integration.overlap.OverlapHooks`); here never.

        Args:
            fp32: ``(n,)`` float32 partition (its ``.grad`` the final gradient, or at ZeRO-3 a placeholder where
                the overlapped step reads the bf16 slice in place). momentum: ``(n,)`` float32 or
                bfloat16. had: ``(n_blocks,)`` bool agreed no-gradient flags, or None (all had). group: the param group.
        """
        return False

    def _blocks_with_gradient(self, i: int) -> torch.Tensor:
        """``(n_blocks,)`` bool in host memory: which blocks of Muon sub-group ``i`` had a gradient on any rank this
        step (:meth:`~ds_muon.sharded.no_grad.GradientFlags.take`). Agreed ahead where the stage can
        (:meth:`_agree_flags_ahead`); else the first Muon sub-group of a process group to step agrees, in one
        all_reduce, on its flags and those of every later sub-group of that group whose gradient is resident
        (:meth:`_resident_grad`); a sub-group whose gradient was not resident then (NVMe-swapped) agrees on its own
        at its turn (and waits for its flags: one host sync)."""
        if not self.gradient_flags.agreed(i):
            self._agree_flags(i, self._fp32_partition(i).grad)
        return self.gradient_flags.take(i)

    def _agree_flags(self, i: int, grad: Optional[torch.Tensor]) -> None:
        """Agree, in one all_reduce over sub-group ``i``'s partition group, on the flags of ``i`` (its gradient
        ``grad``) and of every later Muon sub-group of that group not agreed yet whose gradient is resident.
        Collective: every rank makes the same calls (the layout decides, the same on every rank)."""
        flags, group = self.gradient_flags, self._partition_group(i)
        grads = {i: grad}
        for j in self.muon_steps:
            if j > i and not flags.agreed(j) and self._partition_group(j) is group:
                resident = self._resident_grad(j)
                if resident is not None:
                    grads[j] = resident
        flags.agree(grads, group)

    def _agree_flags_ahead(self) -> None:
        """Agree the no-gradient flags of every Muon sub-group whose gradient is resident now, one all_reduce per
        partition group, before the stage's step reads the global gradient norm on the host (DeepSpeed's
        ``is_invalid_grad_norm``): that read waits for the flags' copy to the host as well, so no Muon sub-group
        waits for its flags at its turn (docs/design.md, "Host syncs of the step"). The stage calls it from the hook
        it has before that read; a sub-group left out agrees at its turn (:meth:`_blocks_with_gradient`)."""
        for i in self.muon_steps:
            if not self.gradient_flags.agreed(i):
                grad = self._resident_grad(i)
                if grad is not None:
                    self._agree_flags(i, grad)

    def _adam_mini_step(self, i: int) -> None:
        """Sub-group ``i``'s Adam-mini step (:meth:`ds_muon.sharded.adam_mini_step.AdamMiniShardStep.run`)."""
        fp32, step = self._fp32_partition(i), self.adam_mini_steps[i]
        state = self._adam_mini_state(fp32, step.n_blocks)
        step.run(fp32, fp32.grad, state["exp_avg"], state[BLOCK_STATE_KEY], state["step"], self._param_group(i),
                 self._partition_group(i), self._device)

    def _adam_mini_state(self, fp32: torch.Tensor, n_blocks: int) -> dict:
        """The Adam-mini state of the flat fp32 partition ``fp32``, created on first use (first use, not
        construction: under NVMe the swapper latches ``exp_avg``, the partition's length, on the first swap-out;
        the ``(n_blocks,)`` fp32 per-block second moments always stay in memory); ``step`` advanced by one."""
        state = self.optimizer.state[fp32]
        if "exp_avg" not in state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(fp32)
            state[BLOCK_STATE_KEY] = torch.zeros(n_blocks, dtype=torch.float32, device=fp32.device)
            state[BLOCK_STATE_KEY].swappable = False
        state["step"] += 1
        return state

    def _clean_after_step(self) -> None:
        """The host's clean-up after every step, applied or skipped (e.g. zeroing gradient partitions)."""

    def _check_fit_before_load(self, deepspeed_load: Callable, args: tuple, kwargs: dict) -> tuple[bool, Optional[dict]]:
        """Before DeepSpeed's ``load_state_dict`` (``deepspeed_load``, called with ``args``/``kwargs``) restores
        anything: bind its arguments and, for a same-world-size load of per-rank files, run ds_muon's fit checks
        against :meth:`checkpoint_layout` on every rank together.

        Returns:
            ``(load_optimizer_states, this rank's state dict or None)`` (None: a universal checkpoint folder).

        Raises:
            CheckpointError: on every rank, naming each problem (:func:`ds_muon.checkpoint.metadata.zero_state_dict_problems`).
        """
        bound = inspect.signature(deepspeed_load).bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        load_optimizer_states = bool(a["load_optimizer_states"])
        if a.get("checkpoint_folder") or a["state_dict_list"] is None:
            return load_optimizer_states, None
        rank = dist.get_rank(group=self.dp_process_group)
        dicts = a["state_dict_list"]
        state_dict = dicts[rank] if rank < len(dicts) else dicts[0]  # fewer files: the world size check names it
        raise_on_every_rank(zero_state_dict_problems(state_dict, self.checkpoint_layout(), load_optimizer_states),
                            self.dp_process_group, "ds_muon: the checkpoint does not fit this model and optimizer:")
        return load_optimizer_states, state_dict

    @contextlib.contextmanager
    def _step_scope(self, what: str) -> Iterator[Optional[dict]]:
        """Around DeepSpeed's ``step()``: the trainable-set check, the no-gradient flags of the last step forgotten,
        QK-clip's factors
        (yielded: the step's figures, or None), collective failures named after ``what`` (``"ZeRO-3"``); then,
        also on error, :meth:`_clean_after_step` and the exchange's buffers handed back to the allocator.

        Raises:
            RuntimeError: a parameter's ``requires_grad`` changed since initialize.
        """
        self.step_seconds = {MUON: 0.0, ADAM_MINI: 0.0}
        self.trainable.check()
        self.gradient_flags.begin_step()
        stats = self._qk_clip_prepare(self.dp_process_group)
        self._stepping = True
        try:
            with named_collective(f"a collective of DeepSpeed's {what} optimizer step (overflow/gradient-norm "
                                  "all_reduce, parameter all_gather)"):
                yield stats
        finally:
            self._stepping = False
            self._qk_factors = None
            self._clean_after_step()
            self._pool.clear()
