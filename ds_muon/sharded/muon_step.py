"""The Muon step of one sub-group on one rank's flat fp32 partition (layer ``sharded``: no DeepSpeed).

prepare -> exchange + Newton–Schulz -> finalize (docs/design.md, "One optimizer step"):

1. **prepare**, element-wise on the local shard ``(n,)``: ``m <- beta*m + (1-beta)*g`` and
   ``u <- lerp(g, m, beta)`` (Nesterov) or ``u <- m``; the momentum ``m`` (fp32, or bf16 with
   ``momentum_dtype``) never leaves its rank. Blocks that had no gradient on any rank are set aside.
2. **exchange + NS** (:class:`~ds_muon.sharded.exchange.OwnerExchange`): all_to_all ``u``'s chunks to each
   matrix's owner rank, Newton–Schulz batched by view there, times the update scale, all_to_all back.
3. **finalize**: ``p <- p*(1 - lr*wd) - lr*o`` (decoupled weight decay); the set-aside blocks are put
   back as they were (no momentum decay, no update, no weight decay).

On CUDA with ``ns_compile``, steps 1 and 3 each run as one compiled pass over the shard
(:func:`ds_muon.core.muon_update.fused_momentum_update_`, :func:`~ds_muon.core.muon_update.fused_apply_update_`);
on CPU (and under CPU offload, where the shard is in CPU memory) they run eagerly.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.profiler import record_function

from ..core.muon_update import (apply_update_, fused_apply_update_, fused_momentum_update_, momentum_update_,
                                scaled_orthogonalizer, set_aside)
from .blocks import BlockMap
from .collectives import named_collective
from .exchange import OwnerExchange
from .ownership import BucketedPlan

__all__ = ["MuonShardStep"]


class MuonShardStep:
    """Muon on one sub-group's local fp32 partition, built once per sub-group (its Newton–Schulz function too).

    Args:
        name: how messages name the sub-group (e.g. ``"ZeRO sub-group 3"``).
        plan: the sub-group's owner plan (:func:`ds_muon.sharded.ownership.build_bucketed_plan`).
        block_map: this rank's :class:`~ds_muon.sharded.blocks.BlockMap` of the sub-group.
        exchange: the :class:`~ds_muon.sharded.exchange.OwnerExchange` over the sub-group's partition group.
        group: the param group; its ``lr``, ``weight_decay``, ``momentum``, ``nesterov``, ``ns_method``, ``ns_steps``
            and ``update_scale`` are read at every step (schedulers apply; a loaded checkpoint's groups bring theirs).
        ns_compile, ns_autotune: the config keys (compiled Newton–Schulz and fused element-wise passes on CUDA).
    """

    def __init__(self, name: str, plan: BucketedPlan, block_map: BlockMap, exchange: OwnerExchange, group: dict,
                 ns_compile: bool, ns_autotune: bool) -> None:
        self.name, self.plan, self.block_map, self.exchange = name, plan, block_map, exchange
        self._ns_compile, self._ns_autotune = ns_compile, ns_autotune
        self._ns_key: Optional[tuple] = None
        self._owner_update = self._orthogonalizer(group)

    def _orthogonalizer(self, group: dict):
        """The owner-side function for the group's current ``ns_method``, ``ns_steps`` and ``update_scale``,
        rebuilt only when one of them changed (a loaded checkpoint's param groups bring their own)."""
        key = (group["ns_method"], group["ns_steps"], group["update_scale"])
        if key != self._ns_key:
            device = self.exchange.device
            self._owner_update = scaled_orthogonalizer(
                *key[:2], self.exchange.compute_dtype, key[2],
                compiled=self._ns_compile and device is not None and device.type == "cuda", autotune=self._ns_autotune)
            self._ns_key = key
        return self._owner_update

    @torch.no_grad()
    def run(self, fp32: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor, had: Optional[torch.Tensor],
            group: dict) -> None:
        """One Muon step of the sub-group, in place. Collective over the partition group (the owner all_to_all);
        every rank must call it with the same ``had``.

        Args:
            fp32: ``(n,)`` float32 local partition, updated in place.
            grad: ``(n,)`` float32 local gradient (final: accumulated, reduced, unscaled, clipped); overwritten
                (it holds ``u`` and then the orthogonalized update).
            momentum: ``(n,)`` float32 or bfloat16 momentum, updated in place.
            had: ``(n_blocks,)`` bool, which blocks had a gradient on any rank
                (:meth:`ds_muon.sharded.no_grad.GradientFlags.blocks_with_gradient`); None: all did.
            group: the param group (its current ``lr``, ``weight_decay``, ``momentum``, ``nesterov``).

        Raises:
            ds_muon.errors.CollectiveError: the all_to_all failed (a peer died), naming the sub-group.
        """
        put_back = None
        if had is not None and not bool(had.all()):  # every rank holds the same flags, so all take the same branch
            if not bool(had.any()):
                return  # no gradient anywhere in the sub-group: no exchange, nothing changes
            put_back = set_aside(self.block_map.local_ranges(torch.nonzero(~had).flatten().tolist()), momentum, fp32)
        fused = self._ns_compile and grad.device.type == "cuda"
        with record_function("ds_muon/momentum"):
            update = (fused_momentum_update_ if fused else momentum_update_)(momentum, grad, group["momentum"],
                                                                             group["nesterov"])
        with record_function("ds_muon/exchange_and_newton_schulz"), \
                named_collective(f"the Muon owner exchange (all_to_all) of {self.name}"):
            self.exchange.run(self.plan, update, grad, self._orthogonalizer(group))
        with record_function("ds_muon/apply_update"):
            (fused_apply_update_ if fused else apply_update_)(fp32, grad, group["lr"], group["weight_decay"])
            if put_back is not None:  # blocks with no gradient: as they were
                put_back()
