"""Which parameters Muon trains, and which go to AdamW (design.md §7).

Order of precedence, first match wins:

1. An explicit ``param.use_muon = True/False`` set by the user.
2. The config's ``muon_params`` / ``adamw_params`` glob patterns over ``model.named_parameters()``
   names (``adamw_params`` is checked first, so a parameter matched by both goes to AdamW).
3. The module-type rule: Muon for the >=2-D weights of hidden linear and convolution layers
   (``nn.Linear``, ``nn.Conv1d/2d/3d``, transposed convs, Hugging Face's GPT-2 ``Conv1D``).
   AdamW for everything else: embeddings (and any linear tied to one), the output head
   (``get_output_embeddings()`` where the model declares one, otherwise the last linear/conv
   module in registration order, e.g. ``lm_head``/``score``/``classifier``/``fc``; a model with
   no head at all therefore sends its last hidden matrix to AdamW), norms, biases, 0-D/1-D parameters, and >=2-D
   parameters of modules the rule does not recognise (tag those yourself; AdamW is never wrong,
   only possibly slower to train).
   MoE (:data:`MOE_RULE`): the 3-D parameters of an expert container (a module whose >=2-D
   parameters are all ``(E, ., .)`` with E the config's expert count or the module's
   ``num_experts``) are Muon; a router/gate next to it (E or 1 output rows) is AdamW.

Each Muon parameter also gets its matrix view (design.md §7b, :mod:`ds_muon.matrix`): the blocks
Newton–Schulz orthogonalizes separately. First match: ``param.muon_split``, the config's
``muon_splits`` patterns, a fused gate_up (gate and up apart: dense ``(2I, H)`` next to a down Linear
with I inputs, or per expert ``(E, 2I, H)`` next to ``(E, H, I)``), a fused QKV (``qkv_proj``/``c_attn``:
Q, K, V apart) and, with ``per_head_muon``, Q/K/V projections per head (geometry from
``model.config``). Otherwise one matrix (E for a stacked parameter). docs/selection.md has the rules.

Shapes come from ``ds_shape`` when the model was built under ``deepspeed.zero.Init`` (there
``param.shape`` is a flat placeholder).
"""
from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

import torch
from torch import nn

from .matrix import SPLIT_ATTR, USER_SPLIT_ATTR, Split, as_split, matrix_view

logger = logging.getLogger("ds_muon")
NO_MUON_WARNING = ("ds_muon: no parameter was selected for Muon, so this run is pure AdamW. Tag matrices with "
                   "param.use_muon=True or set optimizer.params.muon_params.")

_MATRIX_MODULES: tuple[type, ...] = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)
_EMBEDDING_MODULES: tuple[type, ...] = (nn.Embedding, nn.EmbeddingBag)
# Hugging Face's GPT-2 style Conv1D is a linear layer with a transposed weight. Matched by class
# name so transformers stays an optional dependency.
_MATRIX_CLASS_NAMES = ("Conv1D",)

EXPLICIT = "explicit use_muon"
PATTERN = "config pattern"
HIDDEN_MATRIX = "hidden linear/conv weight"
EMBEDDING = "embedding"
OUTPUT_HEAD = "output head"
LOW_DIM = "0-D/1-D (norm, bias, scalar)"
UNRECOGNISED = ">=2-D parameter of an unrecognised module"
EXPERTS = "stacked experts (one matrix per expert)"
ROUTER = "MoE router/gate"


def param_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The parameter's logical shape: ``ds_shape`` under ZeRO-3 partitioning, else ``shape``."""
    ds_shape = getattr(p, "ds_shape", None)
    return tuple(p.shape) if ds_shape is None else tuple(ds_shape)


def param_numel(p: torch.Tensor) -> int:
    """Logical element count (``ds_numel`` under ZeRO-3 partitioning, else ``numel()``)."""
    ds_numel = getattr(p, "ds_numel", None)
    return int(p.numel() if ds_numel is None else ds_numel)


@dataclass
class Selection:
    """Result of :func:`select_muon_params`.

    Attributes:
        use_muon: ``{parameter name: bool}`` for every parameter of the model (tied parameters
            appear once, under the first name ``named_parameters()`` gives).
        reasons: ``{parameter name: reason}``, one of the module-level reason strings.
    """

    use_muon: dict[str, bool] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    numels: dict[str, int] = field(default_factory=dict)
    shapes: dict[str, tuple] = field(default_factory=dict)
    splits: dict[str, Split] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def view(self, name: str):
        """The :class:`~ds_muon.matrix.MatrixView` of Muon parameter ``name``."""
        return matrix_view(self.shapes[name], self.splits.get(name))

    def summary(self, frozen: Iterable[str] = ()) -> str:
        """A one-screen table of what the optimizer trains: parameters and elements per side, per rule.

        Args:
            frozen: names of parameters with ``requires_grad=False`` (PEFT base weights, frozen
                embeddings). They are not counted on either side (the optimizer never sees them)
                and are listed on one ``frozen`` line instead.

        Each side lists the rule that put parameters there (the reason strings of this module,
        e.g. ``hidden linear/conv weight`` for Muon, ``embedding``/``output head`` for AdamW).
        """
        frozen = set(frozen)
        trainable = [n for n in self.use_muon if n not in frozen]
        lines = ["ds_muon parameter split (trainable parameters only):"]
        for side, flag in (("Muon", True), ("AdamW", False)):
            names = [n for n in trainable if self.use_muon[n] is flag]
            elems = sum(self.numels[n] for n in names)
            lines.append(f"  {side:<5} {len(names):>6} params {elems:>14,d} elements")
            by_reason: dict[str, list[str]] = {}
            for n in names:
                by_reason.setdefault(self.reasons[n], []).append(n)
            for reason, ns in sorted(by_reason.items()):
                example = ns[0] if len(ns) == 1 else f"{ns[0]}, ... ({len(ns)})"
                lines.append(f"        rule \"{reason}\": {len(ns)} params, {sum(self.numels[x] for x in ns):,d} "
                             f"elements  [{example}]")
        frozen_names = [n for n in self.use_muon if n in frozen]
        if frozen_names:
            shown = ", ".join(frozen_names[:3]) + (", ..." if len(frozen_names) > 3 else "")
            lines.append(f"  frozen {len(frozen_names):>5} params {sum(self.numels[n] for n in frozen_names):>14,d} "
                         f"elements (requires_grad=False, not optimized): {shown}")
        lines += self._views_summary()
        unrecognised = [n for n in trainable if self.reasons[n] == UNRECOGNISED]
        if unrecognised:
            lines.append("  note: set param.use_muon=True or add a muon_params pattern to train "
                         f"{unrecognised[:3]}{'...' if len(unrecognised) > 3 else ''} with Muon")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _views_summary(self) -> list[str]:
        """Lines for the Muon parameters that are more than one matrix: how they were split."""
        kinds: dict[str, list[str]] = {}
        for n, u in self.use_muon.items():
            if not u or len(self.shapes[n]) < 2:
                continue
            split, stacked = self.splits.get(n), len(self.shapes[n]) == 3
            if split is None and not stacked:
                continue
            kind = ("stacked, " if stacked else "") + (split.label if split else "one matrix each")
            kinds.setdefault(kind, []).append(n)
        if not kinds:
            return []
        lines = ["  matrix views (blocks Newton-Schulz orthogonalizes and scales separately):"]
        for kind, ns in sorted(kinds.items()):
            blocks = sum(self.view(x).num_blocks for x in ns)
            example = ns[0] if len(ns) == 1 else f"{ns[0]}, ... ({len(ns)})"
            lines.append(f"        {kind}: {len(ns)} params -> {blocks} blocks; {ns[0]} {self.shapes[ns[0]]}: "
                         f"{self.view(ns[0]).describe()}  [{example}]")
        if any(r in (EXPERTS, ROUTER) for r in self.reasons.values()):
            lines.append("  MoE rule: " + MOE_RULE.replace("\n", "\n            "))
        return lines


def _output_head_ids(model: nn.Module) -> set[int]:
    ids: set[int] = set()
    get_out = getattr(model, "get_output_embeddings", None)
    head = None
    if callable(get_out):
        try:
            head = get_out()
        except (NotImplementedError, AttributeError):
            head = None
    if isinstance(head, nn.Module):
        return {id(p) for p in head.parameters(recurse=False)}
    if isinstance(head, torch.Tensor):
        return {id(head)}
    # No declared output embeddings (plain modules, or HF classification models whose
    # get_output_embeddings() is None): the last matrix module in registration order maps the
    # trunk's features to the outputs (lm_head, score, classifier, fc, head, or a nested final
    # projection), because models register their layers in forward order.
    matrix_modules = [m for m in model.modules() if _is_matrix_module(m)]
    if matrix_modules:
        ids.update(id(p) for p in matrix_modules[-1].parameters(recurse=False) if len(param_shape(p)) >= 2)
    return ids


def _is_matrix_module(m: nn.Module) -> bool:
    return isinstance(m, _MATRIX_MODULES) or type(m).__name__ in _MATRIX_CLASS_NAMES


def select_muon_params(model: nn.Module,
                       muon_patterns: Iterable[str] = (),
                       adamw_patterns: Iterable[str] = (),
                       per_head_muon: bool = False,
                       muon_splits: Optional[Mapping[str, object]] = None) -> Selection:
    """Decide, for every parameter of ``model``, whether Muon or AdamW trains it.

    Args:
        model: the model (plain or built under ``deepspeed.zero.Init``).
        muon_patterns: ``fnmatch`` globs over parameter names forcing Muon.
        adamw_patterns: ``fnmatch`` globs forcing AdamW (checked before ``muon_patterns``).
        per_head_muon: split attention Q/K/V projections per head (config key ``per_head_muon``).
        muon_splits: ``{glob pattern: split}`` declared matrix views (config key ``muon_splits``;
            a split is a list of row sizes or ``{"rows": [...], "cols": [...]}``).

    Returns:
        A :class:`Selection` with the matrix view of each Muon parameter in ``splits``. Nothing is
        written to the parameters; see :func:`tag_model`.

    Raises:
        ValueError: if an explicit ``use_muon=True`` or a Muon pattern selects a parameter with
            fewer than 2 dimensions (Muon orthogonalizes matrices), naming the parameter; a split
            whose sizes do not fit the parameter, a ``muon_split`` attribute on an AdamW parameter, a
            ``muon_splits`` pattern matching no parameter, or ``per_head_muon`` with no attention
            projection it could split (each naming the parameter or pattern).
    """
    muon_patterns, adamw_patterns = list(muon_patterns), list(adamw_patterns)
    owner: dict[int, nn.Module] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owner.setdefault(id(p), module)
    embedding_ids = {id(p) for m in model.modules() if isinstance(m, _EMBEDDING_MODULES) for p in m.parameters(False)}
    head_ids = _output_head_ids(model)
    containers = _expert_containers(model, _expert_counts(_text_config(model)))
    expert_ids = {id(p) for name in containers for p in dict(model.named_modules())[name].parameters(recurse=False)
                  if len(param_shape(p)) >= 2}
    router_ids = _router_ids(model, containers)

    sel = Selection()
    for name, p in model.named_parameters():
        shape = param_shape(p)
        sel.numels[name] = param_numel(p)
        sel.shapes[name] = shape
        explicit = getattr(p, "use_muon", None)
        # tag_model records what it decided in _ds_muon_auto; a use_muon that differs from it was
        # set by the user afterwards and counts as explicit.
        if explicit is not None and getattr(p, "_ds_muon_auto", None) is not bool(explicit):
            choice, reason = bool(explicit), EXPLICIT
        elif any(fnmatch.fnmatchcase(name, pat) for pat in adamw_patterns):
            choice, reason = False, PATTERN
        elif any(fnmatch.fnmatchcase(name, pat) for pat in muon_patterns):
            choice, reason = True, PATTERN
        elif len(shape) < 2:
            choice, reason = False, LOW_DIM
        elif id(p) in embedding_ids:
            choice, reason = False, EMBEDDING
        elif id(p) in head_ids:
            choice, reason = False, OUTPUT_HEAD
        elif id(p) in router_ids:
            choice, reason = False, ROUTER
        elif id(p) in expert_ids:
            choice, reason = True, EXPERTS
        elif _is_matrix_module(owner[id(p)]):
            choice, reason = True, HIDDEN_MATRIX
        else:
            choice, reason = False, UNRECOGNISED
        if choice and len(shape) < 2:
            raise ValueError(f"parameter {name!r} has shape {shape} but was selected for Muon by {reason}; "
                             "Muon orthogonalizes matrices (>= 2 dims). Set use_muon=False on it or fix the pattern.")
        sel.use_muon[name] = choice
        sel.reasons[name] = reason
    _assign_views(model, sel, per_head_muon, dict(muon_splits or {}))
    return sel


def tag_model(model: nn.Module,
              muon_patterns: Iterable[str] = (),
              adamw_patterns: Iterable[str] = (),
              log: bool = True,
              per_head_muon: bool = False,
              muon_splits: Optional[Mapping[str, object]] = None) -> Selection:
    """Run :func:`select_muon_params` and write ``param.use_muon`` on every parameter.

    Parameters the rule decided (not the user) also get ``param._ds_muon_auto = <the decision>``, so
    a later call re-decides them instead of mistaking them for explicit user tags, while a
    ``use_muon`` the user changes afterwards still counts as explicit. Every parameter's matrix
    split (:class:`~ds_muon.matrix.Split`, or ``None``) is written to ``param.ds_muon_split``, which the
    oracle and the ZeRO-3 owner plan read.

    Returns:
        The :class:`Selection`; its summary is logged at INFO on the ``ds_muon`` logger when ``log``.
    """
    sel = select_muon_params(model, muon_patterns, adamw_patterns, per_head_muon, muon_splits)
    for name, p in model.named_parameters():
        setattr(p, SPLIT_ATTR, sel.splits.get(name))
        if sel.reasons[name] != EXPLICIT:
            p.use_muon = sel.use_muon[name]
            p._ds_muon_auto = sel.use_muon[name]
    if log:
        logger.info("%s", sel.summary(n for n, p in model.named_parameters() if not p.requires_grad))
        if not any(sel.use_muon.values()):
            logger.warning(NO_MUON_WARNING)
    return sel


# ------------------------------------------------------------------------------------------------
# MoE experts and routers, fused and per-head matrix views (design.md §7b)
# ------------------------------------------------------------------------------------------------
# Config keys that hold a model's number of (routed) experts, in the transformers MoE configs
# (Mixtral/GPT-OSS/DeepSeek-V3/OLMoE/Phimoe: num_local_experts; Qwen2/3-MoE, OLMoE: num_experts;
# DeepSeek: n_routed_experts; DBRX: ffn_config.moe_num_experts).
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
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

MOE_RULE = ("experts = a module whose >=2-D parameters are all 3-D with one leading size E, E = the model config's "
            "expert count (num_experts, num_local_experts, n_routed_experts, moe_num_experts) or the module's "
            "num_experts: Muon, one matrix per expert, a fused gate_up (E, 2I, H) as gate and up\n"
            "router/gate = a matrix next to the experts (same parent module) with E or 1 output rows: AdamW\n"
            "shared experts = ordinary hidden linear layers: Muon")


def _text_config(model: nn.Module):
    cfg = getattr(model, "config", None)
    get_text = getattr(cfg, "get_text_config", None)
    if callable(get_text):
        try:
            return get_text()
        except Exception:  # noqa: BLE001 - an unusual config: use it as it is
            return cfg
    return cfg


def _positive_int(x) -> Optional[int]:
    return x if isinstance(x, int) and not isinstance(x, bool) and x >= 1 else None


def _expert_counts(cfg) -> set[int]:
    counts = {_positive_int(getattr(cfg, k, None)) for k in _EXPERT_COUNT_KEYS}
    counts.add(_positive_int(getattr(getattr(cfg, "ffn_config", None), "moe_num_experts", None)))
    return {c for c in counts if c and c >= 2}


def _expert_containers(model: nn.Module, counts: set[int]) -> dict[str, int]:
    """``{module name: E}`` of the expert containers (see :data:`MOE_RULE`)."""
    found = {}
    for name, m in model.named_modules():
        if _is_matrix_module(m) or isinstance(m, _EMBEDDING_MODULES):
            continue
        shapes = [param_shape(p) for p in m.parameters(recurse=False) if len(param_shape(p)) >= 2]
        if not shapes or any(len(s) != 3 for s in shapes) or len({s[0] for s in shapes}) != 1:
            continue
        e = shapes[0][0]
        own = {_positive_int(getattr(m, k, None)) for k in _EXPERT_COUNT_KEYS}
        if e >= 2 and (e in counts or e in own):
            found[name] = e
    return found


def _router_ids(model: nn.Module, containers: dict[str, int]) -> set[int]:
    """Matrices next to an expert container (children of its parent) with E or 1 output rows."""
    modules = dict(model.named_modules())
    ids: set[int] = set()
    for name, e in containers.items():
        parent = modules[name.rpartition(".")[0]] if "." in name else model
        for child_name, child in parent.named_children():
            if child is modules[name]:
                continue
            for p in child.parameters(recurse=False):
                shape = param_shape(p)
                rows = shape[1] if len(shape) == 2 and type(child).__name__ in _MATRIX_CLASS_NAMES else shape[0]
                if len(shape) == 2 and rows in (e, 1):
                    ids.add(id(p))
    return ids


def _head_geometry(cfg) -> Optional[tuple[int, int, int]]:
    """``(num_attention_heads, num_key_value_heads, head_dim)`` from a model config, or None."""
    nh = _positive_int(getattr(cfg, "num_attention_heads", None))
    if nh is None:
        return None
    nkv = _positive_int(getattr(cfg, "num_key_value_heads", None)) or nh
    hd = _positive_int(getattr(cfg, "head_dim", None))
    hidden = _positive_int(getattr(cfg, "hidden_size", None))
    if hd is None and hidden and hidden % nh == 0:
        hd = hidden // nh
    return (nh, nkv, hd) if hd else None


def _module_head_geometry(module: Optional[nn.Module]) -> Optional[tuple[int, int, int]]:
    """Head geometry an attention module states itself (``n_heads``/``num_heads``, ``n_kv_heads``/
    ``num_key_value_heads``, ``head_dim``), for models without a transformers config."""
    first = lambda *names: next((v for v in (_positive_int(getattr(module, n, None)) for n in names) if v), None)  # noqa: E731
    nh = first("num_attention_heads", "num_heads", "n_heads", "n_head")
    hd = first("head_dim", "head_size")
    if module is None or nh is None or hd is None:
        return None
    return nh, first("num_key_value_heads", "num_kv_heads", "n_kv_heads") or nh, hd


def _gate_up_split(leaf_param: str, shape: tuple, siblings: list[tuple], notes: list[str], name: str) -> Optional[Split]:
    """gate and up apart for a fused gate_up: (2I, H) or (E, 2I, H) next to a down (H', I) / (E, H, I)."""
    if "gate_up" not in leaf_param.lower() or len(shape) not in (2, 3):
        return None
    rows, cols = shape[-2:]
    if rows % 2 == 0 and any(s[-1] == rows // 2 for s in siblings if len(s) == len(shape)):
        return Split(rows=(rows // 2, rows // 2), label="gate/up")
    if len(shape) == 3 and cols % 2 == 0 and any(s[-2] == cols // 2 and s[-1] == rows for s in siblings):
        notes.append(f"{name} {shape} stores experts as (E, in, out); whether gate and up are interleaved "
                     "(GPT-OSS) or halves (Llama 4) is not known from the shape, so each expert is one matrix: "
                     "declare a cols split (muon_splits) to take halves apart")
    return None


def _attention_split(leaf: str, module: nn.Module, shape: tuple, cfg, per_head: bool,
                     parent: Optional[nn.Module], examined: dict[str, str]) -> Optional[Split]:
    """Q/K/V apart for fused QKV, and per head with ``per_head``; None for anything else."""
    leaf = leaf.lower()
    fused_contiguous = any(leaf.startswith(k) for k in _FUSED_QKV_CONTIGUOUS)
    fused_interleaved = any(leaf.startswith(k) for k in _FUSED_QKV_INTERLEAVED)
    query, kv = any(leaf.startswith(k) for k in _QUERY_LEAVES), any(leaf.startswith(k) for k in _KV_LEAVES)
    mla = any(leaf.startswith(k) for k in _MLA_LEAVES)
    if len(shape) != 2 or not (fused_contiguous or fused_interleaved or ((query or kv or mla) and per_head)):
        return None
    geometry = _head_geometry(cfg) or _module_head_geometry(parent)
    if geometry is None:
        examined[leaf] = ("no head geometry (model.config with num_attention_heads, or n_heads and head_dim on "
                          "the attention module)")
        return None
    nh, nkv, hd = geometry
    on_cols = type(module).__name__ in _MATRIX_CLASS_NAMES  # GPT-2 Conv1D: weight (in, out)
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
    examined[leaf] = f"{out} outputs != {heads} heads x head_dim {widths[0] if widths else '?'}"
    return None


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


def _assign_views(model: nn.Module, sel: "Selection", per_head: bool, splits: dict[str, dict]) -> None:
    """Fill ``sel.splits``/``sel.notes`` for the Muon parameters (the MoE reasons are already set)."""
    cfg = _text_config(model)
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    used: set[str] = set()
    examined: dict[str, str] = {}
    for name, p in params.items():
        module_name, _, leaf_param = name.rpartition(".")
        module = modules.get(module_name, model)
        if not sel.use_muon[name]:
            if getattr(p, USER_SPLIT_ATTR, None) is not None:
                raise ValueError(f"parameter {name!r} declares {USER_SPLIT_ATTR} but goes to AdamW "
                                 f"({sel.reasons[name]}); remove the split or set use_muon=True on it")
            continue
        declared = _declared_split(name, p, splits, used)
        shape = param_shape(p)
        split = declared
        if split is None and len(shape) == 3:  # per expert gate_up: (E, 2I, H) next to down (E, H, I)
            siblings = [param_shape(q) for n, q in module.named_parameters(recurse=False) if n != leaf_param]
            split = _gate_up_split(leaf_param, shape, siblings, sel.notes, name)
        elif split is None and len(shape) == 2 and module_name and _is_matrix_module(module):
            # a dense fused gate_up Linear (2I, H) next to a down Linear (H, I), e.g. Phi-3's MLP
            parent = modules.get(module_name.rpartition(".")[0], model)
            siblings = [param_shape(c.weight) for c in parent.children() if c is not module
                        and isinstance(c, nn.Linear)]
            split = _gate_up_split(module_name.rpartition(".")[2], shape, siblings, sel.notes, name)
        if split is None and _is_matrix_module(module):
            parent = modules.get(module_name.rpartition(".")[0], model) if module_name else None
            split = _attention_split(module_name.rpartition(".")[2], module, shape, cfg, per_head, parent, examined)
        if split is not None:
            try:
                matrix_view(shape, split)
            except ValueError as err:
                raise ValueError(f"parameter {name!r}: {err}") from None
            sel.splits[name] = split
    unused = sorted(set(splits) - used)
    if unused:
        raise ValueError(f"optimizer.params.muon_splits: pattern(s) {unused} match no Muon parameter; fix the "
                         "pattern (fnmatch over model.named_parameters() names)")
    if per_head:
        if not any(s.label == "per head" for s in sel.splits.values()):
            raise ValueError("per_head_muon is enabled but no attention projection could be split per head, so "
                             "per-head Newton-Schulz would be inactive for every parameter. It needs Q/K/V projections "
                             "named as in Hugging Face models (q_proj/k_proj/v_proj, qkv_proj, c_attn, "
                             "query_key_value, ...) and model.config with num_attention_heads (num_key_value_heads, "
                             "head_dim). Remove per_head_muon, or declare the blocks with muon_splits. Examined: "
                             f"{dict(sorted(examined.items())) or 'none'}")
    mismatched = {k: v for k, v in examined.items() if v not in ("per head", "q/k/v")}
    if mismatched:  # attention projections by name whose geometry or layout did not allow a split
        sel.notes.append(f"attention projections left whole: {dict(sorted(mismatched.items()))}")
