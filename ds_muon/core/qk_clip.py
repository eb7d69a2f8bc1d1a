"""MuonClip's QK-clip rule: by how much each attention head's query and key rows are scaled.

The rule (Kimi K2 technical report, arXiv 2507.20534, section 2.1, per head). After the optimizer
update of a step, with ``S_h`` the step's largest pre-softmax logit ``q_i^h . k_j^h * scaling`` of
query head ``h`` (all micro-batches, all data-parallel ranks; recorded by the attention through
:mod:`ds_muon.model.max_logits`) and ``tau`` the threshold::

    gamma_h   = tau / S_h              if S_h > tau else 1
    W_q[h]   *= gamma_h ** alpha                           (the head_dim rows of query head h)
    gamma_g   = tau / max_{h in g} S_h if that max > tau else 1
    W_k[g]   *= gamma_g ** (1 - alpha)                     (the rows of key head g, shared by the query heads h in g: GQA)

Two variants (:mod:`ds_muon.model.attention` says which layer takes which): MLA (Kimi K2's own rule) also
scales each head's rotary query rows by the whole ``gamma_h`` (its rotary key is shared by all heads and
left alone); q/k-norm gains shared by all heads of a layer take one ``gamma = tau / max_h S_h`` for the layer.

Query head ``h`` uses key head ``h // (num_heads / num_kv_heads)`` (transformers' ``repeat_kv``,
``repeat_interleave`` over heads). Since ``gamma_g <= gamma_h``, the logit of every clipped head,
recomputed with the scaled weights on the same inputs, is at most ``tau`` (exactly ``tau`` without
GQA). A query/key bias (Qwen2) is scaled by the same factor as its rows, so ``q = W_q x + b_q`` and
hence the logits scale exactly (RoPE is linear, so it commutes). Non-finite ``S`` is not clipped.

Layer ``core`` (torch only): the rule (:func:`clip_factors`) and the step's factor vector over all
attention layers (:func:`factor_vector`). Which rows of which parameters are scaled is
:mod:`ds_muon.model.attention`; the sharded scaling is :mod:`ds_muon.sharded.qk_clip`.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["clip_factors", "factor_vector", "scale_rows_"]


# ------------------------------------------------------------------------------------------------
# math
# ------------------------------------------------------------------------------------------------
def clip_factors(max_logits: torch.Tensor, num_kv_heads: int, threshold: float,
                 alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head scale factors of the rule above.

    Args:
        max_logits: ``(num_heads,)`` float, ``S_h`` (``-inf`` where nothing was recorded).
        num_kv_heads: key heads; ``num_heads`` must be a multiple of it.
        threshold: ``tau > 0``. alpha: in ``[0, 1]``.

    Returns:
        ``(q, k)``: fp32 ``(num_heads,)`` factors of the query heads' rows and ``(num_kv_heads,)`` of
        the key heads' rows; 1 where nothing is clipped.
    """
    s = max_logits.detach().float()
    group = s.numel() // num_kv_heads
    s_kv = s.view(num_kv_heads, group).amax(dim=1)  # a key head takes the largest logit of its query heads
    one = torch.ones((), dtype=torch.float32, device=s.device)

    def gamma(x: torch.Tensor) -> torch.Tensor:
        hit = torch.isfinite(x) & (x > threshold)
        return torch.where(hit, threshold / torch.where(hit, x, one), one)

    return gamma(s).pow(alpha), gamma(s_kv).pow(1.0 - alpha)


def factor_vector(targets: Sequence[Any], max_logits: torch.Tensor, threshold: float,
                  alpha: float) -> tuple[torch.Tensor, dict]:
    """All targets' factors concatenated (per target: query heads, then key heads) and the step's figures.

    Args:
        targets: the attention layers in order, each with ``name``, ``num_heads`` and ``num_kv_heads``, and
            optionally ``per_layer`` (one gamma for all heads: ``tau / max_h S_h``) and ``query_full`` (non-empty:
            ``num_heads`` more factors ``gamma_h``, MLA's rotary query rows) (:class:`ds_muon.model.attention.ClipTarget`).
        max_logits: ``(sum of num_heads,)`` from :func:`take_max_logits` (all_reduced MAX over the
            data-parallel group under ZeRO-3).

    Returns:
        ``(factors, stats)``: fp32 ``(sum of num_heads + num_kv_heads [+ num_heads],)``; ``stats`` =
        ``{"heads_clipped": query heads with S > tau (count), "max_logit": max S (float),
        "max_logit_per_layer": {target name: max S}, "max_logit_per_head": {target name: [S_h per query head]}}``
        (``-inf`` where nothing was recorded).
    """
    out, per_layer, per_head, pos, clipped = [], {}, {}, 0, 0
    for t in targets:
        s = max_logits[pos:pos + t.num_heads]
        pos += t.num_heads
        # a layer-wide lever (q/k-norm gains shared by all heads): every head takes the layer's largest logit
        lever = s.max().expand(t.num_heads) if getattr(t, "per_layer", False) else s
        q, k = clip_factors(lever, t.num_kv_heads, threshold, alpha)
        out += [q, k]
        if getattr(t, "query_full", ()):  # MLA's rotary query rows: the whole gamma (their shared key is not scaled)
            out.append(clip_factors(lever, t.num_kv_heads, threshold, 1.0)[0])
        clipped += int((torch.isfinite(s) & (s > threshold)).sum())
        per_layer[t.name] = float(s.max())
        per_head[t.name] = s.tolist()
    return torch.cat(out), {"heads_clipped": clipped, "max_logit": float(max_logits.max()),
                            "max_logit_per_layer": per_layer, "max_logit_per_head": per_head}


def scale_rows_(part: torch.Tensor, factor: float, plus_one: bool) -> None:
    """In place: ``part`` (a head's rows, flat) times ``factor``; a ``plus_one`` gain ``w``, applied as ``1 + w``
    (Gemma's RMSNorm), becomes ``factor * w + (factor - 1)`` so that ``1 + w`` is scaled by ``factor``. The one
    arithmetic of the oracle's clip (:func:`ds_muon.model.attention.scale_spans_`) and the ZeRO partitions'
    (:func:`ds_muon.sharded.qk_clip.scale_shard_`)."""
    part.mul_(factor)
    if plus_one:
        part.add_(factor - 1.0)
