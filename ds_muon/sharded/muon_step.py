"""The Muon step of one sub-group on one rank's flat fp32 partition (layer ``sharded``: no DeepSpeed).

prepare -> exchange + Newton–Schulz -> finalize (docs/design.md, "One optimizer step"):

1. **prepare**, element-wise on the local shard ``(n,)``: ``m <- beta*m + (1-beta)*g`` and
   ``u <- lerp(g, m, beta)`` (Nesterov) or ``u <- m``; the momentum ``m`` (fp32, or bf16 with
   ``momentum_dtype``) never leaves its rank. Blocks that had no gradient on any rank are set aside.
2. **exchange + NS** (:class:`~ds_muon.sharded.exchange.OwnerExchange`): all_to_all ``u``'s chunks to each
   matrix's owner rank, Newton–Schulz batched by view there, times the update scale, all_to_all back.
3. **finalize**: ``p <- p*(1 - lr*wd) - lr*o`` (decoupled weight decay); the set-aside blocks are put
   back as they were (no momentum decay, no update, no weight decay).

Steps 1 and 3 run eagerly or as one compiled pass each over the shard, as the caller chose once
(``optimizer.params.elementwise_compile``; eager on CPU and under CPU offload, where the shard is in CPU memory).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.profiler import record_function

from ..core.muon_update import (apply_update_, fused_apply_update_, fused_momentum_update_, momentum_step_,
                                momentum_update_, scaled_orthogonalizer, set_aside)
from .blocks import BlockMap
from .collectives import named_collective
from .exchange import OwnerExchange
from .ownership import BucketedPlan

__all__ = ["MuonShardStep"]


class MuonShardStep:
    """Muon on one sub-group's local fp32 partition, built once per sub-group (its Newton–Schulz function too).

    One step moves three values through the partition's buffers, each named for its stage:

    - ``g``, the gradient: DeepSpeed's ``(n,)`` float32 gradient partition (final: accumulated, reduced,
      unscaled, clipped);
    - ``u``, the update Newton–Schulz orthogonalizes (:meth:`prepare`): the Nesterov blend
      ``lerp(g, m, beta)``, written over ``g``; or, without Nesterov, the momentum ``m`` itself with fp32
      momentum (``g`` is then left as is), and a copy over ``g`` with bf16 momentum;
    - ``o``, the scaled orthogonalized update (:meth:`orthogonalize`): written over ``g``'s buffer by the owner
      exchange (every slot of ``u`` is read before the same slot of ``o`` is written, so ``u`` may be that
      buffer), then applied to the partition (:meth:`finalize`).

    The caller runs the stages in order (:meth:`ds_muon.integration.zero_common.DsMuonZeroSteps._muon_step`):
    ``put_back = set_aside(had, m, p)``; ``u = prepare(g, m, group)``; ``orthogonalize(u, g, group)``;
    ``finalize(p, g, group)``; ``put_back()`` if set. The first three leave the partition untouched, so computing
    ``o`` and applying it may happen at different times (the overlapped step, :mod:`ds_muon.sharded.overlap`).

    Args:
        name: how messages name the sub-group (e.g. ``"ZeRO sub-group 3"``).
        plan: the sub-group's owner plan (:func:`ds_muon.sharded.ownership.build_bucketed_plan`).
        block_map: this rank's :class:`~ds_muon.sharded.blocks.BlockMap` of the sub-group.
        exchange: the :class:`~ds_muon.sharded.exchange.OwnerExchange` over the sub-group's partition group.
        group: the param group; its ``lr``, ``weight_decay``, ``momentum``, ``nesterov``, ``ns_method``, ``ns_steps``
            and ``update_scale`` are read at every step (schedulers apply; a loaded checkpoint's groups bring theirs).
        ns_compile, ns_autotune: the config keys (Newton–Schulz compiled on CUDA, with autotuning).
        compiled_elementwise: the momentum step and the update apply each run as one compiled pass
            (:func:`ds_muon.core.muon_update.fused_momentum_update_`, :func:`~ds_muon.core.muon_update.fused_apply_update_`)
            instead of eagerly; chosen once by the caller (``optimizer.params.elementwise_compile``,
            :func:`ds_muon.core.muon_update.use_compiled_elementwise`).
    """

    def __init__(self, name: str, plan: BucketedPlan, block_map: BlockMap, exchange: OwnerExchange, group: dict,
                 ns_compile: bool, ns_autotune: bool, compiled_elementwise: bool = False) -> None:
        self.name, self.plan, self.block_map, self.exchange = name, plan, block_map, exchange
        self._ns_compile, self._ns_autotune = ns_compile, ns_autotune
        self.compiled_elementwise = compiled_elementwise
        self._ns_key: Optional[tuple] = None
        self._owner_update = self._orthogonalizer(group)

    def _orthogonalizer(self, group: dict):
        """The owner-side function for the group's current ``ns_method``, ``ns_steps`` and ``update_scale``,
        rebuilt only when one of them changed (a user editing ``param_groups``, a loaded checkpoint's groups): the
        step follows the group, as torch optimizers do (tests/dist/test_ns_settings.py). The owner plan is not
        rebuilt: it read ``ns_steps``/``ns_method`` at initialize for its LPT cost (load balance) only."""
        key = (group["ns_method"], group["ns_steps"], group["update_scale"])
        if key != self._ns_key:
            device = self.exchange.device
            self._owner_update = scaled_orthogonalizer(
                *key[:2], self.exchange.compute_dtype, key[2],
                compiled=self._ns_compile and device is not None and device.type == "cuda", autotune=self._ns_autotune)
            self._ns_key = key
        return self._owner_update

    def prepare(self, g: torch.Tensor, momentum: torch.Tensor, group: dict) -> torch.Tensor:
        """``m <- beta*m + (1-beta)*g`` in place and the update ``u`` (see the class docstring for which buffer
        holds it). Element-wise on the local shard; the momentum never leaves its rank.

        Returns:
            ``u``, ``(n,)`` float32: ``g``'s buffer or the momentum.
        """
        with record_function("ds_muon/momentum"):
            kernel = fused_momentum_update_ if self.compiled_elementwise else momentum_update_
            return kernel(momentum, g, group["momentum"], group["nesterov"])

    def momentum_step(self, g: torch.Tensor, momentum: torch.Tensor, group: dict) -> None:
        """The momentum step of :meth:`prepare` alone, ``m <- beta*m + (1-beta)*g`` in place, ``g`` read only and
        possibly bfloat16 (:func:`ds_muon.core.muon_update.momentum_step_`: the same momentum as :meth:`prepare`'s
        from the float32 gradient): for a commit whose update was orthogonalized in backward. ``momentum``:
        ``(n,)`` float32."""
        with record_function("ds_muon/momentum"):
            momentum_step_(momentum, g, group["momentum"], self.compiled_elementwise)

    def orthogonalize(self, u: torch.Tensor, o: torch.Tensor, group: dict) -> None:
        """``o <- NS(u) * scale`` for every matrix of the sub-group: the owner exchange (all_to_all of ``u``'s
        chunks to each matrix's owner rank, Newton–Schulz batched by view there, all_to_all back). ``o``
        (``(n,)`` float32) may be ``u``'s buffer. Collective over the partition group.

        Raises:
            ds_muon.errors.CollectiveError: the all_to_all failed (a peer died), naming the sub-group.
        """
        with record_function("ds_muon/exchange_and_newton_schulz"), \
                named_collective(f"the Muon owner exchange (all_to_all) of {self.name}"):
            self.exchange.run(self.plan, u, o, self._orthogonalizer(group))

    def finalize(self, fp32: torch.Tensor, o: torch.Tensor, group: dict) -> None:
        """``p <- p*(1 - lr*wd) - lr*o`` in place (decoupled weight decay, Loshchilov & Hutter, arXiv 1711.05101)
        with the group's current ``lr`` and ``weight_decay``; ``o`` float32, or bfloat16 (a stash read directly,
        upcast exactly)."""
        with record_function("ds_muon/apply_update"):
            kernel = fused_apply_update_ if self.compiled_elementwise else apply_update_
            kernel(fp32, o, group["lr"], group["weight_decay"])

    def set_aside(self, had: Optional[torch.Tensor], momentum: torch.Tensor,
                  fp32: torch.Tensor) -> Optional[Callable[[], None]]:
        """Copies of the momentum and weights of the blocks that had no gradient on any rank, so that the step
        leaves them as they were (no momentum decay, no update, no weight decay).

        Args:
            had: ``(n_blocks,)`` bool, which blocks had a gradient on any rank
                (:meth:`ds_muon.sharded.no_grad.GradientFlags.take`; the same on every rank); None: all did.
            momentum: ``(n,)`` float32 or bfloat16 momentum. fp32: ``(n,)`` float32 local partition.

        Returns:
            ``put_back()``, to call after :meth:`finalize`, or None where every block had a gradient. Where no block
            had one, every block is set aside: the caller skips the step instead (no exchange).
        """
        if had is None or bool(had.all()):
            return None
        return set_aside(self.block_map.local_ranges(torch.nonzero(~had).flatten().tolist()), momentum, fp32)
