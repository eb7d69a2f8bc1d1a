"""What ds_muon's ZeRO optimizers share, at every stage they serve (layer ``integration``).

:class:`DsMuonZeroSteps` is a mixin of :class:`~ds_muon.integration.zero3.MuonZeroOptimizer` (ZeRO-3, over
``DeepSpeedZeroOptimizer_Stage3``) and :class:`~ds_muon.integration.zero12.MuonZero12Optimizer` (ZeRO-1/2, over
``DeepSpeedZeroOptimizer``): the step counts and skipped steps, the trainable-set check, the monitor, one Muon
partition's :class:`~ds_muon.sharded.muon_step.MuonShardStep` from its parameters' pieces, the Muon momentum
created on first use, QK-clip's per-step factors, and the ``ns_autotune`` graph check. Each subclass says where
its partitions are (the layout, :mod:`ds_muon.partitions`) and when DeepSpeed's step calls into it.
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
from ..core.ns_compile import AUTOTUNE_PROGRESS, COMPILE_GRAPH_LIMIT, persistent_inductor_cache
from ..core.qk_clip import factor_vector
from ..errors import ConfigError
from ..model.attention import check_recorded, stop_recording, sync_recording, take_max_logits
from ..names import ADAM_MINI, BLOCK_STATE_KEY, MOMENTUM_KEY, MUON
from ..sharded.blocks import build_block_map
from ..sharded.collectives import named_collective
from ..sharded.exchange import OwnerExchange
from ..sharded.muon_step import MuonShardStep
from ..sharded.ownership import ParamInfo, build_bucketed_plan
from ..sharded.plan_check import check_plans_agree
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
                                   shard_numel=shard_numel)
        exchange = OwnerExchange(process_group, wire, compute, self._device, self._pool)
        step = MuonShardStep(name, plan, build_block_map(plan.slots, exchange.rank, plan.shard_numel), exchange,
                             group, cfg.ns_compile, cfg.ns_autotune)
        if exchange.rank == 0:
            logger.info("ds_muon %s: %s", name, plan.describe())
        return step

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

    def _own_step(self, i: int, algorithm: str) -> None:
        """Partition ``i``'s Muon or Adam-mini update (the host's ``_muon_step(i)`` / ``_adam_mini_step(i)``),
        timed into :attr:`step_seconds` while a monitor is attached (the accelerator is synchronized around it
        only then)."""
        timed = self.monitor_reporter is not None
        if timed:
            get_accelerator().synchronize()
            start = time.perf_counter()
        if algorithm == MUON:
            self._muon_step(i)
        else:
            self._adam_mini_step(i)
        if timed:
            get_accelerator().synchronize()
            self.step_seconds[algorithm] += time.perf_counter() - start

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
        """Around DeepSpeed's ``step()``: the trainable-set check, the no-gradient flags reset, QK-clip's factors
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
            self.gradient_flags.begin_step()
            self._qk_factors = None
            self._clean_after_step()
            self._pool.clear()
