"""ds_muon: the Muon optimizer for DeepSpeed ZeRO stages 1, 2 and 3.

Installed (``pip install ds_muon`` or ``pip install -e .``), ds_muon activates itself: a start-up
hook (``ds_muon_autoload.pth``, see :mod:`ds_muon._autoload`) enables it when a process imports
``deepspeed``, so a ``"type": "Muon"`` config runs ds_muon with no change to the training script;
``DS_MUON=0`` turns that off. Importing this package itself changes nothing in DeepSpeed. Explicitly:

* ``ds_muon.initialize(...)`` -- same signature and return value as ``deepspeed.initialize``;
* ``ds_muon.enable()`` / ``ds_muon.disable()`` -- for frameworks (HF Trainer, Accelerate) that call
  ``deepspeed.initialize`` themselves; ``with ds_muon.enable_scope(): ...`` for one block;
  ``ds_muon.is_enabled()`` says whether it is in effect.

The single-device reference optimizers are ``ds_muon.MuonAdamW`` and ``ds_muon.AdamMini``;
the ZeRO optimizer classes are ``ds_muon.MuonZeroOptimizer`` (stage 3) and ``ds_muon.MuonZero12Optimizer``
(stages 1 and 2). docs/design.md maps the package.

Deprecated (still working, with a ``DeprecationWarning`` when called): ``ds_muon.enabled()``, the old name of
``enable_scope()``.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "MuonAdamW": "ds_muon.oracle",
    "AdamMini": "ds_muon.oracle",
    "initialize": "ds_muon.integration",
    "enable": "ds_muon.integration",
    "disable": "ds_muon.integration",
    "enable_scope": "ds_muon.integration",
    "is_enabled": "ds_muon.integration",
    "enabled": "ds_muon.integration",  # deprecated: enable_scope
    "MuonZeroOptimizer": "ds_muon.integration.zero3",
    "MuonZero12Optimizer": "ds_muon.integration.zero12",
    "MuonOptimizerParams": "ds_muon.config",
    "ConfigError": "ds_muon.errors",
    "CheckpointError": "ds_muon.errors",
    "orthogonalize": "ds_muon.core.newton_schulz",
    "record_max_logits": "ds_muon.model.max_logits",
    "max_logits_per_head": "ds_muon.model.max_logits",
    "wants_max_logits": "ds_muon.model.max_logits",
    "register_attention": "ds_muon.model.hf_attention",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> object:
    # Lazy so that `import ds_muon` stays cheap and has no side effects on DeepSpeed.
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ds_muon' has no attribute {name!r}")
