"""Which framework built the DeepSpeed engine, so an error can name the fix that applies there.

Hugging Face Trainer (and TRL's trainers, which subclass it) call ``accelerator.prepare``, which
calls ``deepspeed.initialize``; Accelerate users call ``accelerator.prepare`` themselves; everyone
else calls ``deepspeed.initialize`` or ``ds_muon.initialize`` directly. The same config problem
then has different fixes: the ZeRO stage, for one, is set in the config handed to
``TrainingArguments(deepspeed=...)`` under Trainer, in ``DeepSpeedPlugin(zero_stage=...)`` (or the
accelerate config file) under Accelerate, and in the DeepSpeed config directly.

Use :func:`detect_framework` inside code that ``deepspeed.initialize`` runs (it reads the call
stack), and :func:`for_framework` to pick the text.
"""
from __future__ import annotations

import sys
from typing import Mapping, Optional

TRAINER = "trainer"
ACCELERATE = "accelerate"
DIRECT = "direct"

# module-name prefixes on the call stack -> framework; the outermost match wins (Trainer calls Accelerate)
_PREFIXES = ((TRAINER, ("transformers.trainer", "trl.")), (ACCELERATE, ("accelerate.",)))

ZERO_STAGE_FIX = {
    TRAINER: "set \"zero_optimization\": {\"stage\": 1, 2 or 3} in the DeepSpeed config given to "
             "TrainingArguments(deepspeed=...)",
    ACCELERATE: "set zero_stage to 1, 2 or 3 in DeepSpeedPlugin(...) (zero_stage in the accelerate config file) or "
                "\"stage\" in its DeepSpeed config file",
    DIRECT: "set \"zero_optimization\": {\"stage\": 1, 2 or 3} in the DeepSpeed config",
}


def detect_framework(frame=None) -> str:
    """``"trainer"``, ``"accelerate"`` or ``"direct"``: who is calling ``deepspeed.initialize`` now.

    Walks the Python call stack from ``frame`` (default: the caller's) outward and looks at each
    frame's module name: ``transformers.trainer*`` or ``trl.*`` means Trainer (TRL's trainers are
    Trainers), ``accelerate.*`` means Accelerate, neither means a direct call. Cheap (no imports).
    """
    frame = sys._getframe(1) if frame is None else frame
    found: Optional[str] = None
    while frame is not None:
        module = frame.f_globals.get("__name__", "") or ""
        for framework, prefixes in _PREFIXES:
            if module.startswith(prefixes):
                found = framework if found != TRAINER else found
        frame = frame.f_back
    return found or DIRECT


def for_framework(fixes: Mapping[str, str], framework: Optional[str] = None) -> str:
    """The entry of ``fixes`` (keyed ``"trainer"``/``"accelerate"``/``"direct"``) for ``framework``.

    ``framework`` defaults to :func:`detect_framework` at the caller; a missing key falls back to
    ``fixes["direct"]``. Example: ``for_framework(ZERO_STAGE_FIX)``.
    """
    if framework is None:
        framework = detect_framework(sys._getframe(1))
    return fixes.get(framework, fixes[DIRECT])
