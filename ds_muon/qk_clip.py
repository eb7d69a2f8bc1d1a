"""MuonClip's QK-clip: which query/key weights it scales, per head, and by how much.

The rule (Kimi K2 technical report, arXiv 2507.20534, section 2.1, per head). After the optimizer
update of a step, with ``S_h`` the step's largest pre-softmax logit ``q_i^h . k_j^h * scaling`` of
query head ``h`` (all micro-batches, all data-parallel ranks; recorded by the attention through
:mod:`ds_muon.max_logits`) and ``tau`` the threshold::

    gamma_h   = tau / S_h              if S_h > tau else 1
    W_q[h]   *= gamma_h ** alpha                           (the head_dim rows of query head h)
    gamma_g   = tau / max_{h in g} S_h if that max > tau else 1
    W_k[g]   *= gamma_g ** (1 - alpha)                     (the rows of key head g, shared by the query heads h in g: GQA)

Query head ``h`` uses key head ``h // (num_heads / num_kv_heads)`` (transformers' ``repeat_kv``,
``repeat_interleave`` over heads). Since ``gamma_g <= gamma_h``, the logit of every clipped head,
recomputed with the scaled weights on the same inputs, is at most ``tau`` (exactly ``tau`` without
GQA). A query/key bias (Qwen2) is scaled by the same factor as its rows, so ``q = W_q x + b_q`` and
hence the logits scale exactly (RoPE is linear, so it commutes). Non-finite ``S`` is not clipped.

Three layers, as the rest of ds_muon (design.md section 9):

* math: :func:`clip_factors` (the rule) and :func:`apply_full` (the oracle's in-place scaling of whole
  parameters);
* plan: :func:`find_clip_targets` (attention modules, their query/key rows and head geometry) and
  :func:`local_head_ranges` (which flat ranges of one rank's ZeRO-3 partition belong to which head);
* runtime: :func:`take_max_logits` (the recorder's values of all heads of all layers, concatenated:
  the ZeRO-3 optimizer reduces them with one all_reduce(MAX) per step).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from .config import ConfigError
from .max_logits import RECORDER
from .selection import _head_geometry, _module_head_geometry, _text_config, param_shape

logger = logging.getLogger("ds_muon")

#: The method a custom attention module defines to declare its query/key weights (see :func:`find_clip_targets`).
DECLARE_METHOD = "muon_qk_clip"
#: Children that normalize q/k after the projection (Qwen3, OLMo2, Gemma3, ...): QK-clip cannot act there.
QK_NORM_CHILDREN = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm")
FIX_RECORDING = ("pass attn_implementation=\"ds_muon_sdpa\" to a Hugging Face model (after ds_muon.register_attention() "
                 "or ds_muon.enable()), or call ds_muon.record_max_logits(self, max_logits) in a custom attention's "
                 "forward")


@dataclass(eq=False)
class HeadRows:
    """Consecutive head blocks of one parameter: rows ``[start + h*head_dim, start + (h+1)*head_dim)`` are head ``h``.

    Attributes:
        param: the weight ``(rows, cols)`` or bias ``(rows,)`` (``ds_shape`` under ZeRO-3).
        name: its name in ``model.named_parameters()``.
        start: first row of head 0 (0, or the key block's offset in a fused QKV).
        head_dim: rows per head.
        num_heads: heads in the block.
        cols: elements per row (``in_features`` of a weight, 1 for a bias).
    """

    param: nn.Parameter
    name: str
    start: int
    head_dim: int
    num_heads: int
    cols: int

    def head_span(self, h: int) -> tuple[int, int]:
        """``[lo, hi)`` flat (row-major) element range of head ``h`` in the parameter."""
        lo = (self.start + h * self.head_dim) * self.cols
        return lo, lo + self.head_dim * self.cols


@dataclass(eq=False)
class ClipTarget:
    """One attention module QK-clip acts on.

    Attributes:
        module: the module that records its max logits (``record_max_logits(module, (num_heads,))``).
        name: its name in ``model.named_modules()``.
        num_heads, num_kv_heads: query heads and key heads (``num_heads % num_kv_heads == 0``).
        query, key: the rows to scale: the weight, then the bias if there is one.
    """

    module: nn.Module
    name: str
    num_heads: int
    num_kv_heads: int
    query: tuple[HeadRows, ...]
    key: tuple[HeadRows, ...]

    @property
    def num_factors(self) -> int:
        """Entries of this target in the factor vector: query heads, then key heads."""
        return self.num_heads + self.num_kv_heads


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


def apply_full(target: ClipTarget, q_factors: torch.Tensor, k_factors: torch.Tensor) -> None:
    """In place on whole (single-device) parameters: each head's rows times its factor (the oracle's clip)."""
    for rows_list, factors in ((target.query, q_factors), (target.key, k_factors)):
        for hr in rows_list:
            data = hr.param.data.view(-1)
            for h in range(hr.num_heads):
                f = float(factors[h])
                if f != 1.0:
                    lo, hi = hr.head_span(h)
                    data[lo:hi].mul_(f)


# ------------------------------------------------------------------------------------------------
# plan
# ------------------------------------------------------------------------------------------------
def local_head_ranges(hr: HeadRows, numel: int, chunk: int, rank: int) -> list[tuple[int, int, int]]:
    """Which elements of rank ``rank``'s ZeRO-3 chunk of ``hr.param`` belong to which head.

    The parameter (``numel`` elements, flattened row-major) is cut into chunks of ``chunk`` =
    ``ceil(numel / W)`` elements; rank ``r`` holds ``[r*chunk, (r+1)*chunk)`` (zero padding past
    ``numel``). A head's rows are one contiguous flat range, so each head is at most one range here.

    Returns:
        ``[(offset in the chunk, length, head)]`` for every head that overlaps the chunk (elements).
    """
    lo_r, hi_r = rank * chunk, min((rank + 1) * chunk, numel)
    out = []
    for h in range(hr.num_heads):
        lo, hi = hr.head_span(h)
        a, b = max(lo, lo_r), min(hi, hi_r)
        if a < b:
            out.append((a - lo_r, b - a, h))
    return out


def _rows(p: nn.Parameter, name: str, start: int, head_dim: int, heads: int, where: str) -> HeadRows:
    shape = param_shape(p)
    if len(shape) not in (1, 2) or shape[0] < start + head_dim * heads:
        raise ConfigError(f"optimizer.params.qk_clip: {where}: parameter {name!r} of shape {shape} cannot hold "
                          f"{heads} heads of {head_dim} rows from row {start} (expected a (rows, in) weight or a "
                          "(rows,) bias)")
    return HeadRows(p, name, start, head_dim, heads, shape[1] if len(shape) == 2 else 1)


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}


def _declared_target(name: str, module: nn.Module, names: dict[int, str]) -> ClipTarget:
    where = f"{type(module).__name__} {name!r}.{DECLARE_METHOD}()"
    spec = getattr(module, DECLARE_METHOD)()
    if not isinstance(spec, dict) or not {"q", "k", "num_heads", "num_kv_heads"} <= set(spec):
        raise ConfigError(f"optimizer.params.qk_clip: {where} must return a dict with 'q' and 'k' (the query and "
                          "key projection weights, (heads*head_dim, in)), 'num_heads' and 'num_kv_heads'; optional: "
                          "'q_bias', 'k_bias', 'head_dim', 'q_row_offset', 'k_row_offset' (a fused QKV weight)")
    nh, nkv = int(spec["num_heads"]), int(spec["num_kv_heads"])
    q, k = spec["q"], spec["k"]
    qo, ko = int(spec.get("q_row_offset", 0)), int(spec.get("k_row_offset", 0))
    hd = int(spec.get("head_dim") or (param_shape(q)[0] - qo) // nh)
    return _target(module, name, nh, nkv, hd, [(q, qo), (spec.get("q_bias"), qo)],
                   [(k, ko), (spec.get("k_bias"), ko)], names, where)


def _target(module, name, nh, nkv, hd, query, key, names, where) -> ClipTarget:
    if nh < 1 or nkv < 1 or nh % nkv or hd < 1:
        raise ConfigError(f"optimizer.params.qk_clip: {where}: {nh} query heads, {nkv} key heads and head_dim {hd} "
                          "do not fit (num_heads must be a multiple of num_kv_heads)")
    built = []
    for parts, heads in ((query, nh), (key, nkv)):
        rows = []
        for p, start in parts:
            if p is None:
                continue
            if id(p) not in names:
                raise ConfigError(f"optimizer.params.qk_clip: {where}: a declared tensor is not a parameter of the model")
            rows.append(_rows(p, names[id(p)], start, hd, heads, where))
        built.append(tuple(rows))
    return ClipTarget(module, name, nh, nkv, built[0], built[1])


def _hf_target(name: str, module: nn.Module, cfg: Any, names: dict[int, str]) -> Optional[ClipTarget]:
    children = dict(module.named_children())
    separate = isinstance(children.get("q_proj"), nn.Linear) and isinstance(children.get("k_proj"), nn.Linear)
    fused = isinstance(children.get("qkv_proj"), nn.Linear)
    if not (separate or fused):
        return None
    where = f"attention {type(module).__name__} {name!r}"
    norms = [c for c in QK_NORM_CHILDREN if c in children]
    if norms:
        raise ConfigError(
            f"optimizer.params.qk_clip: {where} normalizes queries/keys after the projection ({', '.join(norms)}): "
            "the norm undoes any scaling of W_q/W_k (RMSNorm(gamma*q) = RMSNorm(q)), so QK-clip cannot bound its "
            "logits (Kimi K2 applies QK-clip to attention without QK-norm; QK-norm bounds the logits through the "
            "norm weights instead). Set optimizer.params.qk_clip.enabled to false for this model")
    geometry = _module_head_geometry(module) or _head_geometry(getattr(module, "config", None) or cfg)
    if geometry is None:
        raise ConfigError(f"optimizer.params.qk_clip: {where}: no head geometry (model.config with "
                          "num_attention_heads, num_key_value_heads, head_dim); or declare it with a "
                          f"{DECLARE_METHOD}() method on the module")
    nh, nkv, hd = geometry
    hd = getattr(module, "head_dim", hd) or hd
    if separate:
        q, k = children["q_proj"], children["k_proj"]
        return _target(module, name, nh, nkv, hd, [(q.weight, 0), (q.bias, 0)], [(k.weight, 0), (k.bias, 0)],
                       names, where)
    qkv = children["qkv_proj"]
    rows = param_shape(qkv.weight)[0]
    if rows != (nh + 2 * nkv) * hd:
        raise ConfigError(f"optimizer.params.qk_clip: {where}: qkv_proj has {rows} rows, not (heads {nh} + 2 x kv "
                          f"heads {nkv}) x head_dim {hd}; declare the layout with a {DECLARE_METHOD}() method")
    return _target(module, name, nh, nkv, hd, [(qkv.weight, 0), (qkv.bias, 0)],
                   [(qkv.weight, nh * hd), (qkv.bias, nh * hd)], names, where)


def find_clip_targets(model: nn.Module) -> list[ClipTarget]:
    """The attention modules of ``model`` QK-clip acts on, in ``named_modules()`` order.

    A module is a target when (first match):

    * it defines ``muon_qk_clip()`` returning ``{"q": W_q, "k": W_k, "num_heads": H, "num_kv_heads": Hkv}``
      (weights ``(H*head_dim, in)`` and ``(Hkv*head_dim, in)``; optional ``"q_bias"``, ``"k_bias"``,
      ``"head_dim"``, and ``"q_row_offset"``/``"k_row_offset"`` for a fused weight);
    * it has ``nn.Linear`` children ``q_proj`` and ``k_proj`` (Llama, Qwen2, Mistral, Mixtral, ...) or a
      fused ``qkv_proj`` laid out ``[Q; K; V]`` (Phi-3), with the head geometry from the module or the
      model's config (``num_attention_heads``, ``num_key_value_heads``, ``head_dim``).

    Raises:
        ConfigError: no target at all (naming the fix); a target with a q/k norm after the projection
            (Qwen3 and others: the norm undoes the scaling); a geometry that does not fit the weights.
    """
    cfg = _text_config(model)
    names = _param_names(model)
    targets = []
    for name, module in model.named_modules():
        if callable(getattr(module, DECLARE_METHOD, None)):
            targets.append(_declared_target(name, module, names))
        else:
            t = _hf_target(name, module, cfg, names)
            if t is not None:
                targets.append(t)
    if not targets:
        raise ConfigError(
            "optimizer.params.qk_clip.enabled is true but no attention module was found: QK-clip recognises "
            "attention modules with q_proj/k_proj or qkv_proj linear layers (Hugging Face models) and modules that "
            f"define {DECLARE_METHOD}() returning {{'q': W_q, 'k': W_k, 'num_heads': H, 'num_kv_heads': Hkv}}; "
            "declare yours, or disable qk_clip")
    return targets


# ------------------------------------------------------------------------------------------------
# runtime
# ------------------------------------------------------------------------------------------------
def take_max_logits(targets: Sequence[ClipTarget], device: torch.device) -> torch.Tensor:
    """Take every target's recorded max logits since the last take (resetting the recorder), concatenated.

    Returns:
        ``(sum of num_heads,)`` fp32 on ``device``; ``-inf`` for a target that recorded nothing.

    Raises:
        ValueError: a target recorded a different number of heads than it has.
    """
    parts = []
    for t in targets:
        value = RECORDER.take(t.module)
        if value is None:
            value = torch.full((t.num_heads,), float("-inf"))
        elif value.numel() != t.num_heads:
            raise ValueError(f"qk_clip: {t.name!r} recorded {value.numel()} max logits, but it has {t.num_heads} "
                             "query heads")
        parts.append(value.to(device=device, dtype=torch.float32))
    return torch.cat(parts)


def check_recorded(max_logits: torch.Tensor) -> None:
    """Raise RuntimeError (naming the fix) when no target recorded anything: every value is ``-inf``."""
    if bool((max_logits == float("-inf")).all()):
        raise RuntimeError("ds_muon: optimizer.params.qk_clip is enabled, but no attention module recorded its max "
                           f"logits in this optimizer step; {FIX_RECORDING}")


def factor_vector(targets: Sequence[ClipTarget], max_logits: torch.Tensor, threshold: float,
                  alpha: float) -> tuple[torch.Tensor, dict]:
    """All targets' factors concatenated (per target: query heads, then key heads) and the step's figures.

    Args:
        max_logits: ``(sum of num_heads,)`` from :func:`take_max_logits` (all_reduced MAX over the
            data-parallel group under ZeRO-3).

    Returns:
        ``(factors, stats)``: fp32 ``(sum of num_heads + num_kv_heads,)``; ``stats`` =
        ``{"heads_clipped": query heads with S > tau (count), "max_logit": max S (float),
        "max_logit_per_layer": {target name: max S}, "max_logit_per_head": {target name: [S_h per query head]}}``
        (``-inf`` where nothing was recorded).
    """
    out, per_layer, per_head, pos, clipped = [], {}, {}, 0, 0
    for t in targets:
        s = max_logits[pos:pos + t.num_heads]
        pos += t.num_heads
        q, k = clip_factors(s, t.num_kv_heads, threshold, alpha)
        out += [q, k]
        clipped += int((torch.isfinite(s) & (s > threshold)).sum())
        per_layer[t.name] = float(s.max())
        per_head[t.name] = s.tolist()
    return torch.cat(out), {"heads_clipped": clipped, "max_logit": float(max_logits.max()),
                            "max_logit_per_layer": per_layer, "max_logit_per_head": per_head}


def apply_factor_vector(targets: Sequence[ClipTarget], factors: torch.Tensor) -> None:
    """:func:`apply_full` for every target, from a :func:`factor_vector`."""
    pos = 0
    for t in targets:
        apply_full(t, factors[pos:pos + t.num_heads], factors[pos + t.num_heads:pos + t.num_factors])
        pos += t.num_factors


def partition_ranges(targets: Sequence[ClipTarget], locate) -> dict[Any, list[tuple[int, int, int]]]:
    """Per partition (a ZeRO-3 sub-group), the flat ranges of its local shard to scale and their factor index.

    Args:
        locate: ``param -> (key, shard offset of the param's chunk, numel, chunk, rank)`` or ``None`` when the
            parameter is not stepped by this optimizer (frozen: an error).

    Returns:
        ``{key: [(offset in the local shard, length, index into the factor vector)]}``.

    Raises:
        ConfigError: a query/key parameter is not trainable.
    """
    out: dict[Any, list[tuple[int, int, int]]] = {}
    pos = 0
    for t in targets:
        for rows_list, base in ((t.query, pos), (t.key, pos + t.num_heads)):
            for hr in rows_list:
                where = locate(hr.param)
                if where is None:
                    raise ConfigError(f"optimizer.params.qk_clip: {hr.name!r} ({t.name}) is not trained by this "
                                      "optimizer (frozen?); QK-clip scales the query and key weights after each step, "
                                      "so they must be trainable (or disable qk_clip)")
                key, offset, numel, chunk, rank = where
                out.setdefault(key, []).extend((offset + o, n, base + h)
                                               for o, n, h in local_head_ranges(hr, numel, chunk, rank))
        pos += t.num_factors
    return out
