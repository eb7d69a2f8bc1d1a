"""DeepSpeed AutoEP (expert parallelism, ``"expert_parallel"``) under ds_muon (layer ``integration``).

What DeepSpeed 0.19.8 does (``DeepSpeedEngine._configure_expert_parallel``, ``deepspeed/module_inject/auto_ep*.py``):
it builds expert-parallel groups of ``autoep_size`` ranks and expert-data-parallel groups of ``W / autoep_size``
ranks, and swaps each MoE block for an ``AutoEPMoELayer``: ``router.gate`` (``[E, d]``, on every rank) and this
expert-parallel rank's stacked local experts ``experts.w1`` (gate), ``experts.w3`` (up), ``experts.w2`` (down),
each ``[E / EP, out, in]``. It then calls ``deepspeed.set_optimizer_flags`` again for the new parameters, which,
with ds_muon enabled, is ds_muon's tagging (:func:`ds_muon.model.selection.tag_model`: the router on AdamW, each
local expert a Muon matrix). The expert parameters are partitioned over the expert-data-parallel group: at ZeRO-3
DeepSpeed's optimizer puts them in sub-groups of their own whose partition group is that group, at ZeRO-1/2 in
param groups marked ``moe`` whose ``real_dp_process_group`` is it. Their gradients are summed over that group and
divided by the whole data-parallel world size (``_gradient_averaging_world_size``), like the dense ones: the mean
gradient of the un-parallelised model. Nothing else is needed from ds_muon: its owner exchange and no-gradient
flags run over each sub-group's partition group, so an expert matrix gets its owner inside its expert-data-parallel
group, and the gradient norm it clips by is DeepSpeed's (each expert counted once). docs/parallelism.md, "AutoEP".

This module holds what is AutoEP's own:

* :func:`transformers_problem`: DeepSpeed 0.19.8's AutoEP fails inside ``deepspeed.initialize`` (any optimizer)
  with transformers 5.23 and later for the presets that retarget transformers' router-logit recorders (Mixtral,
  Qwen2/3-MoE, Qwen3.5-MoE, MiniMax-M3): ds_muon refuses before the engine is built, naming the incompatibility
  and the releases that work, and does not patch transformers (docs/parallelism.md says why);
* :func:`engine_problem`: AutoEP combined with sequence parallelism, which ds_muon has not parity-tested.

Refused with the config (:func:`ds_muon.config.unserved_modes`): AutoEP with AutoTP, with Adam-mini, and with
``checkpoint.load_universal``.
"""
from __future__ import annotations

import inspect
import sys
from typing import Any, Optional

from torch import nn

from ..config.sections import deepspeed_version

__all__ = ["autoep_enabled", "transformers_problem", "engine_problem", "REGISTRY_CHANGED_IN", "WORKING_TRANSFORMERS"]

#: The first transformers release whose ``transformers.utils.output_capturing._CAN_RECORD_REGISTRY`` is a
#: ``_CanRecordRegistry`` (``get(model)``, one argument) instead of a plain dict (checked: 5.22.2 a dict; 5.23.0,
#: 5.24.0, 5.25.0 the class).
REGISTRY_CHANGED_IN = "5.23.0"
#: The transformers releases DeepSpeed 0.19.8's AutoEP runs with, unpatched: the registry is a plain dict from 5.2.0
#: (read: 5.2.0, 5.3.0, 5.6.0, 5.12.0, 5.18.0, 5.21.0, 5.22.0, 5.22.2; tests/dist/test_autoep.py passes with 5.22.2).
#: 5.0/5.1 have no ``output_capturing`` module; DeepSpeed then skips the retargeting (it catches the ImportError),
#: so transformers' router-logit recorders are not pointed at AutoEP's router (not run here).
WORKING_TRANSFORMERS = ">=5.2,<5.23"


def autoep_enabled(config_class: Any) -> bool:
    """Whether DeepSpeed's config object enables AutoEP (``expert_parallel.enabled``)."""
    cfg = getattr(config_class, "expert_parallel_config", None)
    return bool(getattr(cfg, "enabled", False))


def _registry_takes_no_default() -> Optional[tuple[str, str]]:
    """``(transformers version, registry class)`` when transformers' output-capture registry is loaded and its
    ``get`` cannot take DeepSpeed's ``(key, default)``; else None. Read from ``sys.modules`` (ds_muon does not import
    transformers here): a transformers model has imported it (``transformers.modeling_utils`` does)."""
    output_capturing = sys.modules.get("transformers.utils.output_capturing")
    registry = getattr(output_capturing, "_CAN_RECORD_REGISTRY", None)
    if not isinstance(registry, dict):
        return None
    try:
        inspect.signature(registry.get).bind("key", None)
    except TypeError:
        version = getattr(sys.modules.get("transformers"), "__version__", "unknown")
        return version, type(registry).__name__
    except ValueError:  # no signature to read (a C method): a plain dict's get takes a default
        return None
    return None


def _retargeting_preset(autoep_config: Any, model: nn.Module) -> Optional[str]:
    """The AutoEP preset DeepSpeed would pick for ``model`` whose adapter retargets transformers' router-logit
    recorders (its ``retarget_transformers_output_recorders`` is not the base class's no-op), or None.

    DeepSpeed's own choice (``resolve_preset_candidates``): ``preset_model`` when set, else the preset of the
    model's ``config.model_type``, else (custom patterns) none of the presets' adapters."""
    try:
        from deepspeed.module_inject.auto_ep_presets.base import AutoEPPresetAdapter
        from deepspeed.module_inject.auto_ep_presets.registry import (PRESET_MODELS, get_preset_adapter,
                                                                      preset_name_for_hf_model_type)
    except ImportError:  # another DeepSpeed layout: let DeepSpeed report whatever happens
        return None
    name = getattr(autoep_config, "preset_model", None)
    if name is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        name = preset_name_for_hf_model_type(model_type) if model_type else None
    preset = PRESET_MODELS.get(name) if name else None
    if preset is None:
        return None
    try:
        adapter = get_preset_adapter(preset.preset_adapter)
    except ValueError:
        return None
    base = AutoEPPresetAdapter.retarget_transformers_output_recorders
    return name if type(adapter).retarget_transformers_output_recorders is not base else None


def _records_router_logits(model: nn.Module) -> bool:
    """A module of ``model`` declares a ``router_logits`` output recorder (transformers' ``_can_record_outputs``):
    DeepSpeed's retargeting skips models without one."""
    for m in model.modules():
        outputs = getattr(m, "_can_record_outputs", None)
        if isinstance(outputs, dict) and "router_logits" in outputs:
            return True
    return False


def transformers_problem(config_class: Any, model: nn.Module) -> Optional[str]:
    """Why DeepSpeed's AutoEP cannot convert ``model`` with the installed transformers, naming the fix; None when
    it can (or AutoEP is off).

    DeepSpeed 0.19.8 (``deepspeed/module_inject/auto_ep_presets/base.py``,
    ``_install_instance_transformers_output_recorders``) saves transformers' output-capture registry entries with
    ``registry.get(key, default)``. Since transformers 5.23.0 the registry is a ``_CanRecordRegistry`` whose
    ``get(model)`` takes one argument, so for a preset that retargets the router-logit recorders, and a model that
    has one, ``deepspeed.initialize`` raises ``TypeError: _CanRecordRegistry.get() takes 2 positional arguments but
    3 were given`` after swapping the MoE blocks, whatever the optimizer (DeepSpeed's AdamW too; measured with
    transformers 5.24.0). ds_muon refuses first, before the engine allocates anything. It does not patch
    transformers (docs/parallelism.md, "AutoEP", says why).

    Args:
        config_class: DeepSpeed's ``DeepSpeedConfig`` (its ``expert_parallel_config``).
        model: the model ``deepspeed.initialize`` got (before AutoEP swaps its MoE blocks).
    """
    if not autoep_enabled(config_class):
        return None
    incompatible = _registry_takes_no_default()
    if incompatible is None or not _records_router_logits(model):
        return None
    preset = _retargeting_preset(config_class.expert_parallel_config, model)
    if preset is None:
        return None
    version, registry = incompatible
    return (f"expert_parallel: DeepSpeed {deepspeed_version()}'s AutoEP cannot convert this model with transformers "
            f"{version}: after swapping the MoE blocks, its '{preset}' preset retargets transformers' router-logit "
            "recorders and calls transformers.utils.output_capturing._CAN_RECORD_REGISTRY.get(key, default) "
            f"(deepspeed/module_inject/auto_ep_presets/base.py), but since transformers {REGISTRY_CHANGED_IN} that "
            f"registry is a {registry} whose get() takes one argument, so deepspeed.initialize fails with any "
            f"optimizer (\"TypeError: {registry}.get() takes 2 positional arguments but 3 were given\"). Install "
            f"transformers{WORKING_TRANSFORMERS} (AutoEP runs there; ds_muon serves it), or a DeepSpeed release "
            "that fixes the call, or set expert_parallel.enabled to false")


def engine_problem(sequence_parallel: int) -> Optional[str]:
    """What ds_muon does not serve about an engine with AutoEP layers (``engine.has_moe_layers`` without native
    ``MoE`` layers), naming the fix; None when served.

    AutoEP with sequence parallelism (an SP ``mpu``, ``sequence_parallel`` > 1) is not parity-tested (DeepSpeed
    0.19.8 itself refuses it at ZeRO-3: "AutoEP with ZeRO Stage 3 does not support sequence parallelism yet").
    AutoEP with AutoTP, with Adam-mini or with ``load_universal`` is refused with the config
    (:func:`ds_muon.config.unserved_modes`)."""
    if sequence_parallel > 1:
        return (f"AutoEP (expert_parallel) with sequence parallelism (sequence-parallel world size "
                f"{sequence_parallel}) is not served by ds_muon: not parity-tested (DeepSpeed {deepspeed_version()} "
                "itself refuses it at ZeRO stage 3); drop one of them, or use DeepSpeed's built-in Muon (DS_MUON=0)")
    return None
