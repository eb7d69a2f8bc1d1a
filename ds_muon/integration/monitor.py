"""Per-step figures on DeepSpeed's own monitor (tensorboard / csv_monitor / wandb / comet) (layer ``integration``).

Events, written by rank 0 (its own figures) after each step not skipped for overflow, at ``step_fn()`` (the
engine's global sample count after this step, DeepSpeed's own x axis):

* ``"type": "Muon"``: ``Train/ds_muon/muon_seconds`` (wall time of this rank's Muon sub-group steps: momentum,
  exchange, Newton–Schulz; the accelerator is synchronized around them only while a monitor is attached; the
  first step includes torch.compile time), ``Train/ds_muon/exchange_bytes`` (bytes this rank sends in the owner
  all_to_all, from the plan), ``Train/ds_muon/owner_imbalance`` (max/mean Newton–Schulz FLOPs over ranks),
  ``Train/ds_muon/muon_lr`` / ``Train/ds_muon/adam_lr`` (the lr this step used in the first Muon / element-wise
  AdamW param group; DeepSpeed's own ``Train/Samples/lr`` shows only the first group's);
* ``"type": "AdamMini"`` (no Muon events): ``Train/ds_muon/adam_mini_seconds`` (timed as Muon's),
  ``Train/ds_muon/adam_mini_lr`` (the first Adam-mini group's lr), ``Train/ds_muon/adam_lr`` (the first
  per-element group's);
* with ``qk_clip`` enabled: ``Train/ds_muon/qk_clip/heads_clipped`` (query heads whose max logit of the step
  exceeded the threshold, over all layers), ``Train/ds_muon/qk_clip/max_logit`` (the largest pre-softmax logit
  of the step, all layers and ranks), ``Train/ds_muon/qk_clip/max_logit/<module>`` per attention module and,
  unless ``qk_clip.monitor_per_head`` is off, ``Train/ds_muon/qk_clip/max_logit/<module>/head_<h>`` per query
  head (``S_h``; ``-inf`` for a head that saw no allowed key);
* with the overlapped step on (``overlap_backward``): ``Train/ds_muon/overlap/commits`` (of them
  ``Train/ds_muon/overlap/commits_idle_blocks``: with blocks that had no gradient set aside;
  ``Train/ds_muon/overlap/commits_from_grad``: reading ZeRO-3's bf16 gradient in place),
  ``Train/ds_muon/overlap/fallback_<reason>`` (``clip``, ``overflow``, ``not_ready``, ``loss_scale``) and the
  CUDA-graph counters (``Train/ds_muon/overlap/graph_*``): Muon sub-group steps since the start that applied the
  update computed in backward, those that recomputed it, and the graphs' captures and replays.

After each step skipped for a non-finite gradient norm: ``Train/ds_muon/skipped_steps`` (a count).
"""
from __future__ import annotations

from typing import Callable, Optional

from ..names import ADAM_MINI, ADAMW, ALGORITHM_KEY

__all__ = ["MonitorReporter"]

_LR_EVENT = {ADAMW: "Train/ds_muon/adam_lr"}  # the others: Train/ds_muon/<algorithm>_lr


class MonitorReporter:
    """Writes a ds_muon ZeRO optimizer's figures to DeepSpeed's monitor.

    Args:
        monitor: the engine's ``MonitorMaster`` (``write_events([(name, value, step)])``).
        step_fn: ``() -> the engine's global sample count after this step``, or None when the engine is gone.
    """

    def __init__(self, monitor, step_fn: Callable[[], Optional[int]]) -> None:
        self._monitor, self._step_fn = monitor, step_fn

    def applied(self, opt) -> None:
        """Write the figures of the step ``opt`` (a :class:`~ds_muon.integration.zero3.MuonZeroOptimizer`) just
        applied."""
        step = self._step_fn()
        if step is None:
            return
        lrs: dict[str, float] = {}  # the first group's lr of each algorithm, as this step used it
        for group in opt.optimizer.param_groups:
            algorithm = group[ALGORITHM_KEY]
            lrs.setdefault(_LR_EVENT.get(algorithm, f"Train/ds_muon/{algorithm}_lr"), group["lr"])
        if opt.optimizer.optimizer_type == "AdamMini":
            events = [("Train/ds_muon/adam_mini_seconds", opt.step_seconds[ADAM_MINI], step)]
        else:
            imbalance = max((p.imbalance() for p in opt.muon_plans.values()), default=1.0)
            events = [("Train/ds_muon/muon_seconds", opt.step_seconds["muon"], step),
                      ("Train/ds_muon/exchange_bytes", opt.exchange_bytes(), step),
                      ("Train/ds_muon/owner_imbalance", imbalance, step)]
        events += [(name, float(lr), step) for name, lr in lrs.items()]
        stats = opt.qk_clip_stats
        if opt.qk_clip_targets and stats is not None:
            events += [("Train/ds_muon/qk_clip/heads_clipped", stats["heads_clipped"], step),
                       ("Train/ds_muon/qk_clip/max_logit", stats["max_logit"], step)]
            events += [(f"Train/ds_muon/qk_clip/max_logit/{name}", value, step)
                       for name, value in stats["max_logit_per_layer"].items()]
            if opt.optimizer.config.qk_clip.monitor_per_head:
                events += [(f"Train/ds_muon/qk_clip/max_logit/{name}/head_{h}", value, step)
                           for name, values in stats["max_logit_per_head"].items() for h, value in enumerate(values)]
        # the overlapped step's commits and fallbacks, cumulative; also for a step inside overlap_paused()
        if getattr(opt, "overlap_running", False):
            events += [(f"Train/ds_muon/overlap/{key}", count, step) for key, count in opt.overlap_stats.items()]
        self._monitor.write_events(events)

    def skipped(self, count: int) -> None:
        """Write ``Train/ds_muon/skipped_steps`` after a step skipped for a non-finite gradient norm."""
        step = self._step_fn()
        if step is not None:
            self._monitor.write_events([("Train/ds_muon/skipped_steps", count, step)])
