"""DeepSpeed's config schedulers on ds_muon's param groups: one schedule, each group's lr ratio kept.

DeepSpeed 0.19.8's ``WarmupLR``, ``WarmupDecayLR``, ``OneCycle`` and ``LRRangeTest``
(``deepspeed/runtime/lr_schedules.py``) compute absolute learning rates from the scheduler params
(``warmup_min_lr``/``warmup_max_lr``, ``cycle_min_lr``/``cycle_max_lr``, ``lr_range_test_min_lr``);
given one number, they write the same value into every param group (``update_lr``). A Muon config
has at least two learning rates (``lr`` for Muon, ``adam_lr`` for AdamW, and any per-group lr a
user sets), so that would train AdamW at the Muon lr.

ds_muon's rule: **the value such a scheduler computes is the Muon lr** (the config's ``muon_lr``,
or ``lr``), and every param group gets it times that group's ratio to the Muon lr, fixed when the
engine is built: ``lr_g(t) = L(t) * lr_g(0) / muon_lr``. So AdamW groups follow
``L(t) * adam_lr / lr``, and a group a user gave its own ``lr``/``adam_lr`` through
``model_parameters`` keeps its ratio too. :class:`GroupRatioScheduler` applies it after every
scheduler step; :func:`broadcasts_one_lr` says when it is needed.

Schedulers that already scale each group's own lr need nothing: ``WarmupCosineLR`` (a ratio of
each group's initial lr), ``WarmupLR`` without ``warmup_max_lr`` (DeepSpeed then warms each group
up to its own lr), per-group lists of lrs (the user wrote every group's value), and
``torch.optim.lr_scheduler`` classes named in the config.
"""
from __future__ import annotations

from typing import Any, Optional

from ..config.sections import is_number

__all__ = ["SCALAR_LR_SCHEDULERS", "broadcasts_one_lr", "GroupRatioScheduler"]

# DeepSpeed scheduler type -> {its lr keys: DeepSpeed's default}. A key whose value is one number
# is written into every param group. (deepspeed 0.19.8 lr_schedules.py signatures; None: no default,
# WarmupLR's warmup_max_lr None means each group's own lr.)
SCALAR_LR_SCHEDULERS: dict[str, dict[str, Optional[float]]] = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None},
    "WarmupDecayLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001},
    "OneCycle": {"cycle_min_lr": None, "cycle_max_lr": None},
    "LRRangeTest": {"lr_range_test_min_lr": 0.001},
}


def broadcasts_one_lr(scheduler_type: Optional[str], params: Optional[dict]) -> bool:
    """Whether the DeepSpeed scheduler ``scheduler_type`` with ``params`` (the config's
    ``scheduler.type``/``scheduler.params``) writes one absolute lr into every param group.

    True for the types of :data:`SCALAR_LR_SCHEDULERS` when the max lr key (``warmup_max_lr``,
    ``cycle_max_lr``; for ``LRRangeTest`` ``lr_range_test_min_lr``), with DeepSpeed's default
    filled in, is one number. False for per-group lists, for ``WarmupLR``/``WarmupDecayLR`` with
    ``warmup_max_lr`` absent (``WarmupLR``) or null (each group's own lr), and for other types.
    """
    keys = SCALAR_LR_SCHEDULERS.get(scheduler_type or "")
    if keys is None:
        return False
    params = params or {}
    values = {k: params.get(k, default) for k, default in keys.items()}
    main = list(values)[-1]  # the max (or, for LRRangeTest, the only) lr key
    return is_number(values[main]) and all(v is None or is_number(v) for v in values.values())


class GroupRatioScheduler:
    """A DeepSpeed lr scheduler whose computed lr is the Muon lr, scaled per param group.

    After the wrapped scheduler writes its value ``L`` into every group (at construction, when it
    starts from the beginning, and at every :meth:`step`), group ``g`` gets ``L * ratios[g]``.
    Everything else (``state_dict``, ``load_state_dict``, the scheduler's own attributes) is the
    wrapped scheduler's, so checkpoints hold the same scheduler state as without ds_muon.

    Args:
        scheduler: a DeepSpeed scheduler built on ``optimizer`` (``broadcasts_one_lr`` true).
        optimizer: the ``torch.optim.Optimizer`` whose ``param_groups`` the scheduler writes.
        ratios: per param group, its initial lr divided by the Muon lr (floats, one per group).

    Raises:
        ValueError: ``ratios`` does not have one entry per param group.
    """

    def __init__(self, scheduler: Any, optimizer: Any, ratios: list[float]) -> None:
        if len(ratios) != len(optimizer.param_groups):
            raise ValueError(f"{len(ratios)} lr ratios for {len(optimizer.param_groups)} param groups")
        self.scheduler, self.optimizer, self.ratios = scheduler, optimizer, list(ratios)
        self._last_lr = [group["lr"] for group in optimizer.param_groups]
        if getattr(scheduler, "last_batch_iteration", -1) == -1:  # the constructor wrote its start value
            self._scale()

    def _scale(self) -> None:
        for group, ratio in zip(self.optimizer.param_groups, self.ratios):
            group["lr"] = group["lr"] * ratio
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def step(self, *args: Any, **kwargs: Any) -> None:
        """The wrapped scheduler's ``step`` (same arguments), then each group's ratio."""
        self.scheduler.step(*args, **kwargs)
        self._scale()

    def get_lr(self) -> list[float]:
        """The wrapped scheduler's lrs for its current iteration, times each group's ratio."""
        return [lr * ratio for lr, ratio in zip(self.scheduler.get_lr(), self.ratios)]

    def get_last_lr(self) -> list[float]:
        """Each param group's lr as last set (after scaling)."""
        return list(self._last_lr)

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"GroupRatioScheduler({self.scheduler!r}, ratios={self.ratios})"
