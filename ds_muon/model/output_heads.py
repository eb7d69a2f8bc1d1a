"""Output heads: the matrices that map hidden states to outputs (layer ``model``).

Logits of a vocabulary, values, scores, class labels: always AdamW (docs/selection.md), found from
what the model declares and from its config and shapes, never from names or registration order alone:

* declared: ``get_output_embeddings()`` of the model or of any submodule (a wrapper's inner model);
* by width: a linear/conv module outside the repeated layers whose input width is the hidden size,
  whose output width is a vocabulary size or at most ``max(2, num_labels)``, and whose output no
  sibling matrix (a matrix module of the same parent) takes as input: an untied ``lm_head``, an
  MTP ``head``, Medusa-style parallel heads, value heads ``Linear(D, 1)``, reward models'
  ``score``, ``classifier``/``score``/``qa_outputs`` of HF task models.

Hidden sizes and vocabulary sizes come from every ``config`` in the model (``hidden_size``,
``vocab_size``, ``num_labels``, their text config's too) and from the input embeddings
(``get_input_embeddings()``, else every ``nn.Embedding``). Nothing inside the repeated layers
(:func:`ds_muon.model.structure.repeated_layer_ids`) is a head. Only when the model has no config and
none of the rules finds a head is the last matrix module outside the repeated layers taken as the head.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from .structure import (CONV_MODULES, EMBEDDING_MODULES, declared, int_attrs, is_matrix_module, model_configs,
                        param_shape, repeated_layer_ids)

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
    if isinstance(module, CONV_MODULES):
        return module.in_channels, module.out_channels
    weight = getattr(module, "weight", None)
    nf = getattr(module, "nf", None)  # HF Conv1D: weight (in, out)
    if isinstance(weight, torch.Tensor) and isinstance(nf, int) and len(param_shape(weight)) == 2:
        return param_shape(weight)[0], nf
    return None

def find_output_heads(model: nn.Module) -> OutputHeads:
    """The matrices of ``model`` that map hidden states to outputs (the rule in the module docstring).

    Args:
        model: any ``nn.Module``, plain or built under ``deepspeed.zero.Init`` (widths are read from
            the modules' attributes, not from the placeholders' shapes).

    Returns:
        An :class:`OutputHeads`: the heads' parameter ids, and what was guessed or left unsure.
    """
    heads = OutputHeads()
    matrix_names = {id(m): n for n, m in model.named_modules() if is_matrix_module(m)}

    def add(module: nn.Module) -> None:
        heads.param_ids.update(id(p) for p in module.parameters(recurse=False) if len(param_shape(p)) >= 2)

    for m in model.modules():
        head = declared(m, "get_output_embeddings")
        if isinstance(head, nn.Module):
            add(head)
        elif isinstance(head, torch.Tensor):
            heads.param_ids.add(id(head))

    configs = model_configs(model)
    hidden = set().union(*(int_attrs(c, ("hidden_size", "d_model", "n_embd")) for c in configs))
    vocab = set().union(*(int_attrs(c, ("vocab_size",)) for c in configs))
    labels = max([2, *(n for c in configs for n in int_attrs(c, ("num_labels",)))])
    inputs = [e for e in (declared(m, "get_input_embeddings") for m in model.modules())
              if isinstance(e, EMBEDDING_MODULES)]
    for emb in inputs or [m for m in model.modules() if isinstance(m, EMBEDDING_MODULES)]:
        vocab.add(emb.num_embeddings)
        hidden.add(emb.embedding_dim)

    in_layers = repeated_layer_ids(model)
    outside = [m for m in model.modules() if is_matrix_module(m) and id(m) not in in_layers]  # in order
    for parent in model.modules():
        siblings = [(c, _widths(c)) for c in parent.children() if is_matrix_module(c)]
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
