"""Validating a DeepSpeed config once per ``initialize`` (layer ``integration``).

:func:`validate` = the config's own checks (:func:`ds_muon.config.parse_ds_config`) plus the host probes
(:func:`ds_muon.integration.probes.host_problems`), every problem in one :class:`ds_muon.errors.ConfigError`.
``ds_muon.initialize`` validates before DeepSpeed allocates anything and hands the result on
(:func:`validated_once`); the engine hooks read it from DeepSpeed's config object (:func:`parsed_config`),
validating only where no ``initialize`` did (``ds_muon.enable()`` under HF Trainer or Accelerate).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Optional

import torch

from ..config import DsMuonConfig, optimizer_kind, parse_ds_config
from ..errors import ConfigError
from ..names import USE_MUON_ATTR
from .inner import DsMuonInner
from .probes import host_problems

__all__ = ["validate", "validated_once", "parsed_config", "hand_over", "is_parsed", "client_muon_problem",
           "is_client_muon"]

_ATTR = "_ds_muon_config"  # on DeepSpeed's DeepSpeedConfig object: the validated DsMuonConfig (or None)
_pending = threading.local()


def validate(ds_config: dict) -> Optional[DsMuonConfig]:
    """Validate a DeepSpeed config dict for ds_muon: None when its optimizer is none ds_muon serves.

    Raises:
        ConfigError: every problem of the config (:func:`ds_muon.config.parse_ds_config`) and of this host for it
            (:func:`ds_muon.integration.probes.host_problems`), one line each.
    """
    if not isinstance(ds_config, dict):
        return parse_ds_config(ds_config)  # raises the ConfigError that names load_ds_config
    problems: list[str] = []
    cfg = None
    try:
        cfg = parse_ds_config(ds_config)
    except ConfigError as err:
        problems = list(err.problems)
    if optimizer_kind(ds_config) is None:
        return None
    problems += host_problems(ds_config)
    if problems:
        raise ConfigError(problems)
    return cfg


@contextlib.contextmanager
def validated_once(ds_config: Optional[dict]) -> Iterator[None]:
    """Validate ``ds_config`` now (:func:`validate`) and let the next :func:`parsed_config` in this thread take
    the result instead of validating again (``deepspeed.initialize`` builds its config object inside the block)."""
    if ds_config is None:
        yield
        return
    _pending.value = (validate(ds_config),)
    try:
        yield
    finally:
        _pending.value = None


def parsed_config(config_class: Any) -> Optional[DsMuonConfig]:
    """The validated ds_muon config of DeepSpeed's config object (``DeepSpeedConfig``, whose ``_param_dict`` is the
    config dict): kept on the object, so every hook of one engine sees the same one.

    Raises:
        ConfigError: as :func:`validate`.
    """
    if hasattr(config_class, _ATTR):
        return getattr(config_class, _ATTR)
    pending = getattr(_pending, "value", None)
    if pending is not None:
        _pending.value = None
        cfg = pending[0]
    else:
        cfg = validate(config_class._param_dict)
    setattr(config_class, _ATTR, cfg)
    return cfg


def hand_over(config_class: Any) -> None:
    """Mark DeepSpeed's config object as not ds_muon's: every later :func:`parsed_config` of it returns None, so the
    engine hooks pass it to DeepSpeed untouched (the zero-code hand-over, :mod:`ds_muon.integration.hooks`)."""
    setattr(config_class, _ATTR, None)


def is_parsed(config_class: Any) -> bool:
    """Whether :func:`parsed_config` (or :func:`hand_over`) already decided for this config object."""
    return hasattr(config_class, _ATTR)


#: Param-group keys of Muon classes (Keller Jordan's ``Muon``: ``momentum``; Moonlight's ``Muon`` and
#: ``torch.optim.Muon``: both): with "Muon" in the class name, what makes a client optimizer one.
MUON_GROUP_KEYS = frozenset({"momentum", "ns_steps"})


def is_client_muon(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a Muon of its own (not DeepSpeed's built-in Muon, not ds_muon's inner optimizers).

    The rule (docs/migration.md, "Your own Muon object"), first that holds:

    * an instance of ``torch.optim.Muon`` (subclasses too, whatever their name);
    * a param group with a ``use_muon`` key (the ``MuonWithAuxAdam`` convention of Keller Jordan's package, whatever
      the class name; ds_muon's oracle ``MuonAdamW`` too);
    * a class name containing "muon" (any case) and a param group with a Muon hyperparameter,
      :data:`MUON_GROUP_KEYS` (Keller Jordan's and Moonlight's ``Muon``); a "Muon" class without one (a wrapper, a
      logger) is not refused.

    Never for a class from ``deepspeed`` (the built-in ``MuonWithAuxAdam`` ds_muon hands unserved configs to) or
    ds_muon's inner optimizers (:class:`~ds_muon.integration.inner.DsMuonInner`).
    """
    cls = type(optimizer)
    if (cls.__module__ or "").split(".")[0] == "deepspeed" or isinstance(optimizer, DsMuonInner):
        return False
    torch_muon = getattr(torch.optim, "Muon", None)  # torch >= 2.9
    if torch_muon is not None and isinstance(optimizer, torch_muon):
        return True
    groups = [g for g in getattr(optimizer, "param_groups", None) or [] if isinstance(g, dict)]
    if any(USE_MUON_ATTR in g for g in groups):
        return True
    return "muon" in cls.__name__.lower() and any(MUON_GROUP_KEYS & set(g) for g in groups)


def client_muon_problem(optimizer: Any, stage: int) -> Optional[str]:
    """Why a client optimizer handed to ``deepspeed.initialize(optimizer=...)`` cannot run under ZeRO, or None.

    A Muon of its own (:func:`is_client_muon`: ``torch.optim.Muon``, Keller Jordan's ``Muon``/``MuonWithAuxAdam``,
    Moonlight's ``Muon``) steps the parameters it is given, and under ZeRO stages 1-3 DeepSpeed gives it flattened
    1-D fp32 partitions: it fails at the first step (``torch.optim.Muon``: ``ValueError: Param gradient must be a 2D
    matrix``) or orthogonalizes slices of matrices. It is refused, not wrapped: the classes differ in their update
    scaling, Nesterov and weight-decay rules, so a wrapper would silently change the math (docs/migration.md, "Your
    own Muon object"). ds_muon's engine hook asks before DeepSpeed's own "untested ZeRO Optimizer" assertion, so
    the answer does not depend on ``zero_allow_untested_optimizer``.

    Args:
        optimizer: the optimizer DeepSpeed is about to wrap in its ZeRO optimizer (any object).
        stage: the ZeRO stage (1, 2 or 3).

    Returns:
        The message (what failed, why, and the config to write instead), or None.
    """
    if not is_client_muon(optimizer):
        return None
    cls = type(optimizer)
    module = cls.__module__ or ""
    defaults = getattr(optimizer, "defaults", None) or {}
    carried = {k: defaults[k] for k in ("lr", "momentum", "weight_decay", "nesterov", "ns_steps")
               if isinstance(defaults.get(k), (bool, int, float))}
    import json
    snippet = json.dumps({"type": "Muon", "params": carried})
    return (f"deepspeed.initialize got a Muon optimizer object of its own ({module}.{cls.__name__}) under ZeRO stage "
            f"{stage}. DeepSpeed hands a client optimizer flattened 1-D partitions of the parameters, which Muon cannot "
            "orthogonalize: it would fail at the first step (torch.optim.Muon: 'ValueError: Param gradient must be a 2D "
            "matrix'). Do not pass optimizer=...; put the optimizer in the DeepSpeed config instead, "
            f"\"optimizer\": {snippet} (lr, momentum and weight_decay taken from this object; with HF Trainer or "
            "Accelerate leave out optimizers=/the optimizer object), and ds_muon trains it at this ZeRO stage "
            "(its AdamW half, adam_lr, betas, for the embeddings, head, norms and biases).")
