"""Faults a ds_muon ZeRO optimizer reports instead of hiding (layer ``integration``).

* steps skipped because the global gradient norm was NaN/Inf (:class:`SkippedSteps`): counted, logged naming
  the first parameter with a non-finite gradient (:func:`first_non_finite_grad`), reported to the monitor, and
  the run stopped after ``optimizer.params.max_consecutive_skipped_steps`` in a row;
* a parameter whose ``requires_grad`` changed after the engine was built (:class:`TrainableSet`), which ZeRO
  does not follow.

docs/troubleshooting.md ("Faults") lists what each looks like.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger

__all__ = ["SkippedSteps", "TrainableSet", "first_non_finite_grad"]


class SkippedSteps:
    """The count of optimizer steps skipped for a non-finite gradient norm (the step leaves all state untouched).

    Args:
        limit: ``max_consecutive_skipped_steps`` (0: never stop).

    Attributes:
        count: steps skipped so far in this process. consecutive: skipped since the last applied step.
        last_param: name of the first parameter with a non-finite gradient in the last skipped step (None: only
            the norm overflowed).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0
        self.consecutive = 0
        self.last_param: Optional[str] = None

    def applied(self) -> None:
        """A step was applied: the run of skipped steps ends."""
        self.consecutive = 0

    def skipped(self, log: bool, loss_scale, report: Optional[Callable[[int], None]] = None) -> None:
        """Count, log (where ``log``: rank 0 of the data-parallel group) and ``report(count)`` a skipped step.

        Raises:
            RuntimeError: after ``limit`` consecutive skipped steps, on every rank (the overflow flag is global),
                naming the first parameter with a non-finite gradient and the config key.
        """
        self.count += 1
        self.consecutive += 1
        where = (f"first parameter with a non-finite gradient: {self.last_param}"
                 if self.last_param else "no gradient element is non-finite; the norm overflowed")
        if log:
            logger.warning("ds_muon: optimizer step skipped, the global gradient norm is not finite (%s); "
                           "%d consecutive, %d skipped in all, loss scale %s", where, self.consecutive, self.count,
                           loss_scale)
        if report is not None:
            report(self.count)
        if self.limit and self.consecutive >= self.limit:
            raise RuntimeError(
                f"ds_muon: {self.consecutive} consecutive optimizer steps skipped because the gradient "
                f"norm was NaN or Inf ({where}); stopping. Check the data and the loss for NaN/Inf, lower the "
                "learning rate or enable gradient_clipping, or raise optimizer.params.max_consecutive_skipped_steps "
                "(0 never stops)")


class TrainableSet:
    """The model's trainable set when the engine was built, and the check that it did not change.

    ZeRO fixes the trainable set at initialize: a weight frozen later keeps being stepped (Muon's momentum keeps
    it moving at full step size), and one unfrozen later is never stepped. The check is local (no collective);
    switch ``requires_grad`` on every rank alike.
    """

    def __init__(self, module: torch.nn.Module, names: dict) -> None:
        self._at_init = {p: p.requires_grad for p in module.parameters()}
        self._names = names

    def check(self) -> None:
        """Raises:
            RuntimeError: naming each parameter whose ``requires_grad`` changed, and the fix.
        """
        changed = [(self._names.get(p, f"ds_id={getattr(p, 'ds_id', '?')}"), was)
                   for p, was in self._at_init.items() if p.requires_grad != was]
        if changed:
            lines = [f"'{name}' was {'trainable' if was else 'frozen'} at initialize and is now "
                     f"{'frozen' if was else 'trainable'}" for name, was in changed]
            raise RuntimeError(
                "ds_muon: requires_grad changed after the engine was built, which ZeRO-3 does not follow (a frozen "
                "weight would keep moving, an unfrozen one would never train):\n  " + "\n  ".join(lines)
                + "\nSet requires_grad before ds_muon.initialize (save a checkpoint and build a new engine to "
                "change it mid-run), or keep the parameter trainable with lr 0 in its own param group")


def _local_grad_partitions(opt, offloaded: set) -> Iterator[tuple[torch.nn.Parameter, Optional[torch.Tensor]]]:
    """Yield ``(param, local fp32/bf16/fp16 gradient partition or None)`` of a ZeRO-3 optimizer in sub-group
    order, wherever DeepSpeed keeps it at the overflow check: ``averaged_gradients`` without offload, the fp32
    partition's ``grad`` with CPU offload, swapped in (and released) under NVMe (``offloaded``: the ``ds_id`` of
    the parameters whose gradient DeepSpeed offloaded in this window)."""
    for i, params in enumerate(opt.fp16_groups):
        swapped = opt.offload_optimizer and opt._swappable_optimizer_subgroup(i)
        if swapped:
            opt._optimizer_states_and_gradient_swap_in(i)
        try:
            flat = opt.fp32_partitioned_groups_flat[i].grad if opt.offload_optimizer else None
            grads = None if opt.offload_optimizer else (opt.averaged_gradients or {}).get(i)
            for j, param in enumerate(params):
                if grads is not None:
                    yield param, grads[j]
                elif flat is not None and (not swapped or param.ds_id in offloaded):
                    _, offset, numel = opt.grad_position[opt.get_param_id(param)]
                    yield param, flat.narrow(0, offset, numel)
                else:
                    yield param, None
        finally:
            if swapped:
                opt._release_swap_buffers(i)


def first_non_finite_grad(opt, offloaded: set) -> Optional[str]:
    """Name of the first parameter (sub-group order, over all ranks of the data-parallel group) whose gradient
    holds a NaN or Inf, or None if none does (e.g. only the norm overflowed). Collective: one all_reduce(MIN) of
    one int64, so every rank names the same parameter."""
    params = [p for group in opt.fp16_groups for p in group]
    first = len(params)
    for k, (param, grad) in enumerate(_local_grad_partitions(opt, offloaded)):
        if first == len(params) and grad is not None and grad.numel() and not torch.isfinite(grad).all():
            first = k
    found = torch.tensor([first], dtype=torch.int64, device=get_accelerator().current_device_name())
    dist.all_reduce(found, op=dist.ReduceOp.MIN, group=opt.dp_process_group)
    k = int(found.item())
    if k == len(params):
        return None
    return opt.param_names.get(params[k], f"ds_id={params[k].ds_id}")
