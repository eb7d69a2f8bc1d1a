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

Shapes come from ``ds_shape`` when the model was built under ``deepspeed.zero.Init`` (there
``param.shape`` is a flat placeholder).
"""
from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field
from typing import Iterable

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
    """

    use_muon: dict[str, bool] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    numels: dict[str, int] = field(default_factory=dict)

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
        return "\n".join(lines)


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
    head_ids = _output_head_ids(model)

    sel = Selection()
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
