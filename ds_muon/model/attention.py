"""QK-clip's targets: the attention modules of a model and the query/key rows of each head (layer ``model``).

:func:`find_clip_targets` finds them (declared with ``muon_qk_clip()``, or Hugging Face attention with
``q_proj``/``k_proj`` or a fused ``qkv_proj``; head geometry from :func:`ds_muon.model.structure.head_geometry`);
:func:`factor_spans` turns them into flat element ranges per factor, which the oracle scales on whole
parameters and :mod:`ds_muon.sharded.qk_clip` on ZeRO partitions. :func:`take_max_logits` reads the
recorder (:mod:`ds_muon.model.max_logits`). The rule itself is :mod:`ds_muon.core.qk_clip`
(Kimi K2 technical report, arXiv 2507.20534, section 2.1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ..errors import ConfigError
from .max_logits import RECORDER
from .structure import head_geometry, param_shape, text_config

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
    geometry = head_geometry(module, cfg)
    if geometry is None:
        raise ConfigError(f"optimizer.params.qk_clip: {where}: no head geometry (model.config with "
                          "num_attention_heads, num_key_value_heads, head_dim); or declare it with a "
                          f"{DECLARE_METHOD}() method on the module")
    nh, nkv, hd = geometry
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
    cfg = text_config(model)
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



def factor_spans(targets: Sequence[ClipTarget]) -> list[tuple[nn.Parameter, int, int, int]]:
    """Every head's rows as a flat element range of its parameter, with its index in the factor vector.

    Args:
        targets: from :func:`find_clip_targets`.

    Returns:
        ``[(param, lo, hi, k)]``: elements ``[lo, hi)`` of the flattened (row-major) ``param`` are scaled by
        factor ``k`` of :func:`ds_muon.core.qk_clip.factor_vector` (per target: query heads, then key heads;
        weights and biases alike).
    """
    out, pos = [], 0
    for t in targets:
        for rows_list, base in ((t.query, pos), (t.key, pos + t.num_heads)):
            for hr in rows_list:
                out.extend((hr.param, *hr.head_span(h), base + h) for h in range(hr.num_heads))
        pos += t.num_factors
    return out


def scale_spans_(spans: Sequence[tuple[nn.Parameter, int, int, int]], factors: torch.Tensor) -> None:
    """In place on whole (single-device) parameters: each span times its factor (the oracle's clip); factors
    of 1 touch nothing."""
    values = factors.tolist()
    for param, lo, hi, k in spans:
        if values[k] != 1.0:
            param.data.view(-1)[lo:hi].mul_(values[k])
