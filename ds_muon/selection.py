"""Which parameters Muon trains, and which go to AdamW (design.md §7).

Order of precedence, first match wins:

1. An explicit ``param.use_muon = True/False`` set by the user.
2. The config's ``muon_params`` / ``adamw_params`` glob patterns over ``model.named_parameters()``
   names (``adamw_params`` is checked first, so a parameter matched by both goes to AdamW).
3. The module-type rule: Muon for the >=2-D weights of hidden linear and convolution layers
   (``nn.Linear``, ``nn.Conv1d/2d/3d``, transposed convs, Hugging Face's GPT-2 ``Conv1D``), except
   depthwise convs (one filter row per group, e.g. Mamba's ``conv1d``).
   AdamW for everything else: embeddings (and any linear tied to one), output heads (below), norms,
   biases, 0-D/1-D parameters, and >=2-D parameters of modules the rule does not recognise (tag
   those yourself; AdamW is never wrong, only possibly slower to train).
   MoE (:data:`MOE_RULE`): the 3-D parameters of an expert container (a module whose >=2-D
   parameters are all ``(E, ., .)`` with E the config's expert count or the module's
   ``num_experts``) are Muon; a router/gate next to it (E or 1 output rows) is AdamW.

Output heads (:func:`find_output_heads`) are the matrices that map hidden states to outputs: logits
of a vocabulary, values, scores, class labels. They are found from what the model declares and from
its config and shapes, never from names or registration order alone:

* declared: ``get_output_embeddings()`` of the model or of any submodule (a wrapper's inner model);
* by width: a linear/conv module outside the repeated layers whose input width is the hidden size,
  whose output width is a vocabulary size or at most ``max(2, num_labels)``, and whose output no
  sibling matrix (a matrix module of the same parent) takes as input: an untied ``lm_head``, an
  MTP ``head``, Medusa-style parallel heads, value heads ``Linear(D, 1)``, reward models'
  ``score``, ``classifier``/``score``/``qa_outputs`` of HF task models.

Hidden sizes and vocabulary sizes come from every ``config`` in the model (``hidden_size``,
``vocab_size``, ``num_labels``, their text config's too) and from the input embeddings
(``get_input_embeddings()``, else every ``nn.Embedding``). The repeated layers are the children of a
``ModuleList``/``Sequential`` of modules that are neither matrices nor plain containers, either two
or more of one class or as many (of any classes) as a config's layer count (``num_hidden_layers``,
``n_layer``, ...: a 1-layer model, a hybrid stack of several layer classes), and any other module of
such a class (an MTP module's decoder layer); nothing inside them is a head.
Only when the model has no config and none of the rules finds a head is the last matrix module
outside the repeated layers taken as the head, and the split summary says that this was a guess; it
also names the matrices it could not tell from a head (see :attr:`Selection.notes`).

Each Muon parameter also gets its matrix view (design.md §7b, :mod:`ds_muon.matrix`): the blocks
Newton–Schulz orthogonalizes separately. First match: ``param.muon_split``, the config's
``muon_splits`` patterns, a fused gate_up (gate and up apart: dense ``(2I, H)`` next to a down Linear
with I inputs, or per expert ``(E, 2I, H)`` next to ``(E, H, I)``), a fused QKV (``qkv_proj``/``c_attn``:
Q, K, V apart) and, with ``per_head_muon``, Q/K/V projections per head (geometry from
``model.config``). A conv weight ``(out, in/groups, *kernel)`` is one matrix ``(out, in/groups *
prod(kernel))``, also at 3-D (``nn.Conv1d``; never a stack), cut per group when ``groups > 1``.
Otherwise one matrix (E for a stacked parameter). docs/selection.md has the rules.

Shapes come from ``ds_shape`` when the model was built under ``deepspeed.zero.Init`` (there
``param.shape`` is a flat placeholder).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

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
_CONV_TRANSPOSE_MODULES: tuple[type, ...] = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_CONV_MODULES: tuple[type, ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d) + _CONV_TRANSPOSE_MODULES
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
DEPTHWISE = "depthwise conv weight (a 1 x kernel filter per channel)"
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
        notes: lines the summary prints where the rule had to guess (a head taken for want of a
            better rule, matrices it could not tell from a head).
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
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def _views_summary(self) -> list[str]:
        """Lines for the Muon parameters that are more than one matrix: how they were split."""
        kinds: dict[str, list[str]] = {}
        for n, u in self.use_muon.items():
            if not u or len(self.shapes[n]) < 2:
                continue
            split = self.splits.get(n)
            stacked = len(self.shapes[n]) == 3 and not (split is not None and split.conv)
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


@dataclass
class OutputHeads:
    """Result of :func:`find_output_heads`.

    Attributes:
        param_ids: ``id()`` of every >=2-D parameter of an output head.
        guessed: names of head modules taken only because they are the last matrix outside the
            repeated layers (the model has no config and no other rule found a head).
        unsure: names of matrix modules outside the repeated layers that take the hidden size and
            either give a head's output width (vocabulary, or at most ``num_labels``) that a sibling
            matrix also takes as input, or give a width that is no hidden size, no head's and no
            sibling's input: the rule decides them as for any matrix, and the summary names them.
    """

    param_ids: set[int] = field(default_factory=set)
    guessed: list[str] = field(default_factory=list)
    unsure: list[str] = field(default_factory=list)


def _widths(module: nn.Module) -> Optional[tuple[int, int]]:
    """``(in, out)`` feature widths of a matrix module (from its attributes, so it also works on
    ZeRO-3 placeholders), or None when they cannot be read."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                           nn.ConvTranspose3d)):
        return module.in_channels, module.out_channels
    weight = getattr(module, "weight", None)
    nf = getattr(module, "nf", None)  # HF Conv1D: weight (in, out)
    if isinstance(weight, torch.Tensor) and isinstance(nf, int) and len(param_shape(weight)) == 2:
        return param_shape(weight)[0], nf
    return None


def _int_attrs(obj: Any, names: tuple[str, ...]) -> set[int]:
    out = set()
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out.add(value)
    return out


def _configs(model: nn.Module) -> list[Any]:
    """Every distinct ``config`` object of the model and its submodules, with their text configs."""
    seen: dict[int, Any] = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is None or isinstance(cfg, (dict, str, int, float)) or id(cfg) in seen:
            continue
        seen[id(cfg)] = cfg
        get_text = getattr(cfg, "get_text_config", None)
        if callable(get_text):
            try:
                text = get_text()
            except Exception:  # noqa: BLE001 - a config without a text part
                text = None
            if text is not None:
                seen.setdefault(id(text), text)
    return list(seen.values())


def _declared(module: nn.Module, method: str) -> Any:
    fn = getattr(module, method, None)
    if not callable(fn):
        return None
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a getter that does not apply to this module declares nothing
        return None


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


# Config keys that hold a model's number of repeated layers (transformers: num_hidden_layers; GPT-2: n_layer;
# T5/Bart-style: num_layers, encoder_layers, decoder_layers).
_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers")


def _is_layer_candidate(m: nn.Module) -> bool:
    """A module that can be a repeated layer: neither a matrix nor a plain container."""
    return not _is_matrix_module(m) and not isinstance(m, _CONTAINERS)


def _layer_lists(model: nn.Module) -> set[int]:
    """``id()`` of every module inside the repeated layers (see the module docstring), and inside any
    other instance of a repeated layer's class (an MTP module's extra decoder layer).

    A ``ModuleList``/``Sequential`` holds repeated layers when its children are layer candidates
    (:func:`_is_layer_candidate`) and either (a) there are two or more of them, all of one class, or
    (b) their number is a layer count some config of the model states (``num_hidden_layers``, ...):
    a 1-layer model, or layers of several classes (hybrid attention/SSM stacks).
    """
    counts = set().union(*(_int_attrs(c, _LAYER_COUNT_KEYS) for c in _configs(model)))
    layer_types: set[type] = set()
    for m in model.modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(m.children())
        if not children or not all(_is_layer_candidate(c) for c in children):
            continue
        if (len(children) >= 2 and len({type(c) for c in children}) == 1) or len(children) in counts:
            layer_types.update(type(c) for c in children)
    layers = [m for m in model.modules() if type(m) in layer_types]
    return {id(x) for layer in layers for x in layer.modules()}


def find_output_heads(model: nn.Module) -> OutputHeads:
    """The matrices of ``model`` that map hidden states to outputs (the rule in the module docstring).

    Args:
        model: any ``nn.Module``, plain or built under ``deepspeed.zero.Init`` (widths are read from
            the modules' attributes, not from the placeholders' shapes).

    Returns:
        An :class:`OutputHeads`: the heads' parameter ids, and what was guessed or left unsure.
    """
    heads = OutputHeads()
    matrix_names = {id(m): n for n, m in model.named_modules() if _is_matrix_module(m)}

    def add(module: nn.Module) -> None:
        heads.param_ids.update(id(p) for p in module.parameters(recurse=False) if len(param_shape(p)) >= 2)

    for m in model.modules():
        head = _declared(m, "get_output_embeddings")
        if isinstance(head, nn.Module):
            add(head)
        elif isinstance(head, torch.Tensor):
            heads.param_ids.add(id(head))

    configs = _configs(model)
    hidden = set().union(*(_int_attrs(c, ("hidden_size", "d_model", "n_embd")) for c in configs))
    vocab = set().union(*(_int_attrs(c, ("vocab_size",)) for c in configs))
    labels = max([2, *(n for c in configs for n in _int_attrs(c, ("num_labels",)))])
    inputs = [e for e in (_declared(m, "get_input_embeddings") for m in model.modules())
              if isinstance(e, _EMBEDDING_MODULES)]
    for emb in inputs or [m for m in model.modules() if isinstance(m, _EMBEDDING_MODULES)]:
        vocab.add(emb.num_embeddings)
        hidden.add(emb.embedding_dim)

    in_layers = _layer_lists(model)
    outside = [m for m in model.modules() if _is_matrix_module(m) and id(m) not in in_layers]  # in order
    for parent in model.modules():
        siblings = [(c, _widths(c)) for c in parent.children() if _is_matrix_module(c)]
        consumed = {w[0] for _, w in siblings if w is not None}
        for child, w in siblings:
            if w is None or w[0] not in hidden or id(child) in in_layers:
                continue
            head_width = w[1] in vocab or w[1] <= labels
            if head_width and w[1] not in consumed:
                add(child)
            elif head_width or (w[1] not in hidden and w[1] not in consumed):
                heads.unsure.append(matrix_names[id(child)])
    if not heads.param_ids and not configs and outside:
        # No config and no rule found a head: the last matrix outside the repeated layers maps
        # the trunk's features to the outputs (models register their layers in forward order).
        add(outside[-1])
        heads.guessed.append(matrix_names[id(outside[-1])])
    head_names = {n for n, m in model.named_modules() if any(id(p) in heads.param_ids for p in m.parameters(False))}
    heads.unsure = [n for n in heads.unsure if n not in head_names]
    return heads


def _is_depthwise_conv(m: nn.Module) -> bool:
    """A grouped convolution whose per-group matrix has one row (weight ``(C, 1, *kernel)`` with
    ``groups == C``, e.g. Mamba's depthwise ``conv1d``): every channel has its own filter and there
    is no matrix to orthogonalize (Newton–Schulz of one row only normalizes it)."""
    if not isinstance(m, _CONV_MODULES) or m.groups <= 1:
        return False
    rows = m.in_channels if isinstance(m, _CONV_TRANSPOSE_MODULES) else m.out_channels
    return rows // m.groups == 1


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
    heads = find_output_heads(model)
    head_ids = heads.param_ids
    containers = _expert_containers(model, _expert_counts(_text_config(model)))
    expert_ids = {id(p) for name in containers for p in dict(model.named_modules())[name].parameters(recurse=False)
                  if len(param_shape(p)) >= 2}
    router_ids = _router_ids(model, containers)

    sel = Selection()
    if heads.guessed:
        sel.notes.append(f"no config and no declared or vocabulary-sized head: took the last matrix outside the "
                         f"repeated layers, {heads.guessed}, as the output head (AdamW); if it is not one, set "
                         "use_muon=True on it")
    if heads.unsure:
        sel.notes.append(f"could not tell whether {heads.unsure[:3]}{'...' if len(heads.unsure) > 3 else ''} "
                         "(outside the repeated layers, mapping the hidden size to another width) are output "
                         "heads; the rule chose for them; tag heads with use_muon=False")
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
        elif _is_depthwise_conv(owner[id(p)]):
            choice, reason = False, DEPTHWISE
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
    ``num_key_value_heads`` or ``num_key_value_groups``, ``head_dim``), else from its own ``config``
    (transformers' attention modules keep the config of their tower: a vision encoder's differs from the
    text model's); None when the module states neither."""
    if module is None:
        return None
    first = lambda *names: next((v for v in (_positive_int(getattr(module, n, None)) for n in names) if v), None)  # noqa: E731
    nh = first("num_attention_heads", "num_heads", "n_heads", "n_head")
    hd = first("head_dim", "head_size")
    if nh is not None and hd is not None:
        nkv = first("num_key_value_heads", "num_kv_heads", "n_kv_heads")
        groups = first("num_key_value_groups")
        if nkv is None and groups and nh % groups == 0:
            nkv = nh // groups
        return nh, nkv or nh, hd
    return _head_geometry(getattr(module, "config", None))


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
    # the attention module's own geometry first: a multimodal model's vision tower has other head counts
    # than the text config that model.config.get_text_config() returns
    geometry = _module_head_geometry(parent) or _head_geometry(cfg)
    if geometry is None:
        examined[leaf] = ("no head geometry (n_heads and head_dim or a config on the attention module, or "
                          "model.config with num_attention_heads)")
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
        conv = isinstance(module, _CONV_MODULES) and leaf_param == "weight"
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
