"""DeepSpeed glue: the ZeRO-3 optimizer subclass that runs Muon on flattened fp32 partitions.

This is the only module (with :mod:`ds_muon.integration`) that touches DeepSpeed internals.
Checked against deepspeed 0.19.8 (``DeepSpeedZeroOptimizer_Stage3``); see design.md §2.

When the parent's ``step()`` calls ``_optimizer_step(sub_group_id)``, the sub-group's gradient
in ``fp32_partitioned_groups_flat[i].grad`` is final: accumulated over micro-batches, reduced
(reduce-scatter or all-reduce, whichever the config says), unscaled and clipped on the raw
global norm. Every rank calls it for every sub-group in the same order, so the owner exchange's
collectives are safe there. AdamW sub-groups go to the parent unchanged (FusedAdam, or
DeepSpeedCPUAdam when offloaded).
"""
from __future__ import annotations

import functools
import time

from typing import Callable, Optional

import torch
from deepspeed.accelerator import get_accelerator
from torch.profiler import record_function
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.utils import logger

from .config import resolve_exchange_dtype
from .exchange import BufferPool, OwnerExchange
from .matrix import update_scale
from .newton_schulz import compiled_orthogonalize, orthogonalize, resolve_ns_dtype
from .ownership import BucketedPlan, ParamInfo, build_bucketed_plan

MOMENTUM_KEY = "momentum_buffer"


class ZeroMuonInner(torch.optim.Optimizer):
    """The "basic" optimizer that DeepSpeed's ZeRO-3 wraps when the config says ``"Muon"``.

    It holds every param group (each flagged ``use_muon``) and one ``state`` dict. AdamW groups
    are stepped by an element-wise optimizer built by ``adamw_factory`` (DeepSpeed's FusedAdam, or
    DeepSpeedCPUAdam under optimizer offload) that shares these group dicts and this state, so
    checkpoints see a single optimizer. Muon groups are stepped by :class:`MuonZeroOptimizer`,
    which needs the owner exchange; calling :meth:`step` with a non-empty Muon group is an error.

    It is deliberately not DeepSpeed's ``MuonWithAuxAdam``: that class switches on the built-in
    ZeRO-3 Muon path, which must never run alongside ours.

    Args:
        param_groups: from :func:`ds_muon.param_groups.split_param_groups`.
        adamw_factory: ``groups -> torch.optim.Optimizer`` for the AdamW groups, or ``None``.
        config: the validated :class:`ds_muon.config.MuonOptimizerParams`.
    """

    def __init__(self, param_groups: list[dict], adamw_factory: Optional[Callable[[list[dict]], torch.optim.Optimizer]],
                 config) -> None:
        super().__init__(param_groups, {})
        self.config = config
        self.adamw = None
        adam_groups = [g for g in self.param_groups if not g["use_muon"]]
        if adam_groups and adamw_factory is not None:
            self.adamw = adamw_factory(adam_groups)
        self._share_with_adamw()

    def _share_with_adamw(self) -> None:
        if self.adamw is None:
            return
        adam_groups = [g for g in self.param_groups if not g["use_muon"]]
        for group in adam_groups:
            for key, value in self.adamw.defaults.items():
                group.setdefault(key, value)
        self.adamw.param_groups = adam_groups
        self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        """Load as ``torch.optim.Optimizer`` does, then re-share groups and state with the AdamW."""
        super().load_state_dict(state_dict)
        self._share_with_adamw()

    @torch.no_grad()
    def step(self, closure=None):
        """Step the AdamW groups that currently hold parameters.

        Raises:
            RuntimeError: a Muon group holds parameters (those are stepped by MuonZeroOptimizer).
        """
        for group in self.param_groups:
            if group["use_muon"] and group["params"]:
                raise RuntimeError("Muon param groups are stepped by ds_muon.zero3.MuonZeroOptimizer, "
                                   "not by the inner optimizer; was ZeRO stage 3 configured?")
        if self.adamw is None:
            return closure() if closure is not None else None
        return self.adamw.step(closure)


class MuonZeroOptimizer(DeepSpeedZeroOptimizer_Stage3):
    """``DeepSpeedZeroOptimizer_Stage3`` with a distributed Muon step for Muon sub-groups.

    Per Muon sub-group and optimizer step (design.md §3), on the local fp32 shard ``(n,)``:

    1. ``m <- beta*m + (1-beta)*g`` and ``u <- lerp(g, m, beta)`` (Nesterov) or ``u <- m``,
       element-wise; the fp32 momentum ``m`` never leaves its rank.
    2. :class:`~ds_muon.exchange.OwnerExchange`: all_to_all ``u``'s chunks to each matrix's owner
       rank, Newton–Schulz batched by shape there, scale, all_to_all back.
    3. ``p <- p*(1 - lr*wd) - lr*o`` on the shard (decoupled weight decay).

    The owner plan (:func:`ds_muon.ownership.build_bucketed_plan`: LPT by Newton–Schulz FLOPs, cut
    into ``exchange_bucket_mb`` buckets that are pipelined so the all_to_all of one bucket overlaps
    Newton–Schulz on another) is built once per sub-group at construction, identically on every rank.

    ``__init__`` passes ``*args, **kwargs`` through unchanged (the keyword set changes between
    DeepSpeed releases).

    Attributes:
        muon_plans: ``{sub_group_id: BucketedPlan}`` for the Muon sub-groups.
        muon_step_count: optimizer steps that ran the Muon update (overflow-skipped ones excluded).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.optimizer, ZeroMuonInner):
            raise TypeError("MuonZeroOptimizer needs a ds_muon ZeroMuonInner optimizer; "
                            "build the engine through ds_muon.initialize or ds_muon.enable()")
        self.muon_step_count = 0
        self._monitor = None
        self._monitor_step: Optional[Callable[[], int]] = None
        self._muon_seconds = 0.0
        self.muon_plans: dict[int, BucketedPlan] = {}
        self._muon_pool = BufferPool()
        self._muon_exchanges: dict[int, OwnerExchange] = {}
        self._build_muon_plans()

    # ---- setup ---------------------------------------------------------------------------
    def _muon_group(self, sub_group_id: int) -> dict:
        return self.optimizer.param_groups[self.sub_group_to_group_id[sub_group_id]]

    def _build_muon_plans(self) -> None:
        device = torch.device(get_accelerator().current_device_name())
        for i, params in enumerate(self.fp16_groups):
            group = self._muon_group(i)
            if not group["use_muon"]:
                continue
            infos = [ParamInfo(self.param_names.get(p, f"ds_id={p.ds_id}"), tuple(p.ds_shape), int(p.ds_numel))
                     for p in params]
            compute = resolve_ns_dtype(group["ns_dtype"], group["ns_method"], device)
            wire = getattr(torch, resolve_exchange_dtype(group["exchange_dtype"], compute))
            bucket_elements = max(1, int(self.optimizer.config.exchange_bucket_mb * 2**20) // wire.itemsize)
            plan = build_bucketed_plan(infos, self._get_sub_group_partition_count(i), bucket_elements,
                                       group["ns_steps"], group["ns_method"])
            if plan.shard_numel != self.fp16_partitioned_groups_flat_numel[i]:
                raise RuntimeError(f"ds_muon: sub-group {i} holds {self.fp16_partitioned_groups_flat_numel[i]} "
                                   f"elements but its owner plan covers {plan.shard_numel}; this DeepSpeed "
                                   "version lays out ZeRO-3 partitions differently than ds_muon expects")
            self.muon_plans[i] = plan
            self._muon_exchanges[i] = OwnerExchange(self._get_sub_group_process_group(i), wire, compute, device,
                                                    self._muon_pool)
            if self._get_sub_group_partition_rank(i) == 0:
                logger.info("ds_muon sub-group %d: %s", i, plan.describe())

    def attach_monitor(self, monitor, step_fn: Callable[[], int]) -> None:
        """Report per-step Muon figures to DeepSpeed's monitor (tensorboard / csv_monitor / wandb / comet).

        Events, written by rank 0 (its own figures) after each step not skipped for overflow, at
        ``step_fn()`` (the engine's global sample count after this step, DeepSpeed's own x axis): ``Train/ds_muon/muon_seconds`` (wall time of this rank's Muon sub-group steps:
        momentum, exchange, Newton–Schulz; the accelerator is synchronized around them only while a
        monitor is attached; the first step includes torch.compile time), ``Train/ds_muon/exchange_bytes``
        (bytes this rank sends in the owner all_to_all, from the plan) and ``Train/ds_muon/owner_imbalance`` (max/mean Newton–Schulz FLOPs over ranks).
        """
        self._monitor, self._monitor_step = monitor, step_fn

    def exchange_bytes(self) -> int:
        """Bytes this rank sends per optimizer step in the owner exchange (both directions)."""
        return sum(plan.sent_elements(self._get_sub_group_partition_rank(i))
                   * self._muon_exchanges[i].exchange_dtype.itemsize for i, plan in self.muon_plans.items())

    def _report(self) -> None:
        imbalance = max((p.imbalance() for p in self.muon_plans.values()), default=1.0)
        step = self._monitor_step()
        if step is None:  # the engine is gone
            return
        self._monitor.write_events([("Train/ds_muon/muon_seconds", self._muon_seconds, step),
                                    ("Train/ds_muon/exchange_bytes", self.exchange_bytes(), step),
                                    ("Train/ds_muon/owner_imbalance", imbalance, step)])

    # ---- step ----------------------------------------------------------------------------
    def step(self, closure=None):
        """DeepSpeed's ZeRO-3 step; counts the steps that were not skipped for overflow.

        Afterwards the gradient partitions are zeroed. DeepSpeed copies a parameter's gradient
        into its partition on the window's first micro-step and adds on later ones, so a parameter
        that gets no gradient in a step (or in the first micro-step) would otherwise be stepped
        with last step's gradient again. Zeroed, such a parameter sees a zero gradient, the
        oracle's semantics.
        """
        self._muon_seconds = 0.0
        try:
            super().step(closure)
        finally:
            self._zero_grad_partitions()
        if not self.overflow:
            self.muon_step_count += 1
            if self._monitor is not None:
                self._report()

    def _zero_grad_partitions(self) -> None:
        if getattr(self, "grad_partitions_flat_buffer", None) is not None:
            self.grad_partitions_flat_buffer.zero_()
        if self.offload_optimizer:
            for i, fp32 in enumerate(self.fp32_partitioned_groups_flat):
                if fp32.grad is not None and not self._swappable_optimizer_subgroup(i):
                    fp32.grad.zero_()

    def _optimizer_step(self, sub_group_id: int) -> None:
        plan = self.muon_plans.get(sub_group_id)
        if plan is None:
            super()._optimizer_step(sub_group_id)
            return
        timed = self._monitor is not None
        if timed:
            get_accelerator().synchronize()
            start = time.perf_counter()
        self._muon_sub_group_step(sub_group_id, plan)
        if timed:
            get_accelerator().synchronize()
            self._muon_seconds += time.perf_counter() - start

    @torch.no_grad()
    def _muon_sub_group_step(self, i: int, plan: BucketedPlan) -> None:
        group = self._muon_group(i)
        fp32 = self.fp32_partitioned_groups_flat[i]
        grad = fp32.grad
        state = self.optimizer.state[fp32]
        momentum = state.get(MOMENTUM_KEY)
        if momentum is None:
            momentum = state[MOMENTUM_KEY] = torch.zeros_like(fp32, dtype=torch.float32)
        beta = group["momentum"]
        with record_function("ds_muon/momentum"):
            momentum.lerp_(grad, 1 - beta)
            update = grad.lerp_(momentum, beta) if group["nesterov"] else momentum
        method, steps, mode = group["ns_method"], group["ns_steps"], group["update_scale"]
        exchange = self._muon_exchanges[i]
        if self.optimizer.config.ns_compile and exchange.device.type == "cuda":
            ns = compiled_orthogonalize(method, steps, exchange.compute_dtype)
        else:
            ns = functools.partial(orthogonalize, method=method, steps=steps, dtype=exchange.compute_dtype)

        def owner_update(mats: torch.Tensor) -> torch.Tensor:
            rows, cols = mats.shape[-2:]
            return ns(mats).mul_(update_scale(rows, cols, mode))

        with record_function("ds_muon/exchange_and_newton_schulz"):
            exchange.run(plan, update, grad, owner_update)
        with record_function("ds_muon/apply_update"):
            fp32.mul_(1 - group["lr"] * group["weight_decay"])
            fp32.add_(grad, alpha=-group["lr"])

    # ---- checkpoints (the logic lives in ds_muon.checkpoint) ------------------------------
    def state_dict(self):
        """DeepSpeed's ZeRO-3 optimizer state dict plus ds_muon's metadata under ``"ds_muon"``
        (:func:`ds_muon.checkpoint.zero_metadata`: parameter names, shapes, Muon/AdamW flags, sub-group
        layout, world size, ``muon_step_count``)."""
        from .checkpoint import add_metadata
        return add_metadata(self, super().state_dict())

    def load_state_dict(self, *args, **kwargs):
        """DeepSpeed's ZeRO-3 load (arguments passed through unchanged). At the same world size,
        ds_muon's fit checks run first (``CheckpointError`` on every rank before anything is
        restored) and ``muon_step_count`` is restored after; universal checkpoints go to
        :meth:`_load_universal_checkpoint`."""
        from .checkpoint import check_zero_state_dict, restore_step_count, rigid_load_arguments
        state_dict, load_optimizer_states = rigid_load_arguments(self, super().load_state_dict, args, kwargs)
        if state_dict is not None:
            check_zero_state_dict(self, state_dict, load_optimizer_states)
        super().load_state_dict(*args, **kwargs)
        if state_dict is not None and load_optimizer_states:
            restore_step_count(self, state_dict)

    def _load_universal_checkpoint(self, checkpoint_folder, load_optimizer_states, load_from_fp32_weights):
        """Universal checkpoint (``"checkpoint": {"load_universal": true}``): ds_muon's loader, which
        knows Muon's ``momentum_buffer`` (:func:`ds_muon.checkpoint.load_universal_state`); weights
        only (``load_optimizer_states=False``): DeepSpeed's, after ds_muon's checks."""
        from .checkpoint import load_universal_state
        load_universal_state(self, checkpoint_folder, load_optimizer_states)
        if not load_optimizer_states:
            super()._load_universal_checkpoint(checkpoint_folder, load_optimizer_states, load_from_fp32_weights)
