r"""Adam-mini's blocks: which elements of each parameter share one second moment (layer ``model``).

Zhang et al., "Adam-mini: Use Fewer Learning Rates To Gain More", arXiv:2406.16793; reference
implementation https://github.com/zyushun/Adam-mini (``adam_mini/adam_mini.py``, v1.1.1, read for its
block rules; not copied).

Algorithm (one optimizer step, every tensor fp32; ``t`` counts the steps of the parameter):

.. math::
    &\textbf{input}: \gamma \text{ (lr)}, \beta_1, \beta_2 \text{ (betas)}, \epsilon \text{ (eps)},
        \lambda \text{ (weight decay)}, \text{a partition of each parameter into blocks } B \\
    &m_t \leftarrow \beta_1 m_{t-1} + (1-\beta_1) g_t  && \text{one first moment per element} \\
    &v_{t,B} \leftarrow \beta_2 v_{t-1,B} + (1-\beta_2)\, \tfrac{1}{|B|} \textstyle\sum_{i \in B} g_{t,i}^2
        && \text{one second moment per block} \\
    &\theta_t \leftarrow \theta_{t-1} (1 - \gamma\lambda)
        - \gamma \frac{m_t / (1-\beta_1^t)}{\sqrt{v_{t,B(i)} / (1-\beta_2^t)} + \epsilon}
        && \text{decoupled weight decay, Adam's bias corrections}

A block of one element is AdamW (``torch.optim.AdamW``) exactly.

Block rules (:func:`adam_mini_plan`), decided once from the model's structure, not from names alone:

``block_rule="default"`` (the issue's rules; the paper's partition):
    * input embeddings (``nn.Embedding`` modules) and output heads (:func:`ds_muon.model.output_heads.find_output_heads`,
      tied ones included): per-element Adam;
    * biases (a module's ``bias`` parameter): per-element Adam, as the reference (its ``adam_block_names``);
    * query and key projections (``q_proj``/``k_proj``/``wq``/``wk``/``query``/``key``, 2-D, checked against
      the attention module's head geometry, :func:`ds_muon.model.structure.head_geometry`):
      one block per head, i.e. ``head_dim`` whole rows (``head_dim * in_features`` elements); a GQA key
      projection has ``num_key_value_heads`` blocks;
    * every other tensor (value, output projection, MLP, norms): one block, ``|B|`` = its numel.
``block_rule="neuron"`` (the reference's later v1.1 partition): as default, except that every other
    >= 2-D tensor, embeddings and heads included, gets one block per output neuron (row: ``numel / shape[0]``
    elements); 1-D tensors (norms) stay one block.

Weight decay: decoupled, on everything except norm weights and biases (Hugging Face Trainer's convention,
:func:`ds_muon.model.structure.decay_exempt_names`, as for Muon's AdamW half; ``decay_norms_and_biases: true``
decays them too); the reference exempts names containing "norm", "ln" or "bias". A bias is any parameter named
``bias``, ``*_bias`` or ``bias_*`` (``nn.MultiheadAttention``'s ``in_proj_bias``): per-element Adam.
``nn.MultiheadAttention``'s ``in_proj_weight`` ``(3E, E)``: one block per head of Q, K and V.

Block sizes are global (the whole parameter's), so the sharded step
(:class:`ds_muon.sharded.adam_mini_step.AdamMiniShardStep`) computes the same means from partial sums
over shards. The update math is :mod:`ds_muon.core.adam_update`; the oracle is :class:`ds_muon.AdamMini`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

from torch import nn

from ..names import ADAM_MINI, ADAMW, ALGORITHM_KEY, BLOCK_ATTR
from .output_heads import find_output_heads
from .structure import (EMBEDDING_MODULES, decay_exempt_names, head_geometry, is_bias_name, is_matrix_module,
                        is_multihead_attention, is_norm_module, param_shape, text_config)

PER_ELEMENT = "per-element"
BLOCK_RULES = ("default", "neuron")
_QK_LEAVES = ("q_proj", "k_proj", "wq", "wk", "query", "key")
_K_LEAVES = ("k_proj", "wk", "key")


@dataclass(frozen=True)
class AdamMiniRule:
    """How Adam-mini treats one parameter.

    Attributes:
        block: elements per block (an int dividing the parameter's numel; global, never a shard's), or
            :data:`PER_ELEMENT` (Adam's per-element second moment).
        decay: whether decoupled weight decay applies.
        reason: a short description ("per head (4 heads of 64 rows)", "embedding", ...).
    """

    block: Union[int, str]
    decay: bool
    reason: str


def _qk_block(leaf: str, module: nn.Module, shape: tuple, cfg, parent: Optional[nn.Module]) -> Optional[tuple[int, str]]:
    leaf = leaf.lower()
    if len(shape) != 2 or leaf not in _QK_LEAVES or not is_matrix_module(module) or type(module).__name__ == "Conv1D":
        return None
    geometry = head_geometry(parent, cfg)
    if geometry is None:
        return None
    nh, nkv, hd = geometry
    heads = nkv if leaf in _K_LEAVES else nh
    if shape[0] != heads * hd:
        return None
    return hd * shape[1], f"per head ({heads} heads of {hd} rows)"


def _mha_block(leaf_param: str, module: nn.Module, shape: tuple) -> Optional[tuple[int, str]]:
    """``nn.MultiheadAttention``: ``in_proj_weight`` ``(3E, E)`` one block per head of Q, K and V (``head_dim`` rows;
    a block size is one per tensor, so V is per head too), ``q_proj_weight``/``k_proj_weight`` one per head."""
    if not is_multihead_attention(module) or len(shape) != 2:
        return None
    nh, hd = module.num_heads, module.head_dim
    if leaf_param == "in_proj_weight" and shape[0] == 3 * nh * hd:
        return hd * shape[1], f"per head ({3 * nh} heads of Q, K, V of {hd} rows)"
    if leaf_param in ("q_proj_weight", "k_proj_weight") and shape[0] == nh * hd:
        return hd * shape[1], f"per head ({nh} heads of {hd} rows)"
    return None


def adam_mini_plan(model: nn.Module, block_rule: str = "default",
                   decay_norms_and_biases: bool = False) -> dict[str, AdamMiniRule]:
    """The Adam-mini rule of every trainable parameter of ``model`` (see the module docstring).

    Args:
        model: an ``nn.Module``, plain or built under ``deepspeed.zero.Init`` (shapes from ``ds_shape``).
        block_rule: ``"default"`` or ``"neuron"``.
        decay_norms_and_biases: decay norm weights and biases too (default: exempt, Hugging Face Trainer's
            convention, :func:`ds_muon.model.structure.decay_exempt_names`).

    Returns:
        ``{name: AdamMiniRule}`` in ``model.named_parameters()`` order (trainable parameters only).

    Raises:
        ValueError: an unknown ``block_rule``.
    """
    if block_rule not in BLOCK_RULES:
        raise ValueError(f"block_rule {block_rule!r} is invalid; allowed: {', '.join(map(repr, BLOCK_RULES))}")
    cfg = text_config(model)
    heads = find_output_heads(model).param_ids
    modules = dict(model.named_modules())
    embeddings = {id(p) for m in model.modules() if isinstance(m, EMBEDDING_MODULES) for p in m.parameters(False)}
    exempt = set() if decay_norms_and_biases else decay_exempt_names(model)
    plan: dict[str, AdamMiniRule] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        module_name, _, leaf_param = name.rpartition(".")
        module = modules.get(module_name, model)
        shape = tuple(param_shape(p))
        numel = math.prod(shape)
        norm = is_norm_module(module)
        decay = name not in exempt
        if is_bias_name(leaf_param):
            plan[name] = AdamMiniRule(PER_ELEMENT, decay, "bias")
            continue
        if id(p) in embeddings or id(p) in heads:
            kind = "embedding" if id(p) in embeddings else "output head"
            if block_rule == "neuron" and len(shape) >= 2:
                plan[name] = AdamMiniRule(numel // shape[0], decay, f"{kind}, per row")
            else:
                plan[name] = AdamMiniRule(PER_ELEMENT, decay, kind)
            continue
        parent = modules.get(module_name.rpartition(".")[0], model) if module_name else None
        qk = _qk_block(module_name.rpartition(".")[2], module, shape, cfg, parent) if module_name else None
        qk = qk or _mha_block(leaf_param, module, shape)
        if qk is not None:
            plan[name] = AdamMiniRule(qk[0], decay, qk[1])
        elif block_rule == "neuron" and len(shape) >= 2:
            plan[name] = AdamMiniRule(numel // shape[0], decay, "per row")
        else:
            plan[name] = AdamMiniRule(max(1, numel), decay, "norm" if norm else "whole tensor")
    return plan


def adam_mini_blocks(model: nn.Module, block_rule: str = "default") -> dict[str, Union[int, str]]:
    """``{parameter name: elements per block (int) or "per-element"}`` of the trainable parameters
    (:func:`adam_mini_plan`'s blocks): the interface the reference and the ZeRO-3 optimizer share."""
    return {name: rule.block for name, rule in adam_mini_plan(model, block_rule).items()}


def adam_mini_param_groups(model: nn.Module, defaults: dict[str, Any], block_rule: str = "default",
                           decay_norms_and_biases: bool = False) -> list[dict]:
    """Param groups for Adam-mini, and each parameter tagged with its block size.

    Writes ``param.ds_adam_mini_block`` (:data:`BLOCK_ATTR`: elements per block, or None for per-element
    Adam) on every trainable parameter. Groups never mix per-element and block parameters, nor decayed
    and exempt ones (a ZeRO-3 sub-group never mixes param groups, so each sub-group has one kind).

    Args:
        model: the model (see :func:`adam_mini_plan`).
        defaults: ``{"lr", "betas", "eps", "weight_decay"}``, copied into each group.
        block_rule, decay_norms_and_biases: see :func:`adam_mini_plan`.

    Returns:
        Up to four groups ``{"params", "algorithm": "adam_mini" | "adamw", "use_muon": False, "lr", "betas",
        "eps", "weight_decay"}`` (``"adamw"``: per-element Adam, Adam-mini with one-element blocks; empty groups
        are dropped).

    Raises:
        ValueError: no trainable parameter.
    """
    plan = adam_mini_plan(model, block_rule, decay_norms_and_biases)
    if not plan:
        raise ValueError("Adam-mini got a model with no trainable parameter")
    groups: dict[tuple[bool, bool], list] = {}
    for name, p in model.named_parameters():
        rule = plan.get(name)
        if rule is None:
            continue
        blocked = rule.block != PER_ELEMENT
        setattr(p, BLOCK_ATTR, rule.block if blocked else None)
        groups.setdefault((blocked, rule.decay), []).append(p)
    out = []
    for (blocked, decay), params in sorted(groups.items(), key=lambda kv: (not kv[0][0], not kv[0][1])):
        out.append(dict(defaults, params=params, use_muon=False, **{ALGORITHM_KEY: ADAM_MINI if blocked else ADAMW},
                        weight_decay=defaults["weight_decay"] if decay else 0.0))
    return out


def adam_mini_summary(plan: dict[str, AdamMiniRule]) -> str:
    """A few lines for the log: how many parameters and elements, and second moments, go each way."""
    lines = ["Adam-mini blocks:"]
    kinds: dict[str, list] = {}
    for name, rule in plan.items():
        kinds.setdefault(rule.reason.split(" (")[0], []).append(name)
    for kind, names in kinds.items():
        lines.append(f"  {kind}: {len(names)} parameter(s), e.g. {names[0]}")
    return "\n".join(lines)
