"""Configuration of ds_muon: what a DeepSpeed config may say to it, checked before anything runs.

Layer ``config``: pydantic only (neither torch nor deepspeed is imported), so it is cheap to import and
to test. ds_muon reads two places of an ordinary DeepSpeed config:

``optimizer``
    ``{"type": "Muon", "params": {...}}`` (:class:`MuonOptimizerParams`, :mod:`ds_muon.config.muon`) or
    ``{"type": "AdamMini", "params": {...}}`` (:class:`AdamMiniOptimizerParams`). The type is matched
    case-insensitively, as DeepSpeed does.
``zero_optimization`` and the top-level ``gradient_clipping`` / ``tensor_parallel``
    checked by one section checker for both optimizers (:mod:`ds_muon.config.sections`).

Entry points: :func:`parse_ds_config` (a whole config dict -> :class:`DsMuonConfig`, or None for configs
ds_muon does not serve), :func:`parse_muon_params` / :func:`parse_adam_mini_params` (``optimizer.params``),
:func:`load_ds_config` (a JSON file). Every problem raises :class:`ConfigError` (a ``ValueError``) with one
line per problem: the key path, the offending value, and what is allowed or how to fix it. The JSON
Schemas in ``ds_config_schemas/`` (:mod:`ds_muon.config.schema`) and docs/configuration.md
(:mod:`ds_muon.config.reference`) are generated from these models; tests fail when they drift.
"""
from __future__ import annotations

from ..errors import ConfigError
from .adam_mini import AdamMiniOptimizerParams, parse_adam_mini_params
from .loading import load_ds_config
from .muon import (OPTIMIZER_PARAMS_PATH, UNSUPPORTED_BUILTIN_KEYS, MuonOptimizerParams, MuonSplit, QKClipParams,
                   parse_muon_params)
from .sections import (ADAM_MINI, MUON, NVME_PARAM_OFFLOAD_PROBLEM, SERVED_STAGES, DsMuonConfig, optimizer_kind,
                       parse_ds_config, unserved_modes)

__all__ = ["ConfigError", "MuonOptimizerParams", "QKClipParams", "MuonSplit", "AdamMiniOptimizerParams",
           "DsMuonConfig", "parse_muon_params", "parse_adam_mini_params", "parse_ds_config", "load_ds_config",
           "optimizer_kind", "MUON", "ADAM_MINI", "SERVED_STAGES", "OPTIMIZER_PARAMS_PATH",
           "UNSUPPORTED_BUILTIN_KEYS", "NVME_PARAM_OFFLOAD_PROBLEM", "unserved_modes"]
