"""Which parameters Muon trains, and which go to AdamW (design.md §7).

Order of precedence, first match wins:

1. An explicit ``param.use_muon = True/False`` set by the user.
2. The config's ``muon_params`` / ``adamw_params`` glob patterns over ``model.named_parameters()``
   names (``adamw_params`` is checked first, so a parameter matched by both goes to AdamW).
3. The module-type rule: Muon for the >=2-D weights of hidden linear and convolution layers
   (``nn.Linear``, ``nn.Conv1d/2d/3d``, transposed convs, Hugging Face's GPT-2 ``Conv1D``).
   AdamW for everything else: embeddings (and any linear tied to one), output heads (below), norms,
   biases, 0-D/1-D parameters, and >=2-D parameters of modules the rule does not recognise (tag
   those yourself; AdamW is never wrong, only possibly slower to train).

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
``ModuleList``/``Sequential`` of two or more modules of one class that are neither matrices nor
plain containers, and any other module of that class (an MTP module's decoder layer); nothing inside
them is a head.
Only when the model has no config and none of the rules finds a head is the last matrix module
outside the repeated layers taken as the head, and the split summary says that this was a guess; it
also names the matrices it could not tell from a head (see :attr:`Selection.notes`).

Shapes come from ``ds_shape`` when the model was built under ``deepspeed.zero.Init`` (there
``param.shape`` is a flat placeholder).
"""
from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
from torch import nn

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
    notes: list[str] = field(default_factory=list)

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
        unrecognised = [n for n in trainable if self.reasons[n] == UNRECOGNISED]
        if unrecognised:
            lines.append("  note: set param.use_muon=True or add a muon_params pattern to train "
                         f"{unrecognised[:3]}{'...' if len(unrecognised) > 3 else ''} with Muon")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


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


def _layer_lists(model: nn.Module) -> set[int]:
    """``id()`` of every module inside the repeated layers (see the module docstring), and inside any
    other instance of a repeated layer's class (an MTP module's extra decoder layer)."""
    layer_types: set[type] = set()
    for m in model.modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(m.children())
        if (len(children) >= 2 and len({type(c) for c in children}) == 1 and not _is_matrix_module(children[0])
                and not isinstance(children[0], _CONTAINERS)):
            layer_types.add(type(children[0]))
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


def _is_matrix_module(m: nn.Module) -> bool:
    return isinstance(m, _MATRIX_MODULES) or type(m).__name__ in _MATRIX_CLASS_NAMES


def select_muon_params(model: nn.Module,
                       muon_patterns: Iterable[str] = (),
                       adamw_patterns: Iterable[str] = ()) -> Selection:
    """Decide, for every parameter of ``model``, whether Muon or AdamW trains it.

    Args:
        model: the model (plain or built under ``deepspeed.zero.Init``).
        muon_patterns: ``fnmatch`` globs over parameter names forcing Muon.
        adamw_patterns: ``fnmatch`` globs forcing AdamW (checked before ``muon_patterns``).

    Returns:
        A :class:`Selection`. Nothing is written to the parameters; see :func:`tag_model`.

    Raises:
        ValueError: if an explicit ``use_muon=True`` or a Muon pattern selects a parameter with
            fewer than 2 dimensions (Muon orthogonalizes matrices), naming the parameter.
    """
    muon_patterns, adamw_patterns = list(muon_patterns), list(adamw_patterns)
    owner: dict[int, nn.Module] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owner.setdefault(id(p), module)
    embedding_ids = {id(p) for m in model.modules() if isinstance(m, _EMBEDDING_MODULES) for p in m.parameters(False)}
    heads = find_output_heads(model)
    head_ids = heads.param_ids

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
        elif _is_matrix_module(owner[id(p)]):
            choice, reason = True, HIDDEN_MATRIX
        else:
            choice, reason = False, UNRECOGNISED
        if choice and len(shape) < 2:
            raise ValueError(f"parameter {name!r} has shape {shape} but was selected for Muon by {reason}; "
                             "Muon orthogonalizes matrices (>= 2 dims). Set use_muon=False on it or fix the pattern.")
        sel.use_muon[name] = choice
        sel.reasons[name] = reason
    return sel


def tag_model(model: nn.Module,
              muon_patterns: Iterable[str] = (),
              adamw_patterns: Iterable[str] = (),
              log: bool = True) -> Selection:
    """Run :func:`select_muon_params` and write ``param.use_muon`` on every parameter.

    Parameters the rule decided (not the user) also get ``param._ds_muon_auto = <the decision>``, so
    a later call re-decides them instead of mistaking them for explicit user tags, while a
    ``use_muon`` the user changes afterwards still counts as explicit.

    Returns:
        The :class:`Selection`; its summary is logged at INFO on the ``ds_muon`` logger when ``log``.
    """
    sel = select_muon_params(model, muon_patterns, adamw_patterns)
    for name, p in model.named_parameters():
        if sel.reasons[name] != EXPLICIT:
            p.use_muon = sel.use_muon[name]
            p._ds_muon_auto = sel.use_muon[name]
    if log:
        logger.info("%s", sel.summary(n for n, p in model.named_parameters() if not p.requires_grad))
        if not any(sel.use_muon.values()):
            logger.warning(NO_MUON_WARNING)
    return sel
