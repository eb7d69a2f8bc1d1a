"""Splitting user parameter groups into Muon and AdamW halves (layer ``model``).

Shared by the single-device oracle and the ZeRO inner optimizer, so both see the same groups with
the same hyperparameters. A ZeRO sub-group never mixes param groups, so every sub-group is
all-Muon or all-AdamW (docs/design.md, "Where DeepSpeed is hooked"). Each group says which algorithm
steps it under ``"algorithm"`` (:data:`ds_muon.names.ALGORITHM_KEY`); ``"use_muon"`` stays beside it,
DeepSpeed's own contract.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..names import ADAMW, ALGORITHM_KEY, MUON, NO_DECAY_ATTR, USE_MUON_ATTR
from .selection import SelectionRules, tag_model
from .structure import param_shape

# Keys a user param group may set, per half. A shared key (lr, weight_decay) applies to both
# halves unless the half-specific one (muon_lr / adam_lr, adam_weight_decay) is also given.
MUON_KEYS = ("lr", "momentum", "momentum_dtype", "nesterov", "ns_method", "ns_steps", "ns_dtype", "update_scale", "weight_decay",
             "exchange_dtype")
ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")
_RENAMES_MUON = {"muon_lr": "lr"}
_RENAMES_ADAMW = {"adam_lr": "lr", "adam_weight_decay": "weight_decay", "adam_betas": "betas", "adam_eps": "eps"}
_ALL_GROUP_KEYS = (set(MUON_KEYS) | set(ADAMW_KEYS) | set(_RENAMES_MUON) | set(_RENAMES_ADAMW)
                   | {"params", USE_MUON_ATTR, ALGORITHM_KEY})
# A group may also say "use_muon": True/False, which tags every parameter in it.


def _half_settings(defaults: dict, overrides: dict, keys: tuple[str, ...], renames: dict) -> dict:
    settings = dict(defaults)
    settings.update({k: v for k, v in overrides.items() if k in keys})
    settings.update({renames[k]: v for k, v in overrides.items() if k in renames})
    return settings


def split_param_groups(params: Any, muon_defaults: dict, adamw_defaults: dict,
                       rules: SelectionRules = SelectionRules(), decay_norms_and_biases: bool = False) -> list[dict]:
    """Turn ``params`` into param groups each flagged ``use_muon`` True or False.

    Args:
        params: an ``nn.Module`` (parameters are selected by :func:`ds_muon.model.selection.tag_model`),
            an iterable of parameters, or an iterable of param-group dicts. Parameters must carry
            ``use_muon`` unless a module is given; untagged ones go through the shape rule
            (>= 2-D -> Muon), which cannot recognise embeddings or heads, so pass the module.
        muon_defaults / adamw_defaults: hyperparameters of each half (see ``MUON_KEYS``/``ADAMW_KEYS``).
        rules: passed to :func:`ds_muon.model.selection.tag_model` when ``params`` is a module (the
            parameters' matrix views are recorded there).
        decay_norms_and_biases: False (default, Hugging Face Trainer's convention): the parameters tagged
            ``ds_muon_no_decay`` (norm weights, biases; :func:`ds_muon.model.selection.tag_model` tags them) go to
            a group of their own per half with ``weight_decay`` 0.0, whatever the group or the defaults say.
            True: they decay like the rest. Untagged parameters decay.

    Returns:
        A list of group dicts ``{"params": [...], "use_muon": bool, "algorithm": "muon" | "adamw",
        <hyperparameters>}``, Muon half
        first for each incoming group (each half: decayed parameters, then the exempt ones); halves with no
        trainable parameter are dropped; unknown group keys are carried into both halves.

    Raises:
        ValueError: a Muon parameter with fewer than 2 dims (names its shape).
    """
    if isinstance(params, nn.Module):
        tag_model(params, rules)
        params = list(params.parameters())
    params = list(params)
    if not params:
        raise ValueError("optimizer got an empty parameter list")
    groups = params if isinstance(params[0], dict) else [{"params": params}]
    out: list[dict] = []
    for group in groups:
        overrides = {k: v for k, v in group.items() if k != "params"}
        members = [group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"])
        for p in members:
            if "use_muon" in group:  # a group-level tag applies to each of its parameters
                p.use_muon = bool(group["use_muon"])
            if not p.requires_grad:
                continue
            if getattr(p, "use_muon", None) is None:
                p.use_muon = len(param_shape(p)) >= 2
            if p.use_muon and len(param_shape(p)) < 2:
                raise ValueError(f"a parameter of shape {param_shape(p)} has use_muon=True; Muon needs >= 2 dims. "
                                 "Set use_muon=False on it.")
        extra = {k: v for k, v in overrides.items() if k not in _ALL_GROUP_KEYS}
        for flag, defaults, keys, renames in ((True, muon_defaults, MUON_KEYS, _RENAMES_MUON),
                                              (False, adamw_defaults, ADAMW_KEYS, _RENAMES_ADAMW)):
            half = [p for p in members if bool(p.use_muon) is flag and p.requires_grad]
            exempt = [p for p in half if not decay_norms_and_biases and getattr(p, NO_DECAY_ATTR, False)]
            exempt_ids = {id(p) for p in exempt}
            decayed = [p for p in half if id(p) not in exempt_ids]
            settings = _half_settings(defaults, overrides, keys, renames)
            for part, wd in ((decayed, settings["weight_decay"]), (exempt, 0.0)):
                if part:
                    out.append(dict(extra, params=part, use_muon=flag, **{ALGORITHM_KEY: MUON if flag else ADAMW},
                                    **dict(settings, weight_decay=wd)))
    return out


def check_zero3_parameters(model: nn.Module) -> None:
    """Refuse trainable parameters DeepSpeed ZeRO-3 (0.19.8) cannot partition, before it allocates anything.

    * a 0-D parameter (``nn.Parameter(torch.tensor(1.0))``, e.g. a learnable temperature): DeepSpeed fails
      in ``_broadcast_model`` with ``self.dim() cannot be 0 to view Float as Byte``;
    * a parameter with zero elements (``nn.Linear(16, 0)``): DeepSpeed fails with a bare AssertionError
      at the first forward.

    Raises:
        ValueError: naming every such parameter, its shape and the fix.
    """
    problems = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        shape = param_shape(p)
        if len(shape) == 0:
            problems.append(f"parameter '{name}' is 0-D (shape ()): DeepSpeed ZeRO-3 cannot partition it; store it "
                            f"with shape (1,) (e.g. nn.Parameter(value.reshape(1))) and it trains with AdamW")
        elif 0 in shape:
            problems.append(f"parameter '{name}' has no elements (shape {tuple(shape)}): DeepSpeed ZeRO-3 fails on it "
                            "at the first forward; remove the empty layer, or freeze it (requires_grad=False)")
    if problems:
        raise ValueError("ds_muon: trainable parameters that ZeRO-3 cannot hold:\n  " + "\n  ".join(problems))
