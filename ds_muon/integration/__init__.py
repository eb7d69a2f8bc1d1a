"""The DeepSpeed glue (layer ``integration``): the only package that imports deepspeed.

:mod:`~ds_muon.integration.hooks` (``initialize``/``enable``/``disable`` and the engine hooks they install),
:mod:`~ds_muon.integration.validation` and :mod:`~ds_muon.integration.probes` (the config, once, and the host),
:mod:`~ds_muon.integration.inner` (the inner optimizers), :mod:`~ds_muon.integration.zero3` (the ZeRO-3 subclass)
with :mod:`~ds_muon.integration.zero3_checkpoint`, :mod:`~ds_muon.integration.nvme`,
:mod:`~ds_muon.integration.faults` and :mod:`~ds_muon.integration.monitor` beside it,
:mod:`~ds_muon.integration.checkpoint_hooks` (engine-level checkpoint checks), :mod:`~ds_muon.integration.schedulers`
and :mod:`~ds_muon.integration.frameworks`. docs/design.md ("Where DeepSpeed is hooked") lists every DeepSpeed
name used and the releases it was checked against.
"""
from __future__ import annotations

# deepspeed first, before any module of this package: when ds_muon's start-up hook waits for it (ds_muon._autoload),
# its callback runs inside this import and imports .hooks itself, whole (not half-imported under this line).
import deepspeed  # noqa: F401

from .deepspeed_version import require_supported_deepspeed

require_supported_deepspeed()  # an unsupported DeepSpeed: DeepSpeedVersionError here, not an AttributeError later

from .hooks import AUTO_NOTICE, auto_enable, disable, enable, enable_scope, enabled, initialize, is_enabled  # noqa: E402

__all__ = ["initialize", "enable", "disable", "enable_scope", "is_enabled", "enabled", "auto_enable", "AUTO_NOTICE"]
