"""Per-head maximum attention logits, recorded during the forward for MuonClip (QK-clip).

MuonClip (Kimi K2 technical report, arXiv 2507.20534, §2.1) needs, for every attention layer and
query head ``h``, the largest pre-softmax logit of the optimizer step,
``S_max[h] = max over (batch, query i, key j allowed by the mask) of q_i^h · k_j^h * scaling``,
after RoPE, exactly as the softmax sees it. The attention reports it here; the clip
(:mod:`ds_muon.qk_clip`) takes it once per optimizer step, reduces it over the data-parallel group
(all_reduce MAX) and rescales the heads' query and key weights.

Interface (shared by the attention side and the clip side):

* :func:`record_max_logits` ``(module, max_logits)``: called by an attention module (or by the
  ``ds_muon_sdpa`` attention function on its behalf) once per forward, with ``max_logits`` of shape
  ``(num_query_heads,)``, the max over this forward's batch and positions. The recorder keeps the
  element-wise running max per module over the micro-batches of the step (no host sync, stays on
  the logits' device, fp32). Calls made with autograd off (evaluation, ``torch.no_grad``) are ignored,
  so only training forwards count; a recompute under activation checkpointing records the same value
  again, which a max absorbs.
* :data:`RECORDER` ``.take(module)``: the running max of ``module`` since the last take, or ``None``
  if it recorded nothing; taking resets it.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import nn


class MaxLogitRecorder:
    """Running per-head max logits, keyed by attention module (held weakly).

    Shapes: every value is a ``(num_query_heads,)`` fp32 tensor on the device of the logits.
    """

    def __init__(self) -> None:
        self._max: "weakref.WeakKeyDictionary[nn.Module, torch.Tensor]" = weakref.WeakKeyDictionary()

    def record(self, module: nn.Module, max_logits: torch.Tensor) -> None:
        """Fold ``max_logits`` ``(num_query_heads,)`` into ``module``'s running max (ignored with autograd off).

        Raises:
            ValueError: ``max_logits`` is not 1-D, or its length differs from an earlier record of ``module``.
        """
        if not torch.is_grad_enabled():
            return
        if max_logits.dim() != 1:
            raise ValueError(f"record_max_logits expects one value per query head, shape (num_heads,); "
                             f"got shape {tuple(max_logits.shape)}")
        value = max_logits.detach().float()
        old = self._max.get(module)
        if old is None:
            self._max[module] = value.clone()
            return
        if old.shape != value.shape:
            raise ValueError(f"record_max_logits: {type(module).__name__} recorded {old.numel()} heads before and "
                             f"{value.numel()} now")
        torch.maximum(old, value, out=old)

    def take(self, module: nn.Module) -> Optional[torch.Tensor]:
        """``module``'s running max since the last take (and reset it), or ``None`` if it recorded nothing."""
        return self._max.pop(module, None)

    def clear(self) -> None:
        """Forget every record."""
        self._max.clear()


RECORDER = MaxLogitRecorder()


def record_max_logits(module: nn.Module, max_logits: torch.Tensor) -> None:
    """Public API for custom attention: report this forward's per-head max logits ``(num_query_heads,)``.

    See the module docstring for the semantics; :data:`RECORDER` holds the values.
    """
    RECORDER.record(module, max_logits)
