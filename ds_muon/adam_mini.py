r"""Adam-mini: Adam with one second moment per parameter block (math layer, single device).

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
    * input embeddings (``nn.Embedding`` modules) and output heads (:func:`ds_muon.selection.find_output_heads`,
      tied ones included): per-element Adam;
    * biases (a module's ``bias`` parameter): per-element Adam, as the reference (its ``adam_block_names``);
    * query and key projections (``q_proj``/``k_proj``/``wq``/``wk``/``query``/``key``, 2-D, checked against
      the head geometry of ``model.config`` or the attention module, :func:`ds_muon.selection._head_geometry`):
      one block per head, i.e. ``head_dim`` whole rows (``head_dim * in_features`` elements); a GQA key
      projection has ``num_key_value_heads`` blocks;
    * every other tensor (value, output projection, MLP, norms): one block, ``|B|`` = its numel.
``block_rule="neuron"`` (the reference's later v1.1 partition): as default, except that every other
    >= 2-D tensor, embeddings and heads included, gets one block per output neuron (row: ``numel / shape[0]``
    elements); 1-D tensors (norms) stay one block.

Weight decay: decoupled, on everything except norm weights (parameters of a module whose class name
contains "Norm") and biases; the reference exempts names containing "norm", "ln" or "bias".

Block sizes are global (the whole parameter's), so the distributed optimizer
(:class:`ds_muon.zero3.MuonZeroOptimizer` on Adam-mini sub-groups) computes the same means from
partial sums over shards.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from .selection import (_EMBEDDING_MODULES, _head_geometry, _is_matrix_module, _module_head_geometry,
                        _text_config, find_output_heads, param_shape)

PER_ELEMENT = "per-element"
BLOCK_ATTR = "ds_adam_mini_block"  # on each parameter: elements per block (int), or None for per-element
BLOCK_STATE_KEY = "block_exp_avg_sq"  # the per-block second moments (one fp32 per block)
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
    if len(shape) != 2 or leaf not in _QK_LEAVES or not _is_matrix_module(module) or type(module).__name__ == "Conv1D":
        return None
    geometry = _head_geometry(cfg) or _module_head_geometry(parent)
    if geometry is None:
        return None
    nh, nkv, hd = geometry
    heads = nkv if leaf in _K_LEAVES else nh
    if shape[0] != heads * hd:
        return None
    return hd * shape[1], f"per head ({heads} heads of {hd} rows)"


def adam_mini_plan(model: nn.Module, block_rule: str = "default") -> dict[str, AdamMiniRule]:
    """The Adam-mini rule of every trainable parameter of ``model`` (see the module docstring).

    Args:
        model: an ``nn.Module``, plain or built under ``deepspeed.zero.Init`` (shapes from ``ds_shape``).
        block_rule: ``"default"`` or ``"neuron"``.

    Returns:
        ``{name: AdamMiniRule}`` in ``model.named_parameters()`` order (trainable parameters only).

    Raises:
        ValueError: an unknown ``block_rule``.
    """
    if block_rule not in BLOCK_RULES:
        raise ValueError(f"block_rule {block_rule!r} is invalid; allowed: {', '.join(map(repr, BLOCK_RULES))}")
    cfg = _text_config(model)
    heads = find_output_heads(model).param_ids
    modules = dict(model.named_modules())
    embeddings = {id(p) for m in model.modules() if isinstance(m, _EMBEDDING_MODULES) for p in m.parameters(False)}
    plan: dict[str, AdamMiniRule] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        module_name, _, leaf_param = name.rpartition(".")
        module = modules.get(module_name, model)
        shape = tuple(param_shape(p))
        numel = math.prod(shape)
        norm = "norm" in type(module).__name__.lower()
        if leaf_param == "bias":
            plan[name] = AdamMiniRule(PER_ELEMENT, False, "bias")
            continue
        decay = not norm
        if id(p) in embeddings or id(p) in heads:
            kind = "embedding" if id(p) in embeddings else "output head"
            if block_rule == "neuron" and len(shape) >= 2:
                plan[name] = AdamMiniRule(numel // shape[0], decay, f"{kind}, per row")
            else:
                plan[name] = AdamMiniRule(PER_ELEMENT, decay, kind)
            continue
        parent = modules.get(module_name.rpartition(".")[0], model) if module_name else None
        qk = _qk_block(module_name.rpartition(".")[2], module, shape, cfg, parent) if module_name else None
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


def adam_mini_param_groups(model: nn.Module, defaults: dict[str, Any], block_rule: str = "default") -> list[dict]:
    """Param groups for Adam-mini, and each parameter tagged with its block size.

    Writes ``param.ds_adam_mini_block`` (:data:`BLOCK_ATTR`: elements per block, or None for per-element
    Adam) on every trainable parameter. Groups never mix per-element and block parameters, nor decayed
    and exempt ones (a ZeRO-3 sub-group never mixes param groups, so each sub-group has one kind).

    Args:
        model: the model (see :func:`adam_mini_plan`).
        defaults: ``{"lr", "betas", "eps", "weight_decay"}``, copied into each group.
        block_rule: see :func:`adam_mini_plan`.

    Returns:
        Up to four groups ``{"params", "adam_mini": bool, "use_muon": False, "lr", "betas", "eps",
        "weight_decay"}`` (``adam_mini`` False: per-element Adam; empty groups are dropped).

    Raises:
        ValueError: no trainable parameter.
    """
    plan = adam_mini_plan(model, block_rule)
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
        out.append(dict(defaults, params=params, adam_mini=blocked, use_muon=False,
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


class AdamMini(torch.optim.Optimizer):
    r"""Adam-mini on one device (the oracle of the ZeRO-3 Adam-mini step).

    The math and the block rules are in :mod:`ds_muon.adam_mini`'s docstring. State per parameter:
    ``step`` (int), ``exp_avg`` (fp32, the parameter's shape) and either ``exp_avg_sq`` (fp32, the
    parameter's shape; per-element parameters) or ``block_exp_avg_sq`` (fp32, ``(numel / block,)``).
    A parameter whose ``.grad`` is None is skipped, as in ``torch.optim``.

    Args:
        params: an ``nn.Module`` (blocks from :func:`adam_mini_plan`), or the groups of
            :func:`adam_mini_param_groups` (parameters tagged with their block).
        **hyperparameters: the keys of ``"optimizer": {"type": "AdamMini", "params": {...}}``
            (:class:`ds_muon.config.AdamMiniOptimizerParams`): ``lr``, ``betas``, ``eps``,
            ``weight_decay``, ``block_rule``.

    Raises:
        ds_muon.config.ConfigError: a bad hyperparameter (names the key and the allowed values).
        ValueError: a parameter's block does not divide its numel.
    """

    def __init__(self, params: Any, **hyperparameters: Any) -> None:
        from .config import parse_adam_mini_params
        cfg = parse_adam_mini_params(hyperparameters, path="AdamMini")
        groups = (adam_mini_param_groups(params, cfg.group_defaults(), cfg.block_rule)
                  if isinstance(params, nn.Module) else list(params))
        for group in groups:
            for p in group["params"]:
                block = getattr(p, BLOCK_ATTR, None)
                if group.get("adam_mini") and (not block or p.numel() % block):
                    raise ValueError(f"a parameter of shape {tuple(p.shape)} has Adam-mini block {block}, which does "
                                     "not divide its numel")
        super().__init__(groups, {})
        self.config = cfg

    @torch.no_grad()
    def step(self, closure=None):
        """Apply one update to every parameter that has a gradient. Returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                block = getattr(p, BLOCK_ATTR, None) if group.get("adam_mini") else None
                if "step" not in state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    if block is None:
                        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                    else:
                        state[BLOCK_STATE_KEY] = torch.zeros(p.numel() // block, dtype=torch.float32, device=p.device)
                state["step"] += 1
                t = state["step"]
                g = p.grad.float()
                m = state["exp_avg"]
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                if block is None:
                    v = state["exp_avg_sq"]
                    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                    denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(group["eps"])
                else:
                    v = state[BLOCK_STATE_KEY]
                    v.mul_(beta2).add_(g.reshape(-1, block).square().mean(dim=1), alpha=1 - beta2)
                    per_block = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(group["eps"])
                    denom = per_block[:, None].expand(-1, block).reshape(p.shape)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_(m.to(p.dtype), denom.to(p.dtype), value=-group["lr"] / (1 - beta1**t))
        return loss


# ------------------------------------------------------------------------------------------------
# The shard step (used by the ZeRO-3 optimizer on one rank's flat fp32 partition)
# ------------------------------------------------------------------------------------------------
CHUNK_ELEMENTS = 1 << 24  # elements of the shard stepped at once (64 MiB of fp32 temporaries)


@dataclass(frozen=True)
class ShardChunk:
    """One window of a rank's flat shard, as the chunked Adam-mini step reads it.

    Attributes:
        start: first element of the window in the shard.
        numel: elements in the window (at most the chunk size).
        lengths: ``(k,)`` int64, lengths of the pieces of the :class:`ds_muon.blocks.BlockMap` segments
            that fall in the window (tiling it; a segment cut by a window boundary appears in both).
        block: ``(k,)`` int64, the block id of each piece, ``n_blocks`` for padding.
    """

    start: int
    numel: int
    lengths: torch.Tensor
    block: torch.Tensor


def shard_chunks(lengths: Sequence[int], block_of_segment: Sequence[int], n_blocks: int, device: torch.device,
                 chunk: Optional[int] = None) -> list[ShardChunk]:
    """Cut a shard's segments (a :class:`ds_muon.blocks.BlockMap`'s ``lengths``/``block_of_segment``, padding
    ``-1``) into windows of at most ``chunk`` elements (default :data:`CHUNK_ELEMENTS`), built once per
    sub-group.

    Returns:
        The windows in order; together they tile the shard exactly (an empty shard gives none).
    """
    chunk = int(chunk or CHUNK_ELEMENTS)
    out, seg, used, pos, total = [], 0, 0, 0, sum(lengths)
    while pos < total:
        end, start, pieces, blocks = min(total, pos + chunk), pos, [], []
        while pos < end:
            take = min(lengths[seg] - used, end - pos)
            if take > 0:
                pieces.append(take)
                blocks.append(n_blocks if block_of_segment[seg] < 0 else block_of_segment[seg])
            pos, used = pos + take, used + take
            if used == lengths[seg]:
                seg, used = seg + 1, 0
        out.append(ShardChunk(start, end - start, torch.tensor(pieces, dtype=torch.int64, device=device),
                              torch.tensor(blocks, dtype=torch.int64, device=device)))
    return out


def block_square_sums(grad: torch.Tensor, chunks: Sequence[ShardChunk], n_blocks: int) -> torch.Tensor:
    """Per-block partial sums of ``grad**2`` over one rank's shard, one window at a time.

    Args:
        grad: ``(shard numel,)`` fp32, the local gradient shard.
        chunks: the shard's windows (:func:`shard_chunks`).
        n_blocks: blocks in the sub-group (global numbering).

    Returns:
        ``(n_blocks,)`` fp32: the sum of ``g**2`` over this rank's elements of each block (0 for blocks
        with no element here); summed over the ranks (all_reduce SUM) it is the whole block's sum.
        Temporaries: one window's ``g**2`` (at most the chunk size), never the shard's.
    """
    sums = torch.zeros(n_blocks + 1, dtype=torch.float32, device=grad.device)  # the last one collects padding
    for c in chunks:
        piece = torch.segment_reduce(grad.narrow(0, c.start, c.numel).square(), "sum", lengths=c.lengths, unsafe=True,
                                     initial=0)
        sums.index_add_(0, c.block, piece.float())
    return sums[:n_blocks]


def adam_mini_shard_update_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, block_v: torch.Tensor,
                            block_sq_sum: torch.Tensor, block_numel: torch.Tensor, chunks: Sequence[ShardChunk],
                            step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """The Adam-mini update of one rank's shard, in place, given the blocks' global sums of ``g**2``.

    Args:
        param, grad, exp_avg: ``(shard numel,)`` fp32: the fp32 partition, its gradient, the first moment.
        block_v: ``(n_blocks,)`` fp32, the second moments (updated in place; the same on every rank).
        block_sq_sum: ``(n_blocks,)`` fp32, the sum of ``g**2`` over each whole block (all ranks).
        block_numel: ``(n_blocks,)`` fp32, each block's global element count.
        chunks: the shard's windows (:func:`shard_chunks`); the per-element denominator is built one
            window at a time, so no temporary of the shard's size is allocated.
        step: the step number ``t`` after this step (1 for the first).
        lr, betas, eps, weight_decay: the group's hyperparameters.
    """
    beta1, beta2 = betas
    block_v.mul_(beta2).add_(block_sq_sum / block_numel, alpha=1 - beta2)
    denom = (block_v.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    denom = torch.cat([denom, denom.new_ones(1)])  # padding divides by 1 (its m is 0)
    for c in chunks:
        p, g, m = (t.narrow(0, c.start, c.numel) for t in (param, grad, exp_avg))
        per_element = torch.repeat_interleave(denom[c.block], c.lengths, output_size=c.numel)
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        p.mul_(1 - lr * weight_decay)
        p.addcdiv_(m, per_element, value=-lr / (1 - beta1**step))
