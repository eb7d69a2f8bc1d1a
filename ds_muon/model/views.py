"""Matrix views of Muon parameters: which blocks Newton–Schulz orthogonalizes separately (layer ``model``).

First match per Muon parameter: ``param.muon_split``, the config's ``muon_splits`` patterns, a conv
weight (one matrix ``(out, in/groups * prod(kernel))``, also at 3-D, cut per group when grouped), a
fused gate_up (gate and up apart: dense ``(2I, H)`` next to a down Linear with I inputs, or per
expert ``(E, 2I, H)`` next to ``(E, H, I)``), a fused QKV (``qkv_proj``/``c_attn``: Q, K, V apart)
and, with ``per_head_muon``, Q/K/V projections per head (geometry: :func:`ds_muon.model.structure.head_geometry`).
The view itself is shape arithmetic in :mod:`ds_muon.core.matrix`; docs/selection.md has the rules.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import itertools
from typing import Optional

import torch
from torch import nn

from ..core.matrix import Split, as_split, matrix_view
from ..names import USER_SPLIT_ATTR
from .structure import (CONV_MODULES, MATRIX_CLASS_NAMES, MHA_PROJECTIONS, head_geometry, is_bias_name,
                        is_matrix_module, is_multihead_attention, param_shape, positive_int, text_config)

# Attention projections, by leaf module name (as DeepSpeed's built-in per_head_muon reads them), each
# claim confirmed by the shape against the config's head geometry. Fused QKV with Q, K, V in
# contiguous blocks (Phi-3 qkv_proj, GPT-BigCode c_attn rows, GPT-2 Conv1D c_attn columns):
_FUSED_QKV_CONTIGUOUS = ("qkv_proj", "c_attn")
# Fused QKV whose rows interleave heads (GPT-NeoX/Bloom query_key_value: per head q,k,v; Falcon and
# InternLM2: per KV group): only the per-head split (head_dim rows each) is layout-independent.
_FUSED_QKV_INTERLEAVED = ("query_key_value", "wqkv", "in_proj_qkv")
_QUERY_LEAVES = ("q_proj", "query", "wq")
_KV_LEAVES = ("k_proj", "key", "wk", "v_proj", "value", "wv")
_MLA_LEAVES = ("q_b_proj", "kv_b_proj")


# Experts stored as (E, in, out) with a fused gate_up (E, H, 2I): whether gate and up are interleaved or halves
# along the last dimension is not in the shape, only in the model's forward, so it is read here by class, each
# entry checked against transformers 5.x: GptOssExperts._apply_gate reads gate = x[..., ::2], up = x[..., 1::2];
# Llama4TextExperts.forward reads gate, up = gate_up.chunk(2, dim=-1).
_GATE_UP_IN_OUT_LAYOUTS = {"GptOssExperts": "interleaved", "Llama4TextExperts": "halves"}


def _gate_up_split(leaf_param: str, shape: tuple, siblings: list[tuple], notes: list[str], name: str,
                   module: Optional[nn.Module] = None) -> Optional[Split]:
    """gate and up apart for a fused gate_up: (2I, H) or (E, 2I, H) next to a down (H', I) / (E, H, I); experts
    stored (E, H, 2I) next to a down (E, I, H) by the layout their class reads (:data:`_GATE_UP_IN_OUT_LAYOUTS`)."""
    if "gate_up" not in leaf_param.lower() or len(shape) not in (2, 3) or is_bias_name(leaf_param):
        return None
    rows, cols = shape[-2:]
    if rows % 2 == 0 and any(s[-1] == rows // 2 for s in siblings if len(s) == len(shape)):
        return Split(rows=(rows // 2, rows // 2), label="gate/up")
    if len(shape) == 3 and cols % 2 == 0 and any(len(s) == 3 and s[-2] == cols // 2 and s[-1] == rows
                                                  for s in siblings):
        layout = _GATE_UP_IN_OUT_LAYOUTS.get(type(module).__name__)
        if layout == "interleaved":
            return Split(interleave=2, label="gate/up interleaved")
        if layout == "halves":
            return Split(cols=(cols // 2, cols // 2), label="gate/up")
        notes.append(f"{name} {shape} stores experts as (E, in, out); whether gate and up are interleaved "
                     "(GPT-OSS) or halves (Llama 4) is not known from the shape, so each expert is one matrix: "
                     "declare a cols split (muon_splits) to take halves apart")
    return None


def _mha_split(leaf_param: str, module: nn.Module, shape: tuple, per_head: bool,
               examined: dict[str, str]) -> Optional[Split]:
    """``nn.MultiheadAttention``: ``in_proj_weight`` ``(3E, E)`` is Q, K, V stacked (its forward chunks it in
    three), per head with ``per_head``; ``q/k/v_proj_weight`` (``kdim``/``vdim`` set) per head with ``per_head``."""
    nh, hd = module.num_heads, module.head_dim
    if leaf_param == "in_proj_weight" and shape[0] == 3 * nh * hd:
        examined[leaf_param] = "per head" if per_head else "q/k/v"
        return Split(rows=(hd,) * (3 * nh), label="per head") if per_head else Split(rows=(nh * hd,) * 3, label="q/k/v")
    if per_head and leaf_param in MHA_PROJECTIONS[1:] and shape[0] == nh * hd:
        examined[leaf_param] = "per head"
        return Split(rows=(hd,) * nh, label="per head")
    return None


_LINEAR_ATTENTION_LEAVES = ("in_proj_qkvz", "in_proj_ba")


def _linear_attention_split(leaf: str, shape: tuple, parent: Optional[nn.Module], per_head: bool,
                            examined: dict[str, str]) -> Optional[Split]:
    """Qwen3-Next's GatedDeltaNet (transformers ``Qwen3NextGatedDeltaNet.fix_query_key_value_ordering``): per key
    head ``g`` the rows of ``in_proj_qkvz`` are ``[q_g (dk), k_g (dk), v_g (r dv), z_g (r dv)]`` and those of
    ``in_proj_ba`` are ``[b_g (r), a_g (r)]``, ``r = num_v_heads / num_k_heads``. With ``per_head``: q, k, each
    value head, each gate (z) head its own block; b and a of each key head apart. Without: whole (q, k, v, z are
    interleaved per key head, no one matrix each)."""
    geo = [positive_int(getattr(parent, k, None)) for k in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")]
    if not all(geo) or geo[1] % geo[0]:
        examined[leaf] = "no linear-attention geometry (num_k_heads, num_v_heads, head_k_dim, head_v_dim)"
        return None
    nk, nv, dk, dv = geo
    r = nv // nk
    group = (dk, dk) + (dv,) * (2 * r) if leaf == "in_proj_qkvz" else (r, r)
    if shape[0] != nk * sum(group):
        examined[leaf] = f"{shape[0]} outputs != {nk} key heads x {sum(group)}"
        return None
    if not per_head:
        examined[leaf] = "q/k/v/z interleaved per key head: whole without per_head_muon"
        return None
    examined[leaf] = "per head"
    return Split(rows=group * nk, label="per head")


def _attention_split(leaf: str, module: nn.Module, shape: tuple, cfg, per_head: bool,
                     parent: Optional[nn.Module], examined: dict[str, str]) -> Optional[Split]:
    """Q/K/V apart for fused QKV, and per head with ``per_head``; None for anything else."""
    leaf = leaf.lower()
    if leaf in _LINEAR_ATTENTION_LEAVES and len(shape) == 2:
        return _linear_attention_split(leaf, shape, parent, per_head, examined)
    fused_contiguous = any(leaf.startswith(k) for k in _FUSED_QKV_CONTIGUOUS)
    fused_interleaved = any(leaf.startswith(k) for k in _FUSED_QKV_INTERLEAVED)
    query, kv = any(leaf.startswith(k) for k in _QUERY_LEAVES), any(leaf.startswith(k) for k in _KV_LEAVES)
    mla = any(leaf.startswith(k) for k in _MLA_LEAVES)
    if len(shape) != 2 or not (fused_contiguous or fused_interleaved or ((query or kv or mla) and per_head)):
        return None
    # the attention module's own geometry first: a multimodal model's vision tower has other head counts
    # than the text config that model.config.get_text_config() returns
    geometry = head_geometry(parent, cfg)
    if geometry is None:
        examined[leaf] = ("no head geometry (n_heads and head_dim or a config on the attention module, or "
                          "model.config with num_attention_heads)")
        return None
    nh, nkv, hd = geometry
    on_cols = type(module).__name__ in MATRIX_CLASS_NAMES  # GPT-2 Conv1D: weight (in, out)
    out = shape[1] if on_cols else shape[0]

    def cut(sizes: tuple, label: str) -> Split:
        examined[leaf] = label
        return Split(None, sizes, label) if on_cols else Split(sizes, None, label)

    if fused_contiguous or fused_interleaved:
        if out != (nh + 2 * nkv) * hd:
            examined[leaf] = f"{out} outputs != (heads {nh} + 2 x kv heads {nkv}) x head_dim {hd}"
            return None
        if per_head:
            return cut((hd,) * (nh + 2 * nkv), "per head")
        if fused_contiguous:
            return cut((nh * hd, nkv * hd, nkv * hd), "q/k/v")
        examined[leaf] = "fused QKV with interleaved heads: whole without per_head_muon"
        return None
    widths = []
    if mla:
        nope, rope, v = (getattr(cfg, k, None) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        widths = [nope + (rope if leaf.startswith("q_b") else v)] if nope and (rope if leaf.startswith("q_b") else v) else []
        heads = nh
    else:
        widths, heads = [hd], (nh if query else nkv)
    if widths and out == heads * widths[0]:
        return cut((widths[0],) * heads, "per head")
    if query and out == 2 * nh * hd:  # gated attention (Qwen3-Next): per head [query (hd); gate (hd)], 2 blocks
        return cut((hd,) * (2 * nh), "per head")
    examined[leaf] = f"{out} outputs != {heads} heads x head_dim {widths[0] if widths else '?'}"
    return None


def _refined(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """Block sizes cut at the boundaries of both ``a`` and ``b`` (two tilings of the same length)."""
    cuts = sorted(set(itertools.accumulate(a)) | set(itertools.accumulate(b)))
    return tuple(hi - lo for lo, hi in zip([0] + cuts[:-1], cuts))


def _declared_split(name: str, p: torch.Tensor, splits: dict[str, dict], used: set[str]) -> Optional[Split]:
    value = getattr(p, USER_SPLIT_ATTR, None)
    if value is not None:
        return as_split(value, f"{name}.{USER_SPLIT_ATTR}")
    for pattern, spec in splits.items():
        if fnmatch.fnmatchcase(name, pattern):
            used.add(pattern)
            if isinstance(spec, dict):  # the config model's form: both keys, None where not cut
                spec = {k: v for k, v in spec.items() if v is not None}
            return as_split(spec, f"muon_splits[{pattern!r}]")
    return None


def assign_views(model: nn.Module, use_muon: dict[str, bool], reasons: dict[str, str], per_head: bool,
                 splits: dict[str, dict]) -> tuple[dict[str, Split], list[str]]:
    """The matrix view of every Muon parameter of ``model``.

    Args:
        use_muon, reasons: what selection decided for each parameter name (:class:`ds_muon.model.selection.Selection`).
        per_head: ``per_head_muon``. splits: the config's declared splits, ``{pattern: split}``.

    Returns:
        ``({name: Split}, notes)``: the split of each Muon parameter that is more than one matrix, and the lines
        the summary prints where a rule had to leave a matrix whole.

    Raises:
        ValueError: a split that does not fit its parameter, a ``muon_split`` on an AdamW parameter, a
            ``muon_splits`` pattern matching no Muon parameter, ``per_head_muon`` with nothing split per head.
    """
    cfg = text_config(model)
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    used: set[str] = set()
    examined: dict[str, str] = {}
    found: dict[str, Split] = {}
    notes: list[str] = []
    for name, p in params.items():
        module_name, _, leaf_param = name.rpartition(".")
        module = modules.get(module_name, model)
        if not use_muon[name]:
            if getattr(p, USER_SPLIT_ATTR, None) is not None:
                raise ValueError(f"parameter {name!r} declares {USER_SPLIT_ATTR} but goes to AdamW "
                                 f"({reasons[name]}); remove the split or set use_muon=True on it")
            continue
        declared = _declared_split(name, p, splits, used)
        shape = param_shape(p)
        split = declared
        conv = isinstance(module, CONV_MODULES) and leaf_param == "weight"
        if conv:  # (out, in/groups, *kernel): one matrix (out, in/groups*prod(kernel)), per group if grouped
            groups = int(getattr(module, "groups", 1) or 1)
            group_rows = (shape[0] // groups,) * groups if groups > 1 else None
            if split is not None:  # a declared split, cut at the group boundaries too (groups never mix)
                rows = _refined(split.rows or (shape[0],), group_rows) if group_rows else split.rows
                split = dataclasses.replace(split, rows=rows, conv=True)
            elif group_rows:
                split = Split(rows=group_rows, conv=True, label="conv per group")
            elif len(shape) == 3:
                split = Split(conv=True, label="conv")
        elif split is None and len(shape) == 3:  # per expert gate_up: (E, 2I, H) next to down (E, H, I)
            siblings = [param_shape(q) for n, q in module.named_parameters(recurse=False) if n != leaf_param]
            split = _gate_up_split(leaf_param, shape, siblings, notes, name, module)
        elif split is None and len(shape) == 2 and module_name and is_matrix_module(module):
            # a dense fused gate_up Linear (2I, H) next to a down Linear (H, I), e.g. Phi-3's MLP
            parent = modules.get(module_name.rpartition(".")[0], model)
            siblings = [param_shape(c.weight) for c in parent.children() if c is not module
                        and isinstance(c, nn.Linear)]
            split = _gate_up_split(module_name.rpartition(".")[2], shape, siblings, notes, name)
        if split is None and is_multihead_attention(module) and leaf_param in MHA_PROJECTIONS:
            split = _mha_split(leaf_param, module, shape, per_head, examined)
        if split is None and is_matrix_module(module):
            parent = modules.get(module_name.rpartition(".")[0], model) if module_name else None
            split = _attention_split(module_name.rpartition(".")[2], module, shape, cfg, per_head, parent, examined)
        if split is not None:
            try:
                matrix_view(shape, split)
            except ValueError as err:
                raise ValueError(f"parameter {name!r}: {err}") from None
            found[name] = split
    unused = sorted(set(splits) - used)
    if unused:
        raise ValueError(f"optimizer.params.muon_splits: pattern(s) {unused} match no Muon parameter; fix the "
                         "pattern (fnmatch over model.named_parameters() names)")
    if per_head:
        if not any(s.label == "per head" for s in found.values()):
            raise ValueError("per_head_muon is enabled but no attention projection could be split per head, so "
                             "per-head Newton-Schulz would be inactive for every parameter. It needs Q/K/V projections "
                             "named as in Hugging Face models (q_proj/k_proj/v_proj, qkv_proj, c_attn, "
                             "query_key_value, ...) and model.config with num_attention_heads (num_key_value_heads, "
                             "head_dim). Remove per_head_muon, or declare the blocks with muon_splits. Examined: "
                             f"{dict(sorted(examined.items())) or 'none'}")
    mismatched = {k: v for k, v in examined.items() if v not in ("per head", "q/k/v")}
    if mismatched:  # attention projections by name whose geometry or layout did not allow a split
        notes.append(f"attention projections left whole: {dict(sorted(mismatched.items()))}")
    return found, notes
