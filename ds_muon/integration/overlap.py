"""The DeepSpeed hooks of the overlapped Muon step (ZeRO-3, no optimizer offload): docs/design.md, "The overlapped step".

:class:`OverlapHooks` is a mixin of :class:`~ds_muon.integration.zero3.MuonZeroOptimizer` (before
``DsMuonZeroSteps`` in its bases), and the base of ZeRO-1/2's :class:`~ds_muon.integration.overlap12.FlatOverlapHooks`,
which keeps everything here but the backward hook (``partition_grads`` is ZeRO-3's alone). It hooks DeepSpeed
0.19.8's ZeRO-3 optimizer at:

- ``partition_grads(params, grad_partitions)``: called by ``__reduce_and_partition_ipg_grads`` for each gradient
  bucket once it is reduce-scattered (on ``reduce_and_partition_stream`` on CUDA), with the bucket's parameters
  sorted by ``ds_id``; the epilogue flushes the last bucket. The same sequence runs on every rank (the
  reduce-scatter is itself a collective over those parameters), so on the last micro-batch
  (``is_gradient_accumulation_boundary()``) the Muon parameters passed here are final in the same order on every
  rank, and :class:`~ds_muon.sharded.overlap.SpeculativeMuon` starts each owner-plan bucket's speculative step as
  soon as its parameters are all final.
- ``step``: joins the side stream, and drops any speculation a skipped step (fp16 overflow) left.
- ``_get_norm_groups``: with clipping on, whether clipping fires this step, computed on the device from the same
  norms and copied to the host ahead of DeepSpeed's host read of the norm (no host sync of its own).
- ``_commit_speculation(i, ...)``, asked by the base's ``_muon_step``: commits sub-group ``i``'s speculation when
  exact (clip coefficient 1, the loss scale the speculation divided by, the speculation complete; blocks without
  gradient set aside as the ordinary step sets them aside), else the ordinary step runs.
- ``zero_grad`` outside a step and a backward that is not the last micro-batch's: any speculation is dropped
  (a backward never followed by a step leaks nothing).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist
from deepspeed.runtime.utils import combine_grad_norm_groups

from ..errors import ConfigError
from ..names import MOMENTUM_KEY
from ..sharded.exchange import OwnerExchange
from ..sharded.host_copy import HostCopy
from ..sharded.overlap import SpeculativeMuon

__all__ = ["OVERLAP_REDUCE_BUCKET_SIZE", "OverlapHooks", "overlap_auto_applies", "overlap_reduce_bucket_size"]

#: ``zero_optimization.reduce_bucket_size`` (elements) that ds_muon uses where the overlapped step runs and the
#: config leaves the key unset: DeepSpeed's default (5e8) reduces a 934M model in two buckets, the first after about
#: 5e8 of its gradient elements, so the speculation starts late and spills past backward's end (one H200, W=1, 934M,
#: 3 rounds each: step 1.16x AdamW's with 5e8, 0.99x with 5e7, in two runs; docs/benchmarks.md, "Issue 40: the
#: per-bucket stash on a GPU"). 1e8 rather than 5e7 since one H100, W=1, 3 rotated rounds beside AdamW, one run
#: per model (docs/benchmarks.md, "Issue 40: the reduce bucket in three rounds"): backward's host time was lower
#: with 1e8 (934M 0.125 against 0.134 s, MoE-1.5B 0.227 against 0.243) and backward plus the speculation's spill
#: past it no higher; the steps' medians (934M 0.264 against 0.307 s, MoE-1.5B 0.494 against 0.473) differ
#: mostly in forward host time, which the bucket does not touch (the spread between processes).
OVERLAP_REDUCE_BUCKET_SIZE = 100_000_000


def overlap_auto_applies(device_type: str, offloaded: bool, world_size: int, cuda_graphs: bool) -> bool:
    """Where ``overlap_backward: "auto"`` turns the overlapped step on at ZeRO-3: on CUDA at one data-parallel rank,
    no optimizer offload, with ``overlap_cuda_graphs`` (measured faster there: one H200, 3 rounds, 934M: 0.271 s
    against 0.311-0.386 s without it, and AdamW's 0.273; docs/benchmarks.md, "Issue 40: the overlapped step as
    CUDA graphs"). Elsewhere it is off: at W >= 2 the speculation launches eagerly on backward's host thread (no
    graphs around NCCL yet; eager launches made the whole step 1.12-1.20x slower, measured at W=1), and the CPU
    has no streams."""
    return device_type == "cuda" and not offloaded and world_size == 1 and bool(cuda_graphs)


def overlap_reduce_bucket_size(zero_config, params, stage: int, device_type: str, world_size: int) -> Optional[int]:
    """The ``reduce_bucket_size`` (elements) ds_muon gives DeepSpeed's ZeRO optimizer, or None to keep the config's.

    :data:`OVERLAP_REDUCE_BUCKET_SIZE` where the overlapped step will run (``overlap_backward`` true, or "auto" where
    :func:`overlap_auto_applies` at ZeRO-3) and the user's config does not set ``zero_optimization.reduce_bucket_size``
    (pydantic's ``model_fields_set``; an integration such as transformers' that fills in a value sets it), so that the
    first gradient bucket, and with it the speculation, starts early in backward. A set value is kept as it is.

    Args:
        zero_config: DeepSpeed's ``DeepSpeedZeroConfig`` (``engine._config.zero_config``).
        params: the inner optimizer's ``optimizer.params`` model (``overlap_backward``, ``overlap_cuda_graphs``), or
            None (no ds_muon config: None is returned).
        stage: the ZeRO stage (``"auto"`` is on at stage 3 only).
        device_type: the accelerator's device type, e.g. ``"cuda"``.
        world_size: the job's world size (the data-parallel ranks of ``"auto"``'s rule).
    """
    setting = getattr(params, "overlap_backward", False)
    offload = getattr(zero_config, "offload_optimizer", None)
    offloaded = offload is not None and str(getattr(offload.device, "value", offload.device)) != "none"
    if setting is False or offloaded or "reduce_bucket_size" in zero_config.model_fields_set:
        return None
    if stage == 1 and not zero_config.overlap_comm:  # refused there (DeepSpeed reduces after backward)
        return None
    if setting == "auto" and not (stage == 3 and overlap_auto_applies(device_type, offloaded, world_size,
                                                                      getattr(params, "overlap_cuda_graphs", True))):
        return None
    return OVERLAP_REDUCE_BUCKET_SIZE


class OverlapHooks:
    """The overlapped Muon step's hooks on DeepSpeed's ZeRO-3 optimizer (see the module docstring).

    Attributes:
        speculative: the :class:`~ds_muon.sharded.overlap.SpeculativeMuon`, or None (overlap off).
        overlap_stats: ``{"commits": n, "commits_idle_blocks": n, "commits_from_grad": n, "fallback_clip": n,
            "fallback_overflow": n, "fallback_not_ready": n, "fallback_loss_scale": n, "graph_captures": n,
            "graph_replays": n,
            "graph_recaptures_<grad|momentum|loss_scale>": n}`` since construction
            (all zero with overlap off; :meth:`~ds_muon.sharded.overlap.SpeculativeMuon.stats`).
    """

    speculative: Optional[SpeculativeMuon] = None
    _paused: Optional[SpeculativeMuon] = None  # the speculative step set aside by overlap_paused
    _overlap_index: dict = {}
    _overlap_clip: Optional[bool] = None
    _overlap_clip_ahead: Optional[tuple] = None  # (loss scale, HostCopy of the clip decision) of this step
    _grads_in_place: Optional[dict] = None  # sub-group -> gradient slice read in place, set per step (step)

    def _build_steps(self) -> None:
        super()._build_steps()
        self._build_overlap()

    def _bucket_order(self) -> str:
        """``"reverse"`` where the overlapped step will run: a bucket then holds consecutive layers in the order
        ZeRO-3 finalizes their gradients in backward, so the first bucket starts while the rest of backward runs
        (with ``"cost"`` every bucket mixes all layers and is complete only when backward ends)."""
        return "reverse" if self._overlap_wanted(plans_built=False) else super()._bucket_order()

    def _overlap_wanted(self, plans_built: bool = True) -> bool:
        """``optimizer.params.overlap_backward``: True runs where the path applies (no optimizer offload, no ZenFlow,
        Muon sub-groups present; on the CPU inline in backward); "auto" where it is exact and measured faster
        (:meth:`_overlap_auto`).

        Raises:
            ConfigError: True with optimizer offload.
        """
        setting = self._overlap_setting("overlap_backward", False)
        if setting is False or (plans_built and not self.muon_steps) or getattr(self, "zenflow", False):
            return False  # ZenFlow rewrites the fp32 gradients in partition's caller: not the gradient speculated on
        if setting == "auto":
            return self._overlap_auto()
        if self._offloaded():  # setting is True here: "auto" and False returned above
            raise ConfigError("ds_muon: optimizer.params.overlap_backward is true, but the overlapped Muon step "
                              "needs the optimizer state on the accelerator (zero_optimization.offload_optimizer "
                              "is set); use \"auto\" or false")
        return True

    def _overlap_auto(self) -> bool:
        """Where ``"auto"`` turns the overlapped step on (:func:`overlap_auto_applies`; ZeRO-1/2's mixin: nowhere)."""
        return overlap_auto_applies(self._device.type, self._offloaded(), dist.get_world_size(),
                                    self._overlap_setting("overlap_cuda_graphs", True))

    def _overlap_setting(self, key: str, default):
        """The inner optimizer's ``optimizer.params`` value ``key``, or ``default`` where it carries no config."""
        return getattr(getattr(self.optimizer, "config", None), key, default)

    def _build_overlap(self) -> None:
        """Build the speculative step once: on CUDA a side stream and, at W >= 2, a second communicator per
        partition group (NCCL kernels of one communicator on two streams can deadlock); on the CPU inline on the
        step's own groups."""
        if not self._overlap_wanted():
            return
        cuda = self._device.type == "cuda"
        groups: dict = {}
        exchanges = {}
        for i, step in self.muon_steps.items():
            ex = step.exchange
            group = ex.group
            if cuda and ex.world_size > 1:
                ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
                if len(ranks) != dist.get_world_size():  # new_group must be called by every rank for every group
                    return  # e.g. expert-parallel groups: keep today's step (docs/design.md, "The overlapped step")
                if ranks not in groups:
                    groups[ranks] = dist.new_group(list(ranks))
                group = groups[ranks]
            # no pool of its own: each speculated bucket brings one (SpeculativeMuon._bucket_update)
            exchanges[i] = OwnerExchange(group, ex.exchange_dtype, ex.compute_dtype, ex.device)
        self._overlap_index = self._overlap_keys()
        self.speculative = SpeculativeMuon(self.muon_steps, exchanges, torch.cuda.Stream() if cuda else None,
                                           graphs=cuda and self._overlap_setting("overlap_cuda_graphs", True))

    def _overlap_keys(self) -> dict:
        """``{ds_id: (sub-group, index in the sub-group)}`` of every Muon parameter (the key the backward hook finds
        a parameter by; ZeRO-1/2's mixin keys by ``id``)."""
        return {p.ds_id: (i, k) for i in self.muon_steps for k, p in enumerate(self.fp16_groups[i])}

    @property
    def overlap_running(self) -> bool:
        """Whether the overlapped step runs in this optimizer, paused (:meth:`overlap_paused`) or not."""
        return self.speculative is not None or self._paused is not None

    @property
    def overlap_stats(self) -> dict:
        spec = self.speculative or self._paused
        return SpeculativeMuon({}, {}).stats() if spec is None else spec.stats()

    @contextlib.contextmanager
    def overlap_paused(self):
        """Inside the ``with``, the optimizer steps as with ``overlap_backward`` false: nothing is speculated in
        backward, and every Muon sub-group takes the ordinary step. The speculative step's CUDA graphs, their
        output buffer and counters are kept, and it resumes at the next boundary backward after the ``with``. Each
        step is exact either way, so alternating paused and overlapped steps trains as overlap on (or off) does: a
        paired measurement of what the overlap costs backward and saves the step, in one process
        (``benchmarks/step_time.py``, ``bench.alternate_overlap``). A no-op where overlap is off.

        Enter and leave between optimizer steps. A speculation held at the entry (a boundary backward never
        followed by a step) is dropped, uncounted, as ``zero_grad`` drops it.

        Raises:
            RuntimeError: entered inside ``step()``, or while already paused.
        """
        if self._stepping or self._paused is not None:
            raise RuntimeError("ds_muon: overlap_paused() is entered between optimizer steps, once at a time")
        spec = self.speculative
        if spec is not None:
            spec.discard(None)
        self.speculative, self._paused = None, spec
        try:
            yield
        finally:
            self.speculative, self._paused = spec, None

    # ---- backward ------------------------------------------------------------------------------
    def partition_grads(self, params_to_release, grad_partitions):
        """DeepSpeed's; then on the last micro-batch the Muon parameters passed are final: start every owner-plan
        bucket now complete (:meth:`~ds_muon.sharded.overlap.SpeculativeMuon.mark_final`)."""
        buffers = super().partition_grads(params_to_release, grad_partitions)
        spec = self.speculative
        if spec is not None:
            if not self.is_gradient_accumulation_boundary():
                spec.discard(None)  # an earlier boundary backward never reached a step
            else:
                finals = [self._overlap_index[p.ds_id] for p in params_to_release if p.ds_id in self._overlap_index]
                if finals:
                    spec.mark_final(finals, self._resident_grad, self._speculative_momentum, self._param_group,
                                    float(self.loss_scale))
        return buffers

    def _speculative_momentum(self, i: int) -> Optional[torch.Tensor]:
        return self.optimizer.state[self._fp32_partition(i)].get(MOMENTUM_KEY)

    def zero_grad(self, *args, **kwargs):
        """DeepSpeed's; outside a step it also drops any held speculation."""
        if self.speculative is not None and not self._stepping:
            self.speculative.discard(None)
        return super().zero_grad(*args, **kwargs)

    # ---- the step ------------------------------------------------------------------------------
    def step(self, closure=None):
        """DeepSpeed's, with the side stream joined first; a speculation left uncommitted (a step skipped for an
        fp16 overflow) is dropped and counted."""
        self._overlap_clip = self._overlap_clip_ahead = None
        self._grads_in_place = {}  # sub-group -> its gradient slice, for a commit that reads it in place (ZeRO-3)
        if self.speculative is not None:
            self.speculative.join()
        try:
            return super().step(closure)
        finally:
            self._grads_in_place = {}
            if self.speculative is not None:
                self.speculative.discard("overflow" if self.overflow else "not_ready")

    def _get_norm_groups(self):
        """DeepSpeed's per-sub-group gradient norms; with the overlapped step and clipping on, also whether clipping
        fires this step (:meth:`_clip_fires`, on the device), copied to the host without a wait
        (:class:`~ds_muon.sharded.host_copy.HostCopy`): DeepSpeed's step reads the combined norm on the host right
        after (``is_invalid_grad_norm``), which brings the decision along."""
        norm_groups = super()._get_norm_groups()
        if self.speculative is not None and self._stepping and self.clip_grad > 0.:
            scaled = combine_grad_norm_groups(norm_groups)  # DeepSpeed's step combines the same norms the same way
            self._overlap_clip_ahead = (self.loss_scale, HostCopy(self._clip_fires(scaled / self.loss_scale)))
        return norm_groups

    def _clip_fires(self, norm: torch.Tensor) -> torch.Tensor:
        """Whether DeepSpeed's ``unscale_and_clip_grads`` clips at the unscaled global ``norm`` (0-dim tensor): its
        coefficient ``clamp((norm + 1e-6) / clip_grad, min=1)`` is not 1 (the same expression); a 0-dim bool tensor."""
        return (norm + 1e-6) / self.clip_grad > 1.0

    def _clip_fired(self) -> bool:
        """Whether DeepSpeed's ``unscale_and_clip_grads`` clips this step (:meth:`_clip_fires` on DeepSpeed's
        ``_global_grad_norm``). Computed ahead in :meth:`_get_norm_groups` from the same norms, so reading it waits
        for nothing; where the loss scale changed since (fp16's dynamic scale, DeepSpeed divides by the new one)
        it is computed here from DeepSpeed's norm (one host sync)."""
        if self._overlap_clip is None:
            ahead = self._overlap_clip_ahead
            if self.clip_grad <= 0.:
                self._overlap_clip = False
            elif ahead is not None and ahead[0] == self.loss_scale:
                self._overlap_clip = bool(ahead[1].get())
            else:
                self._overlap_clip = bool(self._clip_fires(self._global_grad_norm))
        return self._overlap_clip

    def _clip_known_not_to_fire(self) -> bool:
        """:meth:`DsMuonZeroSteps._clip_known_not_to_fire` (asked with clipping on and a loss scale of 1): with the
        overlapped step built, :meth:`_clip_fired`, which every Muon sub-group's commit reads anyway: at ZeRO-3
        computed ahead and read without a wait; at ZeRO-1/2 from DeepSpeed's global norm where its step has read
        that norm on the host already (its overflow check: a dtype other than bfloat16, or
        ``check_grad_overflow``), else not decided here (reading it would wait for the device)."""
        if self.speculative is None:
            return False
        ahead = self._overlap_clip_ahead
        if ahead is not None:
            return ahead[0] == self.loss_scale and not self._clip_fired()
        norm_read = getattr(self, "dtype", None) != torch.bfloat16 or bool(getattr(self, "check_grad_overflow", False))
        return norm_read and getattr(self, "_global_grad_norm", None) is not None and not self._clip_fired()

    def _commits_in_place(self, i: int) -> bool:
        """Whether Muon sub-group ``i``'s step will commit its speculation reading its gradient where it lies (ZeRO-3's
        bf16 slice, asked while DeepSpeed's step prepares the gradient): the speculation will commit
        (:meth:`~ds_muon.sharded.overlap.SpeculativeMuon.would_commit`, with this step's clip decision and loss
        scale), DeepSpeed's unscale multiplies by exactly 1 (:meth:`_grad_scale_is_one`: it is skipped, so nothing
        writes the gradient before the commit), the momentum is float32, and the sub-group's no-gradient flags are
        agreed already (:meth:`_blocks_with_gradient` would otherwise read them from ``.grad``, the placeholder)."""
        return (self.speculative is not None and self._stepping and i in self.muon_steps
                and self._param_group(i).get("momentum_dtype", "float32") == "float32"
                and self.gradient_flags.agreed(i) and self._grad_scale_is_one()
                and self.speculative.would_commit(i, self._clip_fired(), float(self.loss_scale)))

    def _commit_speculation(self, i: int, fp32: torch.Tensor, momentum: torch.Tensor, had: Optional[torch.Tensor],
                            group: dict) -> bool:
        """Commit sub-group ``i``'s speculation where exact (:meth:`~ds_muon.sharded.overlap.SpeculativeMuon.commit`),
        from the gradient slice kept in place (:meth:`_commits_in_place`) where there is one, else from
        ``fp32.grad``; False: the ordinary Muon step runs (the same no-gradient flags), on ``fp32.grad`` converted
        from the slice now where ``.grad`` held its placeholder. Arguments as
        :meth:`ds_muon.integration.zero_common.DsMuonZeroSteps._commit_speculation`."""
        in_place = (self._grads_in_place or {}).pop(i, None)
        grad = fp32.grad if in_place is None else in_place
        if self.speculative is not None and self.speculative.commit(i, fp32, grad, momentum, had, self._clip_fired(),
                                                                     group, float(self.loss_scale)):
            return True
        if in_place is not None:
            fp32.grad = in_place.to(fp32.dtype)
        return False
