"""Which parameters Muon trains, and which go to AdamW (docs/selection.md; docs/design.md, "Layers": ``model``).

Order of precedence, first match wins:

1. An explicit ``param.use_muon = True/False`` set by the user.
2. The config's ``muon_params`` / ``adamw_params`` glob patterns over ``model.named_parameters()``
   names (``adamw_params`` is checked first, so a parameter matched by both goes to AdamW).
3. The module-type rule: Muon for the >=2-D weights of hidden linear and convolution layers
   (``nn.Linear``, ``nn.Conv1d/2d/3d``, transposed convs, Hugging Face's GPT-2 ``Conv1D``), except
   depthwise convs (one filter row per group, e.g. Mamba's ``conv1d``).
   ``nn.MultiheadAttention``'s ``in_proj_weight`` (and ``q/k/v_proj_weight``) is Muon too.
   AdamW for everything else: embeddings (and any linear tied to one), input layers (the linear/conv layers
   that read the raw input: a ViT patch embedding, :func:`ds_muon.model.structure.input_layer_ids`), output
   heads (below), norms, biases (1-D, and >=2-D ones named as biases: expert biases), 0-D/1-D parameters,
   and >=2-D parameters of modules the rule does not recognise (tag those yourself; AdamW is never wrong,
   only possibly slower to train).
   MoE (:data:`MOE_RULE`): the 3-D parameters of an expert container (a module whose >=2-D
   parameters, biases aside, are all ``(E, ., .)`` with E the config's expert count or the module's
   ``num_experts``) are Muon; a router/gate next to it (E or 1 output rows; also the one matrix of a router module
   next to it, DeepSpeed AutoEP's ``router.gate``) is AdamW.

Output heads are found by :func:`ds_muon.model.output_heads.find_output_heads`; the repeated layers,
expert containers and routers by :mod:`ds_muon.model.structure`. Each Muon parameter also gets its
matrix view (:mod:`ds_muon.model.views`): the blocks Newton–Schulz orthogonalizes separately. The
options arrive as one frozen :class:`SelectionRules` built from the config. docs/selection.md has the
rules with examples.

Shapes come from ``ds_shape`` when the model was built under ``deepspeed.zero.Init`` (there
``param.shape`` is a flat placeholder).
"""
from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from torch import nn

from ..core.matrix import Split, matrix_view
from ..names import AUTO_USE_MUON_ATTR, NO_DECAY_ATTR, SPLIT_ATTR, USE_MUON_ATTR
from .output_heads import find_output_heads
from .structure import (EMBEDDING_MODULES, MHA_PROJECTIONS, MOE_RULE, decay_exempt_names, expert_containers,
                        expert_counts,
                        input_layer_ids, is_bias_name, is_depthwise_conv, is_matrix_module, is_multihead_attention,
                        param_numel, param_shape, router_ids, text_config)
from .views import assign_views

logger = logging.getLogger("ds_muon")

NO_MUON_WARNING = ("ds_muon: no parameter was selected for Muon, so this run is pure AdamW. Tag matrices with "
                   "param.use_muon=True or set optimizer.params.muon_params.")
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
BIAS = ">=2-D bias (named *bias*: expert biases, bias_k/bias_v)"
INPUT_LAYER = "input layer (reads the raw input: patch/feature embedding)"
MHA_IN_PROJ = "attention input projection (nn.MultiheadAttention in_proj_weight)"


@dataclass(frozen=True)
class SelectionRules:
    """The config's say in which parameters Muon trains and how it cuts them (config keys ``muon_params``,
    ``adamw_params``, ``per_head_muon``, ``muon_splits``), built once and handed along unchanged.

    Attributes:
        muon_patterns: ``fnmatch`` globs over parameter names forcing Muon.
        adamw_patterns: ``fnmatch`` globs forcing AdamW (checked before ``muon_patterns``).
        per_head_muon: split attention Q/K/V projections per head.
        muon_splits: ``((glob pattern, split), ...)`` declared matrix views; a split is a list of row sizes or
            ``{"rows": [...], "cols": [...]}`` (None where an axis is not cut).
    """

    muon_patterns: tuple[str, ...] = ()
    adamw_patterns: tuple[str, ...] = ()
    per_head_muon: bool = False
    muon_splits: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_params(cls, params: Any) -> "SelectionRules":
        """From validated optimizer params (:class:`ds_muon.config.MuonOptimizerParams`)."""
        return cls(tuple(params.muon_params), tuple(params.adamw_params), bool(params.per_head_muon),
                   tuple(params.declared_splits().items()))

    @classmethod
    def of(cls, muon_patterns: Iterable[str] = (), adamw_patterns: Iterable[str] = (), per_head_muon: bool = False,
           muon_splits: Mapping[str, Any] | None = None) -> "SelectionRules":
        """From plain values (tests, scripts): ``muon_splits`` as a ``{pattern: split}`` mapping."""
        return cls(tuple(muon_patterns), tuple(adamw_patterns), per_head_muon, tuple((muon_splits or {}).items()))


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
        """The :class:`~ds_muon.core.matrix.MatrixView` of Muon parameter ``name``."""
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
            label = (split.describe() if split.interleave > 1 else split.label) if split else "one matrix each"
            kind = ("stacked, " if stacked else "") + label
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


def select_muon_params(model: nn.Module, rules: SelectionRules = SelectionRules()) -> Selection:
    """Decide, for every parameter of ``model``, whether Muon or AdamW trains it.

    Args:
        model: the model (plain or built under ``deepspeed.zero.Init``).
        rules: the config's patterns, ``per_head_muon`` and declared splits (:class:`SelectionRules`).

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
    muon_patterns, adamw_patterns = rules.muon_patterns, rules.adamw_patterns
    owner: dict[int, nn.Module] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owner.setdefault(id(p), module)
    embedding_ids = {id(p) for m in model.modules() if isinstance(m, EMBEDDING_MODULES) for p in m.parameters(False)}
    heads = find_output_heads(model)
    head_ids = heads.param_ids
    counts = expert_counts(text_config(model))
    containers = expert_containers(model, counts)
    expert_ids = {id(p) for name in containers for p in dict(model.named_modules())[name].parameters(recurse=False)
                  if len(param_shape(p)) >= 2}
    routers = router_ids(model, containers, counts)
    inputs = input_layer_ids(model)

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
        explicit = getattr(p, USE_MUON_ATTR, None)
        # tag_model records what it decided in _ds_muon_auto; a use_muon that differs from it was
        # set by the user afterwards and counts as explicit.
        if explicit is not None and getattr(p, AUTO_USE_MUON_ATTR, None) is not bool(explicit):
            choice, reason = bool(explicit), EXPLICIT
        elif any(fnmatch.fnmatchcase(name, pat) for pat in adamw_patterns):
            choice, reason = False, PATTERN
        elif any(fnmatch.fnmatchcase(name, pat) for pat in muon_patterns):
            choice, reason = True, PATTERN
        elif len(shape) < 2:
            choice, reason = False, LOW_DIM
        elif is_bias_name(name.rpartition(".")[2]):
            choice, reason = False, BIAS
        elif id(p) in embedding_ids:
            choice, reason = False, EMBEDDING
        elif id(p) in inputs:
            choice, reason = False, INPUT_LAYER
        elif id(p) in head_ids:
            choice, reason = False, OUTPUT_HEAD
        elif id(p) in routers:
            choice, reason = False, ROUTER
        elif id(p) in expert_ids:
            choice, reason = True, EXPERTS
        elif is_depthwise_conv(owner[id(p)]):
            choice, reason = False, DEPTHWISE
        elif is_matrix_module(owner[id(p)]):
            choice, reason = True, HIDDEN_MATRIX
        elif is_multihead_attention(owner[id(p)]) and name.rpartition(".")[2] in MHA_PROJECTIONS:
            choice, reason = True, MHA_IN_PROJ
        else:
            choice, reason = False, UNRECOGNISED
        if choice and len(shape) < 2:
            raise ValueError(f"parameter {name!r} has shape {shape} but was selected for Muon by {reason}; "
                             "Muon orthogonalizes matrices (>= 2 dims). Set use_muon=False on it or fix the pattern.")
        sel.use_muon[name] = choice
        sel.reasons[name] = reason
    splits, notes = assign_views(model, sel.use_muon, sel.reasons, rules.per_head_muon, dict(rules.muon_splits))
    sel.splits.update(splits)
    sel.notes.extend(notes)
    return sel


def tag_model(model: nn.Module, rules: SelectionRules = SelectionRules(), log: bool = True) -> Selection:
    """Run :func:`select_muon_params` and write ``param.use_muon`` on every parameter.

    Parameters the rule decided (not the user) also get ``param._ds_muon_auto = <the decision>``, so
    a later call re-decides them instead of mistaking them for explicit user tags, while a
    ``use_muon`` the user changes afterwards still counts as explicit. Every parameter's matrix
    split (:class:`~ds_muon.core.matrix.Split`, or ``None``) is written to ``param.ds_muon_split``, which the
    oracle and the ZeRO-3 owner plan read. ``param.ds_muon_no_decay`` (:data:`ds_muon.names.NO_DECAY_ATTR`) says
    whether it is a norm weight or a bias (:func:`ds_muon.model.structure.decay_exempt_names`), which
    :func:`ds_muon.model.param_groups.split_param_groups` exempts from weight decay unless
    ``decay_norms_and_biases``.

    Returns:
        The :class:`Selection`; its summary is logged at INFO on the ``ds_muon`` logger when ``log``.
    """
    sel = select_muon_params(model, rules)
    exempt = decay_exempt_names(model)
    for name, p in model.named_parameters():
        setattr(p, SPLIT_ATTR, sel.splits.get(name))
        setattr(p, NO_DECAY_ATTR, name in exempt)
        if sel.reasons[name] != EXPLICIT:
            setattr(p, USE_MUON_ATTR, sel.use_muon[name])
            setattr(p, AUTO_USE_MUON_ATTR, sel.use_muon[name])
    if log:
        logger.info("%s", sel.summary(n for n, p in model.named_parameters() if not p.requires_grad))
        if not any(sel.use_muon.values()):
            logger.warning(NO_MUON_WARNING)
    return sel
